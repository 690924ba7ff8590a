"""bench/trace_gaps.py: device idle time from a Chrome trace, attributed to the host work at each gap."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def event(name, cat, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_idle_gaps_are_measured_and_attributed(tmp_path):
    trace = {"traceEvents": [
        event("train.step3", "user_annotation", 0, 1000),
        event("pipe.LoadMicroBatch", "user_annotation", 0, 300),
        event("store.read", "cpu_op", 10, 280),  # the device waits 290 us for this (0..300 idle but 10 us)
        event("pipe.ForwardPass", "user_annotation", 300, 700),
        event("k1", "kernel", 300, 200),
        event("k2", "kernel", 450, 250),  # overlaps k1: busy 300..700
        event("k3", "kernel", 700.2, 299.8),  # a 0.2 us launch gap
        {"ph": "i", "name": "marker", "ts": 5},
    ]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    out = subprocess.run([sys.executable, str(REPO / "bench/trace_gaps.py"), str(path), "--min-gap-ms", "0.1"],
                         capture_output=True, text=True, check=True).stdout
    assert "wall      1.0 ms, GPU busy      0.7 ms, idle     0.3 ms in 2 gaps (0.3 ms in 1 gaps" in out
    lines = out.splitlines()
    by_instruction = lines[lines.index(next(line for line in lines if "by engine instruction" in line)) + 1]
    assert by_instruction.split() == ["0.30", "pipe.LoadMicroBatch"]
    by_host = lines[lines.index(next(line for line in lines if "innermost host event" in line)) + 1]
    assert by_host.split() == ["0.30", "pipe.LoadMicroBatch"]  # at the gap's start (t=0) store.read had not begun
