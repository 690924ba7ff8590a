"""Where did the GPU wait on the host? Reads a torch.profiler Chrome trace (the train stage writes one with
DIFFUSION_PIPE_PROFILE=<file>: <file>.trace.json) and reports, per annotated step, the wall time, the time the
GPU was busy, and the idle gaps between kernels with the host work that ran during them.

    python bench/trace_gaps.py runs/prof.txt.trace.json [--min-gap-ms 0.5] [--top 15]

Gaps under --min-gap-ms are summed as launch latency; each longer gap is attributed to the innermost host
annotation or operator running at its start and to the DeepSpeed pipeline-engine instruction around it
(`pipe.<Instruction>` annotations), so the tables say which host work the GPU waited for.
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict
from pathlib import Path

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATEGORIES = {"cpu_op", "user_annotation", "cuda_runtime", "python_function"}


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """Union of the device's kernel/copy intervals, sorted (microseconds)."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in DEVICE_CATEGORIES)
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def innermost(host: list[dict], starts: list[float], t: float, window: int = 400) -> str:
    """The name of the shortest host event among the `window` that began last before time `t` that contains
    `t` (host events nest, so the innermost one began shortly before)."""
    best, best_dur = "(no host event)", float("inf")
    i = bisect.bisect_right(starts, t)
    for e in host[max(0, i - window):i]:
        dur = e.get("dur", 0)
        if e["ts"] + dur >= t and dur < best_dur:
            best, best_dur = e["name"], dur
    return best


def enclosing(spans: list[tuple[float, float, str]], t: float) -> str | None:
    """The name of the span (start, end, name; sorted, not overlapping) that contains time `t`, if any."""
    i = bisect.bisect_right(spans, (t, float("inf"), "")) - 1
    return spans[i][2] if i >= 0 and spans[i][0] <= t <= spans[i][1] else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--min-gap-ms", type=float, default=0.5, help="gaps shorter than this are not itemised")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    events = [e for e in json.loads(args.trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    busy = busy_intervals(events)
    host = sorted((e for e in events if e.get("cat") in HOST_CATEGORIES), key=lambda e: e["ts"])
    starts = [e["ts"] for e in host]
    steps = sorted((e for e in host if e["name"].startswith("train.step")), key=lambda e: e["ts"])
    windows = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in steps] or [("trace", busy[0][0], busy[-1][1])]

    instructions = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in host
                          if e["name"].startswith("pipe."))
    min_gap = args.min_gap_ms * 1e3
    by_cause: dict[str, float] = defaultdict(float)
    by_instruction: dict[str, float] = defaultdict(float)
    small_us = 0.0
    for name, lo, hi in windows:
        inside = [(max(a, lo), min(b, hi)) for a, b in busy if b > lo and a < hi]
        busy_us = sum(b - a for a, b in inside)
        edges = [lo] + [x for span in inside for x in span] + [hi]
        gaps = [(edges[i], edges[i + 1]) for i in range(0, len(edges) - 1, 2) if edges[i + 1] > edges[i]]
        large = [(a, b) for a, b in gaps if b - a >= min_gap]
        idle_us = sum(b - a for a, b in gaps)
        large_us = sum(b - a for a, b in large)
        small_us += idle_us - large_us
        print(f"{name}: wall {(hi - lo) / 1e3:8.1f} ms, GPU busy {busy_us / 1e3:8.1f} ms, idle {idle_us / 1e3:7.1f} ms "
              f"in {len(gaps)} gaps ({large_us / 1e3:.1f} ms in {len(large)} gaps of {args.min_gap_ms} ms or more)")
        for a, b in large:
            by_cause[innermost(host, starts, a)] += b - a
            by_instruction[enclosing(instructions, a) or "(outside engine instructions)"] += b - a
    n = len(windows)
    print(f"\nper step (mean of {n}): {small_us / n / 1e3:.2f} ms idle in gaps under {args.min_gap_ms} ms "
          "(launch latency between kernels); the gaps of at least that, by engine instruction at their start:")
    for name, us in sorted(by_instruction.items(), key=lambda kv: -kv[1]):
        print(f"  {us / n / 1e3:8.2f}  {name}")
    print(f"\nthe same gaps by the innermost host event at their start (top {args.top}, ms per step):")
    for name, us in sorted(by_cause.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {us / n / 1e3:8.2f}  {name}")


if __name__ == "__main__":
    main()
