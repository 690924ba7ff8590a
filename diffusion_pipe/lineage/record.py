"""Lineage records: built by train (checkpoints) and export (every file it writes), stored in the safetensors
metadata under `diffusion_pipe.lineage` and in a `lineage.json` beside the file.

A record holds: the resolved params; the hashes of the manifest, the encoded table and the set of store keys
trained on; per dataset, a hash of its media and one of its captions (from the manifest); the base model's weights
hash per component; the `dvc.lock` entries of the stages upstream of it (and only those: never the entry of the
stage writing it, which still describes its previous run); the git commit and dirty flag;
every installed package's version with Python, torch, CUDA and GPU; seed, steps and the final losses. Paths in
it are relative to the repository, so `diffusion-pipe lineage --verify` can check a record against a clone.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

from diffusion_pipe.config import flatten, to_dict
from diffusion_pipe.fileio import atomic_writer
from diffusion_pipe.hashing import hash_file, hash_json
from diffusion_pipe.params import Params
from diffusion_pipe.redact import redact_obj

LINEAGE_VERSION = 3
METADATA_KEY = "diffusion_pipe.lineage"
MANIFEST = Path("data/manifest.parquet")
STORE_FAMILIES = ("latent", "text")
# The dvc.lock entries that describe a record's inputs, by the stage writing the record: a stage's own entry is
# rewritten only after it finishes, so while it runs the entry is the previous run's (its deps point at the
# previous inputs), and downstream entries are not inputs at all.
UPSTREAM_STAGES = {"train": ("scan", "encode"), "export": ("scan", "encode", "train")}
# The params the train stage reads, where no dvc.yaml says (a run outside DVC).
TRAIN_PARAMS = ("model", "train")


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


def lock_mismatches(entries: dict, inputs: dict) -> dict[str, str]:
    """Stage -> why its dvc.lock entry does not describe these inputs: a dep or out at the path of one of
    `inputs` (a record's `inputs`: manifest, encoded table, LoRA, each with its md5) that carries another md5.
    Pure; inputs without an md5 are not compared."""
    by_path = {i["path"]: i["md5"] for i in inputs.values() if isinstance(i, dict) and i.get("md5")}
    problems: dict[str, str] = {}
    for stage, entry in sorted(entries.items()):
        for kind in ("deps", "outs"):
            for item in entry.get(kind) or []:
                want = by_path.get(item.get("path"))
                if want is not None and item.get("md5") != want:
                    problems.setdefault(stage, f"its {kind[:-1]} {item['path']} has md5 {item.get('md5')}, the "
                                               f"file this was built from has md5 {want}")
    return problems


def upstream_lock_entries(repo: Path, stage: str, inputs: dict) -> tuple[dict, dict[str, str]]:
    """The dvc.lock entries of the stages upstream of `stage` that describe `inputs`, and stage -> why an entry
    was left out (it records other files: that stage ran outside DVC and was not `dvc commit`ed since)."""
    entries = {name: entry for name, entry in dvc_lock_entries(repo).items() if name in UPSTREAM_STAGES[stage]}
    omitted = lock_mismatches(entries, inputs)
    return {k: v for k, v in entries.items() if k not in omitted}, omitted


def encoded_store_keys(encoded_path: Path) -> dict[str, list[str]]:
    """The store keys an encoded table points at, both splits (train and eval), sorted and unique per family:
    {"latent": [...], "text": [...]}."""
    import pyarrow.parquet as pq

    table = pq.read_table(encoded_path, columns=["latent_key", "text_key"])
    return {"latent": sorted(set(table.column("latent_key").to_pylist())),
            "text": sorted(set(table.column("text_key").to_pylist()))}


def store_keys_record(store_keys: dict[str, list[str]]) -> dict:
    """What a lineage records of a key set: its hash (of the sorted keys per family) and the counts."""
    keys = {family: sorted(set(store_keys.get(family, []))) for family in STORE_FAMILIES}
    return {"xxh3_128": hash_json(keys), "splits": ["train", "eval"], **{f: len(k) for f, k in keys.items()}}


def model_dir(params: Params, repo: Path) -> Path:
    """The base model's directory as the stages read it: `model.path` relative to the repository, else a hub
    id's local snapshot; a model view of it when `model.transformer`, `model.vae` or `model.text_encoders`
    name single files (diffusion_pipe.models.checkpoints)."""
    from diffusion_pipe.models.checkpoints import resolve_model

    return resolve_model(params.model, root=repo)


def base_weights(directory: Path) -> dict[str, str]:
    """Component name -> weights hash (diffusion_pipe.weights.component_hash) of every diffusers component with
    weights (transformer, vae, text encoders; not tokenizers or the scheduler)."""
    from diffusion_pipe.weights import component_hash, has_weights

    return {p.name: component_hash(p) for p in sorted(directory.iterdir()) if p.is_dir() and has_weights(p)}


def base_revision(params: Params, repo: Path) -> str | None:
    """The hub commit of a base model given as a hub id (its Hugging Face cache snapshot), else None."""
    from diffusion_pipe.models.checkpoints import hub_revision

    return hub_revision(model_dir(params, repo))


def repo_relative(repo: Path, path: Path) -> str:
    """`path` relative to `repo` as POSIX text when it lies inside it, else absolute."""
    full = (path if path.is_absolute() else repo / path).resolve()
    try:
        return full.relative_to(repo.resolve()).as_posix()
    except ValueError:
        return str(full)


def md5_file(path: Path) -> str:
    """The md5 of a file's bytes, as dvc.lock records it (only for the few small files a record names)."""
    digest = hashlib.md5()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_input(repo: Path, path: Path) -> dict | None:
    """{"path": repo-relative path, "xxh3_128": hash, "md5": the hash dvc.lock uses} of an input file, or None
    if it does not exist."""
    full = path if path.is_absolute() else repo / path
    if not full.is_file():
        return None
    return {"path": repo_relative(repo, full), "xxh3_128": hash_file(full), "md5": md5_file(full)}


def dataset_inputs(params: Params, manifest_path: Path) -> dict[str, dict]:
    """Per dataset of `scan.datasets` (by its manifest name): its path, item count, and one hash of its media
    and one of its captions (over the manifest's sorted (path, content hash) and (path, caption hash) pairs), so
    that two records tell an edited caption from changed media. Empty without a manifest."""
    if not manifest_path.is_file():
        return {}
    import pyarrow.parquet as pq

    table = pq.read_table(manifest_path, columns=["dataset", "path", "content_hash", "caption_hash"]).to_pylist()
    return {ds.manifest_name: {"path": ds.path, **dataset_summary([r for r in table if r["dataset"] ==
                                                                    ds.manifest_name])}
            for ds in params.scan.datasets}


def dataset_summary(rows: list[dict]) -> dict:
    """One dataset's manifest rows summed up: item count, a hash of its media and one of its captions. Pure."""
    rows = sorted(rows, key=lambda r: r["path"])
    return {"items": len(rows), "media_xxh3": hash_json([[r["path"], r["content_hash"]] for r in rows]),
            "captions_xxh3": hash_json([[r["path"], r["caption_hash"]] for r in rows])}


def training_record(params: Params, train_report: dict | None) -> dict:
    """Seed, steps and final losses; from the train report when there is one."""
    report = train_report or {}
    return {"seed": params.train.seed, "steps": report.get("steps", params.train.steps),
            **{k: report.get(k) for k in ("run_id", "train_loss_last", "train_loss_last10", "eval_loss_start",
                                          "eval_loss_end")}}


def trained_params_drift(record: dict, repo: Path) -> list[str]:
    """`key: trained value -> recorded value` for every param the train stage reads (its `params:` in the
    repository's dvc.yaml, else `model` and `train`) on which an export record's params differ from those its
    trained LoRA's own record holds: the export (and dvc.lock) would then describe a training that did not happen,
    as when params.yaml is edited while train runs. Empty for a record without a trained LoRA's record."""
    from diffusion_pipe.config import changed_params
    from diffusion_pipe.dvcfile import stage_params

    trained = record.get("trained_lora")
    if not trained:
        return []
    keys = stage_params(repo / "dvc.yaml", "train") or TRAIN_PARAMS
    return changed_params(trained.get("params") or {}, record.get("params") or {}, keys)


def checkpoint_lineage(params: Params, repo: Path, encoded_path: Path, store_keys: dict[str, list[str]],
                       train_report: dict | None, *, manifest_path: Path = MANIFEST) -> dict:
    """The lineage record of a trained LoRA or checkpoint (the train stage stamps `lora.safetensors` with it).

    `store_keys`: {"latent": [...], "text": [...]}, the keys of both splits the run reads
    (`encoded_store_keys(encoded_path)` gives them); `train_report`: the train report so far (steps, losses),
    or None before the first step. Relative paths are taken relative to `repo`.
    """
    inputs = {"manifest": file_input(repo, manifest_path), "encoded": file_input(repo, encoded_path),
              "store_keys": store_keys_record(store_keys)}
    if params.train.init_lora:  # the LoRA the run started from (train.init_lora), by content
        inputs["init_lora"] = file_input(repo, Path(params.train.init_lora))
    return _lineage("checkpoint", "train", params, repo, inputs, train_report, manifest_path)


def export_lineage(params: Params, repo: Path, lora_path: Path, manifest_path: Path, encoded_path: Path,
                   train_report: dict | None, trained_lineage: dict | None) -> dict:
    """The lineage record of an export: the inputs as they are now (manifest, encoded table, its store keys,
    the trained LoRA's hash), and the record the train stage stamped on that LoRA (None when it carries none)."""
    inputs = {"manifest": file_input(repo, manifest_path), "encoded": file_input(repo, encoded_path),
              "store_keys": store_keys_record(encoded_store_keys(encoded_path)),
              "lora": file_input(repo, lora_path)}
    return {**_lineage("export", "export", params, repo, inputs, train_report, manifest_path),
            "trained_lora": trained_lineage}


def _lineage(kind: str, stage: str, params: Params, repo: Path, inputs: dict, train_report: dict | None,
             manifest_path: Path) -> dict:
    """The record of what `stage` builds from `inputs`, with everything around them (see the module doc)."""
    lock, omitted = upstream_lock_entries(repo, stage, inputs)
    return {
        "lineage_version": LINEAGE_VERSION,
        "kind": kind,
        "params": redact_obj(to_dict(params)),  # a remote URL's password never enters a record
        "inputs": {**inputs, "datasets": dataset_inputs(
            params, manifest_path if manifest_path.is_absolute() else repo / manifest_path)},
        "base_model": {"family": params.model.family, "path": params.model.path, "dtype": params.model.dtype,
                       "weights": base_weights(model_dir(params, repo)), "revision": base_revision(params, repo)},
        "dvc_lock": redact_obj(lock),
        **({"dvc_lock_omitted": omitted} if omitted else {}),
        "git": git_state(repo),
        "environment": environment(),
        "training": training_record(params, train_report),
    }


def lineage_metadata(record: dict) -> dict[str, str]:
    """The safetensors metadata entry that carries `record` (merge it into a file's metadata when saving)."""
    from diffusion_pipe.hashing import canonical_json

    return {METADATA_KEY: canonical_json(record)}


def read_lineage(path: Path) -> dict:
    """The lineage record of a LoRA file (its safetensors metadata), a lineage JSON file, or a merged export's
    directory (its lineage.json)."""
    path = Path(path)
    if path.is_dir():
        path = path / "lineage.json"
        if not path.is_file():
            raise ValueError(f"{path.parent}: no lineage.json inside; pass an exported file or lineage.json")
    if path.suffix == ".json":
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
    else:
        from safetensors import safe_open

        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
        except Exception as exc:  # safetensors raises its own error types for files that are not safetensors
            raise ValueError(f"{path}: not a safetensors file ({exc})") from None
        if METADATA_KEY not in meta:
            raise ValueError(f"{path}: no diffusion-pipe lineage record in its metadata; it was not written by "
                             "diffusion-pipe export (or was re-saved by another tool)")
        record = json.loads(meta[METADATA_KEY])
    if not isinstance(record, dict) or "lineage_version" not in record:
        raise ValueError(f"{path}: not a diffusion-pipe lineage record (no lineage_version)")
    return record


def stamp_safetensors(path: Path, metadata: dict[str, str]) -> None:
    """Add `metadata` to the header of the safetensors file at `path`, atomically, streaming the tensor bytes
    (a 10 GB shard is never held in memory)."""
    import struct

    with open(path, "rb") as src:
        (n,) = struct.unpack("<Q", src.read(8))
        header = json.loads(src.read(n))
        header["__metadata__"] = {**header.get("__metadata__", {}), **metadata}
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        text += b" " * (-len(text) % 8)
        with atomic_writer(path, "wb") as dst:
            dst.write(struct.pack("<Q", len(text)) + text)
            while chunk := src.read(8 << 20):
                dst.write(chunk)
