"""The last scan's manifest and report, reused whole when nothing the scan reads has changed.

A rescan has to walk and stat every file to know that nothing changed; everything after that (loading the stat
cache, building a row per item, writing the parquet) is the same work with the same result. The fingerprint
covers all of its inputs: the scan params, every listed file's relative path and stat key (size, mtime_ns,
inode), what could not be read, the scan code itself and the versions of the libraries whose output lands in
the manifest (Pillow and PyAV decode, pyarrow writes the bytes). When it matches the last successful scan's, the
saved manifest bytes are the answer. When only some files changed, the saved rows (before duplicates are
marked) are the starting point that the scanner patches, provided they were made under the same `inputs_key`
from the listing the stat cache now holds. Like the stat cache, this lives outside DVC and is only an
optimisation: a missing, damaged or mismatched snapshot means a full rescan.
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


def inputs_key(params: ScanParams) -> str:
    """A hash of what every row is computed with besides the files: the scan params, the scan code and the
    libraries' versions. Rows of a scan under the same key may be reused for files that did not change."""
    h = xxhash.xxh3_128(_code_and_libraries())
    h.update(json.dumps({"version": _VERSION, "params": to_dict(params)}, sort_keys=True).encode())
    return h.hexdigest()


def fingerprint(params: ScanParams, specs: Sequence[DatasetSpec], listings: Sequence[Listing],
                controls: Sequence[Listing | None] = ()) -> str:
    """A hash of everything a scan's manifest and report are computed from, given that unchanged stat keys mean
    unchanged files (the stat cache's premise): `inputs_key`, the datasets' listings and their control
    directories'."""
    h = xxhash.xxh3_128(inputs_key(params).encode())
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
    bytes), `<cache>.last-rows.parquet` (its rows before duplicates are marked: manifest.ROWS_SCHEMA) and
    `<cache>.last-scan.json` (fingerprint, inputs key, the stat cache's digest, hashes of both files, report),
    the JSON written last."""

    def __init__(self, cache_path: Path) -> None:
        stem = cache_path.name.removesuffix(".parquet")
        self.manifest_path = cache_path.with_name(f"{stem}.last-manifest.parquet")
        self.rows_path = cache_path.with_name(f"{stem}.last-rows.parquet")
        self.record_path = cache_path.with_name(f"{stem}.last-scan.json")

    def _record(self) -> dict[str, Any]:
        try:
            record = json.loads(self.record_path.read_text())
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def load(self, fingerprint: str) -> tuple[bytes, dict[str, Any]] | None:
        """(manifest bytes, report without its 'run' part) of the last scan if its fingerprint is `fingerprint`
        and its files are intact; else None."""
        record = self._record()
        if record.get("fingerprint") != fingerprint:
            return None
        try:
            data = self.manifest_path.read_bytes()
        except OSError:
            return None
        if hash_bytes(data) != record.get("manifest_hash") or not isinstance(record.get("report"), dict):
            return None
        return data, record["report"]

    def rows(self, inputs: str, cache_digest: str):
        """The last scan's rows table (pyarrow) if it was made under `inputs` (inputs_key) from the listing the stat
        cache with `cache_digest` holds, so that the files whose stat key differs from the cache's are exactly
        those changed since; else None."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        from diffusion_pipe.scan.manifest import ROWS_SCHEMA

        record = self._record()
        if not cache_digest or record.get("inputs") != inputs or record.get("cache_digest") != cache_digest:
            return None
        try:
            data = self.rows_path.read_bytes()
            if hash_bytes(data) != record.get("rows_hash"):
                return None
            table = pq.ParquetFile(pa.BufferReader(data)).read()
        except Exception:  # noqa: BLE001 - a damaged snapshot means a full rescan, never an error
            return None
        return table if table.schema == ROWS_SCHEMA else None

    def save(self, fingerprint: str, inputs: str, cache_digest: str, manifest: bytes, table,
             report: dict[str, Any]) -> None:
        """Record a successful scan's outputs: manifest bytes, its rows `table` before duplicates are marked, the
        report (its 'run' part, timings and cache hits, is left out)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        from diffusion_pipe.scan.cache import PRIVATE_PARQUET

        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, **PRIVATE_PARQUET)
        rows = sink.getvalue().to_pybytes()
        write_bytes_atomic(self.manifest_path, manifest)
        write_bytes_atomic(self.rows_path, rows)
        write_json_atomic(self.record_path, {
            "fingerprint": fingerprint, "inputs": inputs, "cache_digest": cache_digest,
            "manifest_hash": hash_bytes(manifest), "rows_hash": hash_bytes(rows),
            "report": {k: v for k, v in report.items() if k != "run"},
        })
