"""The HunyuanVideo adapter: the shared contract on a tiny HunyuanVideo-shaped model (videos and images), the
template crop, and the ComfyUI export (Flux's blocks under HunyuanVideo's original names)."""

import pytest
import torch

from diffusion_pipe.models.hunyuan_video import HunyuanVideoAdapter, sequence_mask
from tests.models.contract import AdapterContract


def binary_mask(inputs: tuple, seed: int) -> tuple:
    """The model inputs with a 0/1 text mask, padding at the end as the tokenizer makes it (random values are not
    masks: the refiner pools by it and the blocks count it)."""
    latents, t, text, mask, pooled, guidance = inputs
    lengths = torch.randint(1, mask.shape[1] + 1, (mask.shape[0],), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(mask.shape[1])[None] < lengths[:, None]).to(mask.dtype)
    return latents, t, text, mask, pooled, guidance


class TestHunyuanVideoContract(AdapterContract):
    adapter_cls = HunyuanVideoAdapter
    pipeline_cls = "HunyuanVideoPipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 5))  # an image and a 5-frame video (its VAE needs 4k+1 frames)
    roundtrip_formats = ("diffusers",)

    def _inputs(self, adapter, batch: int = 2, seed: int = 0):
        latents, noised, inputs = super()._inputs(adapter, batch, seed)
        return latents, noised, binary_mask(inputs, seed)

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        """HunyuanVideoTransformer3DModel.forward called as HunyuanVideoPipeline calls it."""
        latents, t, text, mask, pooled, guidance = inputs
        return denoiser(hidden_states=latents, timestep=t * 1000, encoder_hidden_states=text,
                        encoder_attention_mask=mask, pooled_projections=pooled, guidance=guidance * 1000,
                        return_dict=False)[0]

    def test_frames_must_be_4k_plus_1(self, adapter):
        vae = adapter.load_vae(torch.device("cpu"))
        with pytest.raises(ValueError, match="4k\\+1 frames"):
            adapter.encode_media(vae, torch.zeros(1, 3, 3, 32, 32))

    def test_template_is_cropped_off(self, adapter):
        """The tiny tokenizer splits the template's prefix into the 95 tokens the pipeline crops, as the real one
        does: the caption's tokens come first."""
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        short, longer = adapter.encode_text(encoders, ["a cat", "a red circle on a white background"], 16)
        assert 2 <= short["llama_mask"].sum() < longer["llama_mask"].sum() < 16
        assert "95" in adapter.text_template() and "Describe the video" in adapter.text_template()

    def test_comfyui_export_fuses_as_comfyuis_flux_blocks(self, adapter, lora_model):
        """ComfyUI's HunyuanVideo blocks are Flux's: q/k/v fuse exactly into img_attn_qkv / txt_attn_qkv, q/k/v and
        proj_mlp into linear1, each module with .alpha = its rank. (diffusers' HunyuanVideo converter reads these
        names too, but splits linear1 at Hunyuan's real width of 3072, so it cannot load a tiny model's file.)"""
        from tests.models.contract import expected_deltas

        _, lora = lora_model
        out = adapter.export_lora(lora, "comfyui")
        want = expected_deltas(lora)

        def delta(name):
            base = f"diffusion_model.{name}"
            down, up = out[f"{base}.lora_A.weight"], out[f"{base}.lora_B.weight"]
            assert out[f"{base}.alpha"].item() == down.shape[0]
            return up @ down

        d, s = "transformer_blocks.0", "single_transformer_blocks.0"
        assert torch.allclose(delta("double_blocks.0.img_attn_qkv"),
                              torch.cat([want[f"{d}.attn.to_{x}"] for x in "qkv"]), atol=1e-6)
        assert torch.allclose(delta("double_blocks.0.txt_attn_qkv"),
                              torch.cat([want[f"{d}.attn.add_{x}_proj"] for x in "qkv"]), atol=1e-6)
        for ours, comfy in (("attn.to_out.0", "img_attn_proj"), ("attn.to_add_out", "txt_attn_proj"),
                            ("ff.net.0.proj", "img_mlp.fc1"), ("ff.net.2", "img_mlp.fc2"),
                            ("ff_context.net.0.proj", "txt_mlp.fc1"), ("ff_context.net.2", "txt_mlp.fc2")):
            assert torch.allclose(delta(f"double_blocks.0.{comfy}"), want[f"{d}.{ours}"], atol=1e-6)
        linear1 = torch.cat([*(want[f"{s}.attn.to_{x}"] for x in "qkv"), want[f"{s}.proj_mlp"]])
        assert torch.allclose(delta("single_blocks.0.linear1"), linear1, atol=1e-6)
        assert torch.allclose(delta("single_blocks.0.linear2"), want[f"{s}.proj_out"], atol=1e-6)
        assert len(out) == (8 + 2) * 3


def test_sequence_mask_counts_latents_then_text():
    mask = sequence_mask(torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]), 2)
    assert mask[:, 0, 0].tolist() == [[True, True, True, True, False], [True, True, True, False, False]]
