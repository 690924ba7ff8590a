"""A run killed (SIGKILL) or interrupted (Ctrl-C) and resumed continues exactly: the same losses as a run that
was never stopped (CPU, fp32)."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import make_pipeline_repo, run_checked, run_env, run_stages

STEPS = 30
# LoRA dropout on: the RNG state must resume too; caption dropout on: the same samples must drop after a resume
PARAMS = {"steps: 120": f"steps: {STEPS}",
          "eval_every_steps: 40": "eval_every_steps: 0\n  checkpoint_every_steps: 3\n  lora_dropout: 0.1",
          "caption_dropout: 0.0": "caption_dropout: 0.5"}


@pytest.fixture(scope="module")
def encoded_repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    store = root / "store"
    repo = make_pipeline_repo(root / "repo", store, PARAMS)
    run_stages(repo, store)
    return repo, store


@pytest.fixture(scope="module")
def whole(encoded_repo, tmp_path_factory):
    """The run that is never stopped."""
    repo, store = encoded_repo
    runs = tmp_path_factory.mktemp("whole")
    run_checked(train_cmd(runs), cwd=repo, env=run_env(store))
    return runs


def train_cmd(runs: Path) -> list[str]:
    return [sys.executable, "-m", "stages.train", "--runs", str(runs), "--out", str(runs / "out"),
            "--report", str(runs / "report.json"), "--loss-plot", str(runs / "loss.csv")]


def losses(runs: Path) -> list[float]:
    with open(runs / "loss.csv") as fh:
        return [float(r["loss"]) for r in csv.DictReader(fh)]


def stop_after_first_checkpoint(cmd: list[str], repo: Path, store: Path, sig: int) -> None:
    proc = subprocess.Popen(cmd, cwd=repo, env=run_env(store), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    runs = Path(cmd[cmd.index("--runs") + 1])
    deadline = time.monotonic() + 120
    while not list(runs.glob("checkpoints/*/latest")):
        assert proc.poll() is None, "training ended before its first checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(sig)
    proc.wait(timeout=60)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["sigkill", "ctrl-c"])
def test_resumed_run_matches_uninterrupted(encoded_repo, whole, tmp_path, sig):
    repo, store = encoded_repo
    broken = tmp_path / "broken"
    stop_after_first_checkpoint(train_cmd(broken), repo, store, sig)
    assert not (broken / "out" / "lora.safetensors").exists()
    run_checked(train_cmd(broken), cwd=repo, env=run_env(store))
    report = json.loads((broken / "report.json").read_text())
    assert report["resumed_from"] is not None and 0 < report["resumed_from"] < STEPS
    assert losses(broken) == losses(whole)
    assert (broken / "out" / "lora.safetensors").read_bytes() == (whole / "out" / "lora.safetensors").read_bytes()


def test_resume_from_another_run_refuses_changed_data_unless_forced(encoded_repo, whole, tmp_path):
    import pyarrow.parquet as pq

    repo, store = encoded_repo
    table = pq.read_table(repo / "data/encoded.parquet")
    changed = tmp_path / "encoded.parquet"
    pq.write_table(table.slice(1), changed)  # one sample fewer: another encoded table
    source = next((whole / "checkpoints").iterdir())
    runs = tmp_path / "next"
    cmd = [*train_cmd(runs), "--encoded", str(changed), "--resume-from", str(source)]
    refused = subprocess.run(cmd, cwd=repo, env=run_env(store), capture_output=True, text=True)
    assert refused.returncode == 2
    assert "refusing to resume, since the encoded table (hash" in refused.stderr
    assert "pass --force" in refused.stderr
    run_checked([*cmd, "--force"], cwd=repo, env=run_env(store))
    report = json.loads((runs / "report.json").read_text())
    assert report["resumed_from"] == STEPS


def test_checkpoints_by_time_and_pruning(encoded_repo, tmp_path):
    """A checkpoint after every step once the minutes have passed (here: at once), only the newest N kept;
    neither setting changes the run's identity, so the run continues where the other left off."""
    repo, store = encoded_repo
    params = (repo / "params.yaml").read_text().replace(f"steps: {STEPS}", "steps: 6")
    timed = params.replace("checkpoint_every_steps: 3", "checkpoint_every_steps: 0")
    (tmp_path / "timed.yaml").write_text(timed.replace("checkpoint_every_minutes: 30",
                                                       "keep_checkpoints: 2\n  checkpoint_every_minutes: 1.0e-9"))
    (tmp_path / "plain.yaml").write_text(params)
    runs = tmp_path / "runs"
    timed_run = run_checked([*train_cmd(runs), "--params", str(tmp_path / "timed.yaml")], cwd=repo,
                            env=run_env(store))
    (run_dir,) = (runs / "checkpoints").iterdir()
    for step in range(1, 7):  # each save says so, where and how long it took
        assert f"train: checkpoint of step {step} saved to {run_dir / f'step{step}'} in " in timed_run.stderr
    assert sorted(p.name for p in run_dir.glob("step*")) == ["step5", "step6"]
    assert (run_dir / "latest").read_text().strip() == "step6"
    again = run_checked([*train_cmd(runs), "--params", str(tmp_path / "plain.yaml")], cwd=repo, env=run_env(store))
    assert json.loads((runs / "report.json").read_text())["resumed_from"] == 6, again.stderr[-2000:]


@pytest.mark.slow  # about 40 s: two 2-process runs and a resume; the single-process tests above run by default
def test_data_parallel_run_killed_resumes_exactly(encoded_repo, tmp_path):
    """1 stage x 2 data-parallel ranks under torchrun (gloo), LoRA dropout on, SIGKILLed (torchrun and both
    workers) after its first checkpoint and run again: the losses and the LoRA of a run never stopped. The ranks
    train on different micro-batches (two bucket sizes), so their dropout RNG states differ at the checkpoint: a
    rank that restored another rank's states would draw other masks (scripts/mutation_pass.py checks this test
    catches it)."""
    import os

    from tests.conftest import torchrun

    repo, store = encoded_repo
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    run_checked([*torchrun(2), *train_cmd(whole)[1:]], cwd=repo, env=run_env(store))
    with open(tmp_path / "broken.log", "w") as log:
        proc = subprocess.Popen([*torchrun(2), *train_cmd(broken)[1:]], cwd=repo, env=run_env(store), stdout=log,
                                stderr=log, start_new_session=True)
        deadline = time.monotonic() + 300
        while not list(broken.glob("checkpoints/*/latest")):
            assert proc.poll() is None, (tmp_path / "broken.log").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.01)
        workers = _children(proc.pid)  # each in its own session: torchrun starts them with start_new_session
        assert len(workers) == 2
        for pid in [*workers, proc.pid]:  # a crashed node: the workers and torchrun die at once
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=60)
        for pid in workers:
            while Path(f"/proc/{pid}").exists() and "Z" not in _proc_state(pid):
                time.sleep(0.01)
    assert not (broken / "out" / "lora.safetensors").exists(), "the run ended before the kill; give it more steps"
    run_checked([*torchrun(2), *train_cmd(broken)[1:]], cwd=repo, env=run_env(store))
    report = json.loads((broken / "report.json").read_text())
    assert 0 < report["resumed_from"] < STEPS
    assert losses(broken) == losses(whole)
    assert (broken / "out" / "lora.safetensors").read_bytes() == (whole / "out" / "lora.safetensors").read_bytes()


def _proc_state(pid: int) -> str:
    """The state letter of process `pid` (Z: exited, not yet reaped), or '' if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _children(pid: int) -> list[int]:
    """The ids of the processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
    return found
