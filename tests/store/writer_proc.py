"""A store writer run as a separate process by the crash and concurrency tests.

Usage: python writer_proc.py ROOT START STOP PACK_BYTES DELAY_S [GO_FILE]
Writes entries k<START>..k<STOP-1> (skipping those the store already holds), printing the number of
published entries after every add, then "done <computed>". With GO_FILE, waits for it to exist first.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from diffusion_pipe.store import Store


def entry(i: int) -> dict[str, torch.Tensor]:
    """The deterministic content of entry k<i>, so readers can check what they read."""
    return {
        "latents": torch.full((4, 8, 8), float(i), dtype=torch.float32),
        "mask": torch.arange(16, dtype=torch.bfloat16) + i,
    }


def key(i: int) -> str:
    return f"k{i:05d}"


def main() -> None:
    root, start, stop, pack_bytes, delay = sys.argv[1], *map(int, sys.argv[2:5]), float(sys.argv[5])
    if len(sys.argv) > 6:
        while not Path(sys.argv[6]).exists():
            time.sleep(0.005)
    store = Store(root)
    todo = set(store.missing("latent", [key(i) for i in range(start, stop)]))
    computed = 0
    with store.writer("latent", pack_bytes=pack_bytes) as w:
        for i in range(start, stop):
            if key(i) not in todo:
                continue
            w.add(key(i), entry(i))
            computed += 1
            print(w.written, flush=True)
            if delay:
                time.sleep(delay)
    print(f"done {computed}", flush=True)


if __name__ == "__main__":
    main()
