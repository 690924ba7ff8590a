"""Scan: dataset directories -> `data/manifest.parquet` (one row per media item) + `reports/scan.json`.

Entry point: `scan_to_files(params, manifest_path, report_path, cache_path)`. Modules: `files` (walking a
dataset), `media` (hashing and decoding one file), `captions`, `buckets` (pure bucket assignment), `manifest`
(rows, schema, deterministic parquet), `report`, `cache` (the private stat cache), `scanner` (the orchestration
and the process pool). Importing this package is cheap (the params validation imports `buckets`); pyarrow,
Pillow and PyAV load on the first scan.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffusion_pipe.scan.errors import ScanError

if TYPE_CHECKING:
    from diffusion_pipe.params import ScanParams
    from diffusion_pipe.scan.manifest import Row

__all__ = ["ScanError", "scan_datasets", "scan_to_files"]


def scan_to_files(params: ScanParams, manifest_path: Path, report_path: Path, cache_path: Path | None) -> dict:
    """Scan every dataset of params; write the manifest parquet and reports JSON atomically; return the report dict."""
    from diffusion_pipe.scan.scanner import scan_to_files as run

    return run(params, manifest_path, report_path, cache_path)


def scan_datasets(
    params: ScanParams, cache_path: Path | None, progress: bool = True
) -> tuple[list[Row], dict[str, Any]]:
    """Scan without writing the manifest or report: (rows sorted by dataset and path, report dict)."""
    from diffusion_pipe.scan.scanner import scan_datasets as run

    return run(params, cache_path, progress)
