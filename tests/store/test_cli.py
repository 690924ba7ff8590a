"""`diffusion-pipe store status | verify | gc | push | pull` on a hand-built repo (git + DVC cache) and store."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from diffusion_pipe.encode.encode import Sample, write_encoded_table
from diffusion_pipe.store import Store
from diffusion_pipe.store.cli import parse_duration, store_group

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
OLD = time.time() - 7 * 86400


def _entry(i: int) -> dict[str, torch.Tensor]:
    return {"x": torch.full((4,), float(i))}


def _pack(store: Store, family: str, keys: list[str], *, old: bool = True) -> str:
    with store.writer(family) as w:
        for i, k in enumerate(keys):
            w.add(k, _entry(i))
    pack_id = w.packs[0]
    if old:
        for path in (store.pack_path(family, pack_id), store.sidecar_path(family, pack_id)):
            os.utime(path, (OLD, OLD))
    return pack_id


def _table(path: Path, latent_keys: list[str], text_keys: list[str]) -> None:
    samples = [Sample("d", f"{i}.png", "64x64x1", "train", 1, "h", "c", lk, tk)
               for i, (lk, tk) in enumerate(zip(latent_keys, text_keys, strict=True))]
    write_encoded_table(samples, path)


def _commit_table(repo: Path, latent_keys: list[str], text_keys: list[str], *, cached: bool = True) -> str:
    """Commit a dvc.lock recording an encoded table, with the table in the DVC cache (unless not `cached`)."""
    tmp = repo / "table.tmp"
    _table(tmp, latent_keys, text_keys)
    md5 = hashlib.md5(tmp.read_bytes()).hexdigest()
    if cached:
        dest = repo / ".dvc/cache/files/md5" / md5[:2] / md5[2:]
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp.replace(dest)
    else:
        tmp.unlink()
    (repo / "dvc.lock").write_text(
        "schema: '2.0'\nstages:\n  encode:\n    cmd: python -m stages.encode\n    outs:\n"
        f"    - path: data/encoded.parquet\n      hash: md5\n      md5: {md5}\n      size: 1\n"
    )
    subprocess.run([*GIT, "add", "dvc.lock"], cwd=repo, check=True, capture_output=True)
    subprocess.run([*GIT, "commit", "-q", "-m", "lock"], cwd=repo, check=True, capture_output=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=repo, check=True, env=env)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=repo, check=True, env=env)
    return repo


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(store_group, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def test_gc_keeps_what_history_experiments_and_running_encodes_need(repo: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    in_history = _pack(store, "latent", ["a1", "a2"])
    in_experiment = _pack(store, "text", ["b1"])
    in_working_tree = _pack(store, "latent", ["c1"])
    unreferenced = _pack(store, "latent", ["d1"])
    _commit_table(repo, ["a1", "a2"], ["t1", "t1"])
    # an experiment: a commit reachable only from refs/exps (DVC's layout), not from any branch
    subprocess.run([*GIT, "checkout", "-q", "-b", "exp"], cwd=repo, check=True)
    exp_commit = _commit_table(repo, ["a1"], ["b1"])
    subprocess.run([*GIT, "checkout", "-q", "main"], cwd=repo, check=True)
    subprocess.run([*GIT, "update-ref", "refs/exps/ab/cdef/exp-1", exp_commit], cwd=repo, check=True)
    subprocess.run([*GIT, "branch", "-q", "-D", "exp"], cwd=repo, check=True)
    (repo / "data").mkdir()
    _table(repo / "data/encoded.parquet", ["c1"], ["t1"])
    root = str(store.root)

    with store.lease("encode"):  # a running encode has just published a pack no table names yet
        being_written = _pack(store, "latent", ["e1"], old=False)
        code, out = _run("gc", "--store", root, "--repo", str(repo), "--grace", "0")
        assert code == 0, out
        assert "deleted 1 packs" in out and "spared 1 packs written since a running encode started" in out
    store = Store(root)
    assert not store.contains("latent", "d1") and store.contains("latent", "e1")
    assert {in_history, in_working_tree} <= set(store.packs("latent")) and in_experiment in store.packs("text")
    assert unreferenced not in store.packs("latent")

    code, out = _run("gc", "--store", root, "--repo", str(repo), "--grace", "1h")
    assert code == 0 and "spared 1 unreferenced packs younger than 1h" in out
    code, out = _run("gc", "--store", root, "--repo", str(repo), "--grace", "0", "--dry-run")
    assert "would delete 1 packs" in out and Store(root).contains("latent", "e1")
    code, out = _run("gc", "--store", root, "--repo", str(repo), "--grace", "0")
    assert code == 0 and "deleted 1 packs" in out
    store = Store(root)
    assert being_written not in store.packs("latent")
    assert all(store.contains(f, k) for f, k in (("latent", "a1"), ("latent", "a2"), ("latent", "c1"), ("text", "b1")))


def test_gc_stops_when_a_committed_table_is_not_in_the_dvc_cache(repo: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    _pack(store, "latent", ["a1"])
    _commit_table(repo, ["a1"], ["t1"], cached=False)
    code, out = _run("gc", "--store", str(store.root), "--repo", str(repo), "--grace", "0")
    assert code == 2
    assert "not in the DVC cache" in out and "dvc fetch --all-commits" in out
    assert Store(store.root).contains("latent", "a1")
    code, out = _run("gc", "--store", str(store.root), "--repo", str(repo), "--grace", "0", "--allow-unresolved")
    assert code == 0 and not Store(store.root).contains("latent", "a1")


def test_status_verify_push_pull(repo: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    pack = _pack(store, "latent", ["a1", "a2"])
    _pack(store, "text", ["t1"])
    (repo / "data").mkdir()
    _table(repo / "data/encoded.parquet", ["a1", "a2"], ["t1", "t1"])
    root = str(store.root)

    code, out = _run("status", "--store", root)
    assert code == 0 and "latent" in out and "2 entries" in out

    code, out = _run("push", "--store", root, "--repo", str(repo))
    assert code == 2 and "no default DVC remote" in out
    remote = tmp_path / "remote"
    code, out = _run("push", "--store", root, "--repo", str(repo), "--remote", str(remote))
    assert code == 0 and "latent: uploaded 1 packs" in out and "text: uploaded 1 packs" in out

    fresh = str(tmp_path / "fresh")
    code, out = _run("pull", "--store", fresh, "--repo", str(repo), "--remote", str(remote))
    assert code == 0 and "latent: fetched 2 entries" in out and "text: fetched 1 entries" in out

    code, out = _run("verify", "--store", root)
    assert code == 0 and "2 packs verified, 0 bad" in out
    with open(store.pack_path("latent", pack), "r+b") as fh:  # flip a byte inside the tensor data
        fh.seek(-1, os.SEEK_END)
        last = fh.read(1)
        fh.seek(-1, os.SEEK_END)
        fh.write(bytes([last[0] ^ 0xFF]))
    code, out = _run("verify", "--store", root)
    assert code == 1 and f"BAD  latent pack {pack}" in out and "quarantine" in out


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("30m", 1800), ("24h", 86400), ("1.5d", 129600)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_parse_duration_rejects_junk() -> None:
    import click

    with pytest.raises(click.BadParameter, match="30m, 24h, 7d"):
        parse_duration("a week")


def test_a_running_writers_heartbeat_keeps_its_lease_live_past_the_ttl(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An encode running longer than LEASE_TTL_S keeps its lease: the heartbeat touches the file, so gc (from
    another host, with a short --grace) still keeps the packs it has published. Heartbeat shortened to 50 ms."""
    from diffusion_pipe.store import store as store_module

    monkeypatch.setattr(store_module, "LEASE_HEARTBEAT_S", 0.05)
    store = Store(tmp_path / "store")
    with store.lease("encode") as lease:
        long_ago = time.time() - store_module.LEASE_TTL_S - 60  # as if the lease were written long ago
        os.utime(lease.path, (long_ago, long_ago))
        deadline = time.monotonic() + 10
        while lease.path.stat().st_mtime < time.time() - 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lease.path.stat().st_mtime > time.time() - 5
        _pack(store, "latent", ["x1"], old=False)  # published during the run, named by no table yet
        report = store.gc(set(), 0)
        assert report.live_leases == 1 and not report.deleted_packs
    assert not lease.path.exists()


def test_gc_ignores_and_removes_leases_of_dead_writers(tmp_path: Path) -> None:
    from diffusion_pipe.store.store import LEASE_TTL_S

    store = Store(tmp_path / "store")
    dead = store.root / "leases" / "host-1-dead.json"
    dead.parent.mkdir(parents=True)
    dead.write_text('{"purpose": "encode", "pid": 1, "host": "host", "started": 0}')
    stale = time.time() - LEASE_TTL_S - 10
    os.utime(dead, (stale, stale))
    _pack(store, "latent", ["x1"], old=False)
    report = store.gc(set(), 0)
    assert report.live_leases == 0 and len(report.deleted_packs) == 1
    assert not dead.exists()


def test_push_and_pull_report_remote_failures_in_one_line(repo: Path, tmp_path: Path) -> None:
    """An unreachable remote, a remote with a credential in its URL: one `error:` line naming the remote (password
    masked) and exit status 2, never a traceback."""
    from tests.conftest import free_port

    store = Store(tmp_path / "store")
    _pack(store, "latent", ["a1"])
    _pack(store, "text", ["t1"])
    (repo / "data").mkdir()
    _table(repo / "data/encoded.parquet", ["a1"], ["t1"])
    url = f"ssh://u:se/cret@127.0.0.1:{free_port()}/store"  # nothing listens there
    for verb, what in (("push", "upload to"), ("pull", "download from")):
        result = CliRunner().invoke(store_group, [verb, "--store", str(tmp_path / verb), "--repo", str(repo),
                                                  "--remote", url.replace("se/cret", "pw")])
        assert result.exit_code == 2, result.output  # an uncaught exception is exit status 1
        assert f"error: cannot {what} the store remote ssh://u:***@127.0.0.1:" in result.output
        assert "Traceback" not in result.output and ":pw@" not in result.output
        result = CliRunner().invoke(store_group, [verb, "--store", str(tmp_path / verb), "--repo", str(repo),
                                                  "--remote", url])  # DVC cannot parse it: still masked
        assert result.exit_code == 2 and "ssh://u:***@127.0.0.1" in result.output, result.output
        assert "cret" not in result.output


@pytest.mark.parametrize("verb", ["push", "pull"])
def test_push_and_pull_without_an_encoded_table_say_what_to_run(verb: str, repo: Path, tmp_path: Path) -> None:
    code, out = _run(verb, "--store", str(tmp_path / "store"), "--repo", str(repo), "--remote", str(tmp_path / "r"))
    assert code == 2
    assert f"error: encoded table {repo}/data/encoded.parquet not found: run the encode stage" in out
    (repo / "data").mkdir()
    (repo / "data/encoded.parquet").write_text("not a table")
    code, out = _run(verb, "--store", str(tmp_path / "store"), "--repo", str(repo), "--remote", str(tmp_path / "r"))
    assert code == 2 and f"error: cannot read the encoded table {repo}/data/encoded.parquet" in out


def test_every_key_an_encoded_table_names_is_kept_and_carried(tmp_path: Path) -> None:
    """A table with every optional key column (control images' latents, tag orders' texts, the empty caption read
    with an image, a loss mask): each entry it names is reachable (so gc keeps it and push / pull carry it), and
    no column of the encode stage's tables that names entries is left out."""
    from diffusion_pipe.encode.encode import _OPTIONAL_COLUMNS, ENCODED_SCHEMA
    from diffusion_pipe.store.reachable import KEY_COLUMNS, table_keys

    names = [f.name for f in ENCODED_SCHEMA] + [f.name for f, _, _ in _OPTIONAL_COLUMNS]
    assert {n for n in names if n.endswith(("_key", "_keys"))} == set(KEY_COLUMNS)
    samples = [Sample("d", "0.png", "64x64x1", "train", 1, "h", "c", "lat0", "txt0", conditioning_keys=("ctl0",),
                      variant_keys=("var0", "var1"), empty_text_key="empty0", mask_key="mask0"),
               Sample("d", "1.png", "64x64x1", "train", 1, "h", "c", "lat1", "txt1")]
    write_encoded_table(samples, tmp_path / "encoded.parquet")
    assert table_keys(tmp_path / "encoded.parquet") == {
        ("latent", "lat0"), ("latent", "lat1"), ("latent", "ctl0"), ("text", "txt0"), ("text", "txt1"),
        ("text", "var0"), ("text", "var1"), ("text", "empty0"), ("mask", "mask0")}
