"""The scan stage's summary on stderr names the first excluded files with their reasons, and where the rest are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diffusion_pipe.scan import ScanError, scan_to_files
from tests.conftest import REPO
from tests.scan.conftest import make_image, params_for

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


def test_names_and_captions_with_control_characters_print_escaped_one_line_each(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A newline in a file name would forge a summary line, an ESC sequence would drive the terminal: what the scan
    prints is escaped (`\\n`, `\\x1b`); a caption holding a control character is an excluded row."""
    ds = tmp_path / "ds"
    make_image(ds / "ok.png", caption="fine")
    (ds / "two\nscan: 0 items.png").write_bytes(b"not a png")  # corrupt, and a forged second line
    make_image(ds / "esc\x1b[2J.png", color=(1, 2, 3), caption=None)  # no caption: missing_caption
    make_image(ds / "title.png", color=(4, 5, 6), caption="a \x1b]0;pwned\x07 cat")  # sets the terminal's title
    params = params_for(ds, caption_policy="skip")
    report = scan_to_files(params, tmp_path / "m.parquet", tmp_path / "scan.json", None)
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err
    summary = [line for line in err.splitlines() if line.strip() and "scan: probing" not in line]
    assert all(line.startswith("scan: ") for line in summary), summary
    assert "scan: excluded ds/two\\nscan: 0 items.png: corrupt" in err
    assert "scan: excluded ds/esc\\x1b[2J.png: missing_caption" in err
    assert ("scan: excluded ds/title.png: caption_control_character (control character U+001B at character 2; "
            "remove it") in err
    assert report["excluded_by_reason"] == {"caption_control_character": 1, "corrupt": 1, "missing_caption": 1}
    # the error of policy 'error' names the files escaped too
    with pytest.raises(ScanError, match=r"1 item\(s\) have no caption .*: esc\\x1b\[2J\.png\. Write") as caught:
        scan_to_files(params_for(ds), tmp_path / "m.parquet", tmp_path / "scan.json", None)
    assert "\x1b" not in str(caught.value)
