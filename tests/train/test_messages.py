"""What the train stage tells a person while it runs: warnings for params that are valid but almost surely wrong,
and progress during evaluation (which once looked like a hang for minutes)."""

from __future__ import annotations

import sys

import pytest

from diffusion_pipe.config import ConfigError
from diffusion_pipe.params import TrainParams, load_params
from diffusion_pipe.train.loop import schedule_warnings
from tests.conftest import make_pipeline_repo, run_checked, run_env, run_stages


def test_warmup_at_least_steps_is_warned_about():
    (warning,) = schedule_warnings(TrainParams(steps=10, warmup_steps=10))
    assert "train.warmup_steps (10) >= train.steps (10)" in warning
    assert schedule_warnings(TrainParams(steps=11, warmup_steps=10)) == []


def test_a_params_file_still_choosing_the_removed_cudnn_kernel_is_told_why_and_what_to_use(tmp_path):
    """train.attention: cudnn trained on wrong gradients (H100) and crashed (H200): it is refused at load, saying
    so and naming the fix, not with a bare 'unknown value'."""
    path = tmp_path / "params.yaml"
    path.write_text("model: {path: m}\nscan:\n  datasets: [{path: d}]\ntrain:\n  attention: cudnn\n")
    with pytest.raises(ConfigError, match=r"train: attention: cudnn was removed: cuDNN's attention kernel computed "
                                          r"wrong gradients .* set attention: flash \(the default\)"):
        load_params(path)
    path.write_text(path.read_text().replace("cudnn", "sdpa"))
    with pytest.raises(ConfigError, match=r"train: attention: got 'sdpa'; the only kernel is 'flash'"):
        load_params(path)
    assert TrainParams(attention="flash").attention == "flash"


def test_a_run_diverging_at_its_first_step_does_not_blame_the_learning_rate(tmp_path):
    """A first step's loss comes from the initial weights, before any learning rate was applied: a NaN there (a
    timestep or noise param out of its depth, float16 overflow, bad data) names those, not the learning rate;
    later steps name the learning rate and clipping."""
    from diffusion_pipe.train.guards import diverged

    first = str(diverged(1, float("nan"), None, TrainParams(flow_shift=50.0), None, tmp_path))
    assert "diverged at its first step" in first and "the learning rate is not the cause" in first
    assert "train.flow_shift (now 50)" in first and "Lower train.learning_rate" not in first
    later = str(diverged(5, float("nan"), None, TrainParams(), 4, tmp_path))
    assert "Lower train.learning_rate (now 0.0001)" in later and "the last checkpoint, step 4" in later


def test_a_small_learning_rate_with_prodigy_is_warned_about():
    (warning,) = schedule_warnings(TrainParams(steps=11, optimizer="prodigy", learning_rate=1e-4))
    assert "train.learning_rate is 0.0001 with train.optimizer: prodigy" in warning
    assert "set learning_rate: 1.0" in warning
    assert schedule_warnings(TrainParams(steps=11, optimizer="prodigy", learning_rate=1.0)) == []
    assert schedule_warnings(TrainParams(steps=11, learning_rate=1e-4)) == []


def test_train_stage_warns_and_shows_eval_progress(tmp_path):
    store = tmp_path / "store"
    edits = {"steps: 120": "steps: 4", "eval_every_steps: 40": "eval_every_steps: 2"}
    repo = make_pipeline_repo(tmp_path / "repo", store, edits, dvc=False)
    env = run_env(store)
    run_stages(repo, store)
    err = run_checked([sys.executable, "-m", "stages.train"], cwd=repo, env=env).stderr
    assert "train: warning: train.warmup_steps (10) >= train.steps (4)" in err
    for step in (0, 2, 4):  # at the start, every eval_every_steps, and the end
        assert f"eval at step {step}" in err, err[-2000:]
    _tensorboard_logs_what_the_reports_hold(repo)


def _tensorboard_logs_what_the_reports_hold(repo):
    """runs/tensorboard/<run id>/: each step's loss, learning rate, gradient norm and rate, and the eval losses,
    the same values as reports/train_loss.csv and reports/train.json."""
    import csv
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    report = json.loads((repo / "reports/train.json").read_text())
    events = EventAccumulator(str(repo / "runs/tensorboard" / report["run_id"]))
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    with open(repo / "reports/train_loss.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert sorted(scalars["train/loss"]) == [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert abs(scalars["train/loss"][int(r["step"])] - float(r["loss"])) <= 1e-6 * max(1.0, float(r["loss"]))
        assert abs(scalars["train/grad_norm"][int(r["step"])] - float(r["grad_norm"])) <= 1e-5 * float(r["grad_norm"])
    lrs = [scalars["train/lr"][s] for s in (1, 2, 3, 4)]
    assert lrs == sorted(lrs) and 0 < lrs[0] < lrs[-1]  # warming up over 10 steps
    assert all(v > 0 for v in scalars["train/samples_per_s"].values())
    assert sorted(scalars["eval/loss"]) == [0, 2, 4]
    for step, key in ((0, "eval_loss_start"), (4, "eval_loss_end")):
        assert abs(scalars["eval/loss"][step] - report[key]) <= 1e-5 * report[key]
