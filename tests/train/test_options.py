"""Training options users of other trainers expect: epochs instead of steps, noise offset, min-SNR weighting,
each through the train stage on a bundled tiny example (and each shown to change what is trained)."""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, make_pipeline_repo, run_checked, run_env, run_stages


def _encoded_repo(tmp_path: Path, params_file: Path | None = None) -> tuple[Path, Path]:
    store = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store, dvc=False)
    if params_file is not None:
        shutil.copy(params_file, repo / "params.yaml")
    run_stages(repo, store)
    return repo, store


def _train(repo: Path, store: Path, name: str, edits: dict[str, str], check: bool = True):
    """The train stage with `edits` to params.yaml, into its own outputs; (report, losses) or the failed run."""
    text = (repo / "params.yaml").read_text()
    for old, new in edits.items():
        assert old in text, old
        text = text.replace(old, new)
    (repo / f"{name}.yaml").write_text(text)
    out = repo / "out" / name
    cmd = [sys.executable, "-m", "stages.train", "--params", f"{name}.yaml", "--out", str(out),
           "--report", str(out / "r.json"), "--loss-plot", str(out / "loss.csv"), "--runs", str(out / "runs")]
    if not check:
        import subprocess

        return subprocess.run(cmd, cwd=repo, env=run_env(store), capture_output=True, text=True, timeout=600)
    run_checked(cmd, cwd=repo, env=run_env(store))
    with open(out / "loss.csv") as fh:
        losses = [float(r["loss"]) for r in csv.DictReader(fh)]
    return json.loads((out / "r.json").read_text()), losses


def test_epochs_set_the_steps_and_noise_offset_changes_the_noise(tmp_path):
    repo, store = _encoded_repo(tmp_path)
    rows = pq.read_table(repo / "data/encoded.parquet").to_pylist()
    buckets = [r["bucket"] for r in rows if r["split"] == "train"]
    per_epoch = sum(buckets.count(b) // 2 for b in set(buckets))  # whole micro-batches of 2, one bucket each
    quiet = {"eval_every_steps: 40": "eval_every_steps: 0"}
    report, offset = _train(repo, store, "offset", {**quiet, "steps: 120": "steps: 120\n  epochs: 1\n  noise_offset: 0.1"})
    assert report["steps"] == len(offset) == per_epoch  # 1 data-parallel rank, no gradient accumulation
    _, plain = _train(repo, store, "plain", {**quiet, "steps: 120": f"steps: {per_epoch}"})
    assert len(plain) == len(offset) and plain[0] != offset[0]


def test_min_snr_weights_the_loss_of_epsilon_families_and_is_refused_for_flow(tmp_path):
    repo, store = _encoded_repo(tmp_path / "flux")
    failed = _train(repo, store, "snr", {"steps: 120": "steps: 2\n  min_snr_gamma: 5.0"}, check=False)
    assert failed.returncode != 0 and "train.min_snr_gamma: applies to epsilon and v prediction" in failed.stderr
    assert "Traceback" not in failed.stderr

    repo, store = _encoded_repo(tmp_path / "sdxl", REPO / "examples/sdxl-tiny/params.yaml")
    quiet = {"eval_every_steps: 40": "eval_every_steps: 0"}
    _, weighted = _train(repo, store, "snr", {**quiet, "steps: 120": "steps: 3\n  min_snr_gamma: 1.0"})
    _, plain = _train(repo, store, "plain", {**quiet, "steps: 120": "steps: 3"})
    # the same first batch and noise: its weighted loss is the plain one with each sample's error weighted by <= 1
    assert weighted[0] <= plain[0] + 1e-7
    assert weighted != plain  # and < 1 wherever a sample's SNR exceeds gamma


def test_a_datasets_loss_weight_scales_its_samples_loss(tmp_path):
    """scan.datasets[].loss_weight reaches the loss through the manifest and the encoded table: the first step
    (same batch, same noise, same weights) has exactly 3 times the loss, and changing the weight encodes nothing."""
    repo, store = _encoded_repo(tmp_path)
    quiet = {"eval_every_steps: 40": "eval_every_steps: 0", "steps: 120": "steps: 2"}
    _, plain = _train(repo, store, "plain", quiet)
    params = repo / "params.yaml"
    params.write_text(params.read_text().replace("eval_fraction: 0.15", "eval_fraction: 0.15\n      loss_weight: 3"))
    run_stages(repo, store)
    encode = json.loads((repo / "reports/encode.json").read_text())
    assert encode["latent"]["computed"] == encode["text"]["computed"] == 0
    assert {r["loss_weight"] for r in pq.read_table(repo / "data/encoded.parquet").to_pylist()} == {3.0}
    _, weighted = _train(repo, store, "weighted", quiet)
    assert weighted[0] == pytest.approx(3 * plain[0], rel=1e-5)
