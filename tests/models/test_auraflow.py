"""The AuraFlow adapter: the shared contract on a tiny AuraFlow-shaped model, and its ComfyUI export checked
through diffusers' own converter of original AuraFlow checkpoints (the names ComfyUI loads)."""

import pytest
import torch

from diffusion_pipe.export.keys import lora_modules
from diffusion_pipe.models.auraflow import AuraFlowAdapter, auraflow_original_module
from tests.models.contract import AdapterContract


class TestAuraFlowContract(AdapterContract):
    adapter_cls = AuraFlowAdapter
    pipeline_cls = "AuraFlowPipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 1))
    # AuraFlowPipeline's loader reads diffusers keys; test_comfyui_delta_equals_diffusers_delta checks comfyui.
    roundtrip_formats = ("diffusers",)

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        return denoiser(inputs[0], encoder_hidden_states=inputs[2], timestep=inputs[1], return_dict=False)[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> AuraFlowAdapter:
    out = tmp_path_factory.mktemp("auraflow")
    AuraFlowAdapter.build_tiny(out, seed=0)
    return AuraFlowAdapter(out, torch.float32)


def original_auraflow_state_dict(base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tiny transformer's weights in the original AuraFlow layout (the inverse of diffusers' converter)."""
    out = {"register_tokens": base["register_tokens"], "positional_encoding": base["pos_embed.pos_embed"]}
    for key, value in base.items():
        if key in ("register_tokens", "pos_embed.pos_embed"):
            continue
        module, param = key.rsplit(".", 1)
        original = auraflow_original_module(module)
        if original == "modF.1":
            first, second = value.chunk(2, dim=0)
            value = torch.cat([second, first], dim=0)
        out[f"{original}.{param}"] = value
    return out


def test_comfyui_delta_equals_diffusers_delta(tiny):
    """Every Linear with a LoRA: merged in the original layout as ComfyUI merges (W += alpha / rank * up @ down)
    and converted back by diffusers' own converter == merged in diffusers' layout."""
    from diffusers.loaders.single_file_utils import convert_auraflow_transformer_checkpoint_to_diffusers as convert

    denoiser = tiny.load_denoiser(torch.device("cpu"))
    base = {k: v.clone() for k, v in denoiser.state_dict().items()}
    original = original_auraflow_state_dict(base)
    back = convert(dict(original))
    assert set(back) == set(base) and all(torch.equal(back[k], base[k]) for k in base)
    gen = torch.Generator().manual_seed(0)
    lora = {}
    for i, module in enumerate(n for n, m in denoiser.named_modules() if isinstance(m, torch.nn.Linear)):
        out_features, in_features = base[f"{module}.weight"].shape
        lora[f"{module}.lora_A.weight"] = torch.randn(2 + i % 3, in_features, generator=gen)
        lora[f"{module}.lora_B.weight"] = torch.randn(out_features, 2 + i % 3, generator=gen)
    exported = tiny.export_lora(lora, "comfyui")
    merged = dict(original)
    for key in exported:
        if key.endswith(".lora_down.weight"):
            module = key.removeprefix("diffusion_model.").removesuffix(".lora_down.weight")
            down, up = exported[key], exported[f"diffusion_model.{module}.lora_up.weight"]
            scale = exported[f"diffusion_model.{module}.alpha"].item() / down.shape[0]
            merged[f"{module}.weight"] = original[f"{module}.weight"] + scale * up @ down
    want = dict(base)
    for module, (a, b) in lora_modules(lora).items():
        want[f"{module}.weight"] = base[f"{module}.weight"] + b @ a
    got = convert(merged)
    for key in base:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)
