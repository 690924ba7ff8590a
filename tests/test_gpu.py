"""The CUDA paths the CPU suite cannot reach: the bundled example encoded and trained on a GPU in bfloat16 and in
float16 (dynamic loss scaling), with per-layer torch.compile, time-based checkpoints and pruning. Run with
`pytest -m gpu` on a machine with a CUDA GPU (DVC need not be installed); skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import train_example

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = 40


@pytest.mark.parametrize("dtype,compile_layers", [("bfloat16", False), ("float16", False), ("bfloat16", True)])
def test_example_trains_on_gpu(tmp_path, dtype, compile_layers):
    repo, report, rows = train_example(tmp_path, {
        "dtype: float32": f"dtype: {dtype}", "steps: 120": f"steps: {STEPS}",
        # a save whenever 6 ms have passed since the last one: about every step; only the newest 2 are kept
        "checkpoint_every_minutes: 30": "checkpoint_every_minutes: 0.0001",
        "eval_every_steps: 40": "eval_every_steps: 0\n  device: cuda\n"
                                f"  keep_checkpoints: 2\n  compile: {str(compile_layers).lower()}"}, dvc=False)
    losses = [float(r["loss"]) for r in rows]
    # unscaled losses of the size the fp32 CPU run reports (about 1), which fall; finite gradient norms
    assert len(losses) == STEPS and all(0.05 < x < 5 for x in losses)
    assert sum(losses[-10:]) < sum(losses[:10])
    assert all(0 < float(r["grad_norm"]) < 1e3 for r in rows)
    assert report["eval_loss_end"] < report["eval_loss_start"]
    assert report["lora_dtype"] == dtype and report["max_memory_gb"] > 0
    # time-based checkpoints were written through the run (the final one alone would leave one) and pruned to 2
    run_dir = repo / "runs/checkpoints" / report["run_id"]
    kept = sorted(int(p.name[4:]) for p in run_dir.glob("step*"))
    assert len(kept) == 2 and kept[-1] == STEPS


@pytest.mark.parametrize("compile_layers", [False, True])
def test_swapped_blocks_train_as_blocks_kept_on_the_gpu(tmp_path, compile_layers):
    """Swapped blocks' weights copy ahead on a stream of their own while the block before computes: the losses are
    those of the run that keeps every block on the GPU (a weight read before its copy landed would change them)."""
    def losses(name: str, swap: int) -> list[float]:
        _, _, rows = train_example(tmp_path / name, {
            "steps: 120": "steps: 12", "eval_every_steps: 40": "eval_every_steps: 0\n  device: cuda\n"
            f"  activation_checkpointing: true\n  blocks_to_swap: {swap}\n  compile: {str(compile_layers).lower()}"},
            dvc=False)
        return [float(r["loss"]) for r in rows]

    kept = losses("kept", 0)
    assert len(kept) == 12
    assert losses("swapped", 2) == pytest.approx(kept, rel=1e-5)
