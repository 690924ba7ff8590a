"""`reports/scan.json`: counts of everything in the manifest, built by a pure function, plus a short summary.

Top level and per dataset: items, images, videos, ok, excluded, excluded_by_reason, missing_captions (items
whose .txt is absent or empty, whatever the policy did), caption_sources, split (ok items in train / eval),
buckets (ok items per bucket), video_windows (the windows ok videos train as), tag_orders (the distinct tag
orders ok captions train as, with shuffle_tags), masked (ok items with a loss mask), samples_per_epoch (train
items x buckets x windows x repeats). Top level also:
excluded_examples (first paths per reason, with the error), excluded_first (the first excluded rows in manifest
order, each with its reason: what the summary names), duplicates (groups of identical files across all
datasets, extra copies, how many were excluded), ignored_files (neither media nor .txt), warnings, and `run`
(files probed vs reused from the cache, workers, seconds): the only part that differs between identical scans.

What the scan prints goes through `printable`: a file name may hold a newline or an ESC sequence, which printed
raw would forge lines of the summary or drive the terminal. In the JSON report, JSON escapes the C0 controls
(newline, ESC); DEL and C1 characters of a file name stay as they are there (a caption can't hold them).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from diffusion_pipe.errors import printable  # noqa: F401  (the scan prints through it)
from diffusion_pipe.scan.manifest import DatasetSpec

_EXAMPLES = 5  # paths listed per reason / duplicate group, enough to find the problem without a huge report


def _tally(values: pa.ChunkedArray | pa.Array) -> dict[str, int]:
    """{value: count}, sorted by value."""
    counts = pc.value_counts(values)
    return dict(sorted(zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist())))


def _sum(values) -> int:
    return int(pc.sum(values).as_py() or 0)


def _counts(rows: pa.Table) -> dict[str, Any]:
    """The counts of a final rows table (manifest.ROWS_SCHEMA, after `mark_duplicates`), computed on its columns."""
    rows = rows.select(["media", "status", "reason", "caption_missing", "caption_source", "split", "buckets",
                        "frame_starts", "caption_variants", "repeats", "mask_hash"])
    is_ok = pc.equal(rows["status"], "ok")
    ok = rows.filter(is_ok)
    ok_videos = ok.filter(pc.equal(ok["media"], "video"))
    ok_train = ok.filter(pc.equal(ok["split"], "train"))
    windows = pc.list_value_length(ok_train["frame_starts"])
    return {
        "items": rows.num_rows,
        "images": _sum(pc.equal(rows["media"], "image")),
        "videos": _sum(pc.equal(rows["media"], "video")),
        "ok": ok.num_rows,
        "excluded": rows.num_rows - ok.num_rows,
        "excluded_by_reason": _tally(rows["reason"].filter(pc.invert(is_ok))),
        "missing_captions": _sum(rows["caption_missing"]),
        "caption_sources": _tally(ok["caption_source"]),
        "split": {"train": ok_train.num_rows, "eval": ok.num_rows - ok_train.num_rows},
        "buckets": _tally(pc.list_flatten(ok["buckets"])),
        # Windows the ok videos train as (scan.datasets[].frame_extraction; 1 a video unless `windows`).
        "video_windows": _sum(pc.list_value_length(ok_videos["frame_starts"])),
        "tag_orders": _sum(pc.list_value_length(ok["caption_variants"])),  # scan.datasets[].shuffle_tags
        "masked": _sum(pc.not_equal(ok["mask_hash"], "")),  # ok items with a loss mask (`<name>.mask.png`)
        # Samples one epoch draws: each ok item once per bucket (and window) it trains at, times its repeats.
        "samples_per_epoch": _sum(pc.multiply(pc.multiply(ok_train["repeats"].cast(pa.int64()),
                                                          pc.list_value_length(ok_train["buckets"])), windows)),
    }


def duplicate_groups(rows: pa.Table) -> list[list[str]]:
    """Groups of 'dataset/path' with identical bytes (2+ members, sorted); empty files are not duplicates."""
    hashed = rows.filter(pc.and_(pc.not_equal(rows["content_hash"], ""), pc.greater(rows["size_bytes"], 0)))
    counts = pc.value_counts(hashed["content_hash"])
    repeated = counts.field("values").filter(pc.greater(counts.field("counts"), 1))
    by_hash: dict[str, list[str]] = defaultdict(list)
    copies = hashed.filter(pc.is_in(hashed["content_hash"], value_set=repeated))
    for h, dataset, path in zip(*(copies[n].to_pylist() for n in ("content_hash", "dataset", "path"))):
        by_hash[h].append(f"{dataset}/{path}")
    return sorted(sorted(g) for g in by_hash.values())


def build_report(
    rows: pa.Table,
    specs: Sequence[DatasetSpec],
    ignored_files: dict[str, int],
    warnings: Sequence[str],
    run: dict[str, Any],
) -> dict[str, Any]:
    """Everything a user wants counted about a scan of final rows (manifest order, duplicates marked); `run`
    (timings, cache hits) is the only varying part."""
    report: dict[str, Any] = _counts(rows)
    counted = tuple(report)
    excluded = rows.filter(pc.not_equal(rows["status"], "ok"))
    examples: dict[str, list[str]] = defaultdict(list)
    first = []
    for dataset, path, reason, detail in zip(*(excluded[n].to_pylist() for n in ("dataset", "path", "reason",
                                                                                  "detail"))):
        if len(examples[reason]) < _EXAMPLES:
            examples[reason].append(f"{dataset}/{path}" + (f" ({detail})" if detail else ""))
        if len(first) < _EXAMPLES:
            first.append({"path": f"{dataset}/{path}", "reason": reason, "detail": detail})
    report["excluded_examples"] = dict(sorted(examples.items()))
    report["excluded_first"] = first
    groups = duplicate_groups(rows)
    report["duplicates"] = {
        "groups": len(groups),
        "extra_copies": sum(len(g) - 1 for g in groups),
        "excluded": _sum(pc.equal(rows["reason"], "duplicate")),
        "examples": groups[:_EXAMPLES],
    }
    report["datasets"] = {}
    all_warnings = list(warnings)
    for spec in specs:
        # one dataset: its counts are the top level's
        counts = dict(report) if len(specs) == 1 else _counts(rows.filter(pc.equal(rows["dataset"], spec.name)))
        counts = {k: counts[k] for k in counted}
        counts.update(path=spec.params.path, repeats=spec.params.repeats, eval_fraction=spec.params.eval_fraction,
                      loss_weight=spec.params.loss_weight, ignored_files=ignored_files.get(spec.name, 0))
        report["datasets"][spec.name] = counts
        if spec.params.eval_fraction > 0 and counts["ok"] and counts["split"]["eval"] == 0:
            all_warnings.append(
                f"dataset {spec.name}: eval_fraction is {spec.params.eval_fraction} but no item landed in eval "
                f"({counts['ok']} ok items); raise eval_fraction or add items"
            )
        if spec.params.shuffle_tags and counts["ok"] and counts["tag_orders"] == counts["ok"]:
            all_warnings.append(
                f"dataset {spec.name}: shuffle_tags is {spec.params.shuffle_tags}, but no caption has more than "
                f"keep_tags ({spec.params.keep_tags}) + 1 tags separated by {spec.params.tag_separator!r}, so every "
                "caption trains in one order; check tag_separator"
            )
    report["ignored_files"] = sum(ignored_files.values())
    report["warnings"] = all_warnings
    report["run"] = run
    return report


def summary_lines(report: dict[str, Any], manifest_path: str, report_path: str = "reports/scan.json") -> list[str]:
    """A few human-readable lines for stderr: the counts, then the first excluded files with their reasons, so
    why data was dropped shows at once, and where the rest are listed. Each line is `printable`."""
    reasons = ", ".join(f"{k} {v}" for k, v in report["excluded_by_reason"].items())
    run = report["run"]
    lines = [
        f"scan: {report['items']} items ({report['images']} images, {report['videos']} videos) in "
        f"{len(report['datasets'])} dataset(s): {report['ok']} ok, {report['excluded']} excluded"
        + (f" ({reasons})" if reasons else ""),
        f"scan: {report['split']['train']} train / {report['split']['eval']} eval, "
        f"{len(report['buckets'])} bucket(s), {report['duplicates']['groups']} duplicate group(s), "
        f"{report['missing_captions']} missing caption(s)"
        + (f", {report['video_windows']} video windows" if report["video_windows"] > report["videos"] else ""),
        f"scan: probed {run['files_probed']} file(s), reused {run['files_cached']} from the cache, "
        f"{run['seconds']:.1f} s -> {manifest_path}",
    ]
    first = report.get("excluded_first", [])
    lines += [f"scan: excluded {e['path']}: {e['reason']}" + (f" ({e['detail']})" if e["detail"] else "")
              for e in first]
    if report["excluded"] > len(first):
        lines.append(f"scan: ... and {report['excluded'] - len(first)} more excluded; every one is a row of "
                     f"{manifest_path} with status 'excluded' and its reason, the first {_EXAMPLES} per reason "
                     f"are in {report_path} (excluded_examples)")
    lines += [f"scan: warning: {w}" for w in report["warnings"]]
    return [printable(line) for line in lines]  # names and details come from the files: one line each
