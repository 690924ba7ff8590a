"""AdamW with fp32 master weights and global-norm gradient clipping, for the LoRA's trainable parameters.

The LoRA weights compute in the base model's dtype (bf16), so no activation is cast to fp32 and back in every
adapted layer (measured on the H200: that cast traffic cost about 150 ms of a 0.67 s Flux-dev step). Updates
accumulate in fp32 master copies (fp32 parameters are their own masters); a step is a few foreach operations:
gradients in, the global norm, clipping, the fused AdamW update, weights out. DeepSpeed's own fp32 clipping
runs three kernels per parameter from a Python loop (about a thousand parameters for a Flux-dev LoRA), so the
engine is configured without it and clipping happens here; the norm is left where DeepSpeed's
`engine.get_global_grad_norm()` reads it. float16 models get dynamic loss scaling here too (`LossScaler`), so
the engine runs in fp32 mode for every dtype. Masters and the loss scale are part of the state dict, so a
resumed run continues from the exact fp32 weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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


_GRAD_BUFFER_NUMEL = 1 << 26  # 256 MiB of fp32 gradients per buffer (MasterWeightAdamW._grads_in)


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW stepping fp32 copies of `params`, whose own dtype may be bf16, fp16 or fp32.

    Before each update the fp32 gradients are clipped to a global L2 norm of `max_grad_norm` (0: no clipping).
    Under pipeline parallelism each process holds one stage's parameters: set `norm_group` to the process
    group of one pipeline and the norm covers all its stages (gradients are already averaged over
    data-parallel replicas when the engine steps the optimizer)."""

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
