"""AdamW with fp32 master weights for trainable parameters kept in a low-precision compute dtype.

The LoRA weights compute in the base model's dtype (bf16), so no activation is cast to fp32 and back in every
adapted layer (measured on the H200: that cast traffic cost about 150 ms of a 0.67 s Flux-dev step). Updates
accumulate in fp32 master copies; three foreach operations per step move gradients in and weights out.
Masters are part of the state dict, so a resumed run continues from the exact fp32 weights.
"""

from __future__ import annotations

import torch


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW stepping fp32 copies of `params`, whose own dtype may be bf16 or fp16."""

    def __init__(self, params, **kwargs) -> None:
        self.model_params = [p for p in params]
        masters = [p.detach().float().clone().requires_grad_(True) for p in self.model_params]
        super().__init__(masters, **kwargs)
        self.masters = masters

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch's signature
        for master, param in zip(self.masters, self.model_params):
            master.grad = None if param.grad is None else param.grad.float()
        loss = super().step(closure)
        torch._foreach_copy_(self.model_params, self.masters)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        for param in self.model_params:
            param.grad = None
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:  # noqa: D102
        state = super().state_dict()
        state["masters"] = [m.detach().clone() for m in self.masters]
        return state

    def load_state_dict(self, state_dict: dict) -> None:  # noqa: D102
        state_dict = dict(state_dict)
        masters = state_dict.pop("masters")
        super().load_state_dict(state_dict)
        with torch.no_grad():
            torch._foreach_copy_(self.masters, [m.to(self.masters[0].device) for m in masters])
            torch._foreach_copy_(self.model_params, self.masters)


def make_optimizer(params: list[torch.nn.Parameter], fused: bool, **kwargs) -> torch.optim.Optimizer:
    """Plain AdamW for fp32 parameters, MasterWeightAdamW for low-precision ones."""
    if all(p.dtype == torch.float32 for p in params):
        return torch.optim.AdamW(params, fused=fused, **kwargs)
    return MasterWeightAdamW(params, fused=fused, **kwargs)
