"""`train.ema_decay`: an exponential moving average of the trained weights, kept beside the training.

After every optimizer step that updates the weights, `ema = d * ema + (1 - d) * w` over the optimizer's fp32
masters (train/optim.py `MasterWeights`), in fp32, on the masters' device: torch's own EMA update
(`torch.optim.swa_utils.get_ema_multi_avg_fn`, one multi-tensor lerp). Its `AveragedModel` is not used: it
deep-copies a module and averages the module's parameters, which here compute in bf16, not the fp32 masters. The
average starts as a copy of the masters before step 1 (after `train.init_lora`), as torch's does, and a float16
step skipped for overflow leaves it as it is. It is hooked to the optimizer (`register_step_post_hook`), so it runs exactly when the masters
change, and it is no part of the optimizer's state: checkpoints keep it in a file of its own
(train/checkpoint.py), and a resumed run continues it bit for bit.

Training, evaluation and samples use the training weights; the EMA is written beside the LoRA, as
`lora.ema.safetensors` (`ema_lora_path`), for the export stage (`export.ema`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.optim.swa_utils import get_ema_multi_avg_fn

from diffusion_pipe.lora_keys import ema_lora_path

__all__ = ["Ema", "ema_lora_path"]


class Ema:
    """The moving average of `optimizer.masters` with decay `decay` (0: off; nothing is kept or done)."""

    def __init__(self, decay: float, optimizer) -> None:
        self.decay, self.optimizer = decay, optimizer
        self.tensors: list[torch.Tensor] = []
        if not decay:
            return
        self._lerp = get_ema_multi_avg_fn(decay)  # ema = decay * ema + (1 - decay) * w
        with torch.no_grad():
            self.tensors = [m.detach().clone() for m in optimizer.masters]
        self._skipped = optimizer.loss_scaler.skipped_steps
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self.update())

    @property
    def enabled(self) -> bool:
        return bool(self.decay)

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the masters by 1 - decay (the optimizer calls this after each step)."""
        skipped = self.optimizer.loss_scaler.skipped_steps
        if skipped != self._skipped:  # a float16 step skipped for overflow: the masters did not change
            self._skipped = skipped
            return
        self._lerp(self.tensors, [m.detach() for m in self.optimizer.masters], None)

    def state(self) -> list[torch.Tensor]:
        """The average, one fp32 tensor per master in the optimizer's order (for a checkpoint)."""
        return [t.detach().clone() for t in self.tensors]

    @torch.no_grad()
    def load(self, tensors: list[torch.Tensor]) -> None:
        """Restore the average from a checkpoint's tensors (in the optimizer's order)."""
        torch._foreach_copy_(self.tensors, [t.to(self.tensors[0].device) for t in tensors])

    @contextlib.contextmanager
    def in_parameters(self) -> Iterator[None]:
        """Within, the trained parameters hold the average itself (fp32, whatever their dtype), so that code
        reading the parameters (gathering the LoRA across pipeline stages) reads the average; afterwards each
        parameter holds its own tensor again, untouched."""
        params = self.optimizer.model_params
        kept = [p.data for p in params]
        try:
            for p, t in zip(params, self.tensors):
                p.data = t
            yield
        finally:
            for p, data in zip(params, kept):
                p.data = data

    def gather(self, gather: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
        """`gather()` (every rank calls it) run on the average: the EMA LoRA by name, in fp32; None when off."""
        if not self.enabled:
            return None
        with self.in_parameters():
            return gather()
