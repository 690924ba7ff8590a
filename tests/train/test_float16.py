"""float16 models train: the loss is scaled for backward and unscaled for the update (CPU, the tiny example)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

from tests.conftest import make_pipeline_repo, run_env


def test_float16_model_trains_with_loss_scaling(tmp_path):
    store = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store, {
        "dtype: float32": "dtype: float16", "steps: 120": "steps: 24", "eval_every_steps: 40": "eval_every_steps: 0"})
    for stage in ("scan", "encode", "train"):
        proc = subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=repo, env=run_env(store),
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((repo / "reports/train.json").read_text())
    with open(repo / "reports/train_loss.csv") as fh:
        rows = list(csv.DictReader(fh))
    losses = [float(r["loss"]) for r in rows]
    # unscaled losses, of the size the fp32 run reports (about 1), which fall
    assert len(losses) == 24 and all(0.05 < x < 5 for x in losses)
    assert sum(losses[-8:]) < sum(losses[:8])
    assert all(float(r["grad_norm"]) < 1e3 for r in rows)  # the norm of unscaled gradients
    assert report["lora_dtype"] == "float16"
