"""The scan: list every dataset, probe what changed (in a process pool), build rows, write manifest and report."""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from diffusion_pipe.config import ConfigError
from diffusion_pipe.fileio import write_bytes_atomic, write_json_atomic
from diffusion_pipe.params import ScanParams
from diffusion_pipe.scan.buckets import bucket_layout, rounding_note
from diffusion_pipe.scan.cache import ENVIRONMENT_REASONS, CacheEntry, CacheKey, load_cache, save_cache
from diffusion_pipe.scan.captions import CaptionRead
from diffusion_pipe.scan.errors import ScanError
from diffusion_pipe.scan.files import Listing, list_dataset
from diffusion_pipe.scan.manifest import DatasetSpec, Row, build_rows, manifest_bytes
from diffusion_pipe.scan.media import IMAGE_EXTS, VIDEO_EXTS, Probe, Task, probe_batch
from diffusion_pipe.scan.report import build_report, summary_lines
from diffusion_pipe.scan.snapshot import Snapshot, fingerprint

_MAX_BATCH = 256  # files per pool task: large enough to amortise IPC, small enough to balance the cores
_SHOWN = 5  # paths named in a ScanError


def resolve_datasets(params: ScanParams) -> list[DatasetSpec]:
    """Check every dataset directory exists and names are unique; compute each one's bucket layouts."""
    specs: list[DatasetSpec] = []
    seen: dict[str, int] = {}
    for i, ds in enumerate(params.datasets):
        where = f"scan.datasets[{i}]"
        name = ds.manifest_name
        if name in seen:
            raise ConfigError(
                f"{where}: dataset name {name!r} is already used by scan.datasets[{seen[name]}]; "
                f"set a distinct `name` for one of them"
            )
        seen[name] = i
        if not os.path.isdir(ds.path):
            raise ConfigError(f"{where}.path: {ds.path!r} is not a directory (paths are relative to {os.getcwd()})")
        if ds.control:
            _check_control_dir(ds.path, ds.control, where)
        if ds.caption_extension.lower() in (*IMAGE_EXTS, *VIDEO_EXTS):
            raise ConfigError(f"{where}.caption_extension: {ds.caption_extension!r} is a media extension; captions "
                              "need one of their own, such as '.txt' or '.caption'")
        layouts = tuple(
            bucket_layout(res, params.bucket_step, params.min_aspect, params.max_aspect) for res in ds.resolutions
        )
        specs.append(DatasetSpec(name=name, root=ds.path, params=ds, layouts=layouts, control_root=ds.control))
    return specs


def _check_control_dir(path: str, control: str, where: str) -> None:
    """A control directory exists and lies outside its dataset directory (else its images would be items too)."""
    if not os.path.isdir(control):
        raise ConfigError(f"{where}.control: {control!r} is not a directory (paths are relative to {os.getcwd()})")
    root, real = os.path.realpath(path), os.path.realpath(control)
    if os.path.commonpath([root, real]) in (root, real):
        raise ConfigError(f"{where}.control: {control!r} and the dataset directory {path!r} contain one another; "
                          "keep the control images in a directory beside the dataset's, e.g. data/edits and "
                          "data/edits-control")


def _workers(params: ScanParams) -> int:
    return params.workers or os.cpu_count() or 1


def _limits(params: ScanParams) -> dict[str, int]:
    """The scan params that decide a probe's result: the stat cache is valid only under the same ones."""
    return {"max_image_pixels": params.image_pixel_limit, "max_caption_bytes": params.max_caption_bytes}


def probe_all(tasks: Sequence[Task], workers: int, max_image_pixels: int, progress: bool,
              max_caption_bytes: int | None = None) -> list[Probe | CaptionRead]:
    """Probe `tasks` (in order) across `workers` processes, with a progress bar on stderr."""
    from tqdm import tqdm

    if not tasks:
        return []
    size = max(1, min(_MAX_BATCH, math.ceil(len(tasks) / (workers * 8))))
    batches = [list(tasks[i:i + size]) for i in range(0, len(tasks), size)]
    results: list[list[Probe | CaptionRead]] = [[] for _ in batches]
    if workers == 1 or len(batches) == 1:
        with tqdm(total=len(tasks), desc="scan: probing", unit="file", file=sys.stderr, disable=not progress,
                  mininterval=0.5) as bar:
            for i, batch in enumerate(batches):
                results[i] = probe_batch(batch, max_image_pixels, max_caption_bytes)
                bar.update(len(batch))
        return [r for batch in results for r in batch]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        # Submit everything before the progress bar starts its monitor thread: workers fork from a quiet process.
        futures = {pool.submit(probe_batch, batch, max_image_pixels, max_caption_bytes): i
                   for i, batch in enumerate(batches)}
        with tqdm(total=len(tasks), desc="scan: probing", unit="file", file=sys.stderr, disable=not progress,
                  mininterval=0.5) as bar:
            for fut in as_completed(futures):
                i = futures[fut]
                results[i] = fut.result()
                bar.update(len(batches[i]))
    return [r for batch in results for r in batch]


def scan_datasets(
    params: ScanParams, cache_path: Path | None, progress: bool = True
) -> tuple[list[Row], dict[str, Any]]:
    """Scan every dataset: the manifest rows (sorted by dataset, path) and the report dict.

    Only files whose (size, mtime_ns, inode) differ from the cache at `cache_path` are hashed and decoded; the
    cache is rewritten (even when a ScanError follows, so the rescan after a fix is fast).
    Raises ConfigError for bad dataset params and ScanError for missing captions under policy 'error'.
    """
    start = time.perf_counter()
    specs, listings, controls = _list_datasets(params)
    return _scan_listed(params, specs, listings, controls, cache_path, progress, start)


def _list_datasets(params: ScanParams) -> tuple[list[DatasetSpec], list[Listing], list[Listing | None]]:
    """Every dataset's spec (params checked), listing (the walk) and its control directory's listing (or None)."""
    specs = resolve_datasets(params)
    return (specs, [list_dataset(spec.root, spec.params.follow_outside_links, spec.params.caption_extension)
                    for spec in specs],
            [list_dataset(spec.control_root, spec.params.follow_outside_links) if spec.control_root else None
             for spec in specs])


# The cache kind of a control directory's media files: their own keys, as a control image may share its relative
# path with a media file of the dataset.
_CONTROL = "control"


def _probe_entries(spec: DatasetSpec, listing: Listing, control: Listing | None):
    """(cache key, entry) of every stat'ed file of a dataset and of its control directory's images."""
    for e in listing.entries:
        if e.stat_key is not None:
            yield (spec.name, e.rel, e.kind), e
    for e in control.entries if control is not None else ():
        if e.stat_key is not None and e.kind == "media":
            yield (spec.name, e.rel, _CONTROL), e


def _scan_listed(params: ScanParams, specs: list[DatasetSpec], listings: list[Listing],
                 controls: list[Listing | None], cache_path: Path | None, progress: bool,
                 start: float) -> tuple[list[Row], dict[str, Any]]:
    cache = load_cache(cache_path, _limits(params))

    known: dict[CacheKey, CacheEntry] = {}
    todo: list[tuple[CacheKey, Task]] = []
    stat_keys = {}
    for spec, listing, control in zip(specs, listings, controls):
        for key, e in _probe_entries(spec, listing, control):
            stat_keys[key] = e.stat_key
            hit = cache.get(key)
            if hit is not None and hit[0] == e.stat_key:
                known[key] = hit
            else:
                todo.append((key, Task("media" if e.kind == "media" else "caption", e.path)))
    cached = len(known)
    workers = _workers(params)
    probed = probe_all([t for _, t in todo], workers, params.image_pixel_limit, progress, params.max_caption_bytes)
    for (key, _), result in zip(todo, probed):
        stat_key = stat_keys[key]
        assert stat_key is not None
        known[key] = (stat_key, result)
    if cache_path is not None and (todo or known.keys() != cache.keys()):
        # Rewritten only when something changed: an unchanged rescan of 100k files writes nothing.
        save_cache(cache_path, known, _limits(params))

    by_dataset: dict[str, dict[str, Probe | CaptionRead]] = {spec.name: {} for spec in specs}
    control_probes: dict[str, dict[str, Probe]] = {spec.name: {} for spec in specs}
    for (name, rel, kind), (_, result) in known.items():
        if kind == _CONTROL:
            assert isinstance(result, Probe), rel
            control_probes[name][rel] = result
        else:
            by_dataset[name][rel] = result
    rows: list[Row] = []
    for spec, listing, control in zip(specs, listings, controls):
        rows.extend(build_rows(spec, listing.entries, by_dataset[spec.name],
                               control.entries if control is not None else (), control_probes[spec.name]))
    rows.sort(key=lambda r: (r.dataset, r.path))
    _check_captions(rows, specs)

    warnings = [f"dataset {spec.name}: {w}" for spec, lst in zip(specs, listings) for w in lst.warnings]
    warnings += [f"dataset {spec.name} control: {w}" for spec, lst in zip(specs, controls) if lst is not None
                 for w in lst.warnings]
    warnings += [f"dataset {spec.name}: {note}" for spec in specs
                 for res, layout in zip(spec.params.resolutions, spec.layouts)
                 if (note := rounding_note(res, params.bucket_step, layout))]
    run = {"files_probed": len(todo), "files_cached": cached, "workers": workers, "reused_last_scan": False,
           "seconds": round(time.perf_counter() - start, 3)}
    ignored = {spec.name: lst.ignored_files for spec, lst in zip(specs, listings)}
    return rows, build_report(rows, specs, ignored, warnings, run)


def _check_captions(rows: Sequence[Row], specs: Sequence[DatasetSpec]) -> None:
    """Raise one ScanError for every dataset with caption_policy 'error' that has items without a caption."""
    problems = []
    for i, spec in enumerate(specs):
        if spec.params.caption_policy != "error":
            continue
        missing = [r.path for r in rows if r.dataset == spec.name and r.reason == "missing_caption"]
        if missing:
            shown = ", ".join(missing[:_SHOWN]) + (", ..." if len(missing) > _SHOWN else "")
            problems.append(
                f"dataset {spec.name!r} ({spec.root}): {len(missing)} item(s) have no caption (no "
                f"{spec.params.caption_extension} beside them, or an empty one): {shown}. Write a "
                f"{spec.params.caption_extension} with the same base name for each, or set "
                f"caption_policy to 'default' (with default_caption) or 'skip' in params.yaml scan.datasets[{i}]"
            )
    if problems:
        raise ScanError("\n".join(problems))


def scan_to_files(params: ScanParams, manifest_path: Path, report_path: Path, cache_path: Path | None) -> dict:
    """Scan every dataset of params; write the manifest parquet and reports JSON atomically; return the report dict.

    With a `cache_path`, a rescan in which no file's stat key (and no param) changed since the last successful
    scan reuses that scan's manifest bytes and report (see `snapshot.py`) after the walk; otherwise only the
    files whose stat key changed are probed."""
    start = time.perf_counter()
    specs, listings, controls = _list_datasets(params)
    snapshot = Snapshot(cache_path) if cache_path is not None else None
    key = fingerprint(params, specs, listings, controls) if snapshot is not None else ""
    last = snapshot.load(key) if snapshot is not None else None
    if last is not None:
        data, report = last
        files = sum(len(lst.stats) - len(lst.problems) for lst in [*listings, *controls] if lst is not None)
        report["run"] = {"files_probed": 0, "files_cached": files, "workers": _workers(params),
                         "reused_last_scan": True, "seconds": round(time.perf_counter() - start, 3)}
    else:
        rows, report = _scan_listed(params, specs, listings, controls, cache_path, True, start)
        data = manifest_bytes(rows)
        if snapshot is not None and not any(r.reason in ENVIRONMENT_REASONS for r in rows):
            snapshot.save(key, data, report)
    write_bytes_atomic(manifest_path, data)
    write_json_atomic(report_path, report)
    for line in summary_lines(report, str(manifest_path), str(report_path)):
        print(line, file=sys.stderr)
    return report
