"""Which store entries a repository can still ask for: what `store gc` must keep.

An entry is reachable when an encoded table names its key: the working tree's `data/encoded.parquet`, and the
one recorded in `dvc.lock` by every commit of every ref (`git rev-list --all`: branches, tags, stashes and DVC
experiments, which live under refs/exps/). A committed table is found through its md5 in `dvc.lock` in the DVC
cache. A table that cannot be read (not in the local DVC cache) makes the whole answer unknown: gc must then
stop, since any pack might be the one it needs.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

ENCODED = "data/encoded.parquet"


@dataclass
class Reachable:
    """The reachable (family, key) pairs, and the committed tables that could not be read."""

    keep: set[tuple[str, str]] = field(default_factory=set)
    tables: int = 0  # distinct encoded tables read
    commits: int = 0
    unresolved: list[str] = field(default_factory=list)  # "commit md5" of tables missing from the DVC cache


# Every column of an encoded table that names store entries, and their family: a sample's latent and caption, its
# control images' latents, its tag orders' texts, the empty caption read with its image, its loss mask. The optional
# ones are in a table only when a sample has them. (tests/store/test_cli.py checks this against the encode stage's
# columns, so a new one cannot be left out: gc would delete its entries and push would not carry them.)
KEY_COLUMNS = {"latent_key": "latent", "conditioning_latent_keys": "latent", "text_key": "text",
               "text_variant_keys": "text", "empty_text_key": "text", "mask_key": "mask"}


def table_keys(path: Path) -> set[tuple[str, str]]:
    """(family, key) of every store entry one encoded table names (`KEY_COLUMNS`)."""
    import pyarrow.parquet as pq

    columns = [name for name in pq.read_schema(path).names if name in KEY_COLUMNS]
    table = pq.read_table(path, columns=columns)
    keys: set[tuple[str, str]] = set()
    for name in columns:
        for value in table.column(name).to_pylist():
            keys |= {(KEY_COLUMNS[name], k) for k in (value if isinstance(value, list) else [value]) if k}
    return keys


def _git(repo: Path, *args: str, stdin: bytes | None = None) -> bytes:
    return subprocess.run(["git", *args], cwd=repo, input=stdin, capture_output=True, check=True).stdout


def _lock_md5s(repo: Path, commits: list[str], encoded: str) -> dict[str, str]:
    """md5 of `encoded` in each commit's dvc.lock -> the first commit recording it (one `git cat-file` run)."""
    from ruamel.yaml import YAML

    if not commits:
        return {}
    out = _git(repo, "cat-file", "--batch", stdin="".join(f"{c}:dvc.lock\n" for c in commits).encode())
    md5s: dict[str, str] = {}
    pos, yaml, parsed = 0, YAML(typ="safe", pure=True), set()
    for commit in commits:
        header_end = out.index(b"\n", pos)
        header = out[pos:header_end].split()
        pos = header_end + 1
        if header[-1] == b"missing":
            continue
        blob, size = header[0], int(header[2])
        raw = out[pos : pos + size]
        pos += size + 1  # the content is followed by a newline
        if blob in parsed:  # dvc.lock rarely changes: parse each version once
            continue
        parsed.add(blob)
        lock = yaml.load(raw.decode("utf-8")) or {}
        for stage in (lock.get("stages") or {}).values():
            for out_entry in stage.get("outs") or []:
                if out_entry.get("path") == encoded and out_entry.get("md5"):
                    md5s.setdefault(out_entry["md5"], commit)
    return md5s


def reachable_entries(repo: str | Path, encoded: str = ENCODED) -> Reachable:
    """Every (family, key) an encoded table of `repo` (working tree, any commit of any ref) refers to."""
    repo = Path(repo).resolve()
    result = Reachable()
    working = repo / encoded
    seen_md5: set[str] = set()
    if working.is_file():
        result.keep |= table_keys(working)
        result.tables += 1
    if (repo / ".git").exists():
        commits = _git(repo, "rev-list", "--all").decode().split()
        result.commits = len(commits)
        cache = _dvc_cache_dir(repo)
        for md5, commit in _lock_md5s(repo, commits, encoded).items():
            if md5 in seen_md5:
                continue
            seen_md5.add(md5)
            path = cache / md5[:2] / md5[2:]
            if not path.is_file():
                result.unresolved.append(f"{commit[:10]} {md5}")
                continue
            result.keep |= table_keys(path)
            result.tables += 1
    return result


def _dvc_cache_dir(repo: Path) -> Path:
    """The repo's DVC cache of files by md5 (`.dvc/cache/files/md5` unless configured elsewhere)."""
    from dvc.repo import Repo

    with Repo(str(repo)) as dvc:
        return Path(dvc.cache.local.path)
