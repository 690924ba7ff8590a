"""What an exported LoRA, DoRA, LoKr or LoHa file applies, rebuilt with the LyCORIS formulas, against what the
trained peft modules apply: shared by tests/train/test_adapters.py and every family's contract suite."""

from __future__ import annotations

import torch

from diffusion_pipe.lora_keys import split_key


def peft_weights(denoiser) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module name -> (base weight, adapted weight) as the trained peft module computes (DoRA: its magnitude
    times the direction W + scale B A, normed per output feature)."""
    out = {}
    for name, module in denoiser.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
            base = module.get_base_layer().weight.detach()
            if getattr(module, "use_dora", {}).get("default"):
                direction = base + module.get_delta_weight("default").detach()
                magnitude = module.lora_magnitude_vector["default"].weight.detach()
                out[name] = (base, direction * (magnitude / direction.norm(dim=1))[:, None])
            else:
                out[name] = (base, base + module.get_delta_weight("default").detach())
    return out


def lycoris_weight(keys: dict[str, torch.Tensor], base: torch.Tensor) -> torch.Tensor:
    """The weight a LyCORIS loader makes of `base` and one key's tensors (`keys`: suffix -> tensor), with the
    LyCORIS formulas: LoKr kron(w1, w2), a low-rank factor scaled by alpha / its rank; LoHa (w1_a w1_b) *
    (w2_a w2_b) alpha / rank; a LoRA up down alpha / rank (1 without alpha), and with `dora_scale` (on the
    output axis) the result normed per output feature and scaled by it."""
    alpha = keys["alpha"].item() if "alpha" in keys else None  # a LoRA without one applies at scale 1
    if "hada_w1_a" in keys:
        delta = (keys["hada_w1_a"] @ keys["hada_w1_b"]) * (keys["hada_w2_a"] @ keys["hada_w2_b"])
        return base + delta * alpha / keys["hada_w1_b"].shape[0]
    if any(k.startswith("lokr_") for k in keys):
        w1 = keys["lokr_w1"] if "lokr_w1" in keys else keys["lokr_w1_a"] @ keys["lokr_w1_b"]
        w2 = keys["lokr_w2"] if "lokr_w2" in keys else keys["lokr_w2_a"] @ keys["lokr_w2_b"]
        low_rank = keys.get("lokr_w2_b", keys.get("lokr_w1_b"))
        scale = alpha / low_rank.shape[0] if low_rank is not None else 1.0
        return base + torch.kron(w1, w2) * scale
    (up,), (down,) = ([v for k, v in keys.items() if split_key(f"m.{k}") == ("m", which)] for which in "BA")
    weight = base + up @ down * (alpha / down.shape[0] if alpha is not None else 1.0)
    if "dora_scale" in keys:
        assert keys["dora_scale"].shape == (base.shape[0], 1)  # ComfyUI's output-axis DoRA
        weight = weight * keys["dora_scale"] / weight.norm(dim=1, keepdim=True)
    return weight


def by_prefix(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        split = split_key(key)
        prefix, suffix = (split[0], key[len(split[0]) + 1:]) if split else key.rsplit(".", 1)
        out.setdefault(prefix, {})[suffix] = value
    return out


def in_layout(adapter, weights: dict[str, torch.Tensor], fmt: str = "comfyui") -> dict[str, torch.Tensor]:
    """Each exported key's whole weight from per-module weights (fused projections stacked as ComfyUI's Flux
    fuses them), through the family's own (separately tested) LoRA export of an exact full-rank LoRA: A = I."""
    lora = {}
    for module, weight in weights.items():
        lora[f"{module}.lora_A.weight"] = torch.eye(weight.shape[1])
        lora[f"{module}.lora_B.weight"] = weight
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in adapter.export_lora(lora, fmt).items():
        prefix, which = split_key(key)
        out.setdefault(prefix, {})[which] = value
    return {prefix: pair["B"] @ pair["A"] for prefix, pair in out.items()}


def exported_weight_errors(adapter, denoiser, exported: dict[str, torch.Tensor], fmt: str) -> dict[str, float]:
    """Exported key -> the largest difference between the weight its tensors make of the base (`lycoris_weight`)
    and the one the trained modules make, for the keys that differ (or that change nothing: the check would see
    nothing there); {} when every key applies what was trained. A key under a diffusers name (`transformer.`)
    is its module's own weight; any other is the family's `fmt` layout of the modules' weights (`in_layout`)."""
    weights = peft_weights(denoiser)
    bases = in_layout(adapter, {m: base for m, (base, _) in weights.items()}, fmt)
    adapted = in_layout(adapter, {m: w for m, (_, w) in weights.items()}, fmt)
    errors = {}
    for prefix, keys in by_prefix(exported).items():
        if prefix in bases:
            base, want = bases[prefix], adapted[prefix]
        else:
            base, want = weights[prefix.removeprefix("transformer.")]
        got = lycoris_weight(keys, base)
        if not torch.allclose(got, want, atol=1e-5, rtol=1e-4) or torch.allclose(got, base, atol=1e-3):
            errors[prefix] = (got - want).abs().max().item()
    return errors
