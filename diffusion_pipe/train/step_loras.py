"""`train.save_lora_every_steps`: the LoRA as it is every N steps, ready to load, so that when the final one
overfits an earlier step can be picked without retraining.

Files go to `runs/loras/<run id>/step-<N>.<format>.safetensors`, one per format of `export.formats` (the train
stage passes them; diffusers alone when none are given), through the export stage's own conversion: the file of
the last step holds what export writes from the final LoRA. Each is written atomically by rank 0, with the run
id, the step and the run's identity (what `runs/checkpoints/<run id>/identity.json` holds) in its metadata.
With several pipeline stages the LoRA is gathered from every stage first, as for the final LoRA; every rank
calls `save` after every step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from torch import nn
from tqdm import tqdm

from diffusion_pipe.adapter_keys import export_adapter
from diffusion_pipe.config import ConfigError
from diffusion_pipe.lora_keys import fold_scale
from diffusion_pipe.fileio import naming_write_errors, write_bytes_atomic
from diffusion_pipe.models.base import Adapter
from diffusion_pipe.tensorfile import save_deterministic
from diffusion_pipe.train.lora import gather_lora


def step_lora_steps(every: int, total_steps: int) -> list[int]:
    """The steps at which a run of `total_steps` writes its LoRA: every `every` steps (0: none)."""
    return list(range(every, total_steps + 1, every)) if every else []


def step_lora_path(run_dir: Path, step: int, fmt: str) -> Path:
    """Where the LoRA of `step` in format `fmt` goes."""
    return run_dir / f"step-{step:06d}.{fmt}.safetensors"


class StepLoras:
    """Writes the LoRA at the steps `step_lora_steps` names."""

    def __init__(self, every: int, total_steps: int, formats: tuple[str, ...], adapter: Adapter,
                 denoiser: nn.Module, module: nn.Module, rank: int, lora_rank: int, lora_alpha: float,
                 run_dir: Path, identity: dict, run_id: str) -> None:
        formats = formats or ("diffusers",)
        unknown = [f for f in formats if f not in adapter.capabilities.export_formats]
        if unknown:  # checked before step 1, whether or not LoRAs are written along the way: export would fail
            raise ConfigError(f"export.formats: {unknown} not written by model family '{adapter.name}' "
                              f"(supported: {', '.join(adapter.capabilities.export_formats)}); the export stage "
                              "(and train.save_lora_every_steps) writes the LoRA in those formats: fix the list "
                              "before training")
        self.steps = set(step_lora_steps(every, total_steps))
        self.formats, self.adapter, self.denoiser, self.module = formats, adapter, denoiser, module
        self.rank, self.lora_rank, self.lora_alpha = rank, lora_rank, lora_alpha
        self.run_dir, self.run_id = run_dir, run_id
        self.identity = json.dumps(identity, sort_keys=True, separators=(",", ":"))

    def due(self, step: int) -> bool:
        """Whether `save(step)` writes a LoRA."""
        return step in self.steps

    def save(self, step: int) -> None:
        """After step `step` (on every rank): gather and write the LoRA if `step` is one of the steps."""
        if not self.due(step):
            return
        lora = gather_lora(self.denoiser, self.module)  # every rank takes part
        if self.rank != 0:
            return
        # as export reads the final LoRA: float32 (train/loop.py writes it so), the scale folded in (lora_B, ...)
        folded = fold_scale({k: v.float().contiguous() for k, v in lora.items()}, self.lora_rank, self.lora_alpha)
        written = []
        for fmt in self.formats:
            metadata = {"format": "pt", "diffusion_pipe.family": self.adapter.name,
                        "diffusion_pipe.export_format": fmt, "diffusion_pipe.run_id": self.run_id,
                        "diffusion_pipe.step": str(step), "diffusion_pipe.identity": self.identity}
            path = step_lora_path(self.run_dir, step, fmt)
            with naming_write_errors(path):  # a full disk names the file, not a temp name in an OSError
                write_bytes_atomic(path, save_deterministic(export_adapter(self.adapter, folded, fmt), metadata))
            written.append(path.name)
        tqdm.write(f"train: step {step} LoRA: {', '.join(written)} in {self.run_dir}", file=sys.stderr)
