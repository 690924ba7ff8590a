"""Rank 0 of a multi-worker encode waits for the other workers' entries (encode/workers.py `wait_for_entries`):
it returns once every key arrived, keeps waiting while entries keep arriving, and gives up with an error naming
a missing key and `encode.worker_stall_timeout_s` when nothing new arrives for that long (a failed worker),
instead of hanging."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from diffusion_pipe.encode.workers import wait_for_entries
from diffusion_pipe.store import Store, StoreError


def _publish_later(store_root, keys: list[str], every_s: float) -> threading.Thread:
    """Another worker: publishes one entry every `every_s` seconds into the same store directory."""
    def run():
        other = Store(store_root)
        for key in keys:
            time.sleep(every_s)
            with other.writer("latent") as writer:
                writer.add(key, {"latents": torch.zeros(2)})
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _no_pull(family, keys):
    raise AssertionError("no remote: nothing to pull")


def test_returns_when_every_entry_arrived_while_progress_outlasts_the_timeout(tmp_path):
    store = Store(tmp_path / "store")
    keys = ["a", "b", "c"]
    # three entries 1.2 s apart: 3.6 s in all, longer than the 2 s stall timeout, but never 2 s without one
    worker = _publish_later(store.root, keys, 1.2)
    assert wait_for_entries(store, None, {"latent": keys}, 2.0, _no_pull) == {"latent": 3}
    worker.join()


def test_a_stalled_worker_is_an_error_naming_the_missing_entry_and_the_param(tmp_path):
    store = Store(tmp_path / "store")
    worker = _publish_later(store.root, ["a"], 0.1)  # publishes one of its two entries, then stops
    started = time.monotonic()
    with pytest.raises(StoreError) as err:
        wait_for_entries(store, None, {"latent": ["a", "b"]}, 1.0, _no_pull)
    assert time.monotonic() - started < 10
    message = str(err.value)
    assert "1 entries are still missing from the store at" in message and "(first: latent b)" in message
    assert "encode.worker_stall_timeout_s" in message
    worker.join()
