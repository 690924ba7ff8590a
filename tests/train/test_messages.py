"""What the train stage tells a person while it runs: warnings for params that are valid but almost surely wrong,
and progress during evaluation (which once looked like a hang for minutes)."""

from __future__ import annotations

import sys

from diffusion_pipe.params import TrainParams
from diffusion_pipe.train.loop import schedule_warnings
from tests.conftest import make_pipeline_repo, run_checked, run_env


def test_warmup_at_least_steps_is_warned_about():
    (warning,) = schedule_warnings(TrainParams(steps=10, warmup_steps=10))
    assert "train.warmup_steps (10) >= train.steps (10)" in warning
    assert schedule_warnings(TrainParams(steps=11, warmup_steps=10)) == []


def test_train_stage_warns_and_shows_eval_progress(tmp_path):
    store = tmp_path / "store"
    edits = {"steps: 120": "steps: 4", "eval_every_steps: 40": "eval_every_steps: 2"}
    repo = make_pipeline_repo(tmp_path / "repo", store, edits, dvc=False)
    env = run_env(store)
    for stage in ("scan", "encode"):
        run_checked([sys.executable, "-m", f"stages.{stage}"], cwd=repo, env=env)
    err = run_checked([sys.executable, "-m", "stages.train"], cwd=repo, env=env).stderr
    assert "train: warning: train.warmup_steps (10) >= train.steps (4)" in err
    for step in (0, 2, 4):  # at the start, every eval_every_steps, and the end
        assert f"eval at step {step}" in err, err[-2000:]
