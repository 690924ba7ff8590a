"""The LTX-Video adapter: the shared contract on a tiny LTX-Video 0.9-shaped model (videos and images), the
8k+1 frame rule, the text mask, and ComfyUI's LTXV names."""

import pytest
import torch

from diffusion_pipe.models.ltx import LTXAdapter, comfyui_module_name
from tests.models.contract import AdapterContract


class TestLTXContract(AdapterContract):
    adapter_cls = LTXAdapter
    pipeline_cls = "LTXPipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 9))  # an image and a 9-frame video (the LTX VAE needs 8k+1 frames)
    # diffusers' LTX loader rejects `.alpha` tensors; the comfyui file's names are checked against it below.
    roundtrip_formats = ("diffusers",)

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        """LTXVideoTransformer3DModel.forward called as LTXPipeline calls it."""
        from diffusers import LTXPipeline

        latents, t, text, mask = inputs
        _, _, f, h, w = latents.shape
        out = denoiser(hidden_states=LTXPipeline._pack_latents(latents), encoder_hidden_states=text,
                       timestep=t * 1000, encoder_attention_mask=mask, num_frames=f, height=h, width=w,
                       rope_interpolation_scale=adapter.rope_scale(), return_dict=False)[0]
        return LTXPipeline._unpack_latents(out, f, h, w)

    def test_frames_must_be_8k_plus_1(self, adapter):
        vae = adapter.load_vae(torch.device("cpu"))
        with pytest.raises(ValueError, match="8k\\+1 frames"):
            adapter.encode_media(vae, torch.zeros(1, 3, 5, 32, 32))

    def test_text_mask_marks_the_real_tokens(self, adapter):
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        short, longer = adapter.encode_text(encoders, ["a cat", "a red circle on a white background"], 16)
        assert short["t5_mask"][0] == 1 and short["t5_mask"][-1] == 0
        assert short["t5_mask"].sum() < longer["t5_mask"].sum()

    def test_the_text_mask_reaches_the_cross_attention(self, adapter, lora_model):
        """Masked positions do not change the prediction; unmasked ones do."""
        denoiser, _ = lora_model
        latents, _, (x, t, text, mask) = self._inputs(adapter, batch=1)
        mask = torch.ones_like(mask)
        mask[:, 8:] = 0
        changed = text.clone()
        changed[:, 8:] += 1.0
        layers = adapter.pipeline_layers(denoiser)

        def run(*inputs):
            out = inputs
            with torch.no_grad():
                for layer in layers:
                    out = layer(out)
            return out

        base = run(x, t, text, mask)
        assert torch.allclose(base, run(x, t, changed, mask), atol=1e-5)
        assert not torch.allclose(base, run(x, t, changed, torch.ones_like(mask)), atol=1e-5)

    def test_comfyui_names_load_as_diffusers_reads_ltxv_files(self, adapter, lora_model, model_dir):
        """diffusers reads ComfyUI-style LTXV LoRAs (`_convert_non_diffusers_ltxv_lora_to_diffusers`); the
        comfyui file without its `.alpha` tensors (alpha = rank: scale 1) gives the trained deltas."""
        from diffusers import LTXPipeline

        from tests.models.contract import expected_deltas, lora_deltas

        _, lora = lora_model
        exported = adapter.export_lora(lora, "comfyui")
        assert all(v.item() == 4.0 for k, v in exported.items() if k.endswith(".alpha"))
        pipe = LTXPipeline.from_pretrained(model_dir, dtype=torch.float32)
        pipe.load_lora_weights({k: v.clone() for k, v in exported.items() if not k.endswith(".alpha")})
        got, want = lora_deltas(pipe.transformer), expected_deltas(lora)
        assert set(got) == set(want) and all(torch.allclose(got[n], want[n], atol=1e-6) for n in want)

    def test_sample_inputs_drive_the_pipeline(self, adapter, model_dir):
        """Stored text entries (embeddings and masks) render a video through LTXPipeline, with CFG."""
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        text, negative = adapter.encode_text(encoders, ["a red square moving right", ""], 16)
        pipe = adapter.pipeline_class().from_pretrained(model_dir)
        out = pipe(**adapter.sample_inputs(text, negative, 3.0, 1.0), height=32, width=32, num_frames=9,
                   num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0))
        assert out.frames.shape == (1, 9, 32, 32, 3)

    def test_latents_are_normalised_with_the_vae_statistics(self, adapter):
        latents = torch.zeros(1, 8, 2, 4, 4)
        normalised = adapter.normalise_latents(latents)
        mean, std, _ = adapter._latent_stats
        assert torch.allclose(normalised[0, :, 0, 0, 0], -mean / std)


@pytest.mark.parametrize("diffusers_name, comfy", [
    ("transformer_blocks.0.attn1.to_q", "transformer_blocks.0.attn1.to_q"),
    ("transformer_blocks.3.ff.net.0.proj", "transformer_blocks.3.ff.net.0.proj"),
    ("proj_in", "patchify_proj"), ("time_embed.linear", "adaln_single.linear"),
    ("time_embed.emb.timestep_embedder.linear_1", "adaln_single.emb.timestep_embedder.linear_1"),
    ("caption_projection.linear_1", "caption_projection.linear_1"), ("proj_out", "proj_out"),
])
def test_comfyui_names(diffusers_name, comfy):
    assert comfyui_module_name(diffusers_name) == comfy


def test_comfyui_keys_and_alpha(tmp_path):
    lora = {"transformer_blocks.0.attn1.to_q.lora_A.weight": torch.ones(4, 24),
            "transformer_blocks.0.attn1.to_q.lora_B.weight": torch.ones(24, 4)}
    out = LTXAdapter(tmp_path, torch.float32).export_lora(lora, "comfyui")
    base = "diffusion_model.transformer_blocks.0.attn1.to_q"
    assert set(out) == {f"{base}.lora_A.weight", f"{base}.lora_B.weight", f"{base}.alpha"}
    assert out[f"{base}.alpha"].item() == 4.0
