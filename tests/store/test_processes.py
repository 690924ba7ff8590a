"""Real processes: a writer killed with SIGKILL mid-encode, and two writers sharing one store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from diffusion_pipe.store import Store
from tests.store import writer_proc
from tests.store.writer_proc import entry, key

REPO = Path(__file__).resolve().parents[2]
ENTRY = sum(t.numel() * t.element_size() for t in entry(0).values())
PACK_BYTES = 4 * ENTRY - 1  # four entries per pack


def _spawn(root: Path, start: int, stop: int, delay: float, go: Path | None = None) -> subprocess.Popen[str]:
    args = [sys.executable, writer_proc.__file__, str(root), str(start), str(stop), str(PACK_BYTES), str(delay)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([*args, *([str(go)] if go else [])], stdout=subprocess.PIPE, text=True, env=env)


def _check_visible_entries(store: Store, n: int) -> list[str]:
    """Every visible entry reads back exactly; returns the visible keys."""
    visible = [key(i) for i in range(n) if store.contains("latent", key(i))]
    for k in visible:
        got = store.get("latent", k)
        want = entry(int(k[1:]))
        assert got.keys() == want.keys() and all(torch.equal(got[t], want[t]) for t in want)
    return visible


def test_sigkill_mid_encode_leaves_no_partial_pack(tmp_path: Path) -> None:
    root, n = tmp_path / "store", 400
    proc = _spawn(root, 0, n, delay=0.002)
    assert proc.stdout is not None
    published = 0
    for line in proc.stdout:  # wait until a few packs are out, then kill in the middle of the next ones
        published = int(line)
        if published >= 12:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    store = Store(root)
    visible = _check_visible_entries(store, n)
    # Packs are published in order, whole: the visible keys are a prefix made of whole packs.
    m = len(visible)
    assert visible == [key(i) for i in range(m)] and m % 4 == 0 and 12 <= m < n
    assert store.verify() == []
    assert store.missing("latent", [key(i) for i in range(n)]) == [key(i) for i in range(m, n)]

    rerun = _spawn(root, 0, n, delay=0)
    out, _ = rerun.communicate(timeout=60)
    assert rerun.returncode == 0
    assert out.splitlines()[-1] == f"done {n - m}"  # only the missing entries were computed
    store.refresh()
    assert len(_check_visible_entries(store, n)) == n
    assert store.verify() == []


def test_two_writers_in_parallel(tmp_path: Path) -> None:
    root, go = tmp_path / "store", tmp_path / "go"
    # Overlapping ranges whose pack boundaries align on the overlap: both write identical packs (same name)
    # at about the same time, the hardest case for publication by rename.
    procs = [_spawn(root, 0, 120, 0, go), _spawn(root, 40, 160, 0, go)]
    time.sleep(0.5)
    go.touch()
    for p in procs:
        p.communicate(timeout=60)
        assert p.returncode == 0
    store = Store(root)
    assert store.missing("latent", [key(i) for i in range(160)]) == []
    assert len(_check_visible_entries(store, 160)) == 160
    assert store.verify() == []
    assert not [p for p in (root / "latent").iterdir() if p.name.startswith(".")]
