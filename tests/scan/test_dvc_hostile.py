"""`dvc repro` reaches the scan whatever the dataset holds (dangling links, link loops, FIFOs), and the scan
reports them as excluded rows; DVC still notices real changes, through the scan that runs on every repro."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.parquet as pq

from tests.conftest import make_pipeline_repo
from tests.encode.helpers import reproduce
from tests.scan.conftest import make_image


def _rows(repo: Path) -> dict[str, dict]:
    return {r["path"]: r for r in pq.read_table(repo / "data/manifest.parquet").to_pylist()}


def test_dvc_repro_reaches_the_scan_through_hostile_files(tmp_path):
    store = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store)
    data = repo / "examples/flux-tiny/data"
    (data / "dangling.png").symlink_to(data / "nowhere.png")
    (data / "loop1.png").symlink_to(data / "loop2.png")
    (data / "loop2.png").symlink_to(data / "loop1.png")
    os.mkfifo(data / "fifo.png")
    (data / "sub").mkdir()
    (data / "sub" / "up").symlink_to(data)  # a directory loop

    assert reproduce(repo, store, "scan") == ["scan"]
    rows = _rows(repo)
    assert rows["dangling.png"]["reason"] == "broken_symlink"
    assert rows["loop1.png"]["reason"] == rows["loop2.png"]["reason"] == "symlink_loop"
    assert rows["fifo.png"]["reason"] == "not_regular_file"
    ok = sum(r["status"] == "ok" for r in rows.values())
    assert ok == 36

    # Nothing changed: scan runs again (always_changed) and writes the same bytes.
    before = (repo / "data/manifest.parquet").read_bytes()
    assert reproduce(repo, store, "scan") == ["scan"]
    assert (repo / "data/manifest.parquet").read_bytes() == before

    # A real change to the dataset reaches the manifest.
    make_image(data / "zz_new.png", size=(64, 64), color=(1, 200, 3), caption="a new image")
    reproduce(repo, store, "scan")
    assert _rows(repo)["zz_new.png"]["status"] == "ok"
