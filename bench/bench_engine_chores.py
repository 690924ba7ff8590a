"""Measure the host time of the pipeline engine's per-step chores, DeepSpeed's own against the train stage's trimmed
ones (`switch_modes_in_one_loop`, `trim_engine_step` in diffusion_pipe/train/pipeline.py), in the same process.

The chores cost host time that grows with the number of modules and parameters of the LoRA-wrapped denoiser, not
with its widths, while the device waits (at the start of a step and after its backward): so each family is built
at its published depth (blocks, experts: `DEPTH`) with its tiny test widths, LoRA r4 on its default targets, in a
one-stage engine as the train stage builds it (one process, gloo). Per step, each chore is timed on its own:
- `train()`: the engine switching the module to training mode at the start of `train_batch`;
- gradient reduction: the engine's reduce-grads instruction after the backward (one data-parallel rank; every
  trainable tensor holds a gradient, as after a real backward);
- `zero_grad`: the engine clearing gradients after the optimizer step.

Usage: python bench/bench_engine_chores.py [--families flux,kandinsky5_image,hidream] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

# The depth of each family's published denoiser (bench/family_shapes.py REAL), applied to its tiny config.
DEPTH: dict[str, dict] = {
    "flux": dict(num_layers=19, num_single_layers=38),  # FLUX.1-dev
    "kandinsky5_image": dict(num_visual_blocks=50),  # Kandinsky-5.0-T2I-Lite
    # HiDream-I1: 16 double- and 32 single-stream blocks of 4 routed experts; the tiny Llama has 3 layers to read
    "hidream": dict(num_layers=16, num_single_layers=32, num_routed_experts=4, num_activated_experts=2,
                    llama_layers=[min(i, 2) for i in range(48)]),
}


def build_model_dir(family: str, root: Path) -> None:
    """The family's tiny model directory with its denoiser rebuilt (random init) at the published depth."""
    import shutil

    from diffusion_pipe.models import adapter_class

    cls = adapter_class(family)
    cls.build_tiny(root, seed=0)
    adapter = cls(root, torch.float32)
    denoiser_cls, directory = adapter.denoiser_class(), adapter.denoiser_dir()
    config = {k: v for k, v in denoiser_cls.load_config(directory).items() if not k.startswith("_")}
    shutil.rmtree(directory)
    torch.manual_seed(0)
    denoiser_cls(**{**config, **DEPTH[family]}).save_pretrained(directory)


def engine_for(family: str, root: Path, trimmed: bool):
    """A one-stage engine over the LoRA-wrapped denoiser, as train_lora builds it; `trimmed` False undoes the
    stage's two trims (DeepSpeed's and nn.Module's own chores)."""
    import deepspeed

    from diffusion_pipe.models import adapter_class
    from diffusion_pipe.params import TrainParams
    from diffusion_pipe.train.build import build_local_model
    from diffusion_pipe.train.loop import deepspeed_config
    from diffusion_pipe.train.optim import MasterWeightAdamW
    from diffusion_pipe.train.pipeline import build_pipeline_module, trim_engine_step

    adapter = adapter_class(family)(root, torch.bfloat16)
    local = build_local_model(adapter, 1, 0, targets=adapter.default_lora_targets, rank=4, alpha=4.0, dropout=0.0,
                              seed=0)
    module = build_pipeline_module(local.layers, 1, lambda out, labels: out.float().mean(), False, 0,
                                   (local.start, local.stop))
    if not trimmed:
        del module.train  # nn.Module.train's recursion again
    trainable = [p for p in module.parameters() if p.requires_grad]
    optimizer = MasterWeightAdamW(trainable, lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=deepspeed_config(TrainParams(), 1))
    if trimmed:
        trim_engine_step(engine, trainable, optimizer, 1)
    return engine, module, trainable


def time_chores(engine, module: nn.Module, trainable: list[torch.Tensor], steps: int) -> dict[str, float]:
    """Median milliseconds of each chore over `steps` steps (after 3 warm-up steps)."""
    times: dict[str, list[float]] = {"train()": [], "gradient reduction": [], "zero_grad": []}
    for step in range(steps + 3):
        for p in trainable:  # what a backward leaves (not timed)
            p.grad = torch.ones_like(p)
        for name, chore in (("train()", module.train), ("gradient reduction", engine._exec_reduce_grads),
                            ("zero_grad", engine.zero_grad)):
            started = time.perf_counter()
            chore()
            if step >= 3:
                times[name].append((time.perf_counter() - started) * 1e3)
        assert all(p.grad is None or not p.grad.any() for p in trainable)  # zero_grad cleared them
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(DEPTH), help=f"comma list of: {','.join(DEPTH)}")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from diffusion_pipe.train.pipeline import init_distributed

    init_distributed("cpu")
    print(f"engine chores, ms per step (median of {args.steps}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    for family in args.families.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / family
            build_model_dir(family, root)
            results = {}
            for trimmed in (False, True):
                engine, module, trainable = engine_for(family, root, trimmed)
                results[trimmed] = time_chores(engine, module, trainable, args.steps)
            modules = sum(1 for _ in module.modules())
            params = sum(1 for _ in module.parameters())
        print(f"{family}: {modules} modules, {params} parameters, {len(trainable)} trainable")
        for name in results[False]:
            own, trim = results[False][name], results[True][name]
            print(f"  {name:<20} DeepSpeed's own {own:7.2f}   trimmed {trim:7.2f}   {own / trim:6.1f}x")
        own, trim = sum(results[False].values()), sum(results[True].values())
        print(f"  {'all three':<20} DeepSpeed's own {own:7.2f}   trimmed {trim:7.2f}   saves {own - trim:.1f} ms/step")


if __name__ == "__main__":
    main()
