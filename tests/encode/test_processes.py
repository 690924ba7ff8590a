"""The encode stage as real processes: killed with SIGKILL mid-way, two at once on one store, two workers
under torchrun splitting the missing keys."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from diffusion_pipe.store import Store
from tests.conftest import make_pipeline_repo, run_checked, run_env, torchrun
from tests.encode.helpers import run_stage

# Tiny packs (about one entry each) and batches of one: many publications, so a kill lands between them.
SMALL_PACKS = {"batch_size: 8": "batch_size: 1", "workers: 0": "workers: 0\n  remote: ''\n  pack_size_mb: 0.001"}


def _scanned_repo(tmp_path: Path, edits: dict[str, str] | None = None) -> tuple[Path, Path]:
    store = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store, edits or {"workers: 0": "workers: 0\n  remote: ''"})
    run_stage(repo, store, "scan")
    return repo, store


def _sidecars(store: Path, family: str) -> int:
    directory = store / family
    return sum(1 for p in directory.glob("*.json")) if directory.is_dir() else 0


def _all_keys_present(repo: Path, store: Store, table: Path | None = None) -> None:
    encoded = pq.read_table(table or repo / "data/encoded.parquet")
    assert encoded.num_rows == 36
    assert store.missing("latent", encoded.column("latent_key").to_pylist()) == []
    assert store.missing("text", encoded.column("text_key").to_pylist()) == []


def test_sigkill_mid_encode_then_rerun_computes_only_the_rest(tmp_path: Path) -> None:
    repo, store_dir = _scanned_repo(tmp_path, SMALL_PACKS)
    proc = subprocess.Popen([sys.executable, "-m", "stages.encode"], cwd=repo, env=run_env(store_dir),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while _sidecars(store_dir, "latent") < 4:  # a few packs are out: kill while the next ones are being made
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
        assert time.monotonic() < deadline, "encode published nothing in 120 s"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not (repo / "data/encoded.parquet").exists() and not (repo / "reports/encode.json").exists()

    store = Store(store_dir)
    assert store.verify() == []  # every visible pack is whole: hash, header and sidecar agree
    for family in ("latent", "text"):
        for pack_id, sidecar in store.packs(family).items():
            assert store.pack_path(family, pack_id).stat().st_size == sidecar.size
    latents, texts = len(store.keys("latent")), len(store.keys("text"))
    assert 4 <= latents < 36 or (latents == 36 and texts < 36)

    run_stage(repo, store_dir, "encode")
    report = json.loads((repo / "reports/encode.json").read_text())
    assert report["latent"]["computed"] == 36 - latents and report["latent"]["reused_local"] == latents
    assert report["text"]["computed"] == 36 - texts and report["text"]["reused_local"] == texts
    store.refresh()
    _all_keys_present(repo, store)
    assert store.verify() == []


@pytest.mark.slow  # about 20 s; tests/store/test_processes.py covers concurrent writers by default
def test_two_encoders_on_one_store_at_once(tmp_path: Path) -> None:
    repo, store_dir = _scanned_repo(tmp_path, SMALL_PACKS)
    procs = [
        subprocess.Popen([sys.executable, "-m", "stages.encode", "--encoded", f"out{i}/encoded.parquet",
                          "--report", f"out{i}/encode.json"], cwd=repo, env=run_env(store_dir),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    store = Store(store_dir)
    assert store.verify() == []
    tables = [(repo / f"out{i}/encoded.parquet").read_bytes() for i in range(2)]
    assert tables[0] == tables[1]
    _all_keys_present(repo, store, repo / "out0/encoded.parquet")
    reports = [json.loads((repo / f"out{i}/encode.json").read_text()) for i in range(2)]
    for fam in ("latent", "text"):  # each entry was computed by one of them and found or waited for by the other
        assert all(r[fam]["computed"] + r[fam]["reused_local"] + r[fam]["by_other_encoders"] == 36 for r in reports)
        assert sum(r[fam]["computed"] for r in reports) == 36  # the later claim waits: nothing computed twice
    assert not [p for fam in ("latent", "text") for p in (store_dir / fam).iterdir() if p.name.startswith(".")]


def test_two_workers_under_torchrun_split_the_missing_keys(tmp_path: Path) -> None:
    repo, store_dir = _scanned_repo(tmp_path)
    result = run_checked([*torchrun(2), "-m", "stages.encode"], cwd=repo, env=run_env(store_dir), timeout=300)
    report = json.loads((repo / "reports/encode.json").read_text())
    assert report["workers"] == 2
    for fam in ("latent", "text"):
        # rank 0 computed every other key; the rest came from rank 1 through the store, seen before rank 0
        # looked (reused) or while it waited
        assert report[fam]["computed"] == 18
        assert report[fam]["reused_local"] + report[fam]["by_other_workers"] == 18
    assert "encode worker 1/2: latent computed 18" in result.stderr
    store = Store(store_dir)
    _all_keys_present(repo, store)
    assert store.verify() == []


def test_a_worker_that_starts_after_another_published_still_gets_every_key(tmp_path: Path) -> None:
    """Worker 1 of 2 publishes its share before worker 0 has looked at the store (one slow to load its encoders):
    worker 0 still computes exactly its own share and finds the rest, rather than splitting a shorter missing list
    and waiting for keys no worker computes."""
    repo, store_dir = _scanned_repo(tmp_path, {"workers: 0": "workers: 0\n  remote: ''\n  worker_stall_timeout_s: 20"})
    for rank in ("1", "0"):
        run_checked([sys.executable, "-m", "stages.encode"], cwd=repo,
                    env=run_env(store_dir) | {"RANK": rank, "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, timeout=300)
    report = json.loads((repo / "reports/encode.json").read_text())
    for fam in ("latent", "text"):
        assert report[fam]["computed"] == 18 and report[fam]["reused_local"] == 18
    _all_keys_present(repo, Store(store_dir))


@pytest.mark.parametrize("rank_env", [{"RANK": "2", "WORLD_SIZE": "2"}, {"RANK": "x", "WORLD_SIZE": "2"}])
def test_bad_launcher_settings_are_named(rank_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusion_pipe.encode.workers import WorkerLayout
    from diffusion_pipe.store import StoreError

    for name, value in rank_env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(StoreError, match="RANK"):
        WorkerLayout.from_env()
