"""Encoding over several GPUs and machines with no coordination beyond the store.

Each worker started by a launcher (torchrun, `deepspeed`, SLURM wrappers that set RANK/WORLD_SIZE) plans the same
samples from the same manifest, takes a disjoint share of the keys the store lacks, fetches or computes it and
publishes it to the store (and the remote). Rank 0 then waits until every key is visible, in its local store or
on the remote, and writes the stage outputs. No process group, no barrier: a worker that dies leaves whole packs
behind, and the rerun computes only what is still missing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from diffusion_pipe.store import Remote, Store, StoreError

# Rank 0 looks at its local store this often while waiting, and at the remote every _REMOTE_POLL_EVERY looks.
_POLL_S = 0.5
_REMOTE_POLL_EVERY = 10


@dataclass(frozen=True)
class WorkerLayout:
    """Which worker this process is: `rank` of `world`, `local_rank` on its machine (its GPU index)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> WorkerLayout:
        """The layout a launcher set in RANK / WORLD_SIZE / LOCAL_RANK; a world of one without a launcher."""
        try:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            rank = int(os.environ.get("RANK", "0"))
            local = int(os.environ.get("LOCAL_RANK", "0"))
        except ValueError as exc:
            raise StoreError(f"RANK/WORLD_SIZE/LOCAL_RANK must be integers ({exc}); check the launcher") from exc
        if not 0 <= rank < world:
            raise StoreError(f"RANK={rank} is outside WORLD_SIZE={world}; check the launcher's settings")
        return cls(rank, world, local)

    def share(self, keys: Sequence[str]) -> list[str]:
        """This worker's disjoint share of `keys` (every world-th key, from position `rank`)."""
        return list(keys[self.rank :: self.world])


def wait_for_entries(
    store: Store,
    remote: Remote | None,
    wanted: dict[str, list[str]],
    stall_timeout_s: float,
    pull: Callable[[str, list[str]], int],
) -> dict[str, int]:
    """Block until the store holds every key of `wanted` (family -> keys); return how many per family arrived.

    Other workers publish into the same local store (one machine) or push to the remote (several machines):
    the local store is re-read every _POLL_S, and the remote pulled from every few polls via `pull(family,
    keys)`. Raises a StoreError naming a missing key when nothing new arrived for `stall_timeout_s`.
    """
    start = {fam: len(store.missing(fam, keys)) for fam, keys in wanted.items()}
    last_count, last_progress, polls = sum(start.values()), time.monotonic(), 0
    while True:
        store.refresh()
        missing = {fam: store.missing(fam, keys) for fam, keys in wanted.items()}
        if remote is not None and polls % _REMOTE_POLL_EVERY == _REMOTE_POLL_EVERY - 1:
            for fam, keys in missing.items():
                if keys:
                    pull(fam, keys)
            missing = {fam: store.missing(fam, keys) for fam, keys in wanted.items()}
        count = sum(len(m) for m in missing.values())
        if count == 0:
            return {fam: start[fam] for fam in wanted}
        now = time.monotonic()
        if count < last_count:
            last_count, last_progress = count, now
        elif now - last_progress > stall_timeout_s:
            fam, keys = next((f, k) for f, k in missing.items() if k)
            where = f"the store at {store.root}" + (f" or the remote {remote.url}" if remote else "")
            raise StoreError(
                f"rank 0 waited {stall_timeout_s:.0f} s without a new entry from the other encode workers: {count} "
                f"entries are still missing from {where} (first: {fam} {keys[0]}). A worker probably failed (see "
                "its log); re-run the encode stage, which computes only what is missing, or raise "
                "encode.worker_stall_timeout_s if the workers are just slow"
            )
        polls += 1
        time.sleep(_POLL_S)
