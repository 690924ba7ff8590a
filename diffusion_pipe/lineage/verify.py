"""`diffusion-pipe lineage --verify`: a lineage record checked against a repository and the store, item by item."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from diffusion_pipe.hashing import hash_file
from diffusion_pipe.lineage.record import (
    STORE_FAMILIES,
    UPSTREAM_STAGES,
    base_weights,
    encoded_store_keys,
    lock_mismatches,
    md5_file,
    store_keys_record,
    trained_params_drift,
)
from diffusion_pipe.lineage.show import short_hash
from diffusion_pipe.store.pack import REPAIR_HINT

MAX_KEYS_SHOWN = 10


@dataclass(frozen=True)
class Check:
    """One item of `--verify`: what was checked, whether it matches the record, and what differs."""

    item: str
    ok: bool
    detail: str = ""


def _check_file(repo: Path, what: str, recorded: dict | None, fix: str) -> Check | None:
    if recorded is None:
        return None
    path = repo / recorded["path"]
    item = f"{what} {recorded['path']}"
    if not path.is_file():
        return Check(item, False, f"{path} is missing; {fix}")
    actual = hash_file(path)
    if actual != recorded["xxh3_128"]:
        return Check(item, False, f"{path} hashes to {short_hash(actual)}, the lineage records "
                                  f"{short_hash(recorded['xxh3_128'])}: it changed since; {fix}")
    return Check(item, True)


def _check_base_model(record: dict, repo: Path) -> list[Check]:
    from diffusion_pipe.models.checkpoints import resolve_model
    from diffusion_pipe.params import ModelParams

    base = record["base_model"]
    # The model params as recorded (single files included), so the same components are hashed again.
    recorded = {k: tuple(v) if isinstance(v, list) else v for k, v in record["params"]["model"].items()
                if k in ModelParams.__dataclass_fields__}
    try:
        directory = resolve_model(ModelParams(**{**recorded, "path": base["path"]}), root=repo)
    except (FileNotFoundError, ValueError) as exc:
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
            checks.append(Check(item, False, f"{directory / component}: weights hash {short_hash(got)}, the lineage "
                                             f"records {short_hash(recorded)}: the base weights were swapped or "
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
                                             f"missing from the store at {store.root / family}: {shown}; "
                                             f"{REPAIR_HINT}, or pull them from the store's remote"))
            continue
        wanted_set, bad = set(wanted), []
        for pack_id, sidecar in sorted(store.packs(family).items()):
            held = wanted_set.intersection(sidecar.entries)
            if held:
                reason = check_pack(store.pack_path(family, pack_id), sidecar, full_hash=True)
                if reason is not None:
                    bad.append(f"pack {pack_id} ({len(held)} of the entries): {reason}")
        if bad:
            checks.append(Check(item, False, "; ".join(bad) + "; quarantine them (`diffusion-pipe store verify`), then "
                                        + REPAIR_HINT))
        else:
            checks.append(Check(item, True, f"{len(wanted)} present and intact"))
    return checks


def _check_datasets(record: dict, repo: Path) -> list[Check]:
    """Each dataset of the record's params scanned again and compared with what the record holds; the changed
    files named (see `data.py`)."""
    from diffusion_pipe.errors import UserError
    from diffusion_pipe.lineage.data import dataset_drift

    checks = []
    for i, ds in enumerate(((record.get("params") or {}).get("scan") or {}).get("datasets") or []):
        try:
            ok, detail = dataset_drift(record, repo, i)
        except UserError as exc:  # recorded scan params this version no longer reads, a dataset it cannot walk
            ok, detail = False, f"cannot scan it again with the recorded scan params: {exc}"
        checks.append(Check(f"dataset {ds['path']}", ok, detail if ok else
                            f"{detail}; re-run `dvc repro` to train on them, or restore the files"))
    return checks


def _check_dvc_lock(record: dict, repo: Path) -> Check | None:
    """The recorded dvc.lock entries describe this record's inputs: only stages upstream of the one that wrote
    it, and each dep or out at an input's path carries that input's md5."""
    entries = record.get("dvc_lock") or {}
    if not entries:
        return None
    writer = "train" if record.get("kind") == "checkpoint" else "export"
    problems = [f"stage '{s}' is not upstream of this {record.get('kind')} (its entry was left by an earlier run)"
                for s in sorted(entries) if s not in UPSTREAM_STAGES[writer]]
    inputs = {}
    for name, recorded in (record.get("inputs") or {}).items():
        if isinstance(recorded, dict) and "path" in recorded and "xxh3_128" in recorded:
            path = repo / recorded["path"]
            md5 = recorded.get("md5") or (md5_file(path) if path.is_file() and hash_file(path) ==
                                          recorded["xxh3_128"] else None)
            inputs[name] = {"path": recorded["path"], "md5": md5}
    problems += [f"stage '{s}': {why}" for s, why in lock_mismatches(entries, inputs).items()]
    if problems:
        return Check("dvc.lock entries", False, "; ".join(problems) + ": the record describes other inputs than "
                     "this artifact's; re-run `dvc repro export` to write a record of its own")
    return Check("dvc.lock entries", True, f"{', '.join(sorted(entries))} describe the recorded inputs")


def _check_trained_params(record: dict, repo: Path) -> Check | None:
    """An export record's params agree with the params its LoRA was trained with, on every key train reads."""
    if not record.get("trained_lora"):
        return None
    drift = trained_params_drift(record, repo)
    return Check("trained params", not drift, "" if not drift else
                 f"the LoRA was trained with other params than this record (and dvc.lock) state: {'; '.join(drift)} "
                 "(trained -> recorded; params.yaml was edited while train ran?); run `dvc repro --force train` to "
                 "train with the recorded ones, or restore the values it was trained with")


def verify_lineage(record: dict, repo: Path, store=None, lineage_dir: Path | None = None) -> list[Check]:
    """Check a lineage record against the repository and the store, item by item.

    Each dataset is scanned again (read-only) and compared with the record, naming the changed files (see
    `data.py`); the recorded dvc.lock entries must describe the recorded inputs, not other files.
    The manifest, encoded table and trained LoRA are re-hashed at their recorded paths under `repo`; the store
    keys of the repository's encoded table are hashed and each looked up in `store` (default
    `Store.default()`), its packs fully re-hashed (nothing is quarantined); the base model's components are
    re-hashed. With `lineage_dir` (where a lineage.json lies), the exported files it lists are re-hashed too.
    """
    from diffusion_pipe.store import Store

    repo = Path(repo)
    inputs = record.get("inputs", {})
    fix = "re-run `dvc repro` to retrain on the current state, or check out the commit the lineage records"
    checks = _check_datasets(record, repo)
    checks += [c for c in (_check_trained_params(record, repo), _check_dvc_lock(record, repo),
                          _check_file(repo, "manifest", inputs.get("manifest"), fix),
                          _check_file(repo, "encoded table", inputs.get("encoded"), fix),
                          _check_file(repo, "trained LoRA", inputs.get("lora"), fix)) if c is not None]
    encoded = inputs.get("encoded")
    if encoded is not None and (repo / encoded["path"]).is_file():
        keys = encoded_store_keys(repo / encoded["path"])
        got = store_keys_record(keys)["xxh3_128"]
        want = inputs["store_keys"]["xxh3_128"]
        checks.append(Check("store key set", got == want, "" if got == want else
                            f"the keys of {encoded['path']} hash to {short_hash(got)}, the lineage records "
                            f"{short_hash(want)}: the table points at other store entries now"))
        checks += _check_store(keys, store if store is not None else Store.default())
    checks += _check_base_model(record, repo)
    for name, digest in sorted(record.get("files", {}).items()) if lineage_dir is not None else ():
        path = lineage_dir / name
        actual = hash_file(path) if path.is_file() else None
        checks.append(Check(f"exported file {name}", actual == digest, "" if actual == digest else
                            (f"{path} is missing" if actual is None else
                             f"{path} hashes to {short_hash(actual)}, the lineage records {short_hash(digest)}: it was "
                             "modified after export; re-run `dvc repro export`")))
    return checks


def format_checks(checks: list[Check]) -> str:
    """One line per verified item, drift first-class: `DRIFT item: what differs and the fix`."""
    lines = [f"{'ok   ' if c.ok else 'DRIFT'}  {c.item}{': ' + c.detail if c.detail else ''}" for c in checks]
    drift = sum(not c.ok for c in checks)
    lines.append(f"{drift} of {len(checks)} items drifted" if drift else f"all {len(checks)} items match")
    return "\n".join(lines) + "\n"
