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
