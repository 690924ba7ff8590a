"""Shared fixtures: a throwaway copy of the repository's pipeline and example, as a git + DVC repo."""

from __future__ import annotations

import csv
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# dvc.yaml lists every bundled example's data and model as deps, so the copy carries every examples/*-tiny.
PIPELINE_FILES = ("dvc.yaml", "params.yaml", "stages", "diffusion_pipe",
                  *sorted(f"examples/{p.name}" for p in (REPO / "examples").glob("*-tiny")))


def run_env(store: Path) -> dict[str, str]:
    """The environment the stages run in: this interpreter first on PATH, the test's own store."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(DIFFUSION_PIPE_STORE=str(store), DVC_NO_ANALYTICS="1", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    return env


def run_checked(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a command; on failure, fail the test with the command's own output (its last 4000 characters), which
    `check=True` with captured output would hide."""
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        pytest.fail(f"exit {out.returncode}: {' '.join(map(str, cmd))}\n--- stdout ---\n{out.stdout[-4000:]}"
                    f"\n--- stderr ---\n{out.stderr[-4000:]}", pytrace=False)
    return out


def free_port() -> int:
    """A TCP port nothing listened on a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int) -> list[str]:
    """`torch.distributed.run` with `nproc` local workers; `--standalone` lets the rendezvous store bind a port
    the OS picks, so no port is chosen here and then raced for by other jobs on the machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def make_pipeline_repo(dest: Path, store: Path, params_edits: dict[str, str] | None = None,
                       dvc: bool = True) -> Path:
    """Copy the pipeline into `dest`, make it a git (+ DVC unless not `dvc`) repo, and apply text edits to
    params.yaml."""
    for name in PIPELINE_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    params = (dest / "params.yaml").read_text()
    for old, new in (params_edits or {}).items():
        assert old in params, old
        params = params.replace(old, new)
    (dest / "params.yaml").write_text(params)
    env = run_env(store)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True, env=env)
    if dvc:
        subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=dest, check=True, env=env)
    return dest


def run_stages(repo: Path, store: Path, stages: tuple[str, ...] = ("scan", "encode")) -> None:
    """Run each stage of `stages` as its plain command (`python -m stages.NAME`) in `repo`, with `store`."""
    for stage in stages:
        run_checked([sys.executable, "-m", f"stages.{stage}"], cwd=repo, env=run_env(store))


def train_cmd(runs: Path, *more: str) -> list[str]:
    """The train stage as a plain command writing under `runs`: out/lora.safetensors, report.json, loss.csv and
    checkpoints/; `more`: its other options (--params FILE, ...)."""
    return [sys.executable, "-m", "stages.train", "--runs", str(runs), "--out", str(runs / "out"),
            "--report", str(runs / "report.json"), "--loss-plot", str(runs / "loss.csv"), *more]


def trained_run(params: Path, runs: Path, repo: Path, store: Path) -> tuple[list[str], dict[str, bytes], dict]:
    """The train stage run with `params` under `runs` (`train_cmd`): its command, the bytes of its loss plot and
    LoRA (what `resumed_without` compares) and its report."""
    cmd = train_cmd(runs, "--params", str(params))
    run_checked(cmd, cwd=repo, env=run_env(store))
    whole = {f: (runs / f).read_bytes() for f in ("loss.csv", "out/lora.safetensors")}
    return cmd, whole, json.loads((runs / "report.json").read_text())


def resumed_without(step_dir: Path, cmd: list[str], repo: Path, store: Path, whole: dict[str, bytes],
                    report: dict) -> dict:
    """The run of `cmd` (`train_cmd` under runs = `step_dir`'s grandparent) as it was when stopped just before it
    saved `step_dir`, run again: it must end with the same files (`whole`: path under runs -> bytes) and the same
    evaluations as `report`, the unbroken run's. Returns the resumed run's report."""
    runs = step_dir.parent.parent.parent
    shutil.rmtree(step_dir)
    (runs / "out/lora.safetensors").unlink()
    run_checked(cmd, cwd=repo, env=run_env(store))
    resumed = json.loads((runs / "report.json").read_text())
    assert {f: (runs / f).read_bytes() for f in whole} == whole
    assert resumed["eval"] == report["eval"]
    return resumed


def encoded_example(root: Path, params_edits: dict[str, str] | None) -> tuple[Path, Path]:
    """(repo, store) under `root`: the bundled example with `params_edits`, scanned and encoded (no DVC)."""
    store = root / "store"
    repo = make_pipeline_repo(root / "repo", store, params_edits, dvc=False)
    run_stages(repo, store)
    return repo, store


def train_example(tmp_path: Path, params_edits: dict[str, str], dvc: bool = True) -> tuple[Path, dict, list[dict]]:
    """The bundled example with `params_edits`, through scan, encode and train as plain stage commands: its repo,
    the train report and the loss plot's rows."""
    store = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store, params_edits, dvc=dvc)
    run_stages(repo, store, ("scan", "encode", "train"))
    with open(repo / "reports/train_loss.csv") as fh:
        rows = list(csv.DictReader(fh))
    return repo, json.loads((repo / "reports/train.json").read_text()), rows


@pytest.fixture
def store_env(tmp_path, monkeypatch) -> Path:
    """A private store for this test, set in this process's environment too."""
    store = tmp_path / "store"
    monkeypatch.setenv("DIFFUSION_PIPE_STORE", str(store))
    return store


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory) -> Path:
    """A tiny random-init Flux model (seed 0) in diffusers format, built once; tests must not modify it."""
    from diffusion_pipe.models.flux import FluxAdapter

    out = tmp_path_factory.mktemp("tiny-flux")
    FluxAdapter.build_tiny(out, seed=0)
    return out
