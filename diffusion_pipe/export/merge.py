"""Denoiser exports as diffusers component directories: merged (the base denoiser with the LoRA folded into its
weights, export.merged) and full (a full fine-tune's trained weights, train.adapter: full)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import nn

from diffusion_pipe.lora_keys import lora_modules
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
    """Write the base denoiser with `lora` folded in to `out_dir` (`write_denoiser_dir`)."""
    denoiser = adapter.load_denoiser(torch.device("cpu"))
    merge_lora_into(denoiser, lora)
    return write_denoiser_dir(adapter, denoiser, out_dir, {**lineage, "kind": "merged"})


@torch.no_grad()
def write_full(adapter: Adapter, trained: TensorDict, out_dir: Path, lineage: dict) -> Path:
    """Write a full fine-tune's denoiser to `out_dir` (`write_denoiser_dir`): the base model's class and config
    with the trained weights, every one of its parameters among them."""
    denoiser = adapter.load_denoiser(torch.device("cpu"))
    params = dict(denoiser.named_parameters())
    if unknown := sorted(set(trained) - set(params)):
        raise ValueError(f"the trained weights hold {len(unknown)} tensors the base {type(denoiser).__name__} does "
                         f"not have (e.g. {unknown[0]}): they were trained on another model than model.path")
    if untrained := sorted(set(params) - set(trained)):
        raise ValueError(f"the trained weights lack {len(untrained)} parameters of {type(denoiser).__name__} (e.g. "
                         f"{untrained[0]}): not a full fine-tune of this model; re-run the train stage")
    for name, tensor in trained.items():
        if tensor.shape != params[name].shape:
            raise ValueError(f"trained weight {name} is {tuple(tensor.shape)}, the base's is "
                             f"{tuple(params[name].shape)}: trained on another model than model.path")
        params[name].copy_(tensor)
    return write_denoiser_dir(adapter, denoiser, out_dir, {**lineage, "kind": "full"})


def write_denoiser_dir(adapter: Adapter, denoiser: nn.Module, out_dir: Path, lineage: dict) -> Path:
    """Write `out_dir/<denoiser component>/` (diffusers `save_pretrained`, every safetensors file stamped with
    the lineage) and `out_dir/lineage.json` listing the files' hashes.

    Built in a temp directory beside `out_dir` and renamed into place, so a reader sees the whole directory or
    none; a previous `out_dir` is replaced.
    """
    component = adapter.denoiser_dir().name
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
