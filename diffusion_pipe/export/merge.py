"""Merged export: the base denoiser with the LoRA folded into its weights, as a diffusers component directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import nn

from diffusion_pipe.export.keys import lora_modules
from diffusion_pipe.lineage.record import lineage_metadata, stamp_safetensors
from diffusion_pipe.fileio import fsync_dir, write_json_atomic
from diffusion_pipe.hashing import hash_file
from diffusion_pipe.models.base import Adapter, TensorDict


@torch.no_grad()
def merge_lora_into(model: nn.Module, lora: TensorDict) -> None:
    """W += B @ A for every LoRA module of `model`, in place. `lora` is PEFT-named with the scale folded into
    lora_B; the product is taken in float32 and rounded once to the weight's dtype."""
    for module, (a, b) in lora_modules(lora).items():
        try:
            layer = model.get_submodule(module)
        except AttributeError:
            raise ValueError(f"LoRA module {module!r} is not a module of the base {type(model).__name__}: the "
                             "LoRA was trained on another model than model.path") from None
        weight = layer.weight
        if tuple(weight.shape) != (b.shape[0], a.shape[1]):
            raise ValueError(f"LoRA module {module!r} is {b.shape[0]}x{a.shape[1]}, the base weight is "
                             f"{tuple(weight.shape)}: the LoRA was trained on another model than model.path")
        weight.copy_((weight.float() + b.float() @ a.float().to(weight.device)).to(weight.dtype))


def write_merged(adapter: Adapter, lora: TensorDict, out_dir: Path, lineage: dict) -> Path:
    """Write `out_dir/<denoiser component>/` (diffusers `save_pretrained`, every safetensors file stamped with
    the lineage) and `out_dir/lineage.json` listing the files' hashes.

    Built in a temp directory beside `out_dir` and renamed into place, so a reader sees the whole directory or
    none; a previous `out_dir` is replaced.
    """
    lineage = {**lineage, "kind": "merged"}
    component = adapter.denoiser_dir().name
    denoiser = adapter.load_denoiser(torch.device("cpu"))
    merge_lora_into(denoiser, lora)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        denoiser.save_pretrained(tmp / component)
        for path in sorted((tmp / component).glob("*.safetensors")):
            stamp_safetensors(path, lineage_metadata(lineage))
        files = {p.relative_to(tmp).as_posix(): hash_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        write_json_atomic(tmp / "lineage.json", {**lineage, "files": files})
        if out_dir.exists():
            old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
            os.replace(out_dir, old)
            shutil.rmtree(old)
        os.replace(tmp, out_dir)
        fsync_dir(out_dir.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
