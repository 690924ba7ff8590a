"""LoRA through peft: which modules get adapters, and the trained weights under PEFT's key names (or, for a full
fine-tune, the denoiser's own)."""

from __future__ import annotations

import re

import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from diffusion_pipe.config import ConfigError

_PEFT_NAME = re.compile(r"\.(lora_[AB])\.default\.")


def target_module_names(model: nn.Module, suffixes: tuple[str, ...], exclude: str | None = None) -> list[str]:
    """Full names of the Linear modules whose name ends with one of `suffixes` (matched on '.'-boundaries)."""
    names = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear)
             and any(name == s or name.endswith(f".{s}") for s in suffixes)
             and not (exclude and re.search(exclude, name))]
    if not names:
        raise ConfigError(f"train.lora_targets: none of {list(suffixes)} names a Linear module of the model; "
                          "use module-name suffixes such as 'to_q' or 'attn.to_k'")
    return sorted(names)


def add_lora(model: nn.Module, targets: list[str], rank: int, alpha: float, dropout: float,
             dtype: torch.dtype = torch.float32) -> LoraConfig:
    """Inject LoRA adapters into `model` in place; only they train. They compute in `dtype` (give the base's:
    peft casts each adapted layer's input to the adapter's dtype, a costly round trip when they differ);
    the optimizer keeps fp32 masters when `dtype` is lower precision (train/optim.py)."""
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                        init_lora_weights=True)
    model.requires_grad_(False)
    inject_adapter_in_model(config, model)
    for name, param in model.named_parameters():
        if "lora_" in name:
            if param.device.type != "meta":
                param.data = param.data.to(dtype)
            param.requires_grad_(True)
    return config


def lora_state_dict(model: nn.Module, only: set[int] | None = None) -> dict[str, torch.Tensor]:
    """LoRA tensors under PEFT's saved names ('x.lora_A.weight'), on CPU; `only` restricts to parameters with
    these ids (the ones a pipeline stage owns)."""
    out = {}
    for name, param in model.named_parameters():
        if "lora_" in name and (only is None or id(param) in only):
            out[_PEFT_NAME.sub(r".\1.", name)] = param.detach().to("cpu", copy=True).contiguous()
    return out


def full_state_dict(model: nn.Module, only: set[int]) -> dict[str, torch.Tensor]:
    """The trained weights of a full fine-tune (train.adapter: full) under the denoiser's own names, on CPU, in
    the dtype they train in; `only`: the parameters a pipeline stage owns."""
    return {name: param.detach().to("cpu", copy=True).contiguous() for name, param in model.named_parameters()
            if id(param) in only and param.requires_grad}


def gather_lora(denoiser: nn.Module, module: nn.Module, full: bool = False) -> dict[str, torch.Tensor]:
    """Every stage's LoRA weights, gathered on every rank (each stage owns only its own layers' weights); every
    rank must call it at the same point. With `full`, every trained weight of the denoiser, gathered on rank 0
    only (the others get {}): a whole model is too large to hold once per rank."""
    import torch.distributed as tdist

    only = {id(p) for p in module.parameters()}
    mine = full_state_dict(denoiser, only) if full else lora_state_dict(denoiser, only=only)
    if not tdist.is_initialized() or tdist.get_world_size() == 1:
        return mine
    parts: list = [None] * tdist.get_world_size()
    if full:
        tdist.gather_object(mine, parts if tdist.get_rank() == 0 else None, dst=0)
        if tdist.get_rank() != 0:
            return {}
    else:
        tdist.all_gather_object(parts, mine)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged
