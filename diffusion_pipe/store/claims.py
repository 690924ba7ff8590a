"""Concurrent encoders share work through the store's leases, as a build cache's workers do.

An encoder records in its lease the keys it is about to compute (`Lease.claim`), then reads the claims of the other
live writers: a key that another writer claimed earlier (claim time, then lease file name, so that of two claims
exactly one wins) is theirs, and this encoder waits for it to be published instead of computing it
(`wait_for_claimed`). The wait is bounded: a key whose claimant's lease is gone (it finished without publishing
the key, failed, or was killed: a lease of a dead process or untouched for LEASE_TTL_S is not live) is computed
here after all, and so is everything still missing once nothing new has arrived for `stall_s`. Nothing depends on
the claims for correctness: packs are immutable, and two writers of one key are harmless, only wasteful.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from diffusion_pipe.store.store import Lease, Store, live_leases

# How often a waiting encoder looks at the store and the claimants' leases.
POLL_S = 0.5


def claimed_elsewhere(store: Store, own: Lease, family: str, keys: Iterable[str]) -> dict[str, str]:
    """Key -> lease file of the live writer that claimed it before `own` did (`own` must have claimed already),
    for those of `keys` that another writer claimed first."""
    assert own.claimed_at is not None, "claim before looking at other writers' claims"
    mine = (own.claimed_at, own.path.name)
    wanted, out = set(keys), {}
    for lease in sorted(live_leases(store.root), key=lambda r: (float(r.get("claimed_at", 0)), r["file"])):
        if lease["file"] == own.path.name or "claims" not in lease:
            continue
        if (float(lease["claimed_at"]), lease["file"]) > mine:  # a later claim yields to this one
            continue
        for key in lease["claims"].get(family, ()):
            if key in wanted:
                out.setdefault(key, lease["file"])
    return out


def share_work(store: Store, own: Lease, todo: dict[str, list[str]]) -> dict[str, dict[str, str]]:
    """Claim `todo` (family -> keys this writer lacks) in `own`; return per family the keys another live writer
    claimed first (key -> its lease file): this writer waits for those (`wait_for_claimed`) and computes the rest."""
    own.claim(todo)
    return {fam: claimed_elsewhere(store, own, fam, keys) for fam, keys in todo.items()}


def wait_for_claimed(store: Store, deferred: dict[str, dict[str, str]], stall_s: float) -> dict[str, list[str]]:
    """Wait until the store holds every deferred key (family -> key -> claimant's lease file); return per family
    the keys this writer must compute after all: those whose claimant's lease is no longer live, and, once
    nothing has arrived for `stall_s`, all that are still missing."""
    left: dict[str, list[str]] = {fam: [] for fam in deferred}
    waiting = {fam: dict(keys) for fam, keys in deferred.items()}
    last_count, last_progress = sum(map(len, waiting.values())), time.monotonic()
    while True:
        store.refresh()
        live = {lease["file"] for lease in live_leases(store.root)}
        for fam, keys in waiting.items():
            missing = set(store.missing(fam, keys))
            for key in list(keys):
                if key not in missing:
                    del keys[key]
                elif keys[key] not in live:  # its claimant stopped without publishing it
                    left[fam].append(key)
                    del keys[key]
        count = sum(map(len, waiting.values()))
        now = time.monotonic()
        if count < last_count:
            last_count, last_progress = count, now
        if count == 0 or now - last_progress > stall_s:
            return {fam: sorted([*left[fam], *waiting[fam]]) for fam in deferred}
        time.sleep(POLL_S)
