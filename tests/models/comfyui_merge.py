"""The check every family's ComfyUI export passes: a random LoRA on every Linear, exported, merged into the
original-layout weights as ComfyUI merges (W += alpha / rank * up @ down), and converted back by the family's
converter (diffusers' own where it has one) equals the LoRA merged in diffusers' layout."""

from __future__ import annotations

from collections.abc import Callable

import torch

from diffusion_pipe.lora_keys import lora_modules
from diffusion_pipe.models.base import Adapter

StateDict = dict[str, torch.Tensor]


def random_lora(base: StateDict, modules: list[str], seed: int = 0) -> StateDict:
    """A PEFT-keyed LoRA of ranks 2-4 on each of `modules` (Linear names of `base`)."""
    gen, lora = torch.Generator().manual_seed(seed), {}
    for i, module in enumerate(modules):
        out_features, in_features = base[f"{module}.weight"].shape
        lora[f"{module}.lora_A.weight"] = torch.randn(2 + i % 3, in_features, generator=gen)
        lora[f"{module}.lora_B.weight"] = torch.randn(out_features, 2 + i % 3, generator=gen)
    return lora


def merge_as_comfyui(original: StateDict, exported: StateDict, prefix: str = "diffusion_model.") -> StateDict:
    """`original` with each exported lora_down/lora_up pair merged at its `.alpha` / rank, as ComfyUI does."""
    merged = dict(original)
    for key in exported:
        if key.endswith(".lora_down.weight"):
            module = key.removeprefix(prefix).removesuffix(".lora_down.weight")
            down, up = exported[key], exported[f"{prefix}{module}.lora_up.weight"]
            scale = exported[f"{prefix}{module}.alpha"].item() / down.shape[0]
            merged[f"{module}.weight"] = original[f"{module}.weight"] + scale * up @ down
    return merged


def assert_comfyui_merge_matches(adapter: Adapter, to_original: Callable[[StateDict], StateDict],
                                 to_diffusers: Callable[[StateDict], StateDict],
                                 modules: list[str] | None = None, exact_round_trip: bool = True) -> StateDict:
    """The check above for `adapter`; `modules` defaults to every Linear of its denoiser. Returns the export."""
    denoiser = adapter.load_denoiser(torch.device("cpu"))
    base = {k: v.clone() for k, v in denoiser.state_dict().items()}
    original = to_original(base)
    back = to_diffusers(dict(original))
    assert set(back) == set(base)
    if exact_round_trip:
        assert all(torch.equal(back[k], base[k]) for k in base)
    if modules is None:
        modules = [n for n, m in denoiser.named_modules() if isinstance(m, torch.nn.Linear)]
    lora = random_lora(base, modules)
    exported = adapter.export_lora(lora, "comfyui")
    want = dict(base)
    for module, (a, b) in lora_modules(lora).items():
        want[f"{module}.weight"] = base[f"{module}.weight"] + b @ a
    got = to_diffusers(merge_as_comfyui(original, exported))
    for key in base:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)
    return exported
