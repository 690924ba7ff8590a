"""Pure helpers for LoRA tensors and key mapping, shared by every family's `export_lora` (adapters), export and
the LoRAs train writes along the way: a floor below all of them.

Input is always a PEFT-named LoRA (`<module>.lora_A.weight`, `<module>.lora_B.weight`) with the alpha/rank scale
already folded into lora_B, so every output applies at scale 1: where a format carries `.alpha`, it is the
module's rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

TensorDict = dict[str, torch.Tensor]
LoraPair = tuple[torch.Tensor, torch.Tensor]  # (A: rank x in, B: out x rank)


# file key suffix -> which factor it is ("A" = down, "B" = up)
_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B", ".lora_down.weight": "A", ".lora_up.weight": "B",
             ".lora.down.weight": "A", ".lora.up.weight": "B"}


def split_key(key: str) -> tuple[str, str] | None:
    """(prefix, "A" | "B" | "alpha") of a LoRA tensor key, or None for any other key."""
    if key.endswith(".alpha"):
        return key[: -len(".alpha")], "alpha"
    for suffix, which in _SUFFIXES.items():
        if key.endswith(suffix):
            return key[: -len(suffix)], which
    return None


def lora_modules(lora: TensorDict) -> dict[str, LoraPair]:
    """Module name -> (lora_A, lora_B) of a PEFT-named LoRA, sorted by module name.

    A key that is not `<module>.lora_A.weight` / `.lora_B.weight`, or a module with only one of the two, is a
    ValueError naming the key: a half LoRA exported silently would load as garbage or not at all.
    """
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in lora.items():
        for which in ("lora_A", "lora_B"):
            suffix = f".{which}.weight"
            if key.endswith(suffix):
                parts.setdefault(key[: -len(suffix)], {})[which] = value
                break
        else:
            raise ValueError(f"LoRA key {key!r} is not '<module>.lora_A.weight' or '<module>.lora_B.weight'; "
                             "the trained LoRA file is not one the train stage wrote")
    out: dict[str, LoraPair] = {}
    for module in sorted(parts):
        pair = parts[module]
        if set(pair) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(pair)).pop()
            raise ValueError(f"LoRA module {module!r} has no {missing} weight; the trained LoRA file is incomplete")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.shape[0] != b.shape[1]:
            raise ValueError(f"LoRA module {module!r}: lora_A has rank {a.shape[0]}, lora_B {b.shape[1]}")
        out[module] = (a, b)
    return out


def fuse_loras(parts: Sequence[LoraPair | None], out_dims: Sequence[int]) -> LoraPair:
    """One LoRA for a projection that fuses several (e.g. q, k, v stacked along the output dimension).

    Exact: A = cat(A_i) (sum of ranks x in) and B = block_diag(B_i) (sum of out_dims x sum of ranks), so
    B @ A stacks the parts' deltas B_i @ A_i. A part without a LoRA (None) contributes zero rows of B.
    """
    assert len(parts) == len(out_dims), (len(parts), out_dims)
    present = [p for p in parts if p is not None]
    assert present, "fuse_loras needs at least one LoRA part"
    a_fused = torch.cat([a for a, _ in present], dim=0)
    b_fused = torch.zeros(sum(out_dims), a_fused.shape[0], dtype=present[0][1].dtype)
    row = col = 0
    for part, dim in zip(parts, out_dims):
        if part is not None:
            a, b = part
            if b.shape[0] != dim:
                raise ValueError(f"LoRA part has {b.shape[0]} output features where the fused projection "
                                 f"expects {dim}: the model config does not match the trained LoRA")
            b_fused[row:row + dim, col:col + a.shape[0]] = b
            col += a.shape[0]
        row += dim
    return a_fused.contiguous(), b_fused


def down_up_alpha(prefix: str, a: torch.Tensor, b: torch.Tensor) -> TensorDict:
    """`<prefix>.lora_down.weight`, `.lora_up.weight` and `.alpha` = rank (scale 1: B is pre-scaled).

    The kohya/ComfyUI spelling: ComfyUI scales by alpha/rank only where `.alpha` exists, and diffusers'
    converters recognise these files by `lora_down`.
    """
    return {f"{prefix}.lora_down.weight": a.contiguous(), f"{prefix}.lora_up.weight": b.contiguous(),
            f"{prefix}.alpha": torch.tensor(float(a.shape[0]))}


def kohya_name(module: str, prefix: str = "lora_unet") -> str:
    """kohya-style name of a module: `lora_unet_` + the dotted name with `_`, e.g.
    'down_blocks.1.attentions.0.proj_in' -> 'lora_unet_down_blocks_1_attentions_0_proj_in'. Use the module
    names the target loader maps (ComfyUI maps kohya names of diffusers UNet modules onto its own SDXL model)."""
    return f"{prefix}_{module.replace('.', '_')}"


# The one factor of each adapter kind that carries the scale alpha/rank when it is folded in: the whole delta is
# linear in it (LoRA's B, LoKr's first Kronecker factor, LoHa's first Hadamard factor).
_SCALED_FACTOR = (".lora_B.weight", ".lokr_w1", ".lokr_w1_a", ".hada_w1_a")


def fold_scale(lora: dict[str, torch.Tensor], rank: int, alpha: float) -> dict[str, torch.Tensor]:
    """Fold the scale alpha/rank into the factor of each module that carries it (lora_B; LoKr's lokr_w1, LoHa's
    hada_w1_a), so every loader applies the trained strength at scale 1 whether or not it reads alpha. DoRA's
    magnitude is left as it is: DoRA's direction is W + scale * B A, so folding into B keeps it exact."""
    scale = alpha / rank
    return {k: (v * scale if k.endswith(_SCALED_FACTOR) else v).contiguous() for k, v in lora.items()}


def ema_lora_path(lora_path: Path) -> Path:
    """Where the train stage writes the EMA of the LoRA it writes to `lora_path` (`train.ema_decay`), and the
    export stage reads it: `runs/train/lora.safetensors` -> `runs/train/lora.ema.safetensors`."""
    return lora_path.with_name(lora_path.name.removesuffix(".safetensors") + ".ema.safetensors")
