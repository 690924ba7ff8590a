"""The HunyuanVideo 1.5 adapter: the shared contract on a tiny HunyuanVideo 1.5-shaped model (videos and images),
the text side (system prompt cropped as the pipeline crops it, ByT5 only for quoted text), and both exports."""

import pytest
import torch

from diffusion_pipe.models.hunyuan_video15 import HunyuanVideo15Adapter, valid_tokens_first
from tests.models.contract import AdapterContract, expected_deltas, lora_deltas


def binary_masks(inputs: tuple, seed: int) -> tuple:
    """The model inputs with 0/1 text masks (random ones are not masks: the refiner pools by them)."""
    latents, t, qwen, qwen_mask, byt5, byt5_mask = inputs
    g = torch.Generator().manual_seed(seed)
    qwen_mask = (torch.rand(qwen_mask.shape, generator=g) < 0.6).to(qwen_mask.dtype)
    qwen_mask[:, 0] = 1
    byt5_mask = (torch.rand(byt5_mask.shape, generator=g) < 0.3).to(byt5_mask.dtype)
    return latents, t, qwen, qwen_mask, byt5, byt5_mask


class TestHunyuanVideo15Contract(AdapterContract):
    adapter_cls = HunyuanVideo15Adapter
    pipeline_cls = "HunyuanVideo15Pipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 5))  # an image and a 5-frame video (its VAE needs 4k+1 frames)
    # HunyuanVideo15Pipeline has no LoRA loader in diffusers 0.42.1: the exports are checked below instead.
    roundtrip_formats = ()

    def _inputs(self, adapter, batch: int = 2, seed: int = 0):
        latents, noised, inputs = super()._inputs(adapter, batch, seed)
        return latents, noised, binary_masks(inputs, seed)

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        """HunyuanVideo15Transformer3DModel.forward called as HunyuanVideo15Pipeline calls it for text-to-video
        (all-zero image embeddings)."""
        latents, t, qwen, qwen_mask, byt5, byt5_mask = inputs
        image = torch.zeros(latents.shape[0], 729, denoiser.config.image_embed_dim)
        return denoiser(hidden_states=latents, timestep=t * 1000, encoder_hidden_states=qwen,
                        encoder_attention_mask=qwen_mask, encoder_hidden_states_2=byt5,
                        encoder_attention_mask_2=byt5_mask, image_embeds=image, return_dict=False)[0]

    def test_frames_must_be_4k_plus_1(self, adapter):
        vae = adapter.load_vae(torch.device("cpu"))
        with pytest.raises(ValueError, match="4k\\+1 frames"):
            adapter.encode_media(vae, torch.zeros(1, 3, 3, 32, 32))

    def test_text_side(self, adapter):
        """The system prompt is cropped off (the caption's tokens come first); ByT5 encodes quoted text only."""
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        plain, quoted = adapter.encode_text(encoders, ["a cat", 'a sign that says "hello"'], 16)
        assert encoders["tokenizer"].decode(encoders["tokenizer"](" cat").input_ids) == " cat"
        assert 3 <= plain["qwen_mask"].sum() < 16 and plain["qwen_mask"][0] == 1
        assert plain["byt5_mask"].sum() == 0 and plain["byt5"].abs().sum() == 0
        assert quoted["byt5_mask"].sum() > 0

    def test_text_template_keys_the_system_prompt(self, adapter):
        assert "Describe the video" in adapter.text_template()

    def test_diffusers_export_loads_into_the_pipelines_transformer(self, adapter, lora_model, model_dir, tmp_path):
        """diffusers' pipeline has no load_lora_weights; the sampling pipeline's, through the transformer's own
        PEFT loader, takes the exported file."""
        from safetensors.torch import save_file

        _, lora = lora_model
        save_file(adapter.export_lora(lora, "diffusers"), tmp_path / "lora.safetensors")
        pipe = adapter.pipeline_class().from_pretrained(model_dir, dtype=torch.float32)
        pipe.load_lora_weights(tmp_path / "lora.safetensors")
        got, want = lora_deltas(pipe.transformer), expected_deltas(lora)
        assert set(got) == set(want) and all(torch.allclose(got[n], want[n], atol=1e-6) for n in want)

    def test_sample_inputs_drive_the_pipeline(self, adapter, model_dir):
        """Stored text entries render a video through the sampling pipeline, with its guidance scale per call."""
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        text, negative = adapter.encode_text(encoders, ["a red square moving right", ""], 16)
        pipe = adapter.pipeline_class().from_pretrained(model_dir)
        out = pipe(**adapter.sample_inputs(text, negative, 4.0, 1.0), height=32, width=32, num_frames=5,
                   num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0))
        assert out.frames.shape == (1, 5, 32, 32, 3) and pipe.guider.guidance_scale == 4.0

    def test_comfyui_export_fuses_qkv_as_comfyuis_double_blocks(self, adapter, lora_model):
        """ComfyUI's HunyuanVideo double blocks are Flux's: q/k/v LoRAs fuse exactly into img_attn.qkv and
        txt_attn.qkv, the rest keep one module each, every module with .alpha = its rank."""
        _, lora = lora_model
        out = adapter.export_lora(lora, "comfyui")
        want = expected_deltas(lora)

        def delta(name):
            base = f"diffusion_model.{name}"
            scale = out[f"{base}.alpha"] / out[f"{base}.lora_down.weight"].shape[0]
            return scale * out[f"{base}.lora_up.weight"] @ out[f"{base}.lora_down.weight"]

        for i in range(2):
            b = f"transformer_blocks.{i}"
            img_qkv = torch.cat([want[f"{b}.attn.to_{x}"] for x in "qkv"])
            txt_qkv = torch.cat([want[f"{b}.attn.add_{x}_proj"] for x in "qkv"])
            assert torch.allclose(delta(f"double_blocks.{i}.img_attn.qkv"), img_qkv, atol=1e-6)
            assert torch.allclose(delta(f"double_blocks.{i}.txt_attn.qkv"), txt_qkv, atol=1e-6)
            pairs = [("attn.to_out.0", "img_attn.proj"), ("ff.net.0.proj", "img_mlp.0"), ("ff.net.2", "img_mlp.2")]
            if i == 0:
                pairs += [("attn.to_add_out", "txt_attn.proj"), ("ff_context.net.0.proj", "txt_mlp.0"),
                          ("ff_context.net.2", "txt_mlp.2")]
            for ours, comfy in pairs:
                assert torch.allclose(delta(f"double_blocks.{i}.{comfy}"), want[f"{b}.{ours}"], atol=1e-6)
        assert len(out) == (8 + 5) * 3  # the last block has no text-stream output LoRA (lora_exclude)


def test_valid_tokens_first_keeps_order_and_zeroes_the_rest():
    states = torch.arange(1.0, 6.0).view(1, 5, 1)
    mask = torch.tensor([[0.0, 1.0, 0.0, 1.0, 1.0]])
    got, got_mask = valid_tokens_first(states, mask)
    assert got.flatten().tolist() == [2.0, 4.0, 5.0, 0.0, 0.0]
    assert got_mask.tolist() == [[1.0, 1.0, 1.0, 0.0, 0.0]]
