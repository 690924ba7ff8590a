"""Concurrent writers share work through their leases' claims (diffusion_pipe.store.claims): real leases, real
packs, a second writer on a thread."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from diffusion_pipe.store import Store
from diffusion_pipe.store.claims import claimed_elsewhere, share_work, wait_for_claimed
from tests.store.conftest import make_entry

KEYS = [f"k{i}" for i in range(6)]


def _publish_later(store: Store, keys: list[str], release, delay_s: float = 0.3) -> threading.Thread:
    """Another writer: after `delay_s`, publish `keys` and call `release` (its lease's end)."""
    def run() -> None:
        time.sleep(delay_s)
        if keys:
            with Store(store.root).writer("latent") as w:
                for k in keys:
                    w.add(k, make_entry(int(k[1:])))
        release()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_later_claim_waits_for_the_earlier_claimant_instead_of_computing(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    with store.lease("encode") as first, store.lease("encode") as second:
        assert share_work(store, first, {"latent": KEYS[:4]}) == {"latent": {}}
        deferred = share_work(store, second, {"latent": KEYS[2:]})
        assert deferred == {"latent": {"k2": first.path.name, "k3": first.path.name}}
        # the first writer, looking again, still computes everything it claimed: the later claim yields
        assert claimed_elsewhere(store, first, "latent", KEYS[:4]) == {}
        thread = _publish_later(store, ["k2", "k3"], first.release)
        started = time.monotonic()
        assert wait_for_claimed(store, deferred, stall_s=60) == {"latent": []}
        assert time.monotonic() - started < 10
        thread.join()
    assert Store(store.root).missing("latent", ["k2", "k3"]) == []


def test_keys_a_claimant_stopped_without_are_computed_here_at_once(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    with store.lease("encode") as other, store.lease("encode") as own:
        share_work(store, other, {"latent": KEYS[:3]})
        deferred = share_work(store, own, {"latent": KEYS[:3]})
        assert set(deferred["latent"]) == set(KEYS[:3])
        thread = _publish_later(store, ["k0"], other.release)  # it publishes one key, then its lease ends
        started = time.monotonic()
        assert wait_for_claimed(store, deferred, stall_s=20) == {"latent": ["k1", "k2"]}
        assert time.monotonic() - started < 10
        thread.join()


def test_a_live_claimant_that_publishes_nothing_is_waited_for_only_until_the_stall_bound(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    with store.lease("encode") as other, store.lease("encode") as own:
        share_work(store, other, {"latent": KEYS[:2], "text": []})
        deferred = share_work(store, own, {"latent": KEYS, "text": ["t"]})
        assert deferred == {"latent": {"k0": other.path.name, "k1": other.path.name}, "text": {}}
        started, result = time.monotonic(), []
        waiter = threading.Thread(target=lambda: result.append(wait_for_claimed(store, deferred, stall_s=0.5)),
                                  daemon=True)
        waiter.start()
        waiter.join(10)
        assert result == [{"latent": ["k0", "k1"], "text": []}], "still waiting after 10 s"
        assert time.monotonic() - started >= 0.5
