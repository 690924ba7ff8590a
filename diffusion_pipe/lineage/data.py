"""A lineage record's datasets compared with the working tree.

The dataset folders are not DVC deps (the scan stage runs on every repro and notices changes itself), so dvc.lock
holds no hash of them. The record holds, per dataset, a hash of its media and one of its captions. `--verify`
scans each dataset again (read-only: with a copy of the scan's stat cache, so unchanged files cost a stat, not a
decode) and compares those two hashes; where one differs, the fresh rows are compared item by item with the
manifest the record was built from (the working tree's while it still hashes as recorded, else DVC's cache copy),
which names the files: media changed, caption edited, added, removed.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path, PurePosixPath

from diffusion_pipe.hashing import hash_file

MAX_CAPTION_SHOWN = 60
SCAN_CACHE = Path(".diffusion-pipe/scan-cache.parquet")  # the scan stage's stat cache (stages/scan)
ROW_FIELDS = ("path", "content_hash", "caption", "caption_hash", "status", "reason")


def recorded_manifest(record: dict, repo: Path) -> Path | None:
    """The manifest the record was built from: in the working tree while it still hashes as recorded, else in
    DVC's cache (by the md5 the record holds); None when neither has it."""
    recorded = (record.get("inputs") or {}).get("manifest")
    if not recorded:
        return None
    candidates = [repo / recorded["path"]]
    if recorded.get("md5") and (repo / ".dvc").is_dir():
        from dvc.repo import Repo

        with Repo(str(repo)) as dvc:
            candidates.append(Path(dvc.cache.local.oid_to_path(recorded["md5"])))
    return next((p for p in candidates if p.is_file() and hash_file(p) == recorded["xxh3_128"]), None)


def manifest_rows(path: Path, dataset: str) -> list[dict]:
    """The rows of one dataset (by manifest name) of a manifest file."""
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["dataset", *ROW_FIELDS]).to_pylist()
    return [{k: r[k] for k in ROW_FIELDS} for r in table if r["dataset"] == dataset]


def rescan_rows(scan, index: int, repo: Path) -> list[dict]:
    """The manifest rows a scan of dataset `index` of `scan` (ScanParams) gives now, its path taken relative to
    `repo`. Nothing is written: the scan's stat cache is read through a copy, and a missing caption under policy
    'error' is a row, not an error."""
    from diffusion_pipe.scan.scanner import scan_datasets

    ds = scan.datasets[index]
    here = dataclasses.replace(ds, path=str(repo / ds.path), name=ds.manifest_name,
                               caption_policy="skip" if ds.caption_policy == "error" else ds.caption_policy)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / SCAN_CACHE.name
        if (repo / SCAN_CACHE).is_file():
            shutil.copyfile(repo / SCAN_CACHE, cache)
        rows, _ = scan_datasets(dataclasses.replace(scan, datasets=(here,)), cache, progress=False)
    return [{k: getattr(r, k) for k in ROW_FIELDS} for r in rows]


def _caption(text: str) -> str:
    return repr(text if len(text) <= MAX_CAPTION_SHOWN else text[:MAX_CAPTION_SHOWN] + "...")


def item_changes(old: list[dict], new: list[dict]) -> list[str]:
    """What differs between two scans of one dataset, one line per file (paths relative to the dataset), in
    path order. Pure."""
    before, after = {r["path"]: r for r in old}, {r["path"]: r for r in new}
    changes = []
    for path in sorted(before.keys() | after.keys()):
        a, b = before.get(path), after.get(path)
        if a is None:
            changes.append(f"{path}: added")
        elif b is None:
            changes.append(f"{path}: removed")
        else:
            if a["content_hash"] != b["content_hash"]:
                changes.append(f"{path}: media changed")
            if a["caption_hash"] != b["caption_hash"]:
                txt = PurePosixPath(path).with_suffix(".txt").as_posix()
                changes.append(f"{txt}: caption {_caption(a['caption'])} -> {_caption(b['caption'])}")
            if (a["status"], a["reason"]) != (b["status"], b["reason"]):
                changes.append(f"{path}: {a['status']}{' (' + a['reason'] + ')' if a['reason'] else ''} -> "
                               f"{b['status']}{' (' + b['reason'] + ')' if b['reason'] else ''}")
    return changes


def dataset_drift(record: dict, repo: Path, index: int) -> tuple[bool, str]:
    """(matches, detail) for dataset `index` of the record's `scan.datasets` against the working tree."""
    from diffusion_pipe.config import from_dict
    from diffusion_pipe.lineage.record import dataset_summary
    from diffusion_pipe.params import ScanParams

    scan = from_dict(ScanParams, record["params"]["scan"], "scan")
    ds = scan.datasets[index]
    if not (repo / ds.path).is_dir():
        return False, f"{repo / ds.path} is missing; restore it"
    rows = rescan_rows(scan, index, repo)
    recorded = ((record.get("inputs") or {}).get("datasets") or {}).get(ds.manifest_name)
    now = dataset_summary(rows)
    if recorded is not None and all(recorded.get(k) == now[k] for k in now):
        return True, f"{now['items']} items match"
    manifest = recorded_manifest(record, repo)
    if manifest is None:
        if recorded is None:
            return False, ("the record holds no hashes of this dataset and the manifest it was built from is "
                           "neither in the working tree nor in DVC's cache (`dvc fetch` it) to compare with")
        what = [k.removesuffix("_xxh3") for k in ("media_xxh3", "captions_xxh3") if recorded[k] != now[k]]
        return False, (f"its {' and '.join(what) or 'item list'} changed since this was trained (the manifest "
                       "it was built from is not at hand to name the files: `dvc fetch` it)")
    changes = item_changes(manifest_rows(manifest, ds.manifest_name), rows)
    if not changes:
        return True, f"{len(rows)} items match the manifest"
    shown = "; ".join(changes[:10]) + (" ..." if len(changes) > 10 else "")
    return False, f"{len(changes)} change(s) since this was trained: {shown}"
