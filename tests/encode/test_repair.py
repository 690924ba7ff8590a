"""Encode repairs the store it reuses: a pack with a flipped byte is found before training (and its entries
recomputed), the command the store's errors give repairs it, and the lease covers the table's publication."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from diffusion_pipe.store import Store, StoreError, live_leases
from diffusion_pipe.store.pack import read_header
from tests.conftest import make_pipeline_repo, run_env
from tests.encode.helpers import environment, reproduce, run_stage

NO_REMOTE = {"workers: 0": "workers: 0\n  remote: ''"}


def _flip_data_byte(path: Path) -> None:
    _, data_start = read_header(path)
    with open(path, "r+b") as fh:
        fh.seek(data_start + 5)
        byte = fh.read(1)
        fh.seek(data_start + 5)
        fh.write(bytes([byte[0] ^ 0xFF]))


def _report(repo: Path) -> dict:
    return json.loads((repo / "reports" / "encode.json").read_text())


def _follow(message: str, repo: Path, store: Path) -> None:
    """Run the first command the message quotes, as a user would paste it."""
    command = re.search(r"`(dvc [^`]+)`", message)
    assert command is not None, message
    subprocess.run([sys.executable, "-m", *command.group(1).split()], cwd=repo, env=run_env(store), check=True,
                   capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # about 40 s: three encode runs through DVC; tests/store/test_repair.py guards the checks fast
def test_a_flipped_byte_is_repaired_by_encode_and_by_following_the_error(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store_dir, NO_REMOTE)
    assert reproduce(repo, store_dir, "encode") == ["scan", "encode"]
    store = Store(store_dir)
    latent = sorted(store.packs("latent"))[0]
    entries = len(store.packs("latent")[latent].entries)

    # 1. A flipped byte in a reused pack: encode finds it (exit 0 before, and training failed minutes later),
    #    quarantines it and recomputes its entries in the same run.
    _flip_data_byte(store.pack_path("latent", latent))
    assert reproduce(repo, store_dir, "encode", force=True, single_item=True) == ["encode"]
    report = _report(repo)
    assert report["latent"]["quarantined_packs"] == 1 and report["latent"]["computed"] == entries
    assert Store(store_dir).verify() == []

    # 2. A damaged pack met by a reader (training): its error names the command; following it repairs the store.
    text = sorted(Store(store_dir).packs("text"))[0]
    key = next(iter(Store(store_dir).packs("text")[text].entries))
    _flip_data_byte(Store(store_dir).pack_path("text", text))
    with pytest.raises(StoreError, match=r"`dvc repro --force --single-item encode`") as err:
        Store(store_dir).get("text", key)
    assert reproduce(repo, store_dir, "encode") == ["scan"]  # what the old advice, `dvc repro encode`, did
    _follow(str(err.value), repo, store_dir)
    fresh = Store(store_dir)
    assert fresh.verify() == [] and fresh.get("text", key)
    assert _report(repo)["text"]["computed"] > 0  # the quarantined pack's entries, computed again


def test_the_encode_lease_lasts_until_the_table_is_published(tmp_path: Path, monkeypatch) -> None:
    import diffusion_pipe.encode.encode as enc
    from diffusion_pipe.params import load_params

    store_dir = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store_dir, NO_REMOTE, dvc=False)
    run_stage(repo, store_dir, "scan")
    seen: list[int] = []
    real = enc.write_encoded_table

    def observed(samples, path):  # the real writer, watched: how many encodes hold a lease as it publishes
        seen.append(len(live_leases(store_dir)))
        real(samples, path)

    monkeypatch.setattr(enc, "write_encoded_table", observed)
    params = load_params(repo / "params.yaml")
    with environment(run_env(store_dir), repo):
        enc.encode_manifest(params.model, params.scan, params.encode, Path("data/manifest.parquet"),
                            Path("data/encoded.parquet"), Path("reports/encode.json"), Store(store_dir),
                            repo_root=repo)
    assert seen == [1]  # gc running now would spare every pack the new table names
    assert live_leases(store_dir) == []  # released once published
