"""`diffusion-pipe store ...`: look after the content-addressed store (status, verify, gc, push, pull)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import click

from diffusion_pipe.errors import error_text

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """'90', '90s', '30m', '24h', '7d' -> seconds."""
    match = _DURATION.match(text)
    if not match:
        raise click.BadParameter(f"{text!r}: write a number of seconds or a duration such as 30m, 24h, 7d")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def _store(root: Path | None) -> Any:
    from diffusion_pipe.store import Store

    return Store(root) if root else Store.default()


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _fail(message: str, status: int = 2) -> None:
    click.echo(error_text(message), err=True)
    sys.exit(status)


_root_option = click.option("--store", "root", type=click.Path(file_okay=False, path_type=Path),
                            help="The store root (default: $DIFFUSION_PIPE_STORE, else ~/.cache/diffusion-pipe).")
_repo_option = click.option("--repo", type=click.Path(file_okay=False, path_type=Path), default=".",
                            show_default=True, help="The pipeline repository.")
_remote_option = click.option("--remote",
                              help="A URL or path, 'dvc' or 'dvc:NAME' (default: the repo's default DVC remote).")


def _encoded_option(verb: str):
    return click.option("--encoded", type=click.Path(dir_okay=False, path_type=Path),
                        help=f"{verb} the entries this encoded table names (default: the repo's data/encoded.parquet).")


@click.group("store")
def store_group() -> None:
    """The content-addressed store of latents and text embeddings ($DIFFUSION_PIPE_STORE)."""


@store_group.command("status")
@_root_option
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def status(root: Path | None, as_json: bool) -> None:
    """Packs, entries and bytes per family; quarantined packs; running writers; what killed writers left."""
    from diffusion_pipe.store import live_leases

    store = _store(root)
    figures = store.status()
    quarantine = store.root / "quarantine"
    quarantined = sum(1 for p in quarantine.rglob("*.safetensors")) if quarantine.is_dir() else 0
    leases = live_leases(store.root)
    left = store.leftovers()
    if as_json:
        click.echo(json.dumps({"root": str(store.root), "families": figures, "quarantined_packs": quarantined,
                               "running_writers": len(leases), "leftovers": left}, indent=2, sort_keys=True))
        return
    click.echo(f"store {store.root}")
    for fam, f in figures.items():
        click.echo(f"  {fam:<8} {f['entries']:>9} entries  {f['packs']:>6} packs  {_size(f['bytes']):>10}")
    if not figures:
        click.echo("  (empty)")
    if quarantined:
        click.echo(f"  quarantined: {quarantined} packs in {quarantine} (their entries are recomputed by encode)")
    for lease in leases:
        click.echo(f"  running: {lease.get('purpose')} pid {lease.get('pid')} on {lease.get('host')}")
    if left["temp_files"] or left["dead_leases"]:
        click.echo(f"  left by stopped writers: {len(left['temp_files'])} temp files ({_size(left['temp_bytes'])}, "
                   f"{left['temp_files_of_dead_writers']} of processes known dead), {len(left['dead_leases'])} "
                   "leases; `diffusion-pipe store gc` removes them")
    if left["orphan_packs"]:
        click.echo(f"  orphan packs (no sidecar): {len(left['orphan_packs'])}; `diffusion-pipe store verify` "
                   "adopts the whole ones and quarantines the rest")


@store_group.command("verify")
@_root_option
@click.option("--family", help="Only this family (latent, text).")
@click.option("--no-quarantine", is_flag=True, help="Report problems without moving the packs aside.")
def verify(root: Path | None, family: str | None, no_quarantine: bool) -> None:
    """Re-hash every pack against its sidecar; quarantine the bad ones (encode recomputes them). Exit 1 on any."""
    store = _store(root)
    problems = store.verify(family, quarantine=not no_quarantine)
    bad = [p for p in problems if not p.adopted]
    for problem in problems:
        click.echo(f"{'FIXED' if problem.adopted else 'BAD '} {problem}")
    total = sum(f["packs"] for f in store.status().values())
    adopted = len(problems) - len(bad)
    click.echo(f"{total} packs verified, {len(bad)} bad" + (f", {adopted} orphan packs adopted" if adopted else ""))
    if bad or (no_quarantine and problems):
        sys.exit(1)


@store_group.command("gc")
@_root_option
@_repo_option
@click.option("--grace", default="24h", show_default=True,
              help="Never delete packs (or temp files) younger than this: 3600, 30m, 24h, 7d.")
@click.option("--dry-run", is_flag=True, help="Say what would be deleted; delete nothing.")
@click.option("--allow-unresolved", is_flag=True,
              help="Proceed even if some committed encoded tables are not in the DVC cache (their entries may go).")
def gc(root: Path | None, repo: Path, grace: str, dry_run: bool, allow_unresolved: bool) -> None:
    """Delete packs that no encoded table of REPO refers to: not the working tree's, not one in dvc.lock at
    any commit of any branch, tag or DVC experiment. Packs written since a running encode started are kept."""
    from diffusion_pipe.store.reachable import ENCODED, reachable_entries

    grace_s = parse_duration(grace)
    store = _store(root)
    found = reachable_entries(repo)
    if found.unresolved and not allow_unresolved:
        _fail(f"{len(found.unresolved)} committed {ENCODED} versions are not in the DVC cache of {repo} (first: "
              f"commit {found.unresolved[0]}), so gc cannot know which entries they need. Fetch them with "
              "`dvc fetch --all-commits --all-branches --all-tags`, or pass --allow-unresolved")
    report = store.gc(found.keep, grace_s, dry_run=dry_run)
    verb = "would delete" if dry_run else "deleted"
    click.echo(f"kept entries of {found.tables} encoded tables ({found.commits} commits): {report.kept_packs} packs")
    click.echo(f"{verb} {len(report.deleted_packs)} packs ({_size(report.deleted_bytes)}), "
               f"{len(report.deleted_temp_files)} temp/orphan files and {len(report.deleted_leases)} leases of "
               "writers that stopped")
    if report.young_packs:
        click.echo(f"spared {len(report.young_packs)} unreferenced packs younger than {grace}")
    if report.in_use_packs:
        click.echo(f"spared {len(report.in_use_packs)} packs written since a running encode started "
                   f"({report.live_leases} running)")
    if report.mixed_packs:
        click.echo(f"kept {len(report.mixed_packs)} packs whole that also hold "
                   f"{report.unkept_entries_in_mixed_packs} unreferenced entries")


def _remote_and_keys(repo: Path, remote: str | None, encoded: Path | None, all_packs: bool, has_all: bool = True
                     ) -> tuple[Any, Any]:
    """The resolved remote and the (family, key) pairs of the encoded table (None with `all_packs`); a problem is
    a one-line error and exit status 2 (`has_all`: the command has an --all flag to suggest)."""
    from diffusion_pipe.store import StoreError
    from diffusion_pipe.store.reachable import ENCODED, table_keys
    from diffusion_pipe.store.remote import resolve_remote

    spec = remote if remote is not None else "dvc"
    try:
        resolved = resolve_remote(spec, repo, param="--remote")
    except StoreError as exc:
        _fail(str(exc))
    if resolved is None:
        _fail(f"no store remote: {repo}/.dvc/config has no default DVC remote; pass --remote URL "
              "(a path, ssh://host/path, s3://bucket/prefix) or add one with `dvc remote add -d NAME URL`")
    if all_packs:
        return resolved, None
    table = encoded or (repo / ENCODED)
    how = "run the encode stage (`dvc repro encode`) or `dvc pull` it first, or pass --encoded PATH" + (
        " or --all" if has_all else "")
    if not table.is_file():
        _fail(f"encoded table {table} not found: {how}")
    try:
        return resolved, table_keys(table)
    except (OSError, ValueError) as exc:  # pyarrow's errors for a file that is not a readable table
        _fail(f"cannot read the encoded table {table} ({exc}): {how}")
    raise AssertionError("unreachable")


def _families(store: Any, keys: Any) -> tuple[str, ...]:
    """The families to transfer: latents and texts, and loss masks where the keys (or, for every pack, the
    store) have any."""
    masks = any(f == "mask" for f, _ in keys) if keys is not None else "mask" in store.families()
    return ("latent", "text", "mask") if masks else ("latent", "text")


@store_group.command("push")
@_root_option
@_repo_option
@_remote_option
@_encoded_option("Push")
@click.option("--all", "all_packs", is_flag=True, help="Push every pack of the store.")
def push(root: Path | None, repo: Path, remote: str | None, encoded: Path | None, all_packs: bool) -> None:
    """Upload to the remote the packs holding the encoded table's entries (or all) that it lacks."""
    from diffusion_pipe.store import StoreError

    store = _store(root)
    target, keys = _remote_and_keys(repo, remote, encoded, all_packs)
    try:
        for fam in _families(store, keys):
            wanted = None if keys is None else sorted(k for f, k in keys if f == fam)
            n = store.push(target, fam, keys=wanted)
            click.echo(f"{fam}: uploaded {n} packs to {target.url}")
    except StoreError as exc:
        _fail(str(exc))


@store_group.command("pull")
@_root_option
@_repo_option
@_remote_option
@_encoded_option("Pull")
def pull(root: Path | None, repo: Path, remote: str | None, encoded: Path | None) -> None:
    """Download from the remote the packs holding the encoded table's entries that the store lacks."""
    from diffusion_pipe.store import StoreError

    store = _store(root)
    target, keys = _remote_and_keys(repo, remote, encoded, False, has_all=False)
    missing = 0
    try:
        for fam in _families(store, keys):
            wanted = sorted(k for f, k in keys if f == fam)
            n = store.pull(target, fam, wanted)
            left = len(store.missing(fam, wanted))
            missing += left
            click.echo(f"{fam}: fetched {n} entries from {target.url}; {left} still missing")
    except StoreError as exc:
        _fail(str(exc))
    if missing:
        _fail(f"{missing} entries are on neither the store nor the remote: run the encode stage to compute them", 1)
