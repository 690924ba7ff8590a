"""LoRA, LoKr, LoHa and DoRA through peft: which modules get adapters, and the trained weights under PEFT's key
names (or, for a full fine-tune, the denoiser's own)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from peft import LoHaConfig, LoKrConfig, LoraConfig, inject_adapter_in_model
from peft.config import PeftConfig
from torch import nn

from diffusion_pipe.config import ConfigError

# A trained adapter tensor's name in the injected model: `<module>.<tensor>.default[.weight]`; saved without the
# adapter name, as peft's get_peft_model_state_dict does: `<module>.lora_A.weight`, `<module>.lokr_w1`, ...
_ADAPTER_TENSOR = r"lora_[AB]|lora_magnitude_vector|lokr_w[12](?:_[ab])?|hada_w[12]_[ab]"
_PEFT_NAME = re.compile(rf"\.({_ADAPTER_TENSOR})\.default(\.weight)?$")
_SAVED_SUFFIX = {"lora_A": ".weight", "lora_B": ".weight"}
# the tensors peft initialises at random (Kaiming uniform, a=sqrt(5)); the others start at zero, or (DoRA's
# magnitude) at the base weight's row norms
RANDOM_INIT = ("lora_A", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "hada_w1_a", "hada_w1_b", "hada_w2_a")


@dataclass(frozen=True)
class AdapterKind:
    """Which peft adapter a run injects (train.adapter and its options); rank, alpha and dropout travel apart."""

    name: str = "lora"  # "lora", "lokr" or "loha"
    dora: bool = False
    lokr_factor: int = -1
    lokr_decompose_both: bool = False

    @classmethod
    def of(cls, train) -> AdapterKind:
        """The kind `train` (TrainParams) asks for ("full" trains no adapter: the default, unused)."""
        name = train.adapter if train.adapter != "full" else "lora"
        return cls(name, train.lora_dora, train.lokr_factor, train.lokr_decompose_both)

    @property
    def label(self) -> str:
        """How messages name it: 'LoRA', 'DoRA', 'LoKr' or 'LoHa'."""
        return {"lokr": "LoKr", "loha": "LoHa"}.get(self.name, "DoRA" if self.dora else "LoRA")

    def config(self, targets: list[str], rank: int, alpha: float, dropout: float) -> PeftConfig:
        """peft's config of this kind on `targets`."""
        if self.name == "lokr":
            return LoKrConfig(r=rank, alpha=alpha, target_modules=targets, decompose_both=self.lokr_decompose_both,
                              decompose_factor=self.lokr_factor)
        if self.name == "loha":
            return LoHaConfig(r=rank, alpha=alpha, target_modules=targets)
        return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                          init_lora_weights=True, use_dora=self.dora)


def adapter_tensor(name: str) -> str | None:
    """Which adapter tensor a parameter of the injected model is ('lora_A', 'lokr_w1', ...), None for base weights."""
    match = _PEFT_NAME.search(name)
    return match.group(1) if match else None


def saved_name(name: str) -> str:
    """The PEFT saved name of an injected adapter parameter: 'x.lora_A.default.weight' -> 'x.lora_A.weight',
    'x.lokr_w1.default' -> 'x.lokr_w1', 'x.lora_magnitude_vector.default.weight' -> 'x.lora_magnitude_vector'."""
    return _PEFT_NAME.sub(lambda m: f".{m.group(1)}{_SAVED_SUFFIX.get(m.group(1), '')}", name)


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
             dtype: torch.dtype = torch.float32, kind: AdapterKind = AdapterKind()) -> PeftConfig:
    """Inject `kind`'s adapters (LoRA unless told) into `model` in place; only they train. They compute in
    `dtype` (give the base's: peft casts each adapted layer's input to the adapter's dtype, a costly round trip
    when they differ); the optimizer keeps fp32 masters when `dtype` is lower precision (train/optim.py)."""
    config = kind.config(targets, rank, alpha, dropout)
    model.requires_grad_(False)
    inject_adapter_in_model(config, model)
    for name, param in model.named_parameters():
        if adapter_tensor(name):
            if param.device.type != "meta":
                param.data = param.data.to(dtype)
            param.requires_grad_(True)
    return config


def lora_state_dict(model: nn.Module, only: set[int] | None = None) -> dict[str, torch.Tensor]:
    """Adapter tensors under PEFT's saved names ('x.lora_A.weight', 'x.lokr_w1', ...), on CPU; `only` restricts to
    parameters with these ids (the ones a pipeline stage owns)."""
    out = {}
    for name, param in model.named_parameters():
        if adapter_tensor(name) and (only is None or id(param) in only):
            out[saved_name(name)] = param.detach().to("cpu", copy=True).contiguous()
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
