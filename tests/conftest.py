"""Shared fixtures: a throwaway copy of the repository's pipeline and example, as a git + DVC repo."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PIPELINE_FILES = ("dvc.yaml", "params.yaml", "stages", "diffusion_pipe", "examples/flux-tiny", "examples/sdxl-tiny",
                  "examples/wan-tiny")


def run_env(store: Path) -> dict[str, str]:
    """The environment the stages run in: this interpreter first on PATH, the test's own store."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(DIFFUSION_PIPE_STORE=str(store), DVC_NO_ANALYTICS="1", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    return env


def make_pipeline_repo(dest: Path, store: Path, params_edits: dict[str, str] | None = None) -> Path:
    """Copy the pipeline into `dest`, make it a git + DVC repo, and apply text edits to params.yaml."""
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
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=dest, check=True, env=env)
    return dest


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
