"""Edit datasets: each item's control image, matched by relative path without extension in the dataset's control
directory; an item whose control image is missing or unusable is an excluded row with its reason, never an item
that trains without it."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from diffusion_pipe.config import ConfigError
from diffusion_pipe.scan import scan_to_files
from diffusion_pipe.scan.media import probe_media
from tests.scan.conftest import make_image, make_video, params_for


def _scan(tmp_path: Path, ds: Path, control: Path, **dataset: object) -> tuple[dict[str, dict], dict]:
    out = tmp_path / "out"
    params = params_for(ds, control=str(control), **dataset)
    report = scan_to_files(params, out / "manifest.parquet", out / "scan.json", out / "cache.parquet")
    return {r["path"]: r for r in pq.read_table(out / "manifest.parquet").to_pylist()}, report


def _edit_dataset(tmp_path: Path) -> tuple[Path, Path]:
    ds, control = tmp_path / "edits", tmp_path / "edits-control"
    for name, colour in (("good", (200, 0, 0)), ("sub/nested", (0, 200, 0)), ("missing", (0, 0, 200)),
                         ("corrupt", (9, 9, 9)), ("twice", (8, 8, 8)), ("video", (7, 7, 7)), ("outside", (6, 6, 6))):
        make_image(ds / f"{name}.png", size=(64, 64), color=colour, caption=f"make it {name}")
    make_image(control / "good.jpg", size=(64, 48), color=(1, 1, 1), caption=None)  # any extension, any size
    make_image(control / "sub/nested.png", size=(64, 64), color=(2, 2, 2), caption=None)
    (control / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    make_image(control / "twice.png", size=(64, 64), color=(3, 3, 3), caption=None)
    make_image(control / "twice.webp", size=(64, 64), color=(4, 4, 4), caption=None)
    make_video(control / "video.mp4", n_frames=3, caption=None)
    secret = make_image(tmp_path / "private/secret.png", size=(64, 64), color=(5, 5, 5), caption=None)
    (control / "outside.png").symlink_to(secret)
    return ds, control


def test_each_item_gets_its_control_image_or_a_reason(tmp_path):
    ds, control = _edit_dataset(tmp_path)
    rows, report = _scan(tmp_path, ds, control)
    good = rows["good.png"]
    assert good["status"] == "ok" and good["control_paths"] == ["good.jpg"]
    assert good["control_hashes"] == [probe_media(str(control / "good.jpg"), 10**8).content_hash]
    assert rows["sub/nested.png"]["status"] == "ok" and rows["sub/nested.png"]["control_paths"] == ["sub/nested.png"]
    reasons = {path: row["reason"] for path, row in rows.items() if row["status"] != "ok"}
    assert reasons == {"missing.png": "missing_control", "corrupt.png": "control_corrupt",
                       "twice.png": "control_ambiguous", "video.png": "control_not_image",
                       "outside.png": "control_outside_root"}
    assert all(rows[p]["control_paths"] == [] and rows[p]["control_hashes"] == [] for p in reasons)
    assert report["excluded_by_reason"] == {"control_ambiguous": 1, "control_corrupt": 1, "control_not_image": 1,
                                            "control_outside_root": 1, "missing_control": 1}
    assert "twice.png, twice.webp" in str(report["excluded_examples"]["control_ambiguous"])
    # the control directory's own files are not items
    assert set(rows) == {"good.png", "sub/nested.png", "missing.png", "corrupt.png", "twice.png", "video.png",
                         "outside.png"}


def test_outside_links_are_followed_only_when_the_dataset_opts_in(tmp_path):
    ds, control = _edit_dataset(tmp_path)
    rows, _ = _scan(tmp_path, ds, control, follow_outside_links=True)
    assert rows["outside.png"]["status"] == "ok" and rows["outside.png"]["control_paths"] == ["outside.png"]


def test_an_edited_control_image_changes_the_manifest_on_rescan(tmp_path):
    """The last-scan snapshot covers the control directory: a changed control image is noticed."""
    ds, control = _edit_dataset(tmp_path)
    rows, _ = _scan(tmp_path, ds, control)
    st = os.stat(control / "good.jpg")
    make_image(control / "good.jpg", size=(64, 48), color=(90, 90, 90), caption=None)
    os.utime(control / "good.jpg", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    again, report = _scan(tmp_path, ds, control)
    assert report["run"]["reused_last_scan"] is False and report["run"]["files_probed"] == 1
    assert again["good.png"]["control_hashes"] != rows["good.png"]["control_hashes"]
    assert {p: r for p, r in again.items() if p != "good.png"} == {p: r for p, r in rows.items() if p != "good.png"}
    (control / "missing.png").write_bytes((control / "sub/nested.png").read_bytes())  # a new control image
    third, _ = _scan(tmp_path, ds, control)
    assert third["missing.png"]["status"] == "ok"


def test_same_target_with_different_controls_is_not_a_duplicate(tmp_path):
    ds, control = tmp_path / "edits", tmp_path / "edits-control"
    for name in ("a", "b", "c"):
        make_image(ds / f"{name}.png", size=(64, 64), color=(10, 10, 10), caption="the same picture")
    make_image(control / "a.png", size=(64, 64), color=(1, 0, 0), caption=None)
    make_image(control / "b.png", size=(64, 64), color=(0, 1, 0), caption=None)
    make_image(control / "c.png", size=(64, 64), color=(1, 0, 0), caption=None)  # the same pair as a
    rows, _ = _scan(tmp_path, ds, control)
    assert [rows[n]["reason"] for n in ("a.png", "b.png", "c.png")] == ["", "", "duplicate"]


def test_control_directory_must_exist_and_lie_outside_the_dataset(tmp_path):
    ds = tmp_path / "edits"
    make_image(ds / "a.png", caption="x")
    with pytest.raises(ConfigError, match=r"scan.datasets\[0\].control: '.*nope' is not a directory"):
        _scan(tmp_path, ds, tmp_path / "nope")
    (ds / "control").mkdir()
    with pytest.raises(ConfigError, match=r"scan.datasets\[0\].control: .* contain one another; keep the control "
                                          r"images in a directory beside"):
        _scan(tmp_path, ds, ds / "control")
    with pytest.raises(ConfigError, match=r"scan.datasets\[0\].control: .* contain one another"):
        _scan(tmp_path, ds, tmp_path)  # the dataset inside its control directory
