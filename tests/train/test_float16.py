"""float16 models train: the loss is scaled for backward and unscaled for the update (CPU, the tiny example)."""

from __future__ import annotations

from tests.conftest import train_example


def test_float16_model_trains_with_loss_scaling(tmp_path):
    _, report, rows = train_example(tmp_path, {
        "dtype: float32": "dtype: float16", "steps: 120": "steps: 24", "eval_every_steps: 40": "eval_every_steps: 0"})
    losses = [float(r["loss"]) for r in rows]
    # unscaled losses, of the size the fp32 run reports (about 1), which fall
    assert len(losses) == 24 and all(0.05 < x < 5 for x in losses)
    assert sum(losses[-8:]) < sum(losses[:8])
    assert all(float(r["grad_norm"]) < 1e3 for r in rows)  # the norm of unscaled gradients
    assert report["lora_dtype"] == "float16"
