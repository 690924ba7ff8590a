"""The Flux adapter: the shared contract on a tiny Flux-shaped model, plus packing, the excluded final
projection and its export key names."""

import pytest
import torch

from diffusion_pipe.models.flux import FluxAdapter, image_ids, pack_latents, unpack_latents
from diffusion_pipe.train.lora import target_module_names
from tests.models.contract import AdapterContract


class TestFluxContract(AdapterContract):
    adapter_cls = FluxAdapter
    pipeline_cls = "FluxPipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 1))
    # FluxPipeline's loader splits fused ComfyUI qkv LoRAs by Flux-dev's real widths (3072), so it cannot load
    # a tiny model's; tests/export/test_comfyui_flux.py checks that format against diffusers' converter instead.
    roundtrip_formats = ("diffusers",)

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        full = denoiser(hidden_states=inputs[0], timestep=inputs[1], encoder_hidden_states=inputs[2],
                        pooled_projections=inputs[3], img_ids=inputs[4][0], txt_ids=inputs[5][0],
                        guidance=inputs[6], return_dict=False)[0]
        return unpack_latents(full, like.shape[-2], like.shape[-1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("flux")
    FluxAdapter.build_tiny(out, seed=0)
    return FluxAdapter(out, torch.float32)


def test_pack_roundtrip():
    x = torch.randn(2, 4, 8, 12)
    tokens = pack_latents(x)
    assert tokens.shape == (2, 4 * 6, 16)
    assert torch.equal(unpack_latents(tokens, 8, 12), x)
    assert image_ids(8, 12).shape == (24, 3)


def test_lora_targets_exist_and_exclude_final_projection(tiny):
    transformer = tiny.load_denoiser(torch.device("cpu"))
    names = target_module_names(transformer, tiny.default_lora_targets, tiny.lora_exclude())
    assert "proj_out" not in names
    assert any(n.startswith("single_transformer_blocks.") and n.endswith("proj_out") for n in names)
    assert any(n.endswith("attn.to_q") for n in names)


def test_export_formats(tiny):
    lora = {"transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(4, 32),
            "transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(32, 4)}
    assert set(tiny.export_lora(lora, "diffusers")) == {f"transformer.{k}" for k in lora}
    comfy = tiny.export_lora(lora, "comfyui")  # q alone fills its third of the fused qkv; k, v rows are zero
    assert set(comfy) == {f"diffusion_model.double_blocks.0.img_attn.qkv.{s}"
                          for s in ("lora_down.weight", "lora_up.weight", "alpha")}
    assert comfy["diffusion_model.double_blocks.0.img_attn.qkv.alpha"].item() == 4.0
    assert comfy["diffusion_model.double_blocks.0.img_attn.qkv.lora_up.weight"][32:].abs().sum() == 0
    with pytest.raises(ValueError, match="export.formats: 'kohya' is not supported"):
        tiny.export_lora(lora, "kohya")
