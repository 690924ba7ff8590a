"""train.init_lora: start training from an existing LoRA file in any layout this family exports (ours, diffusers,
ComfyUI, kohya), mapped onto the run's LoRA modules through the adapter's own `export_lora` run in reverse.

The reverse map comes from probes: each run target is exported alone, as a rank-1 LoRA whose lora_A and lora_B
hold 1, 2, 3, ... in every format; the exported key names the module, and where the values moved tells the
permutation the format applies (Flux's final modulation swaps its halves), so no family needs code of its own.
A key that several modules export to (a fused projection, such as ComfyUI's Flux qkv) cannot be split back
exactly and is refused.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from diffusion_pipe.config import ConfigError
from diffusion_pipe.lora_keys import TensorDict, split_key


@dataclass(frozen=True)
class KeyMap:
    """Where a file's LoRA prefix lands: `module` (PEFT name) and the index permutations that undo the format's
    reordering (None: unchanged); `fused`: the modules a fused prefix holds (then it cannot be split)."""
    module: str = ""
    rows: torch.Tensor | None = None  # B[rows[i]] = file B[i]
    cols: torch.Tensor | None = None  # A[:, cols[j]] = file A[:, j]
    fused: tuple[str, ...] = ()


def _aliases(prefix: str) -> list[str]:
    """The prefix and the kohya spellings ComfyUI also loads: `lora_unet_` for `diffusion_model.` names,
    `lora_transformer_` for diffusers' `transformer.` names, dots as underscores."""
    out = [prefix]
    for head, kohya in (("diffusion_model.", "lora_unet_"), ("transformer.", "lora_transformer_")):
        if prefix.startswith(head):
            out.append(kohya + prefix[len(head):].replace(".", "_"))
    return out


def _permutation(exported: torch.Tensor, n: int) -> torch.Tensor | None | bool:
    """The permutation the export applied to probe values 1..n (None: identity), or False when it is no
    permutation of them (a fused or transformed tensor)."""
    values = exported.flatten().double()
    if values.numel() != n or not torch.equal(torch.sort(values).values, torch.arange(1, n + 1).double()):
        return False
    perm = values.long() - 1
    return None if torch.equal(perm, torch.arange(n)) else perm


def reverse_key_map(adapter, shapes: dict[str, tuple[int, int]]) -> dict[str, KeyMap]:
    """File prefix -> KeyMap for every run target (PEFT name -> (out, in) features) in our own layout (PEFT
    names) and every export format of the adapter, kohya spellings included."""
    found: dict[str, list[tuple[str, object, object]]] = {}
    for module, (out_f, in_f) in sorted(shapes.items()):
        probe = {f"{module}.lora_A.weight": torch.arange(1, in_f + 1, dtype=torch.float32)[None],
                 f"{module}.lora_B.weight": torch.arange(1, out_f + 1, dtype=torch.float32)[:, None]}
        outputs = [probe] + [adapter.export_lora(probe, fmt) for fmt in adapter.capabilities.export_formats]
        for tensors in outputs:
            parts: dict[str, dict[str, torch.Tensor]] = {}
            for key, value in tensors.items():
                split = split_key(key)
                if split and split[1] != "alpha":
                    parts.setdefault(split[0], {})[split[1]] = value
            for prefix, pair in parts.items():
                rows = _permutation(pair["B"], out_f) if "B" in pair else False
                cols = _permutation(pair["A"], in_f) if "A" in pair else False
                for alias in _aliases(prefix):
                    found.setdefault(alias, []).append((module, rows, cols))
    out: dict[str, KeyMap] = {}
    for prefix, hits in found.items():
        modules = tuple(sorted({m for m, _, _ in hits}))
        if len(modules) > 1 or any(r is False or c is False for _, r, c in hits):
            out[prefix] = KeyMap(fused=modules)
        else:
            _, rows, cols = hits[0]
            out[prefix] = KeyMap(module=modules[0], rows=rows, cols=cols)
    return out


def read_lora_file(path: Path) -> tuple[TensorDict, dict[str, str]]:
    """The tensors and metadata of a LoRA file; a clear error for a missing or non-safetensors file."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise FileNotFoundError(f"train.init_lora: {path} does not exist; give the path of a LoRA .safetensors "
                                "file (or remove train.init_lora to start from LoRA's usual init)")
    try:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(f"train.init_lora: {path} is not a safetensors file ({exc}); give a LoRA in "
                          "safetensors format (convert a .ckpt/.pt first)") from exc


def metadata_scale(metadata: dict[str, str], path: Path) -> float:
    """The scale a file without `.alpha` tensors applies: our train stage's lora_alpha / lora_rank (not folded
    into lora_B), diffusers' `save_lora_weights` metadata (`lora_adapter_metadata`: its LoraConfig's lora_alpha
    / r), else 1 (our exports fold it)."""
    import json

    if "lora_alpha" in metadata and "lora_rank" in metadata and "diffusion_pipe.export_format" not in metadata:
        return float(metadata["lora_alpha"]) / int(metadata["lora_rank"])
    if "lora_adapter_metadata" in metadata:
        config = json.loads(metadata["lora_adapter_metadata"])
        if any(config.get(k) for k in config if k.endswith(("rank_pattern", "alpha_pattern"))):
            raise ConfigError(f"train.init_lora: {path} gives some modules their own rank or alpha "
                              "(rank_pattern / alpha_pattern), which a run of one lora_rank cannot start from")
        alphas = {v for k, v in config.items() if k.endswith("lora_alpha")}
        ranks = {v for k, v in config.items() if k == "r" or k.endswith(".r")}
        if len(alphas) == 1 and len(ranks) == 1:
            return float(alphas.pop()) / int(ranks.pop())
    return 1.0


def init_lora_weights(adapter, shapes: dict[str, tuple[int, int]], path: Path, rank: int,
                      alpha: float) -> TensorDict:
    """The PEFT-named lora_A / lora_B start values of the run's targets (`shapes`: PEFT name -> (out, in)) that
    the LoRA file `path` holds, at the run's own scale alpha/rank: the starting model equals the base + that
    LoRA at the strength the file applies (its `.alpha`/rank, our train stage's metadata, else 1, as our exports
    fold it). Errors name the file and the key: a key no target maps to, a fused key, a rank other than
    train.lora_rank."""
    tensors, metadata = read_lora_file(path)
    keymap = reverse_key_map(adapter, shapes)
    meta_scale = metadata_scale(metadata, path)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        split = split_key(key)
        if split is None:
            raise ConfigError(f"train.init_lora: {path} holds {key!r}, which is no LoRA tensor (lora_A/lora_B, "
                              "lora_down/lora_up or alpha); only LoRA files can start a run")
        groups.setdefault(split[0], {})[split[1]] = value
    out: TensorDict = {}
    for prefix, group in sorted(groups.items()):
        target = keymap.get(prefix)
        if target is None:
            raise ConfigError(f"train.init_lora: {path} holds {prefix!r}, which maps to no LoRA module of this "
                              f"{adapter.name} run (train.lora_targets); is it a LoRA of another family, or of "
                              "modules this run does not adapt?")
        if target.fused:
            raise ConfigError(f"train.init_lora: {path} holds {prefix!r}, a fused projection of "
                              f"{', '.join(target.fused)} that cannot be split back exactly; start from the "
                              "diffusers export of that LoRA instead")
        if "A" not in group or "B" not in group:
            raise ConfigError(f"train.init_lora: {path}: {prefix!r} lacks its "
                              f"{'lora_A/lora_down' if 'A' not in group else 'lora_B/lora_up'} weight")
        a, b = group["A"].float(), group["B"].float()
        if a.shape[0] != rank:
            raise ConfigError(f"train.init_lora: {path} has rank {a.shape[0]} ({prefix!r}) and train.lora_rank is "
                              f"{rank}; set train.lora_rank: {a.shape[0]} to continue that LoRA")
        if target.module in {k.rsplit(".lora_", 1)[0] for k in out}:
            raise ConfigError(f"train.init_lora: {path} holds module {target.module} twice (also as {prefix!r})")
        file_scale = float(group["alpha"]) / a.shape[0] if "alpha" in group else meta_scale
        if target.cols is not None:
            a = a[:, torch.argsort(target.cols)]
        if target.rows is not None:
            b = b[torch.argsort(target.rows)]
        out[f"{target.module}.lora_A.weight"] = a.contiguous()
        out[f"{target.module}.lora_B.weight"] = (b * (file_scale * rank / alpha)).contiguous()
    missing = len(shapes) - len(out) // 2
    print(f"train: init_lora {path}: {len(out) // 2} LoRA modules start from it, {missing} from LoRA's usual "
          "init", file=sys.stderr)
    return out
