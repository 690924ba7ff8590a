"""Measure the store's write throughput, the next run's reuse check (what an incremental encode pays before it
computes anything: the full hash of a pack is paid once per machine, when it is written or pulled) and the read-path
verification cost (first open of a pack hashes it).

Usage: python bench/bench_store.py [--pack-mb 256] [--packs 2] [--entry-kb 256]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from diffusion_pipe.store import Store


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pack-mb", type=int, default=256)
    ap.add_argument("--packs", type=int, default=2)
    ap.add_argument("--entry-kb", type=int, default=256)
    args = ap.parse_args()
    numel = args.entry_kb * 1024 // 4
    per_pack = args.pack_mb * 1024 // args.entry_kb
    n = per_pack * args.packs
    t = torch.randn(numel)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp))
        t0 = time.perf_counter()
        with store.writer("latent", pack_bytes=args.pack_mb << 20) as w:
            for i in range(n):
                w.add(f"k{i}", {"latents": t})
        dt = time.perf_counter() - t0
        total_mb = n * args.entry_kb / 1024
        print(f"write: {n} entries, {len(w.packs)} packs, {total_mb:.0f} MB in {dt:.2f} s ({total_mb / dt:.0f} MB/s)")
        t0 = time.perf_counter()
        assert Store(Path(tmp)).check_reused("latent", [f"k{i}" for i in range(n)]) == []
        print(f"next run's reuse check (encode's check_reused of every key): {time.perf_counter() - t0:.3f} s")
        for verify in (False, True):
            reader = Store(Path(tmp), verify_reads=verify)
            t0 = time.perf_counter()
            reader.refresh()
            reader.missing("latent", [f"k{i}" for i in range(n)])
            t_index = time.perf_counter() - t0
            t0 = time.perf_counter()
            reader.get("latent", "k0")
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i in range(n):
                reader.get("latent", f"k{i}")
            rest = time.perf_counter() - t0
            print(
                f"verify_reads={verify}: index load {t_index * 1e3:.1f} ms, first get {first * 1e3:.1f} ms, "
                f"all {n} gets {rest:.2f} s ({total_mb / rest:.0f} MB/s)"
            )
        t0 = time.perf_counter()
        problems = Store(Path(tmp)).verify()
        dt = time.perf_counter() - t0
        print(f"verify(): {len(problems)} problems, {dt:.2f} s ({total_mb / dt:.0f} MB/s)")


if __name__ == "__main__":
    main()
