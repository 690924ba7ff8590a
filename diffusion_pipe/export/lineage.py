"""Lineage: where a LoRA came from. Built at export, stored in the safetensors metadata and beside the file."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

from diffusion_pipe.config import to_dict
from diffusion_pipe.hashing import hash_file
from diffusion_pipe.params import Params

LINEAGE_VERSION = 1


def git_state(repo: Path) -> dict:
    """The commit and whether tracked files differ from it; nulls outside a git checkout."""
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def environment() -> dict:
    """Every installed distribution with its version, plus Python, torch, CUDA and GPU."""
    packages = {d.metadata["Name"].lower(): d.version for d in importlib.metadata.distributions()
                if d.metadata["Name"]}
    return {
        "python": sys.version.split()[0], "platform": platform.platform(),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "packages": dict(sorted(packages.items())),
    }


def dvc_lock_entries(repo: Path) -> dict:
    """The `stages` of dvc.lock as DVC wrote them (the commands, deps, params and outs with their hashes)."""
    lock = repo / "dvc.lock"
    if not lock.is_file():
        return {}
    from ruamel.yaml import YAML

    return (YAML(typ="safe", pure=True).load(lock.read_text()) or {}).get("stages", {})


def build_lineage(params: Params, repo: Path, manifest: Path, encoded: Path, lora: Path,
                  base_hashes: dict[str, str], train_report: dict) -> dict:
    """The lineage record of an export."""
    return {
        "lineage_version": LINEAGE_VERSION,
        "params": to_dict(params),
        "inputs": {"manifest": hash_file(manifest), "encoded": hash_file(encoded), "lora": hash_file(lora)},
        "base_model": {"family": params.model.family, "path": params.model.path, "weights": base_hashes},
        "dvc_lock": dvc_lock_entries(repo),
        "git": git_state(repo),
        "environment": environment(),
        "training": {k: train_report.get(k) for k in ("run_id", "steps", "train_loss_last10", "eval_loss_start",
                                                       "eval_loss_end")} | {"seed": params.train.seed},
    }


def read_lineage(path: Path) -> dict:
    """The lineage record in a LoRA's safetensors metadata, or in a lineage JSON file."""
    if path.suffix == ".json":
        return json.loads(path.read_text())
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if "diffusion_pipe.lineage" not in meta:
        raise ValueError(f"{path}: no diffusion-pipe lineage record in its metadata")
    return json.loads(meta["diffusion_pipe.lineage"])
