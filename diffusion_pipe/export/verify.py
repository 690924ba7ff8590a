"""Reading lineage records: print one readably, verify one against a repository and the store, diff two."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from diffusion_pipe.export.lineage import (
    STORE_FAMILIES,
    base_weights,
    encoded_store_keys,
    read_lineage,
    store_keys_record,
)
from diffusion_pipe.hashing import hash_file

# Shown by name in the readable form; the whole environment is in the record (`--json`).
KEY_PACKAGES = ("diffusers", "transformers", "peft", "deepspeed", "safetensors", "dvc", "diffusion-pipe")
MAX_KEYS_SHOWN = 10


@dataclass(frozen=True)
class Check:
    """One item of `--verify`: what was checked, whether it matches the record, and what differs."""

    item: str
    ok: bool
    detail: str = ""


def _short(digest: str | None) -> str:
    return digest[:12] if digest else "none"


def _check_file(repo: Path, what: str, recorded: dict | None, fix: str) -> Check | None:
    if recorded is None:
        return None
    path = repo / recorded["path"]
    item = f"{what} {recorded['path']}"
    if not path.is_file():
        return Check(item, False, f"{path} is missing; {fix}")
    actual = hash_file(path)
    if actual != recorded["xxh3_128"]:
        return Check(item, False, f"{path} hashes to {_short(actual)}, the lineage records "
                                  f"{_short(recorded['xxh3_128'])}: it changed since; {fix}")
    return Check(item, True)


def _check_base_model(record: dict, repo: Path) -> list[Check]:
    from diffusion_pipe.models.common import resolve_model_dir

    base = record["base_model"]
    local = repo / base["path"]
    try:
        directory = local.resolve() if local.is_dir() else resolve_model_dir(base["path"])
    except FileNotFoundError as exc:
        return [Check(f"base model {base['path']}", False, str(exc))]
    try:
        actual = base_weights(directory)
    except (FileNotFoundError, NotADirectoryError) as exc:
        return [Check(f"base model {base['path']}", False, str(exc))]
    checks = []
    for component, recorded in sorted(base["weights"].items()):
        item = f"base model component '{component}'"
        got = actual.get(component)
        if got is None:
            checks.append(Check(item, False, f"{directory / component} has no weights; restore it"))
        elif got != recorded:
            checks.append(Check(item, False, f"{directory / component}: weights hash {_short(got)}, the lineage "
                                             f"records {_short(recorded)}: the base weights were swapped or "
                                             "changed; point model.path at the weights this LoRA was trained on"))
        else:
            checks.append(Check(item, True))
    return checks


def _check_store(keys: dict[str, list[str]], store) -> list[Check]:
    from diffusion_pipe.store.pack import check_pack

    checks = []
    for family in STORE_FAMILIES:
        wanted = keys[family]
        missing = store.missing(family, wanted)
        item = f"store {family} entries"
        if missing:
            shown = ", ".join(missing[:MAX_KEYS_SHOWN]) + (" ..." if len(missing) > MAX_KEYS_SHOWN else "")
            checks.append(Check(item, False, f"{len(missing)} of {len(wanted)} {family} entries trained on are "
                                             f"missing from the store at {store.root / family}: {shown}; re-run "
                                             "`dvc repro encode` (or pull the store from its remote)"))
            continue
        wanted_set, bad = set(wanted), []
        for pack_id, sidecar in sorted(store.packs(family).items()):
            held = wanted_set.intersection(sidecar.entries)
            if held:
                reason = check_pack(store.pack_path(family, pack_id), sidecar, full_hash=True)
                if reason is not None:
                    bad.append(f"pack {pack_id} ({len(held)} of the entries): {reason}")
        if bad:
            checks.append(Check(item, False, "; ".join(bad) + "; quarantine them (Store.verify()) and re-run `dvc repro encode`"))
        else:
            checks.append(Check(item, True, f"{len(wanted)} present and intact"))
    return checks


def verify_lineage(record: dict, repo: Path, store=None, lineage_dir: Path | None = None) -> list[Check]:
    """Check a lineage record against the repository and the store, item by item.

    The manifest, encoded table and trained LoRA are re-hashed at their recorded paths under `repo`; the store
    keys of the repository's encoded table are hashed and each looked up in `store` (default
    `Store.default()`), its packs fully re-hashed (nothing is quarantined); the base model's components are
    re-hashed. With `lineage_dir` (where a lineage.json lies), the exported files it lists are re-hashed too.
    """
    from diffusion_pipe.store import Store

    repo = Path(repo)
    inputs = record.get("inputs", {})
    fix = "re-run `dvc repro` to retrain on the current state, or check out the commit the lineage records"
    checks = [c for c in (_check_file(repo, "manifest", inputs.get("manifest"), fix),
                          _check_file(repo, "encoded table", inputs.get("encoded"), fix),
                          _check_file(repo, "trained LoRA", inputs.get("lora"), fix)) if c is not None]
    encoded = inputs.get("encoded")
    if encoded is not None and (repo / encoded["path"]).is_file():
        keys = encoded_store_keys(repo / encoded["path"])
        got = store_keys_record(keys)["xxh3_128"]
        want = inputs["store_keys"]["xxh3_128"]
        checks.append(Check("store key set", got == want, "" if got == want else
                            f"the keys of {encoded['path']} hash to {_short(got)}, the lineage records "
                            f"{_short(want)}: the table points at other store entries now"))
        checks += _check_store(keys, store if store is not None else Store.default())
    checks += _check_base_model(record, repo)
    for name, digest in sorted(record.get("files", {}).items()) if lineage_dir is not None else ():
        path = lineage_dir / name
        actual = hash_file(path) if path.is_file() else None
        checks.append(Check(f"exported file {name}", actual == digest, "" if actual == digest else
                            (f"{path} is missing" if actual is None else
                             f"{path} hashes to {_short(actual)}, the lineage records {_short(digest)}: it was "
                             "modified after export; re-run `dvc repro export`")))
    return checks


def flatten(obj: object, prefix: str = "") -> dict[str, object]:
    """Dotted paths to leaf values: {"params": {"train": {"seed": 0}}} -> {"params.train.seed": 0}. Items of a
    list of mappings or lists are indexed as `[i]`; a list of plain values is one leaf."""
    if isinstance(obj, dict) and obj:
        out: dict[str, object] = {}
        for key in sorted(obj):
            out.update(flatten(obj[key], f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        out = {}
        for i, value in enumerate(obj):
            out.update(flatten(value, f"{prefix}[{i}]"))
        return out
    return {prefix: obj}


def diff_lineage(a: dict, b: dict) -> list[tuple[str, object, object]]:
    """(dotted path, value in a, value in b) of every leaf that differs; `<absent>` where one record lacks it.

    The nested record of the trained LoRA is left out: its differences show as the LoRA's own hash and the
    inputs, params and training values it shares with the export.
    """
    absent = "<absent>"
    fa = flatten({k: v for k, v in a.items() if k not in ("trained_lora", "files")})
    fb = flatten({k: v for k, v in b.items() if k not in ("trained_lora", "files")})
    return [(path, fa.get(path, absent), fb.get(path, absent)) for path in sorted(set(fa) | set(fb))
            if fa.get(path, absent) != fb.get(path, absent)]


def _value(v: object) -> str:
    return v if isinstance(v, str) and v else json.dumps(v)


def format_lineage(record: dict) -> str:
    """The record as readable sections (not a JSON dump; `--json` gives that)."""
    lines: list[str] = []

    def section(title: str, rows: list[tuple[str, object]]) -> None:
        lines.append(title)
        width = max((len(k) for k, _ in rows), default=0)
        lines.extend(f"  {k.ljust(width)}  {_value(v)}" for k, v in rows)
        lines.append("")

    base, training, inputs = record.get("base_model", {}), record.get("training", {}), record.get("inputs", {})
    git, env = record.get("git", {}), record.get("environment", {})
    lines.append(f"diffusion-pipe lineage (version {record.get('lineage_version')}, {record.get('kind', '?')})")
    lines.append("")
    section("Base model", [("family", base.get("family")), ("path", base.get("path")), ("dtype", base.get("dtype")),
                           *((f"{c} weights", _short(h)) for c, h in sorted(base.get("weights", {}).items()))])
    order = ("run_id", "seed", "steps", "train_loss_last", "train_loss_last10", "eval_loss_start", "eval_loss_end")
    section("Training", [(k.replace("_", " "), training[k]) for k in sorted(training, key=lambda k: (
        order.index(k) if k in order else len(order), k))])
    rows: list[tuple[str, object]] = []
    for name in ("manifest", "encoded", "lora"):
        if inputs.get(name):
            rows.append((name, f"{inputs[name]['path']}  {_short(inputs[name]['xxh3_128'])}"))
    if inputs.get("store_keys"):
        sk = inputs["store_keys"]
        rows.append(("store keys", f"{_short(sk['xxh3_128'])}  ({sk.get('latent')} latent, {sk.get('text')} text; "
                                   f"splits {'+'.join(sk.get('splits', []))})"))
    section("Inputs", rows)
    trained = record.get("trained_lora")
    if "trained_lora" in record:
        section("Trained LoRA's own record", [("recorded", "yes" if trained else "no (the train stage wrote none)")]
                + ([("run id", trained.get("training", {}).get("run_id"))] if trained else []))
    section("Source", [("git commit", f"{git.get('commit')}{' (dirty)' if git.get('dirty') else ''}"),
                       *((f"dvc.lock {stage}", ", ".join(f"{o['path']} {o.get('md5', '')[:12]}"
                                                         for o in entry.get("outs", [])) or "-")
                         for stage, entry in sorted(record.get("dvc_lock", {}).items()))])
    packages = env.get("packages", {})
    section("Environment", [("python", env.get("python")), ("torch", env.get("torch")), ("cuda", env.get("cuda")),
                            ("gpu", env.get("gpu")), ("platform", env.get("platform")),
                            *((p, packages[p]) for p in KEY_PACKAGES if p in packages),
                            ("packages", f"{len(packages)} recorded (--json lists them)")])
    section("Params", list(flatten(record.get("params", {})).items()))
    if record.get("files"):
        section("Files", [(name, _short(h)) for name, h in sorted(record["files"].items())])
    return "\n".join(lines).rstrip() + "\n"


def format_checks(checks: list[Check]) -> str:
    """One line per verified item, drift first-class: `DRIFT item: what differs and the fix`."""
    lines = [f"{'ok   ' if c.ok else 'DRIFT'}  {c.item}{': ' + c.detail if c.detail else ''}" for c in checks]
    drift = sum(not c.ok for c in checks)
    lines.append(f"{drift} of {len(checks)} items drifted" if drift else f"all {len(checks)} items match")
    return "\n".join(lines) + "\n"


def format_diff(diffs: list[tuple[str, object, object]], a: str, b: str) -> str:
    """One line per differing dotted path: `path: A -> B`."""
    if not diffs:
        return f"{a} and {b}: lineage records are identical\n"
    lines = [f"--- {a}", f"+++ {b}"]
    lines += [f"{path}: {_value(x)} -> {_value(y)}" for path, x, y in diffs]
    return "\n".join(lines) + f"\n{len(diffs)} differences\n"


def lineage_command(file: Path, *, verify: bool, repo: Path, other: Path | None, as_json: bool) -> tuple[str, int]:
    """What `diffusion-pipe lineage` prints and its exit status (1: drift or differences; 2: unreadable)."""
    try:
        record = read_lineage(file)
        other_record = read_lineage(other) if other is not None else None
    except ValueError as exc:
        return f"error: {exc}\n", 2
    if verify:
        lineage_dir = file if file.is_dir() else file.parent if file.suffix == ".json" else None
        checks = verify_lineage(record, repo, lineage_dir=lineage_dir)
        return format_checks(checks), 0 if all(c.ok for c in checks) else 1
    if other_record is not None:
        diffs = diff_lineage(record, other_record)
        return format_diff(diffs, str(file), str(other)), 1 if diffs else 0
    return (json.dumps(record, indent=2, sort_keys=True) + "\n") if as_json else format_lineage(record), 0
