"""Running stages of a throwaway pipeline repo (tests/conftest.py: make_pipeline_repo) and reading their reports."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.conftest import run_checked, run_env

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]


@contextlib.contextmanager
def environment(env: dict[str, str], cwd: Path) -> Iterator[None]:
    """Run DVC's Python API as `dvc` would in `cwd` with `env` (it spawns the stage commands from there)."""
    saved, old_cwd = dict(os.environ), Path.cwd()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(saved)


def reproduce(repo: Path, store: Path, target: str | None = None, **kwargs: Any) -> list[str]:
    """`dvc repro [target]` through DVC's Python API; the names of the stages that ran."""
    from dvc.repo import Repo

    with environment(run_env(store), repo), Repo(str(repo)) as dvc:
        return [stage.addressing for stage in dvc.reproduce(target, **kwargs)]


def encode_counts(repo: Path) -> dict[str, dict[str, int]]:
    """Per family: computed, reused_local, fetched_remote, from the repo's reports/encode.json."""
    report = json.loads((repo / "reports" / "encode.json").read_text())
    return {fam: {k: report[fam][k] for k in ("computed", "reused_local", "fetched_remote")}
            for fam in ("latent", "text")}


def run_stage(repo: Path, store: Path, stage: str, *args: str, env: dict[str, str] | None = None,
              check: bool = True) -> subprocess.CompletedProcess[str]:
    """`python -m stages.<stage> ARGS` in `repo` with `store` as the store; with `check`, a failure fails the test
    with the stage's output."""
    cmd, env = [sys.executable, "-m", f"stages.{stage}", *args], env or run_env(store)
    if check:
        return run_checked(cmd, repo, env, timeout=300)
    return subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)


def stage_in_process(name: str, store: Path, *args: str) -> None:
    """Run stage `name`'s command in this process, in the current directory (a pipeline repo), with `store` as
    the store: no interpreter start-up, which is most of a tiny stage's time. Not for train (it starts a
    process group)."""
    import importlib

    saved = os.environ.get("DIFFUSION_PIPE_STORE")
    os.environ["DIFFUSION_PIPE_STORE"] = str(store)
    try:
        importlib.import_module(f"stages.{name}").command.main(list(args), standalone_mode=False)
    finally:
        if saved is None:
            os.environ.pop("DIFFUSION_PIPE_STORE")
        else:
            os.environ["DIFFUSION_PIPE_STORE"] = saved


def git(repo: Path, *args: str) -> str:
    """Run git in `repo` (identity given per command: the global config is never touched)."""
    return subprocess.run([*GIT, *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def dvc(repo: Path, store: Path, *args: str) -> str:
    """Run the `dvc` command line in `repo`."""
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, env=run_env(store), check=True,
                          capture_output=True, text=True, timeout=600).stdout
