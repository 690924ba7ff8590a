"""The scan stage's summary on stderr names the first excluded files with their reasons, and where the rest are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from tests.scan.conftest import make_image

PARAMS = """\
model:
  family: flux
  path: unused
scan:
  datasets:
    - path: ds
      caption_policy: skip
      resolutions: [64]
  bucket_step: 16
  workers: 1
"""


def scan_stage(root: Path) -> subprocess.CompletedProcess:
    (root / "params.yaml").write_text(PARAMS)
    env = {**os.environ, "PYTHONPATH": str(REPO), "DVC_NO_ANALYTICS": "1"}
    out = subprocess.run([sys.executable, "-m", "stages.scan"], cwd=root, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out


def test_the_summary_names_the_first_five_excluded_files_and_where_the_rest_are(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    make_image(ds / "a-good.png", caption="fine")
    for name in ("b1", "b2", "b3"):
        (ds / f"{name}.png").write_bytes(b"not a png")  # corrupt
        (ds / f"{name}.txt").write_text("x")
    for name in ("c1", "c2", "c3", "c4"):
        make_image(ds / f"{name}.png", color=(1, 2, int(name[1])), caption=None)  # no caption: skipped
    out = scan_stage(tmp_path)
    lines = [line for line in out.stderr.splitlines() if line.startswith("scan: excluded ")]
    assert [line.split(":")[1].strip() for line in lines] == ["excluded ds/b1.png", "excluded ds/b2.png",
                                                               "excluded ds/b3.png", "excluded ds/c1.png",
                                                               "excluded ds/c2.png"]
    report = json.loads((tmp_path / "reports/scan.json").read_text())
    reasons = {e["path"]: e["reason"] for e in report["excluded_first"]}
    for line in lines:  # each line gives its file's reason as the manifest records it
        path = line.split(":")[1].removeprefix(" excluded ")
        assert line.split(":")[2].strip().startswith(reasons[path]), line
    assert reasons["ds/c1.png"] == "missing_caption"
    assert ("scan: ... and 2 more excluded; every one is a row of data/manifest.parquet with status 'excluded' "
            "and its reason, the first 5 per reason are in reports/scan.json (excluded_examples)") in out.stderr
    # a rescan that reuses the last scan whole says the same
    again = scan_stage(tmp_path)
    assert json.loads((tmp_path / "reports/scan.json").read_text())["run"]["reused_last_scan"] is True
    assert [line for line in again.stderr.splitlines() if line.startswith("scan: excluded ")] == lines


def test_no_excluded_files_no_lines(tmp_path: Path) -> None:
    make_image(tmp_path / "ds" / "a.png", caption="fine")
    out = scan_stage(tmp_path)
    assert "scan: excluded" not in out.stderr and "more excluded" not in out.stderr
