"""The store: round trips, pack flushing, publication order, validation, refresh, status and gc."""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import pytest
import torch

from diffusion_pipe.store import Store, StoreError
from tests.store.conftest import ENTRY_BYTES, assert_same, make_entry


def test_round_trip_several_dtypes(store: Store) -> None:
    with store.writer("latent") as w:
        for i in range(5):
            w.add(f"k{i}", make_entry(i))
    assert w.written == 5 and len(w.packs) == 1
    for i in range(5):
        assert_same(store.get("latent", f"k{i}"), make_entry(i))
    fresh = Store(store.root)  # another process's view: everything comes from the sidecars
    assert_same(fresh.get("latent", "k3"), make_entry(3))
    assert fresh.spec("latent", "k3") == {
        "latents": ((4, 8, 8), "float32"),
        "half": ((3, 5), "float16"),
        "bf16": ((7,), "bfloat16"),
        "ids": ((6,), "int64"),
    }
    assert fresh.contains("latent", "k0") and not fresh.contains("latent", "nope")
    assert not fresh.contains("text", "k0")  # families are separate


def test_missing_preserves_order_and_dedups(store: Store) -> None:
    with store.writer("text") as w:
        w.add("b", make_entry(1))
    assert store.missing("text", ["c", "a", "b", "c", "d", "a"]) == ["c", "a", "d"]


def test_noncontiguous_and_reused_tensors_are_copied(store: Store) -> None:
    buf = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = buf.t()[1:3]
    expected = view.clone()
    with store.writer("latent") as w:
        w.add("k", {"x": view})
        buf.zero_()  # the caller reuses its buffer before the flush
    assert torch.equal(store.get("latent", "k")["x"], expected)


def test_packs_flush_by_size(store: Store) -> None:
    with store.writer("latent", pack_bytes=2 * ENTRY_BYTES) as w:
        for i in range(7):
            w.add(f"k{i}", make_entry(i))
            assert w.written == (i + 1) // 2 * 2  # a pack is published every second entry
    assert w.written == 7 and len(w.packs) == 4  # 2+2+2+1 (the rest, on exit)
    assert store.status() == {"latent": {"packs": 4, "entries": 7, "bytes": store.status()["latent"]["bytes"]}}
    assert sorted(p.stem for p in (store.root / "latent").glob("*.safetensors")) == sorted(w.packs)
    for pack_id in w.packs:
        assert store.pack_path("latent", pack_id).stat().st_size == store.packs("latent")[pack_id].size


def test_pack_without_sidecar_is_invisible(store: Store) -> None:
    with store.writer("latent") as w:
        w.add("k", make_entry(0))
    (pack_id,) = w.packs
    store.sidecar_path("latent", pack_id).unlink()
    fresh = Store(store.root)
    assert not fresh.contains("latent", "k")
    assert fresh.missing("latent", ["k"]) == ["k"]
    assert fresh.status()["latent"] == {"packs": 0, "entries": 0, "bytes": 0}
    with pytest.raises(StoreError, match="latent entry k is not in the store .* run the encode stage"):
        fresh.get("latent", "k")


def test_exception_publishes_nothing_buffered(store: Store) -> None:
    with pytest.raises(RuntimeError, match="encoder exploded"), store.writer("latent", 2 * ENTRY_BYTES) as w:
        for i in range(5):
            w.add(f"k{i}", make_entry(i))
        raise RuntimeError("encoder exploded")
    assert w.written == 4  # two packs were complete before the error and stay
    assert store.missing("latent", [f"k{i}" for i in range(5)]) == ["k4"]
    assert Store(store.root).missing("latent", [f"k{i}" for i in range(5)]) == ["k4"]
    assert not [p for p in (store.root / "latent").iterdir() if p.name.startswith(".")]


def test_same_key_twice_in_one_writer(store: Store) -> None:
    with store.writer("latent") as w:
        w.add("k", make_entry(1))
        w.add("k", make_entry(1))
    assert w.written == 1


def test_equal_content_gives_the_same_pack(store: Store) -> None:
    packs = []
    for _ in range(2):
        with store.writer("latent") as w:
            w.add("k", make_entry(1))
        packs += w.packs
    assert packs[0] == packs[1]
    assert Store(store.root).status()["latent"]["packs"] == 1


def test_refresh_sees_other_writers(store: Store) -> None:
    assert store.missing("latent", ["k"]) == ["k"]
    other = Store(store.root)
    with other.writer("latent") as w:
        w.add("k", make_entry(0))
    assert store.missing("latent", ["k"]) == ["k"]  # memoised until refresh
    store.refresh()
    assert_same(store.get("latent", "k"), make_entry(0))


def test_validation_errors(store: Store) -> None:
    with pytest.raises(StoreError, match="invalid store family 'Latent'"):
        store.contains("Latent", "k")
    with pytest.raises(StoreError, match="invalid store family 'quarantine'"):
        store.writer("quarantine")
    with pytest.raises(StoreError, match="pack_bytes must be positive"):
        store.writer("latent", pack_bytes=0)
    with store.writer("latent") as w:
        with pytest.raises(StoreError, match="invalid store key 'a/b'"):
            w.add("a/b", make_entry(0))
        with pytest.raises(StoreError, match="invalid store key ''"):
            w.add("", make_entry(0))
        with pytest.raises(StoreError, match="entry k: tensors must be a non-empty dict"):
            w.add("k", {})
        with pytest.raises(StoreError, match="entry k: 'x' must be a dense torch.Tensor, got list"):
            w.add("k", {"x": [1, 2]})  # type: ignore[dict-item]
        with pytest.raises(StoreError, match="entry k: 'x' must be a dense torch.Tensor"):
            w.add("k", {"x": torch.eye(3).to_sparse()})
    assert w.written == 0
    with pytest.raises(StoreError, match="text entry zz is not in the store"):
        store.spec("text", "zz")


def test_root_is_resolved_and_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert Store("rel/store").root == tmp_path / "rel" / "store"
    assert (tmp_path / "rel" / "store").is_dir()
    monkeypatch.setenv("DIFFUSION_PIPE_STORE", str(tmp_path / "env-store"))
    assert Store.default().root == tmp_path / "env-store"
    monkeypatch.delenv("DIFFUSION_PIPE_STORE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert Store.default().root == tmp_path / "home" / ".cache" / "diffusion-pipe"


def test_store_pickles_with_open_handles(store: Store) -> None:
    with store.writer("latent") as w:
        w.add("k", make_entry(2))
    store.get("latent", "k")
    clone = pickle.loads(pickle.dumps(store))
    assert_same(clone.get("latent", "k"), make_entry(2))


def test_check_keys(store: Store) -> None:
    with store.writer("latent") as w:
        w.add("k", make_entry(2))
    store.check_keys("latent", ["k"])
    with pytest.raises(StoreError, match="1 of 2 latent entries are not in the store .*first: j"):
        store.check_keys("latent", ["k", "j"])


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_gc(store: Store) -> None:
    with store.writer("latent", pack_bytes=2 * ENTRY_BYTES) as w:
        for i in range(6):  # packs: {k0,k1} {k2,k3} {k4,k5}
            w.add(f"k{i}", make_entry(i))
    with store.writer("text") as wt:
        wt.add("t0", make_entry(9))
    directory = store.root / "latent"
    old_temp, young_temp = directory / ".pack-old.tmp", directory / ".pack-young.tmp"
    old_temp.write_bytes(b"crashed writer")
    young_temp.write_bytes(b"running writer")
    orphan = directory / ("f" * 32 + ".safetensors")  # a crash between rename and sidecar
    orphan.write_bytes(b"x")
    for p in [*directory.iterdir(), *(store.root / "text").iterdir()]:
        if p != young_temp:
            _age(p, 3600)

    keep = {("latent", "k0"), ("latent", "k1"), ("latent", "k2"), ("text", "t0")}
    dry = store.gc(keep, grace_seconds=60, dry_run=True)
    assert dry.deleted_packs == [w.packs[2]] and store.contains("latent", "k4")

    report = store.gc(keep, grace_seconds=60)
    assert report.deleted_packs == [w.packs[2]]
    assert report.mixed_packs == [w.packs[1]] and report.unkept_entries_in_mixed_packs == 1
    assert report.kept_packs == 3
    assert sorted(report.deleted_temp_files) == sorted([old_temp.name, orphan.name])
    assert young_temp.exists() and not old_temp.exists() and not orphan.exists()
    fresh = Store(store.root)
    assert fresh.missing("latent", [f"k{i}" for i in range(6)]) == ["k4", "k5"]
    assert_same(fresh.get("latent", "k3"), make_entry(3))  # kept: it shares a pack with k2
    assert fresh.verify() == []

    # Unkept but young packs survive the grace period.
    with store.writer("latent") as w2:
        w2.add("new", make_entry(7))
    report = store.gc(set(), grace_seconds=60)
    assert report.young_packs == [w2.packs[0]] and store.contains("latent", "new")
    assert sorted(report.deleted_packs) == sorted([w.packs[0], w.packs[1], wt.packs[0]])
    assert store.gc(set(), grace_seconds=0).deleted_packs == [w2.packs[0]]
    assert store.status()["latent"] == {"packs": 0, "entries": 0, "bytes": 0}
