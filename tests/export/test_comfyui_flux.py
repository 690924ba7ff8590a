"""The ComfyUI Flux export against BFL's original layout, with diffusers' own converter as the reference."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from diffusion_pipe.lora_keys import fuse_loras, lora_modules
from diffusion_pipe.models.flux import FluxAdapter, original_flux_state_dict

INNER, MLP = 32, 128  # the tiny model's widths: 2 heads x 16, mlp_ratio 4


@pytest.fixture(scope="module")
def tiny(tiny_flux_dir) -> FluxAdapter:
    return FluxAdapter(tiny_flux_dir, torch.float32)


@pytest.fixture(scope="module")
def base(tiny) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tiny.load_denoiser(torch.device("cpu")).state_dict().items()}


def to_diffusers(original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' own original -> diffusers converter, its hard-coded Flux-dev width (3072) set to the tiny one."""
    import diffusers.loaders.single_file_utils as sfu

    source = inspect.getsource(sfu.convert_flux_transformer_checkpoint_to_diffusers)
    assert "inner_dim = 3072" in source
    namespace = dict(vars(sfu))
    exec(source.replace("inner_dim = 3072", f"inner_dim = {INNER}"), namespace)
    return namespace["convert_flux_transformer_checkpoint_to_diffusers"](dict(original))


def random_lora(base: dict[str, torch.Tensor], modules: list[str], seed: int = 0) -> dict[str, torch.Tensor]:
    """A PEFT-named LoRA on `modules`, ranks varying by module, B nonzero (unlike a fresh init)."""
    gen = torch.Generator().manual_seed(seed)
    lora = {}
    for i, module in enumerate(modules):
        out_features, in_features = base[f"{module}.weight"].shape
        rank = 2 + i % 3
        lora[f"{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen)
        lora[f"{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen)
    return lora


def every_linear(tiny) -> list[str]:
    model = tiny.load_denoiser(torch.device("cpu"))
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


PARTIAL = ["transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.add_v_proj",
           "single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.1.attn.to_k", "norm_out.linear"]


def apply_comfyui(original: dict[str, torch.Tensor], exported: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What ComfyUI does with the file: W += (alpha / rank) * up @ down, per `diffusion_model.` module."""
    merged = dict(original)
    for key in exported:
        if key.endswith(".lora_down.weight"):
            module = key.removeprefix("diffusion_model.").removesuffix(".lora_down.weight")
            down, up = exported[key], exported[f"diffusion_model.{module}.lora_up.weight"]
            scale = exported[f"diffusion_model.{module}.alpha"].item() / down.shape[0]
            merged[f"{module}.weight"] = original[f"{module}.weight"] + scale * up @ down
    return merged


def test_original_layout_is_the_inverse_of_diffusers_converter(base):
    original = original_flux_state_dict(base, INNER, MLP)
    back = to_diffusers(original)
    assert set(back) == set(base)
    assert all(torch.equal(back[k], base[k]) for k in base)


@pytest.mark.parametrize("targets", ["all", "partial"])
def test_every_key_lands_on_an_original_module(tiny, base, targets):
    lora = random_lora(base, every_linear(tiny) if targets == "all" else PARTIAL)
    exported = tiny.export_lora(lora, "comfyui")
    original = original_flux_state_dict(base, INNER, MLP)
    modules = {k.removeprefix("diffusion_model.").rsplit(".", 2)[0] if "lora_" in k
               else k.removeprefix("diffusion_model.").removesuffix(".alpha") for k in exported}
    assert all(k.startswith("diffusion_model.") for k in exported)
    for module in modules:
        weight = original[f"{module}.weight"]  # KeyError: a key naming no module of the original model
        down = exported.pop(f"diffusion_model.{module}.lora_down.weight")
        up = exported.pop(f"diffusion_model.{module}.lora_up.weight")
        alpha = exported.pop(f"diffusion_model.{module}.alpha")
        assert down.shape[1] == weight.shape[1] and up.shape == (weight.shape[0], down.shape[0])
        assert alpha.ndim == 0 and alpha.item() == down.shape[0]
    assert exported == {}  # nothing left over


@pytest.mark.parametrize("targets", ["all", "partial"])
def test_comfyui_delta_equals_diffusers_delta(tiny, base, targets):
    """Merged in ComfyUI's layout and converted back by diffusers == merged in diffusers' layout."""
    lora = random_lora(base, every_linear(tiny) if targets == "all" else PARTIAL, seed=1)
    merged_diffusers = dict(base)
    for module, (a, b) in lora_modules(lora).items():
        merged_diffusers[f"{module}.weight"] = base[f"{module}.weight"] + b @ a
    merged_comfyui = to_diffusers(apply_comfyui(original_flux_state_dict(base, INNER, MLP),
                                                tiny.export_lora(lora, "comfyui")))
    for key in base:
        torch.testing.assert_close(merged_comfyui[key], merged_diffusers[key], rtol=1e-5, atol=1e-5)


def test_fused_lora_is_exact_and_zero_where_untrained():
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(2, 8, generator=gen), torch.randn(4, 2, generator=gen))
    v = (torch.randn(3, 8, generator=gen), torch.randn(4, 3, generator=gen))
    a, b = fuse_loras([q, None, v], [4, 4, 4])
    assert a.shape == (5, 8) and b.shape == (12, 5)
    torch.testing.assert_close(b @ a, torch.cat([q[1] @ q[0], torch.zeros(4, 8), v[1] @ v[0]]))


def test_unmappable_module_is_named(tiny):
    lora = {"pos_embed.proj.lora_A.weight": torch.ones(2, 4), "pos_embed.proj.lora_B.weight": torch.ones(4, 2)}
    with pytest.raises(ValueError, match="no ComfyUI Flux name for LoRA module 'pos_embed.proj'"):
        tiny.export_lora(lora, "comfyui")


def test_half_a_lora_is_an_error(tiny):
    with pytest.raises(ValueError, match="'transformer_blocks.0.attn.to_q' has no lora_B weight"):
        tiny.export_lora({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 32)}, "comfyui")
