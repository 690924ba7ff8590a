"""`diffusion-pipe lineage A --diff B`: what differs between two lineage records, grouped by what changed.

One edited caption changes a dataset's caption hash, and with it the manifest, the encoded table, the store keys,
the LoRA, the losses and a dozen dvc.lock hashes. So differences are grouped: the root causes first (params,
data, captions, weights, code, environment), then what was derived from them (encodings, training, dvc.lock).
"""

from __future__ import annotations

from diffusion_pipe.config import flatten
from diffusion_pipe.lineage.show import format_value

ABSENT = "<absent>"
ROOT_GROUPS = ("params", "data", "captions", "weights", "code", "environment")
DERIVED_GROUPS = ("encodings", "training", "dvc.lock", "record")
CODE_PREFIXES = ("diffusion_pipe/", "stages/")


def _comparable(record: dict, other: dict) -> dict:
    """The record with each dvc.lock entry's deps and outs keyed by path instead of listed (a dep added to one
    stage shifts no other dep's dotted path), and an entry that `other` lacks as one summary value (one line,
    not one per hash), without the nested trained-LoRA record and the files list."""
    theirs = other.get("dvc_lock") or {}
    lock = {}
    for stage, entry in (record.get("dvc_lock") or {}).items():
        if stage not in theirs:
            lock[stage] = f"recorded ({len(entry.get('deps') or [])} deps, {len(entry.get('outs') or [])} outs)"
            continue
        lock[stage] = {k: ({d.get("path"): {f: v for f, v in d.items() if f != "path"} for d in value}
                           if k in ("deps", "outs") and isinstance(value, list) else value)
                       for k, value in entry.items()}
    out = {k: v for k, v in record.items() if k not in ("trained_lora", "files")}
    return {**out, "dvc_lock": lock} if "dvc_lock" in record else out


def diff_lineage(a: dict, b: dict) -> list[tuple[str, object, object]]:
    """(dotted path, value in a, value in b) of every leaf that differs; `<absent>` where one record lacks it.

    The nested record of the trained LoRA is left out: its differences show as the LoRA's own hash and the
    inputs, params and training values it shares with the export. dvc.lock deps and outs are keyed by path
    (`dvc_lock.scan.deps.data/manifest.parquet.md5`); a stage entry only one record holds is one value.
    """
    fa, fb = flatten(_comparable(a, b)), flatten(_comparable(b, a))
    return [(path, fa.get(path, ABSENT), fb.get(path, ABSENT)) for path in sorted(set(fa) | set(fb))
            if fa.get(path, ABSENT) != fb.get(path, ABSENT)]


def classify(path: str) -> str:
    """The group of a differing dotted path: a root cause (params, data, captions, weights, code, environment)
    or something derived from them (encodings, training, dvc.lock), else `record`. Pure."""
    head, _, rest = path.partition(".")
    if head == "params":
        return "params"
    if head == "inputs":
        kind, _, tail = rest.partition(".")
        if kind == "datasets":
            return "captions" if tail.endswith(".captions_xxh3") else "data"
        return "training" if kind == "lora" else "encodings"
    if head == "base_model":
        return "weights"
    if head == "git":
        return "code"
    if head == "environment":
        return "environment"
    if head == "training":
        return "training"
    if head in ("dvc_lock", "dvc_lock_omitted"):
        stage, _, tail = rest.partition(".")
        kind, _, dep = tail.partition(".")
        if kind == "cmd" or (kind == "deps" and dep.startswith(CODE_PREFIXES)):
            return "code"
        return "dvc.lock"
    return "record"


def group_diffs(diffs: list[tuple[str, object, object]]) -> dict[str, list[tuple[str, object, object]]]:
    """The differences by group, root causes first and derived values last, empty groups left out. Pure."""
    grouped: dict[str, list] = {g: [] for g in ROOT_GROUPS + DERIVED_GROUPS}
    for path, a, b in diffs:
        group = classify(path)
        if group == "code" and path.startswith("dvc_lock") and ABSENT in (a, b):
            group = "dvc.lock"  # a stage's entry that one record lacks is no code change
        grouped[group].append((path, a, b))
    return {g: rows for g, rows in grouped.items() if rows}


def format_diff(diffs: list[tuple[str, object, object]], a: str, b: str) -> str:
    """A count per group on one line, then each group's differences (`path: A -> B`), root causes first."""
    if not diffs:
        return f"{a} and {b}: lineage records are identical\n"
    grouped = group_diffs(diffs)
    roots = [f"{g} {len(rows)}" for g, rows in grouped.items() if g in ROOT_GROUPS]
    derived = [f"{g} {len(rows)}" for g, rows in grouped.items() if g in DERIVED_GROUPS]
    summary = "; ".join(part for part in (", ".join(roots), "derived: " + ", ".join(derived) if derived else "")
                        if part)
    lines = [f"--- {a}", f"+++ {b}", f"{len(diffs)} differences: {summary}"]
    for group, rows in grouped.items():
        lines.append("")
        lines.append(f"{group} ({len(rows)}{', derived' if group in DERIVED_GROUPS else ''})")
        lines += [f"  {path}: {format_value(x)} -> {format_value(y)}" for path, x, y in rows]
    return "\n".join(lines) + "\n"
