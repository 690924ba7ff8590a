"""`reports/scan.json`: counts of everything in the manifest, built by a pure function, plus a short summary.

Top level and per dataset: items, images, videos, ok, excluded, excluded_by_reason, missing_captions (items
whose .txt is absent or empty, whatever the policy did), caption_sources, split (ok items in train / eval),
buckets (ok items per bucket), video_windows (the windows ok videos train as), tag_orders (the distinct tag
orders ok captions train as, with shuffle_tags), samples_per_epoch (train items x buckets x windows x
repeats). Top level also:
excluded_examples (first paths per reason, with the error), excluded_first (the first excluded rows in manifest
order, each with its reason: what the summary names), duplicates (groups of identical files across all
datasets, extra copies, how many were excluded), ignored_files (neither media nor .txt), warnings, and `run`
(files probed vs reused from the cache, workers, seconds): the only part that differs between identical scans.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from diffusion_pipe.scan.manifest import DatasetSpec, Row

_EXAMPLES = 5  # paths listed per reason / duplicate group, enough to find the problem without a huge report


def _counts(rows: Sequence[Row]) -> dict[str, Any]:
    ok = [r for r in rows if r.status == "ok"]
    return {
        "items": len(rows),
        "images": sum(r.media == "image" for r in rows),
        "videos": sum(r.media == "video" for r in rows),
        "ok": len(ok),
        "excluded": len(rows) - len(ok),
        "excluded_by_reason": dict(sorted(Counter(r.reason for r in rows if r.status != "ok").items())),
        "missing_captions": sum(r.caption_missing for r in rows),
        "caption_sources": dict(sorted(Counter(r.caption_source for r in ok).items())),
        "split": {"train": sum(r.split == "train" for r in ok), "eval": sum(r.split == "eval" for r in ok)},
        "buckets": dict(sorted(Counter(b for r in ok for b in r.buckets).items())),
        # Windows the ok videos train as (scan.datasets[].frame_extraction; 1 a video unless `windows`).
        "video_windows": sum(len(r.frame_starts) for r in ok if r.media == "video"),
        "tag_orders": sum(len(r.caption_variants) for r in ok),  # scan.datasets[].shuffle_tags
        # Samples one epoch draws: each ok item once per bucket (and window) it trains at, times its repeats.
        "samples_per_epoch": sum(r.repeats * len(r.buckets) * len(r.frame_starts) for r in ok if r.split == "train"),
    }


def duplicate_groups(rows: Sequence[Row]) -> list[list[str]]:
    """Groups of 'dataset/path' with identical bytes (2+ members, sorted); empty files are not duplicates."""
    by_hash: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        if r.content_hash and r.size_bytes > 0:
            by_hash[r.content_hash].append(f"{r.dataset}/{r.path}")
    return sorted(sorted(g) for g in by_hash.values() if len(g) > 1)


def build_report(
    rows: Sequence[Row],
    specs: Sequence[DatasetSpec],
    ignored_files: dict[str, int],
    warnings: Sequence[str],
    run: dict[str, Any],
) -> dict[str, Any]:
    """Everything a user wants counted about a scan; `run` (timings, cache hits) is the only varying part."""
    report: dict[str, Any] = _counts(rows)
    examples: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        if r.status != "ok" and len(examples[r.reason]) < _EXAMPLES:
            examples[r.reason].append(f"{r.dataset}/{r.path}" + (f" ({r.detail})" if r.detail else ""))
    report["excluded_examples"] = dict(sorted(examples.items()))
    report["excluded_first"] = [{"path": f"{r.dataset}/{r.path}", "reason": r.reason, "detail": r.detail}
                                for r in [r for r in rows if r.status != "ok"][:_EXAMPLES]]
    groups = duplicate_groups(rows)
    report["duplicates"] = {
        "groups": len(groups),
        "extra_copies": sum(len(g) - 1 for g in groups),
        "excluded": sum(r.reason == "duplicate" for r in rows),
        "examples": groups[:_EXAMPLES],
    }
    report["datasets"] = {}
    all_warnings = list(warnings)
    for spec in specs:
        ds_rows = [r for r in rows if r.dataset == spec.name]
        counts = _counts(ds_rows)
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
    why data was dropped shows at once, and where the rest are listed."""
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
    return lines
