"""The optimizer of the LoRA's trainable parameters: any torch optimizer (`OPTIMIZERS`, chosen by
`train.optimizer`), stepping fp32 master weights, with global-norm gradient clipping and fp16 loss scaling.

The LoRA weights compute in the base model's dtype (bf16), so no activation is cast to fp32 and back in every
adapted layer (measured on the H200: that cast traffic cost about 150 ms of a 0.67 s Flux-dev step). Updates
accumulate in fp32 master copies (fp32 parameters are their own masters); a step is a few foreach operations:
gradients in, the global norm, clipping, the chosen optimizer's update of the masters, weights out. DeepSpeed's
own fp32 clipping runs three kernels per parameter from a Python loop (about a thousand parameters for a
Flux-dev LoRA), so the engine is configured without it and clipping happens here; the norm is left where
DeepSpeed's `engine.get_global_grad_norm()` reads it. float16 models get dynamic loss scaling here too
(`LossScaler`), so the engine runs in fp32 mode for every dtype. Masters and the loss scale are part of the state
dict, so a resumed run continues from the exact fp32 weights.

`MasterWeights` is a mixin placed before the optimizer's class (`master_weight_class`): the optimizer's own
`step` updates the masters, its own state dict holds its state; no optimizer maths is written here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from diffusion_pipe.config import ConfigError

if TYPE_CHECKING:
    from diffusion_pipe.params import TrainParams


class LossScaler:
    """Dynamic loss scaling, for float16 training: the loss is multiplied by `scale` before backward so that
    small gradients survive fp16's range; the optimizer divides it out of the fp32 master gradients, skips a
    step whose gradients overflowed (halving the scale) and doubles the scale after `growth_interval` clean
    steps. Disabled (scale 1, never skips) for bfloat16 and float32, whose range needs none of this."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 1000) -> None:
        self.enabled, self.growth_interval = enabled, growth_interval
        self.scale = init_scale if enabled else 1.0
        self.clean_steps = 0
        self.skipped_steps = 0

    def update(self, finite: bool) -> bool:
        """Record one step's outcome; return whether its update may be applied."""
        if finite:
            self.clean_steps += 1
            if self.clean_steps % self.growth_interval == 0:
                self.scale *= 2.0
            return True
        self.scale = max(self.scale / 2.0, 1.0)
        self.clean_steps = 0
        self.skipped_steps += 1
        return False

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps, self.skipped_steps = state["scale"], state["clean_steps"], state["skipped_steps"]


_GRAD_BUFFER_NUMEL = 1 << 26  # 256 MiB of fp32 gradients per buffer (MasterWeights._grads_in)


class MasterWeights:
    """Placed before a torch optimizer's class (`master_weight_class`): that optimizer steps fp32 copies of
    `params`, whose own dtype may be bf16, fp16 or fp32.

    Before each update the fp32 gradients are clipped to a global L2 norm of `max_grad_norm` (0: no clipping).
    Under pipeline parallelism each process holds one stage's parameters: set `norm_group` to the process
    group of one pipeline and the norm covers all its stages (gradients are already averaged over
    data-parallel replicas when the engine steps the optimizer).

    An optimizer with `train()` and `eval()` modes (schedule-free) is put in train mode here, since its steps
    need it; `eval_weights()` gives the weights to evaluate and export."""

    def __init__(self, params, *, max_grad_norm: float = 0.0, norm_group: object = None,
                 loss_scaler: LossScaler | None = None, **kwargs) -> None:
        self.model_params = [p for p in params]
        masters = [p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
                   for p in self.model_params]
        super().__init__(masters, **kwargs)
        self.masters = masters
        # the low-precision parameters and their masters (fp32 parameters step in place)
        self._low = [(p, m) for p, m in zip(self.model_params, masters) if m is not p]
        self.max_grad_norm, self.norm_group = max_grad_norm, norm_group
        self.loss_scaler = loss_scaler or LossScaler(enabled=False)
        self._global_grad_norm: torch.Tensor | None = None  # DeepSpeed's engine.get_global_grad_norm() reads it
        self.has_modes = callable(getattr(self, "train", None)) and callable(getattr(self, "eval", None))
        if self.has_modes:
            self.train()

    @property
    def optimizer_class(self) -> str:
        """The stepping optimizer's class, as `module.name` (e.g. torch.optim.adamw.AdamW)."""
        mro = type(self).__mro__
        cls = mro[mro.index(MasterWeights) + 1]
        return f"{cls.__module__}.{cls.__qualname__}"

    @contextlib.contextmanager
    def eval_weights(self, active: bool = True) -> Iterator[None]:
        """Within, the parameters hold the weights to evaluate, sample and export: for an optimizer with modes
        (schedule-free) its eval-mode weights (the average it keeps, not the point its gradients are taken at);
        afterwards the masters are restored bit for bit (the optimizer's `train()` interpolates back, which
        rounds), so a run that evaluates or samples more often trains exactly the same. Any other optimizer, or
        not `active`: nothing changes."""
        if not (active and self.has_modes):
            yield
            return
        with torch.no_grad():
            training = [m.detach().clone() for m in self.masters]
        self.eval()
        self._copy_out()
        try:
            yield
        finally:
            self.train()
            with torch.no_grad():
                torch._foreach_copy_(self.masters, training)
            self._copy_out()

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch's signature
        self._grads_in()
        grads = [m.grad for m in self.masters if m.grad is not None]
        scaler = self.loss_scaler
        if grads:
            if scaler.enabled:
                torch._foreach_mul_(grads, 1.0 / scaler.scale)
            norm = torch.nn.utils.get_total_norm(grads, foreach=None)
            if self.norm_group is not None:
                squared = norm.square()
                dist.all_reduce(squared, group=self.norm_group)
                norm = squared.sqrt()
            self._global_grad_norm = norm
            # the norm spans every stage, so all stages skip an overflowed step together
            if scaler.enabled and not scaler.update(bool(torch.isfinite(norm))):
                for master in self.masters:
                    master.grad = None
                return None
            if self.max_grad_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(self.masters, self.max_grad_norm, norm, foreach=None)
        loss = super().step(closure)
        self._copy_out()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        for param in self.model_params:
            param.grad = None
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:  # noqa: D102
        state = super().state_dict()
        state["masters"] = [m.detach().clone() for m in self.masters]
        state["loss_scaler"] = self.loss_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:  # noqa: D102
        state_dict = dict(state_dict)
        masters = state_dict.pop("masters", None)  # None: a checkpoint of torch's AdamW on fp32 parameters
        if "loss_scaler" in state_dict:
            self.loss_scaler.load_state_dict(state_dict.pop("loss_scaler"))
        super().load_state_dict(state_dict)
        with torch.no_grad():
            if masters is not None:
                torch._foreach_copy_(self.masters, [m.to(self.masters[0].device) for m in masters])
                self._copy_out()
            elif self._low:  # no saved masters: take them from the (already loaded) parameters
                torch._foreach_copy_([m for _, m in self._low], [p for p, _ in self._low])

    @torch.no_grad()
    def _grads_in(self) -> None:
        """The low-precision parameters' gradients, as fp32 gradients of their masters: a few buffers of at most
        `_GRAD_BUFFER_NUMEL` elements per device (a larger tensor gets its own; a full fine-tune's gradients are not
        asked of the allocator as one block), each filled by one multi-tensor copy (a LoRA has hundreds of small
        tensors; a cast each cost a launch each)."""
        buffers: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        filling: dict[torch.device, tuple[int, int]] = {}  # device -> (its open buffer's index, that one's elements)
        for param, master in self._low:
            master.grad = None
            if param.grad is None:
                continue
            index, numel = filling.get(master.device, (-1, 0))
            if index < 0 or numel + master.numel() > _GRAD_BUFFER_NUMEL:
                buffers.append([])
                index, numel = len(buffers) - 1, 0
            buffers[index].append((param, master))
            filling[master.device] = (index, numel + master.numel())
        for pairs in buffers:
            flat = torch.empty(sum(m.numel() for _, m in pairs), dtype=torch.float32, device=pairs[0][1].device)
            views = [v.view_as(m) for v, (_, m) in zip(flat.split([m.numel() for _, m in pairs]), pairs)]
            torch._foreach_copy_(views, [p.grad for p, _ in pairs])
            for view, (_, master) in zip(views, pairs):
                master.grad = view

    @torch.no_grad()
    def _copy_out(self) -> None:
        """The masters' values into the low-precision parameters."""
        if self._low:
            torch._foreach_copy_([p for p, _ in self._low], [m for _, m in self._low])


class MasterWeightAdamW(MasterWeights, torch.optim.AdamW):
    """torch's AdamW stepping fp32 masters (train.optimizer: adamw)."""


def master_weight_class(optimizer: type[torch.optim.Optimizer]) -> type:
    """`optimizer` stepping fp32 masters, with clipping and loss scaling (`MasterWeights`)."""
    if optimizer is torch.optim.AdamW:
        return MasterWeightAdamW
    return type(f"MasterWeight{optimizer.__name__}", (MasterWeights, optimizer), {"__doc__": optimizer.__doc__})


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """One `train.optimizer` choice: `build(train, device)` imports the library and returns its optimizer class
    and keyword arguments (learning rate, weight decay, the args of `train.optimizer_args`); `unavailable(device)`
    says why it cannot run here (None: it can)."""

    build: Callable[[TrainParams, torch.device], tuple[type[torch.optim.Optimizer], dict]]
    unavailable: Callable[[torch.device], str | None] = lambda device: None


def _adamw(train: TrainParams, device: torch.device) -> tuple[type, dict]:
    return torch.optim.AdamW, dict(fused=device.type == "cuda", lr=train.learning_rate, betas=train.adam_betas,
                                   eps=train.adam_eps, weight_decay=train.weight_decay)


def _adamw8bit(train: TrainParams, device: torch.device) -> tuple[type, dict]:
    import bitsandbytes

    return bitsandbytes.optim.AdamW8bit, dict(lr=train.learning_rate, betas=train.adam_betas, eps=train.adam_eps,
                                              weight_decay=train.weight_decay,
                                              min_8bit_size=train.optimizer_args.min_8bit_size)


def _adamw8bit_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return (f"train.optimizer: adamw8bit (bitsandbytes) runs on CUDA GPUs only, and this run is on "
                f"{device.type}; use train.optimizer: adamw here")
    if importlib.util.find_spec("bitsandbytes") is None:
        return ("train.optimizer: adamw8bit needs bitsandbytes, which is not installed (it is optional, GPU only): "
                "`pip install bitsandbytes`, or use train.optimizer: adamw")
    return None


def _prodigy(train: TrainParams, device: torch.device) -> tuple[type, dict]:
    from prodigyopt import Prodigy

    args = train.optimizer_args
    return Prodigy, dict(lr=train.learning_rate, betas=train.adam_betas, beta3=args.beta3, eps=train.adam_eps,
                         weight_decay=train.weight_decay, decouple=args.decouple,
                         use_bias_correction=args.use_bias_correction, safeguard_warmup=args.safeguard_warmup,
                         d0=args.d0, d_coef=args.d_coef,
                         growth_rate=math.inf if args.growth_rate is None else args.growth_rate, slice_p=args.slice_p)


def _schedulefree_adamw(train: TrainParams, device: torch.device) -> tuple[type, dict]:
    from schedulefree import AdamWScheduleFree

    args = train.optimizer_args
    return AdamWScheduleFree, dict(lr=train.learning_rate, betas=train.adam_betas, eps=train.adam_eps,
                                   weight_decay=train.weight_decay, warmup_steps=args.warmup_steps, r=args.r,
                                   weight_lr_power=args.weight_lr_power)


def _adafactor(train: TrainParams, device: torch.device) -> tuple[type, dict]:
    from transformers.optimization import Adafactor

    args = train.optimizer_args
    # relative_step off: the step size is train.learning_rate (and the LR schedule), never Adafactor's own
    return Adafactor, dict(lr=train.learning_rate, eps=args.eps, clip_threshold=args.clip_threshold,
                           decay_rate=args.decay_rate, beta1=args.beta1, weight_decay=train.weight_decay,
                           scale_parameter=args.scale_parameter, relative_step=False, warmup_init=False)


def _muon(train: TrainParams, device: torch.device) -> tuple[type, dict]:
    args = train.optimizer_args
    return torch.optim.Muon, dict(lr=train.learning_rate, weight_decay=train.weight_decay, momentum=args.momentum,
                                  nesterov=args.nesterov, eps=args.eps, ns_steps=args.ns_steps,
                                  adjust_lr_fn=args.adjust_lr_fn)


# train.optimizer -> how to build it; params.py's OPTIMIZER_ARGS holds each one's typed args
OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec(_adamw),
    "adamw8bit": OptimizerSpec(_adamw8bit, _adamw8bit_unavailable),
    "prodigy": OptimizerSpec(_prodigy),
    "schedulefree_adamw": OptimizerSpec(_schedulefree_adamw),
    "adafactor": OptimizerSpec(_adafactor),
    "muon": OptimizerSpec(_muon),
}


def check_optimizer_available(train: TrainParams, device: torch.device) -> None:
    """Refuse, before any model is loaded, an optimizer that cannot run on `device` (a ConfigError saying what to
    install or use instead)."""
    if (reason := OPTIMIZERS[train.optimizer].unavailable(device)) is not None:
        raise ConfigError(reason)


def build_optimizer(params: list[torch.Tensor], train: TrainParams, device: torch.device,
                    loss_scaler: LossScaler) -> MasterWeights:
    """`train.optimizer` over `params`, stepping their fp32 masters, clipping at `train.max_grad_norm`."""
    check_optimizer_available(train, device)
    if train.optimizer == "muon" and (shapes := sorted({tuple(p.shape) for p in params if p.ndim != 2})):
        raise ConfigError(f"train.optimizer: muon updates 2-D weight matrices only, and this run trains tensors of "
                          f"shapes {shapes[:3]}; train a LoRA on linear layers (not train.adapter: full, not "
                          "convolutions), or choose another train.optimizer")
    optimizer, kwargs = OPTIMIZERS[train.optimizer].build(train, device)
    return master_weight_class(optimizer)(params, max_grad_norm=train.max_grad_norm, loss_scaler=loss_scaler,
                                          **kwargs)
