"""The Wan adapter: the shared contract on a tiny Wan 2.1-shaped model (videos and images), the original Wan
names ComfyUI loads, and Wan 2.2's expert timestep ranges."""

import json
import shutil

import pytest
import torch

from diffusion_pipe.models.wan import WanAdapter, unpatchify, wan_original_name
from tests.models.contract import AdapterContract


class TestWanContract(AdapterContract):
    adapter_cls = WanAdapter
    pipeline_cls = "WanPipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 5))  # an image and a 5-frame video (Wan's VAE needs 4k+1 frames)
    roundtrip_formats = ("diffusers", "comfyui")

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        latents, t, text = inputs
        return denoiser(latents, t * 1000, text, return_dict=False)[0]

    def test_frames_must_be_4k_plus_1(self, adapter):
        vae = adapter.load_vae(torch.device("cpu"))
        with pytest.raises(ValueError, match="4k\\+1 frames"):
            adapter.encode_media(vae, torch.zeros(1, 3, 4, 32, 32))

    def test_text_padding_is_zero(self, adapter):
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        (entry,) = adapter.encode_text(encoders, ["a cat"], 16)
        assert entry["t5"][-1].abs().sum() == 0 and entry["t5"][0].abs().sum() > 0

    def test_wan22_experts_train_their_timestep_ranges(self, model_dir, tmp_path):
        d = tmp_path / "wan22"
        shutil.copytree(model_dir, d)
        shutil.copytree(d / "transformer", d / "transformer_2")
        index = json.loads((d / "model_index.json").read_text())
        (d / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": 0.875}))
        assert WanAdapter(d, torch.float32).timestep_range() == (0.0, 1.0)
        assert WanAdapter(d, torch.float32, expert="high").timestep_range() == (0.875, 1.0)
        low = WanAdapter(d, torch.float32, expert="low")
        assert low.timestep_range() == (0.0, 0.875) and low.denoiser_dir() == d / "transformer_2"
        with pytest.raises(ValueError, match="no boundary_ratio"):
            WanAdapter(model_dir, torch.float32, expert="high").timestep_range()


def test_unpatchify_inverts_patching():
    x = torch.randn(2, 16, 3, 4, 6)
    tokens = x.reshape(2, 16, 3, 1, 2, 2, 3, 2).permute(0, 2, 4, 6, 3, 5, 7, 1).reshape(2, 3 * 2 * 3, 16 * 4)
    assert torch.equal(unpatchify(tokens, x, (1, 2, 2)), x)


@pytest.mark.parametrize("diffusers_name, original", [
    ("blocks.0.attn1.to_q", "blocks.0.self_attn.q"), ("blocks.12.attn1.to_out.0", "blocks.12.self_attn.o"),
    ("blocks.3.attn2.to_v", "blocks.3.cross_attn.v"), ("blocks.3.attn2.add_k_proj", "blocks.3.cross_attn.k_img"),
    ("blocks.5.ffn.net.0.proj", "blocks.5.ffn.0"), ("blocks.5.ffn.net.2", "blocks.5.ffn.2"),
    ("proj_out", "head.head"),
])
def test_original_wan_names(diffusers_name, original):
    assert wan_original_name(diffusers_name) == original


def test_comfyui_keys_and_alpha(tmp_path):
    lora = {"blocks.0.attn1.to_q.lora_A.weight": torch.ones(4, 24),
            "blocks.0.attn1.to_q.lora_B.weight": torch.ones(24, 4)}
    out = WanAdapter(tmp_path, torch.float32).export_lora(lora, "comfyui")
    base = "diffusion_model.blocks.0.self_attn.q"
    assert set(out) == {f"{base}.lora_A.weight", f"{base}.lora_B.weight", f"{base}.alpha"}
    assert out[f"{base}.alpha"].item() == 4.0
