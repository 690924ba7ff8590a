"""Scan benchmark: first scan of N small images, rescans (nothing changed, 1% changed), and hashing throughput.

    python bench/bench_scan.py            # n=5000 512x512 JPEGs, a 1 GiB file for hashing
    python bench/bench_scan.py --n 100000 --size 64 --format png

Each image is a photo-like JPEG (smooth colours plus grain, 512x512 and about 68 KB by default) or a PNG, with a
caption; `--size 64` gives thumbnails whose decode is so cheap that the rescan's fixed per-file cost (walk,
stat, rows) dominates the ratio. Ratios are first-scan time / rescan time. Hashing compares the scan's
large-file hash (`hashing.hash_file`: mmap of the page cache, the file was just written) with
`xxhash.xxh3_128` over the same bytes already in memory, in the same run (best of 3 each).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusion_pipe.params import DatasetParams, ScanParams  # noqa: E402
from diffusion_pipe.scan import scan_to_files  # noqa: E402
from diffusion_pipe.hashing import hash_file  # noqa: E402


def make_images(root: Path, n: int, size: int = 512, fmt: str = "jpg", seed: int = 0) -> None:
    """n photo-like images (size x size) with captions, 1000 per directory."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for i in range(n):
        d = root / f"{i // 1000:03d}"
        d.mkdir(parents=True, exist_ok=True)
        # Smooth random colours plus grain: compresses like a photo, unlike pure noise.
        base = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)).resize((size, size), Image.BILINEAR)
        grain = rng.integers(-12, 13, (size, size, 3), dtype=np.int16)
        pixels = np.clip(np.asarray(base, dtype=np.int16) + grain, 0, 255).astype(np.uint8)
        img = Image.fromarray(pixels)
        if fmt == "png":
            img.save(d / f"{i:06d}.png", compress_level=1)
        else:
            img.save(d / f"{i:06d}.jpg", quality=90)
        (d / f"{i:06d}.txt").write_text(f"image number {i}")


def timed_scan(params: ScanParams, out: Path) -> tuple[float, dict]:
    start = time.perf_counter()
    report = scan_to_files(params, out / "manifest.parquet", out / "scan.json", out / "cache.parquet")
    return time.perf_counter() - start, report


def bench_hash(mib: int, tmp: Path) -> tuple[float, float]:
    """GB/s of the scan's large-file hash on a file of `mib` MiB, and of xxh3_128 over the same bytes in memory."""
    import xxhash

    data = os.urandom(mib << 20)
    path = tmp / "big.bin"
    path.write_bytes(data)
    hash_file(path)  # warm-up: the file is in the page cache for both runs
    best_file = best_mem = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        h_file = hash_file(path)
        best_file = min(best_file, time.perf_counter() - start)
        start = time.perf_counter()
        h_mem = xxhash.xxh3_128(data).hexdigest()
        best_mem = min(best_mem, time.perf_counter() - start)
        assert h_file == h_mem
    path.unlink()
    gb = len(data) / 1e9
    return gb / best_file, gb / best_mem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=5000, help="number of images (default 5000)")
    ap.add_argument("--size", type=int, default=512, help="image side in pixels (default 512)")
    ap.add_argument("--format", choices=["jpg", "png"], default="jpg")
    ap.add_argument("--workers", type=int, default=0, help="scan workers, 0: every core")
    ap.add_argument("--hash-mib", type=int, default=1024, help="size of the hashed file in MiB (0: skip)")
    ap.add_argument("--tmp", default=tempfile.gettempdir(), help="where the dataset and the big file go")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-scan-", dir=args.tmp))
    try:
        ds, out = tmp / "ds", tmp / "out"
        start = time.perf_counter()
        make_images(ds, args.n, args.size, args.format)
        print(f"generated {args.n} images in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        params = ScanParams(datasets=(DatasetParams(path=str(ds)),), workers=args.workers)
        first, report = timed_scan(params, out)
        assert report["ok"] == args.n, report["excluded_by_reason"]
        rescans = []
        for _ in range(3):  # median of 3: a rescan is short, and fsync latency on this disk varies
            t, report = timed_scan(params, out)
            assert report["run"]["files_probed"] == 0
            rescans.append(t)
        again = sorted(rescans)[1]
        changed = max(1, args.n // 100)
        partials = []
        for seed in (1, 2, 3):  # median of 3, each time other bytes
            make_images(ds, changed, args.size, args.format, seed=seed)  # rewrites the first 1%: new bytes, mtimes
            t, report = timed_scan(params, out)
            assert report["run"]["files_probed"] == 2 * changed, report["run"]
            assert report["run"]["rows_rebuilt"] == changed, report["run"]  # the other rows are the last scan's
            partials.append(t)
        partial = sorted(partials)[1]
        workers = report["run"]["workers"]
        lines = [
            f"scan benchmark: n={args.n} images ({args.size}x{args.size} {args.format} + caption), workers={workers}, cpus={os.cpu_count()}",
            f"  first scan              {first:8.2f} s   {args.n / first:9.0f} images/s",
            f"  rescan, nothing changed {again:8.2f} s   {first / again:6.1f}x faster than the first scan "
            f"(median of 3: {', '.join(f'{t:.2f}' for t in rescans)} s)",
            f"  rescan, 1% changed      {partial:8.2f} s   {first / partial:6.1f}x faster than the first scan "
            f"(median of 3: {', '.join(f'{t:.2f}' for t in partials)} s; {changed} rows rebuilt)",
        ]
        if args.hash_mib:
            file_gbs, mem_gbs = bench_hash(args.hash_mib, tmp)
            lines.append(f"  hash {args.hash_mib} MiB file          {file_gbs:8.2f} GB/s vs xxh3_128 in memory "
                         f"{mem_gbs:.2f} GB/s: {100 * file_gbs / mem_gbs:.0f}% of raw")
        print("\n".join(lines))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
