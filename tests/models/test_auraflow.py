"""The AuraFlow adapter: the shared contract on a tiny AuraFlow-shaped model, and its ComfyUI export checked
through diffusers' own converter of original AuraFlow checkpoints (the names ComfyUI loads)."""

import pytest
import torch

from diffusion_pipe.models.auraflow import AuraFlowAdapter, auraflow_original_module
from tests.models.comfyui_merge import assert_comfyui_merge_matches
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
    assert_comfyui_merge_matches(tiny, original_auraflow_state_dict, convert)
