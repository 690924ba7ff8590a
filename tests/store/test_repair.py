"""Store faults a user meets, each detected and repaired: group permissions, flipped bytes in reused packs,
orphan packs, leftovers of killed writers, the lease around the table, a full disk."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from diffusion_pipe.store import Store
from diffusion_pipe.store.remote import Remote
from tests.store.conftest import ENTRY_BYTES, make_entry


def _write(store: Store, n: int = 4, pack_bytes: int = 2 * ENTRY_BYTES, family: str = "latent") -> list[str]:
    with store.writer(family, pack_bytes=pack_bytes) as w:
        for i in range(n):
            w.add(f"k{i}", make_entry(i))
    return w.packs


@pytest.fixture
def group_umask():
    old = os.umask(0o002)  # a store shared by a group: files group-writable, like everything else the group makes
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_packs_follow_the_umask_like_their_sidecars(tmp_path, group_umask):
    store = Store(tmp_path / "store")
    packs = _write(store)
    for pack_id in packs:
        assert _mode(store.pack_path("latent", pack_id)) == 0o664
        assert _mode(store.sidecar_path("latent", pack_id)) == 0o664
    other = Store(tmp_path / "other")
    assert other.pull(Remote(str(store.root)), "latent", ["k0", "k3"]) == 2
    assert len(other.packs("latent")) == 2
    for pack_id in other.packs("latent"):
        assert _mode(other.pack_path("latent", pack_id)) == 0o664
        assert _mode(other.sidecar_path("latent", pack_id)) == 0o664


def _flip_data_byte(path: Path, keep_stat: bool = False) -> None:
    from diffusion_pipe.store.pack import read_header

    st = path.stat()
    _, data_start = read_header(path)
    with open(path, "r+b") as fh:
        fh.seek(data_start + 5)
        byte = fh.read(1)[0]
        fh.seek(data_start + 5)
        fh.write(bytes([byte ^ 0xFF]))
    if keep_stat:  # bit rot: the bytes change, the stat does not
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:  # a write a second later (one within the clock's tick could leave the mtime as it was)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_reused_packs_are_checked_and_a_flipped_byte_is_quarantined(store: Store) -> None:
    packs = _write(store)
    _flip_data_byte(store.pack_path("latent", packs[0]))
    fresh = Store(store.root)  # encode's view: nothing read yet
    problems = fresh.check_reused("latent", ["k0", "k1", "k2", "k3"])
    assert [p.pack for p in problems] == [packs[0]] and "hash to" in problems[0].reason
    assert fresh.missing("latent", ["k0", "k1", "k2", "k3"]) == ["k0", "k1"]  # recomputed by this encode
    assert (store.root / "quarantine" / "latent" / f"{packs[0]}.safetensors").exists()


def test_the_full_hash_is_paid_once_per_pack_per_machine_the_size_check_always(store: Store) -> None:
    packs = _write(store)
    assert Store(store.root).check_reused("latent", ["k0", "k2"]) == []  # hashed and remembered
    _flip_data_byte(store.pack_path("latent", packs[0]), keep_stat=True)
    assert Store(store.root).check_reused("latent", ["k0"]) == []  # remembered: not hashed again
    with open(store.pack_path("latent", packs[1]), "ab") as fh:
        fh.write(b"x")  # a size change is always seen
    assert [p.pack for p in Store(store.root).check_reused("latent", ["k2"])] == [packs[1]]
    assert [p.pack for p in Store(store.root).verify()] == [packs[0]]  # `store verify` hashes regardless


def test_packs_written_or_pulled_here_are_not_hashed_again_by_the_next_run(store: Store, tmp_path: Path) -> None:
    packs = _write(store)
    other = Store(tmp_path / "other")
    assert other.pull(Remote(str(store.root)), "latent", ["k2"]) == 1
    (pulled,) = other.packs("latent")
    # bit rot after each pack came in: only hashing its bytes again would see it
    _flip_data_byte(store.pack_path("latent", packs[0]), keep_stat=True)
    _flip_data_byte(other.pack_path("latent", pulled), keep_stat=True)
    assert Store(store.root).check_reused("latent", ["k0"]) == []  # hashed when written: not read again
    assert Store(other.root).check_reused("latent", ["k2"]) == []  # hashed when pulled: not read again
    assert [p.pack for p in Store(store.root).verify()] == [packs[0]]  # the flips are real
    assert [p.pack for p in Store(other.root).verify()] == [pulled]


def _age(path: Path, seconds: float = 3600) -> None:
    st = path.stat()
    os.utime(path, (st.st_atime - seconds, st.st_mtime - seconds))


def test_verify_adopts_an_orphan_pack_and_quarantines_a_damaged_one(store: Store, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from diffusion_pipe.store.cli import store_group

    packs = _write(store, n=6)
    _flip_data_byte(store.pack_path("latent", packs[1]))
    for pack_id in packs[:2]:
        store.sidecar_path("latent", pack_id).unlink()
        _age(store.pack_path("latent", pack_id))  # a writer that died long ago, not one about to write it
    assert Store(store.root).missing("latent", ["k0", "k2"]) == ["k0", "k2"]  # invisible, never reported before
    status = CliRunner().invoke(store_group, ["status", "--store", str(store.root)])
    assert "orphan packs (no sidecar): 2" in status.output
    out = CliRunner().invoke(store_group, ["verify", "--store", str(store.root)])
    assert f"FIXED latent pack {packs[0]}: orphan pack without sidecar" in out.output
    assert f"BAD  latent pack {packs[1]}: orphan pack without sidecar" in out.output
    assert "1 bad, 1 orphan packs adopted" in out.output and out.exit_code == 1
    fresh = Store(store.root)
    assert fresh.missing("latent", ["k0", "k1", "k2", "k3"]) == ["k2", "k3"]  # adopted back; the damaged one not
    assert fresh.get("latent", "k0")["latents"].equal(make_entry(0)["latents"])
    assert (store.root / "quarantine" / "latent" / f"{packs[1]}.safetensors").exists()


KILLED_WRITER = """
import os, signal, sys, tempfile
from diffusion_pipe.store import Store
from diffusion_pipe.store.pack import TEMP_SUFFIX, temp_prefix
store = Store(sys.argv[1])
with store.lease("encode"):
    (store.root / "latent").mkdir(exist_ok=True)
    fd, _ = tempfile.mkstemp(prefix=temp_prefix(), suffix=TEMP_SUFFIX, dir=store.root / "latent")
    os.write(fd, b"x" * 1000)
    os.kill(os.getpid(), signal.SIGKILL)  # mid-write: no cleanup runs
"""


def test_what_a_killed_encode_leaves_is_shown_by_status_and_removed_by_gc(store: Store) -> None:
    import subprocess
    import sys

    from click.testing import CliRunner

    from diffusion_pipe.store import live_leases
    from diffusion_pipe.store.cli import store_group

    _write(store, n=2)
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(store.root)], capture_output=True)
    assert proc.returncode == -9
    left = store.leftovers()
    assert len(left["temp_files"]) == 1 and left["temp_files_of_dead_writers"] == 1 and left["temp_bytes"] == 1000
    assert len(left["dead_leases"]) == 1 and live_leases(store.root) == []  # it protects nothing any more
    status = CliRunner().invoke(store_group, ["status", "--store", str(store.root)])
    assert "left by stopped writers: 1 temp files (1000 B, 1 of processes known dead), 1 leases" in status.output
    report = store.gc({("latent", "k0"), ("latent", "k1")}, grace_seconds=24 * 3600)  # the default grace
    assert len(report.deleted_temp_files) == 1 and len(report.deleted_leases) == 1 and not report.deleted_packs
    assert store.leftovers() == {"temp_files": [], "temp_bytes": 0, "temp_files_of_dead_writers": 0,
                                 "dead_leases": [], "orphan_packs": []}


FULL_DISK = """
import resource, signal, sys, torch
from diffusion_pipe.store import Store, StoreError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
store = Store(sys.argv[1])
try:
    with store.writer("latent") as w:
        w.add("k", {"latents": torch.zeros(1 << 19)})  # 2 MB
except StoreError as exc:
    print(exc)
"""


def test_a_full_disk_is_a_clear_error_naming_the_store_and_the_space(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = tmp_path / "store"
    out = subprocess.run([sys.executable, "-c", FULL_DISK, str(root)], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in out.stderr, out.stderr
    assert f"the store at {root} cannot take a pack of 2.0 MB in latent/: File too large" in out.stdout
    assert "diffusion-pipe store gc" in out.stdout
    assert not [p for p in (root / "latent").iterdir()]  # no temp file left behind
