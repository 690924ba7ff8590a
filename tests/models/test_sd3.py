"""The SD3 adapter: the shared contract on a tiny SD3.5-shaped model (dual attention in one block, qk norms,
three text encoders), and its ComfyUI export checked through diffusers' own converter of original MMDiT
checkpoints (the names ComfyUI loads)."""

import re

import pytest
import torch

from diffusion_pipe.models.sd3 import SD3Adapter, sd3_original_module, swaps_scale_shift
from tests.models.comfyui_merge import assert_comfyui_merge_matches
from tests.models.contract import AdapterContract


class TestSD3Contract(AdapterContract):
    adapter_cls = SD3Adapter
    pipeline_cls = "StableDiffusion3Pipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 1))
    # StableDiffusion3Pipeline's loader reads diffusers keys only; test_comfyui_delta_equals_diffusers_delta
    # checks the comfyui format instead.
    roundtrip_formats = ("diffusers",)

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        return denoiser(hidden_states=inputs[0], timestep=inputs[1] * 1000, encoder_hidden_states=inputs[2],
                        pooled_projections=inputs[3], return_dict=False)[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> SD3Adapter:
    out = tmp_path_factory.mktemp("sd3")
    SD3Adapter.build_tiny(out, seed=0)
    return SD3Adapter(out, torch.float32)


def original_sd3_state_dict(base: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """The tiny transformer's weights in the original MMDiT layout (the inverse of diffusers' converter)."""
    fused: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for key, value in base.items():
        norm = re.fullmatch(r"transformer_blocks\.(\d+)\.(attn2?)\.norm_(added_)?([qk])\.weight", key)
        if key == "pos_embed.pos_embed":
            out["pos_embed"] = value
        elif key.startswith("pos_embed.proj."):
            out[key.replace("pos_embed.proj.", "x_embedder.proj.")] = value
        elif norm:
            index, attn, added, qk = norm.groups()
            out[f"joint_blocks.{index}.{'context_block' if added else 'x_block'}.{attn}.ln_{qk}.weight"] = value
        else:
            module, param = key.rsplit(".", 1)
            original, part = sd3_original_module(module)
            if part is not None:
                fused.setdefault(f"{original}.{param}", {})[part] = value
            elif swaps_scale_shift(original, num_layers):
                first, second = value.chunk(2, dim=0)
                out[f"{original}.{param}"] = torch.cat([second, first], dim=0)
            else:
                out[f"{original}.{param}"] = value
    for key, parts in fused.items():
        out[key] = torch.cat([parts[i] for i in range(3)], dim=0)
    return out


def to_diffusers(original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    return convert_sd3_transformer_checkpoint_to_diffusers(dict(original))


def test_comfyui_delta_equals_diffusers_delta(tiny):
    """Every Linear of the transformer with a LoRA: merged in the original layout as ComfyUI merges
    (W += alpha / rank * up @ down) and converted back by diffusers == merged in diffusers' layout."""
    assert_comfyui_merge_matches(tiny, lambda sd: original_sd3_state_dict(sd, num_layers=2), to_diffusers)


def test_unmappable_module_is_named(tiny):
    lora = {"pos_embed.proj.lora_A.weight": torch.ones(2, 4), "pos_embed.proj.lora_B.weight": torch.ones(4, 2)}
    with pytest.raises(ValueError, match="no ComfyUI SD3 name for LoRA module 'pos_embed.proj'"):
        tiny.export_lora(lora, "comfyui")
