"""Scan: dataset directories -> `data/manifest.parquet` (one row per media item) + `reports/scan.json`.

Entry point: `scan_to_files(params, manifest_path, report_path, cache_path)`. Modules: `files` (walking a
dataset), `media` (hashing and decoding one file), `captions`, `buckets` (pure bucket assignment), `manifest`
(rows, schema, deterministic parquet), `report`, `cache` (the private stat cache), `scanner` (the orchestration
and the process pool).
"""

from diffusion_pipe.scan.scanner import ScanError, scan_datasets, scan_to_files

__all__ = ["ScanError", "scan_datasets", "scan_to_files"]
