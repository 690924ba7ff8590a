"""Stop a diverging run at the first non-finite step, before it writes a checkpoint or a LoRA of NaNs.

A run whose learning rate is far too high reaches loss NaN within a few steps; without this guard it trained on
to the end at NaN, overwrote its good checkpoints with NaN ones and failed writing the LoRA.
"""

from __future__ import annotations

import math
from pathlib import Path

from diffusion_pipe.errors import UserError
from diffusion_pipe.params import TrainParams


class TrainingDiverged(UserError):
    """The loss or the gradients stopped being finite numbers."""


def step_is_finite(loss: float, grad_norm: float | None, loss_scaling: bool) -> bool:
    """Whether a step's loss, and its gradient norm, are finite. Under float16 loss scaling a non-finite
    gradient norm is an overflow the scaler handles (it skips the step and lowers the scale), not divergence."""
    return math.isfinite(loss) and (loss_scaling or grad_norm is None or math.isfinite(grad_norm))


def diverged(step: int, loss: float, grad_norm: float | None, train: TrainParams, last_checkpoint: int | None,
             checkpoint_dir: Path) -> TrainingDiverged:
    """The error that stops a run whose step `step` was not finite: what happened, what was kept, what to try."""
    kept = (f"the last checkpoint, step {last_checkpoint} in {checkpoint_dir}, is kept" if last_checkpoint is not None
            else "no checkpoint was written before it")
    if step == 1:  # its loss and gradients came from the initial weights: no learning rate had been applied yet
        return TrainingDiverged(
            f"training diverged at its first step: loss {loss}, gradient norm {grad_norm}, computed before any "
            f"update, so the learning rate is not the cause; stopped without writing a LoRA ({kept}). Check what "
            f"shapes the inputs: train.flow_shift (now {train.flow_shift:g}), train.noise_offset (now "
            f"{train.noise_offset:g}), train.guidance (now {train.guidance:g}), model.dtype (float16 overflows where "
            "bfloat16 does not) and the encoded data, then run the stage again")
    return TrainingDiverged(
        f"training diverged at step {step}: loss {loss}, gradient norm {grad_norm}; stopped without writing a "
        f"LoRA ({kept}). Lower train.learning_rate (now {train.learning_rate:g}), or clip gradients harder with a "
        f"lower train.max_grad_norm (now {train.max_grad_norm:g}; 0 is no clipping), then run the stage again")
