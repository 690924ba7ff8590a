"""The last scan's manifest and report, reused whole when nothing the scan reads has changed.

A rescan has to walk and stat every file to know that nothing changed; everything after that (loading the stat
cache, building a row per item, writing the parquet) is the same work with the same result. The fingerprint
covers all of its inputs: the scan params, every listed file's relative path and stat key (size, mtime_ns,
inode), what could not be read, the scan code itself and the versions of the libraries whose output lands in
the manifest (Pillow and PyAV decode, pyarrow writes the bytes). When it matches the last successful scan's, the
saved manifest bytes are the answer. Like the stat cache, this lives outside DVC and is only an optimisation:
a missing, damaged or mismatched snapshot means a full rescan.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash

from diffusion_pipe.config import to_dict
from diffusion_pipe.fileio import write_bytes_atomic, write_json_atomic
from diffusion_pipe.hashing import hash_bytes
from diffusion_pipe.params import ScanParams
from diffusion_pipe.scan.files import Listing
from diffusion_pipe.scan.manifest import DatasetSpec

_VERSION = 1
_LIBRARIES = ("pillow", "av", "pyarrow")


@functools.cache
def _code_and_libraries() -> bytes:
    """The scan package's source and the versions of the libraries that decide what the manifest holds."""
    h = xxhash.xxh3_128()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    for name in _LIBRARIES:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:  # e.g. a build without distribution metadata
            version = "unknown"
        h.update(f"{name}={version}\0".encode())
    return h.digest()


def fingerprint(params: ScanParams, specs: Sequence[DatasetSpec], listings: Sequence[Listing],
                controls: Sequence[Listing | None] = ()) -> str:
    """A hash of everything a scan's manifest and report are computed from, given that unchanged stat keys mean
    unchanged files (the stat cache's premise): the datasets' listings and their control directories'."""
    h = xxhash.xxh3_128(_code_and_libraries())
    h.update(json.dumps({"version": _VERSION, "params": to_dict(params)}, sort_keys=True).encode())
    missing = (0, 0, 0)
    tagged = [(f"dataset {spec.name}", lst) for spec, lst in zip(specs, listings)]
    tagged += [(f"control {spec.name}", lst) for spec, lst in zip(specs, controls) if lst is not None]
    for tag, listing in tagged:
        h.update(f"\0{tag} {len(listing.rels)} {listing.ignored_files}\0".encode())
        # relative paths (the listing skipped names that are not UTF-8), kinds, then the stat keys as arrays
        h.update("\0".join(listing.rels).encode("utf-8"))
        h.update("".join([k[0] for k in listing.kinds]).encode())
        stats = [s or missing for s in listing.stats]
        h.update(array("Q", [s[0] for s in stats]).tobytes())
        h.update(array("q", [s[1] for s in stats]).tobytes())
        h.update(array("Q", [s[2] for s in stats]).tobytes())
        h.update(json.dumps([sorted(listing.problems.items()), listing.warnings]).encode())
    return h.hexdigest()


class Snapshot:
    """The last successful scan's outputs next to the stat cache: `<cache>.last-manifest.parquet` (the manifest
    bytes) and `<cache>.last-scan.json` (fingerprint, manifest hash, report), the JSON written last."""

    def __init__(self, cache_path: Path) -> None:
        stem = cache_path.name.removesuffix(".parquet")
        self.manifest_path = cache_path.with_name(f"{stem}.last-manifest.parquet")
        self.record_path = cache_path.with_name(f"{stem}.last-scan.json")

    def load(self, fingerprint: str) -> tuple[bytes, dict[str, Any]] | None:
        """(manifest bytes, report without its 'run' part) of the last scan if its fingerprint is `fingerprint`
        and its files are intact; else None."""
        try:
            record = json.loads(self.record_path.read_text())
            if record.get("fingerprint") != fingerprint:
                return None
            data = self.manifest_path.read_bytes()
        except (OSError, ValueError):
            return None
        if hash_bytes(data) != record.get("manifest_hash") or not isinstance(record.get("report"), dict):
            return None
        return data, record["report"]

    def save(self, fingerprint: str, manifest: bytes, report: dict[str, Any]) -> None:
        """Record a successful scan's outputs (the report's 'run' part, timings and cache hits, is left out)."""
        write_bytes_atomic(self.manifest_path, manifest)
        write_json_atomic(self.record_path, {
            "fingerprint": fingerprint, "manifest_hash": hash_bytes(manifest),
            "report": {k: v for k, v in report.items() if k != "run"},
        })
