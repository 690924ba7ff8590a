"""Corrupt, truncated and orphaned packs are detected, reported by name, and their entries recomputed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffusion_pipe.store import Store, StoreError
from diffusion_pipe.store.pack import read_header
from tests.store.conftest import ENTRY_BYTES, assert_same, make_entry


def _write(store: Store, n: int = 4, pack_bytes: int = 2 * ENTRY_BYTES) -> list[str]:
    with store.writer("latent", pack_bytes=pack_bytes) as w:
        for i in range(n):
            w.add(f"k{i}", make_entry(i))
    return w.packs


def _flip_data_byte(path: Path) -> None:
    _, data_start = read_header(path)
    raw = bytearray(path.read_bytes())
    raw[data_start + 5] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_flipped_byte_detected_on_read(store: Store) -> None:
    packs = _write(store)
    bad = store.pack_path("latent", packs[0])
    _flip_data_byte(bad)
    reader = Store(store.root)  # a new process: the first open of the pack hashes it
    assert reader.contains("latent", "k0")  # size is unchanged, so the cheap check passes
    with pytest.raises(StoreError, match=rf"latent entry k0 cannot be read: latent pack {packs[0]}: pack bytes hash"):
        reader.get("latent", "k0")
    # The pack is out of sight now, for this process and every other one; its entries get recomputed.
    assert reader.missing("latent", ["k0", "k1", "k2"]) == ["k0", "k1"]
    assert Store(store.root).missing("latent", ["k0", "k1", "k2"]) == ["k0", "k1"]
    assert (store.root / "quarantine" / "latent" / bad.name).exists()
    assert_same(reader.get("latent", "k2"), make_entry(2))
    _write(store, n=2)  # a rerun recomputes them
    assert_same(Store(store.root).get("latent", "k0"), make_entry(0))


def test_flipped_byte_detected_by_verify(store: Store) -> None:
    packs = _write(store)
    _flip_data_byte(store.pack_path("latent", packs[1]))
    reader = Store(store.root, verify_reads=False)
    assert Store(store.root).verify(quarantine=False)[0].pack == packs[1]  # report only
    assert reader.contains("latent", "k2")
    (problem,) = reader.verify()
    assert problem.pack == packs[1] and problem.keys == ("k2", "k3") and "hash to" in problem.reason
    assert problem.quarantined_to is not None and f"latent pack {packs[1]}" in str(problem)
    assert reader.missing("latent", ["k1", "k2", "k3"]) == ["k2", "k3"]
    assert reader.verify() == []


def test_check_keys_fails_before_training(store: Store) -> None:
    packs = _write(store)
    _flip_data_byte(store.pack_path("latent", packs[1]))
    with pytest.raises(StoreError, match=rf"latent pack {packs[1]}: pack bytes hash .* `dvc repro --force --single-item encode`"):
        Store(store.root).check_keys("latent", ["k0", "k3"])


def test_truncated_pack_is_invisible_and_reported(store: Store) -> None:
    packs = _write(store)
    path = store.pack_path("latent", packs[0])
    path.write_bytes(path.read_bytes()[:-10])
    reader = Store(store.root)
    assert reader.missing("latent", ["k0", "k1", "k2"]) == ["k0", "k1"]
    with pytest.raises(StoreError, match="latent entry k0 is not in the store"):
        reader.get("latent", "k0")
    (problem,) = reader.verify()
    assert problem.pack == packs[0] and "truncated" in problem.reason


def test_truncated_after_load_is_caught_on_open(store: Store) -> None:
    packs = _write(store)
    reader = Store(store.root, verify_reads=False)
    assert reader.contains("latent", "k0")
    path = store.pack_path("latent", packs[0])
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(StoreError, match=rf"pack {packs[0]}: pack is \d+ bytes, its sidecar says \d+"):
        reader.get("latent", "k1")


def test_sidecar_referencing_missing_pack(store: Store) -> None:
    packs = _write(store)
    store.pack_path("latent", packs[1]).unlink()
    reader = Store(store.root)
    assert reader.missing("latent", ["k1", "k2"]) == ["k2"]
    (problem,) = reader.verify()
    assert problem.pack == packs[1] and "missing pack file" in problem.reason
    assert not store.sidecar_path("latent", packs[1]).exists()  # the orphan sidecar is quarantined
    assert reader.verify() == []


def test_pack_deleted_under_a_reader(store: Store) -> None:
    packs = _write(store)
    reader = Store(store.root)
    assert reader.contains("latent", "k0")
    store.sidecar_path("latent", packs[0]).unlink()
    store.pack_path("latent", packs[0]).unlink()
    with pytest.raises(StoreError, match="latent entry k0 cannot be read: .*deleted while in use"):
        reader.get("latent", "k0")
    assert reader.missing("latent", ["k0"]) == ["k0"]


def test_sidecar_disagreeing_with_pack(store: Store) -> None:
    packs = _write(store)
    side = store.sidecar_path("latent", packs[0])
    obj = json.loads(side.read_text())
    obj["specs"][obj["entries"]["k0"]]["latents"]["shape"] = [4, 8, 9]
    side.write_text(json.dumps(obj))
    reader = Store(store.root, verify_reads=False)
    with pytest.raises(StoreError, match="tensor k0/latents is float32\\[4, 8, 8\\] in the pack, float32\\[4, 8, 9\\]"):
        reader.get("latent", "k0")


def test_malformed_sidecar(store: Store) -> None:
    packs = _write(store)
    store.sidecar_path("latent", packs[0]).write_text("{not json")
    reader = Store(store.root)
    assert reader.missing("latent", ["k0", "k2"]) == ["k0"]
    (problem,) = reader.verify()
    assert "not valid JSON" in problem.reason


def test_corrupt_copy_falls_back_to_a_good_one(store: Store) -> None:
    bad_pack = _write(store, n=2)[0]
    with store.writer("latent") as w:  # another pack also holding k0
        w.add("k0", make_entry(0))
        w.add("x", make_entry(5))
    _flip_data_byte(store.pack_path("latent", bad_pack))
    reader = Store(store.root)
    assert_same(reader.get("latent", "k0"), make_entry(0))
    assert reader.missing("latent", ["k0", "k1"]) == ["k1"]
