"""The Markdown table of a `bench/bench_train.py --json` result, as BENCHMARKS.md quotes it.

    python bench/results_table.py bench/results/FILE.json

BENCHMARKS.md puts `<!-- table: bench/results/FILE.json -->` on the line before each such table; a test
(tests/test_bench.py) renders every marked file again and requires the text that follows to be exactly this, so a
figure in BENCHMARKS.md is the figure in the committed result.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RUNNERS = ("plain", "plain-diffusers", "ours")


def train_table(results: dict) -> str:
    """Rows of every variant and runner (s/step, MFU against the run's own matmul peak, peak GB, ours' losses),
    then the baseline check's lines (each plain loop's compile gain, and the ratios it allowed)."""
    flops, peak = results.get("flops_per_step"), results.get("peak_flops")
    lines = [f"{results['shape']} shape on {results['gpu'] or results['device']}, torch {results['torch']}"
             f"{', CUDA ' + results['cuda'] if results.get('cuda') else ''}, {results['steps']} steps, "
             f"{results.get('date', '')}, commit {results.get('commit')}: `{results.get('command', '')}`", "",
             "| variant | runner | s/step | MFU | peak GB | loss, first step | loss, mean of last 10 |",
             "|---|---|---|---|---|---|---|"]
    for variant, runs in results.items():
        if not isinstance(runs, dict) or "params" not in runs:
            continue
        for runner in (r for r in RUNNERS if r in runs):
            r = runs[runner]
            mfu = f"{flops / r['step_seconds'] / peak:.0%}" if flops and peak else "-"
            losses = [f"{r[k]:.4f}" if r.get(k) is not None else "-" for k in ("train_loss_first", "train_loss_last10")]
            lines.append(f"| {variant} | {runner} | {r['step_seconds']:.3f} | {mfu} | {r.get('max_memory_gb') or '-'} "
                         f"| {' | '.join(losses)} |")
    check = results.get("baseline_check")
    if check:
        lines += [""] + [f"- {line}" for line in check["lines"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    print(train_table(json.loads(Path(sys.argv[1]).read_text())), end="")


if __name__ == "__main__":
    main()
