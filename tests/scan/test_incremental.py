"""The incremental rescan: after a change, only the rows of the items around the changed files are rebuilt, the
rest are the last scan's, and the manifest and report are exactly those of a scan without any cache."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from diffusion_pipe.params import DatasetParams, ScanParams
from diffusion_pipe.scan import scan_to_files
from tests.scan.conftest import make_image


def _scan(out: Path, params: ScanParams, cache: bool = True) -> tuple[dict, bytes]:
    report = scan_to_files(params, out / "manifest.parquet", out / "scan.json",
                           out / "cache.parquet" if cache else None)
    return report, (out / "manifest.parquet").read_bytes()


def _without_run(report: dict) -> dict:
    return {k: v for k, v in report.items() if k != "run"}


@pytest.fixture
def world(tmp_path: Path) -> tuple[Path, Path, ScanParams]:
    """Two datasets: `plain` (duplicates, a caption-less image, a broken symlink) and `edits` (control images)."""
    plain, edits, control = tmp_path / "plain", tmp_path / "edits", tmp_path / "edits-control"
    for i in range(6):
        make_image(plain / f"{i}.png", color=(10 * i, 0, 0), caption=f"image {i}")
    make_image(plain / "sub" / "copy-of-1.png", color=(10, 0, 0), caption="a copy")  # a duplicate of 1.png
    make_image(plain / "no-caption.png", color=(0, 99, 0), caption=None)
    make_image(plain / "3.v2.png", color=(3, 3, 3), caption="not 3.png's stem")
    (plain / "dangling.png").symlink_to(plain / ".hidden" / "gone.png")  # hidden: not an item itself
    for i in range(4):
        make_image(edits / f"e{i}.png", color=(0, 0, 10 * i), caption=f"edit {i}")
        make_image(control / f"e{i}.jpg", color=(0, 10 * i, 0), caption=None)
    params = ScanParams(datasets=(
        DatasetParams(path=str(plain), caption_policy="skip", repeats=2, eval_fraction=0.3),
        DatasetParams(path=str(edits), control=str(control)),
    ), workers=1)
    return plain, control, params


def _rescan_equals_a_fresh_scan(tmp_path: Path, params: ScanParams, rebuilt: int) -> dict:
    """Rescan with the cache; assert it rebuilt `rebuilt` rows and matches a scan without a cache byte for byte."""
    report, data = _scan(tmp_path / "out", params)
    assert report["run"]["reused_last_scan"] is False
    fresh = tmp_path / "fresh"
    shutil.rmtree(fresh, ignore_errors=True)
    fresh_report, fresh_data = _scan(fresh, params, cache=False)
    assert data == fresh_data
    assert _without_run(report) == _without_run(fresh_report)
    assert report["run"]["rows_rebuilt"] == rebuilt, report["run"]
    return report


def test_each_change_rebuilds_only_its_items_and_equals_a_fresh_scan(tmp_path, world):
    plain, control, params = world
    first, _ = _scan(tmp_path / "out", params)
    assert first["run"]["rows_rebuilt"] == first["items"] == 14
    assert first["duplicates"]["excluded"] == 1

    broken = 1  # the dangling symlink: never in the stat cache, its row is rebuilt on every rescan
    (plain / "3.txt").write_text("image 3, edited")  # a caption: its item
    _rescan_equals_a_fresh_scan(tmp_path, params, rebuilt=1 + broken)
    make_image(plain / "1.png", color=(1, 2, 3), caption=None)  # the first of two copies: the copy trains now
    report = _rescan_equals_a_fresh_scan(tmp_path, params, rebuilt=1 + broken)
    assert report["duplicates"]["excluded"] == 0
    make_image(plain / "z-new.png", color=(0, 0, 0), caption="new, a copy of 0")  # a new item, a duplicate
    report = _rescan_equals_a_fresh_scan(tmp_path, params, rebuilt=1 + broken)
    assert report["items"] == 15 and report["excluded_by_reason"]["duplicate"] == 1
    (plain / "0.png").unlink()  # its copy z-new.png trains now, nothing is rebuilt
    report = _rescan_equals_a_fresh_scan(tmp_path, params, rebuilt=0 + broken)
    assert report["items"] == 14 and "duplicate" not in report["excluded_by_reason"]
    (plain / "2.txt").unlink()  # a caption gone: missing_caption under 'skip'
    _rescan_equals_a_fresh_scan(tmp_path, params, rebuilt=1 + broken)
    make_image(plain / ".hidden" / "gone.png", color=(5, 5, 5), caption=None)  # the symlink's target appears
    report = _rescan_equals_a_fresh_scan(tmp_path, params, rebuilt=1)
    assert "broken_symlink" not in report["excluded_by_reason"]
    (control / "e2.jpg").unlink()  # a control image gone: missing_control
    report = _rescan_equals_a_fresh_scan(tmp_path, params, rebuilt=1)
    assert report["datasets"]["edits"]["excluded_by_reason"] == {"missing_control": 1}
    make_image(control / "e1.webp", color=(7, 7, 7), caption=None)  # a second control image: ambiguous
    make_image(control / "e2.png", color=(8, 8, 8), caption=None)  # and one back
    report = _rescan_equals_a_fresh_scan(tmp_path, params, rebuilt=2)
    assert report["datasets"]["edits"]["excluded_by_reason"] == {"control_ambiguous": 1}
    os.utime(plain / "4.png", ns=(7, 7))  # same bytes, new stat key: probed again, the same row
    _rescan_equals_a_fresh_scan(tmp_path, params, rebuilt=1)
    shutil.rmtree(plain / "sub")  # a directory gone
    report = _rescan_equals_a_fresh_scan(tmp_path, params, rebuilt=0)
    assert report["items"] == 13


def test_rows_are_rebuilt_in_full_when_the_last_scan_is_not_the_caches(tmp_path, world):
    """A scan that failed (a missing caption under policy 'error') rewrote the stat cache but left the snapshot:
    the next scan can't tell what changed since the snapshot from the cache, and rebuilds every row."""
    plain, _, params = world
    strict = ScanParams(datasets=(DatasetParams(path=str(plain), caption_policy="error"),), workers=1)
    (plain / "no-caption.txt").write_text("now captioned")
    first, _ = _scan(tmp_path / "out", strict)
    (plain / "no-caption.txt").unlink()
    (plain / "5.txt").write_text("image 5, edited before the failing scan")
    with pytest.raises(Exception, match="no-caption.png"):
        _scan(tmp_path / "out", strict)
    (plain / "no-caption.txt").write_text("captioned again")
    report = _rescan_equals_a_fresh_scan(tmp_path, strict, rebuilt=first["items"])
    assert report["run"]["files_probed"] == 1  # the cache still spared the probing


def test_other_params_rebuild_every_row(tmp_path, world):
    _, _, params = world
    _scan(tmp_path / "out", params)
    more = ScanParams(datasets=tuple(DatasetParams(**{**d.__dict__, "repeats": 5}) for d in params.datasets),
                      workers=1)
    report = _rescan_equals_a_fresh_scan(tmp_path, more, rebuilt=14)
    assert report["run"]["files_probed"] == 0


def test_copies_in_other_datasets_all_train(tmp_path):
    """Rule 5 is per dataset: the same bytes in two datasets are one duplicate group, and both rows train."""
    a, b = tmp_path / "a", tmp_path / "b"
    make_image(a / "x.png", caption="in a")
    make_image(b / "y.png", caption="in b")  # the same pixels, the same bytes
    make_image(b / "z.png", caption="a copy within b")
    params = ScanParams(datasets=(DatasetParams(path=str(a)), DatasetParams(path=str(b))), workers=1)
    report, _ = _scan(tmp_path / "out", params)
    assert report["duplicates"]["groups"] == 1 and report["duplicates"]["extra_copies"] == 2
    assert report["datasets"]["a"]["ok"] == 1 and report["datasets"]["b"]["ok"] == 1
    assert report["duplicates"]["excluded"] == 1 and report["excluded_examples"]["duplicate"] == \
        ["b/z.png (same content as y.png)"]


def test_each_part_of_the_stat_key_alone_marks_a_file_changed(tmp_path):
    """A file is re-probed when any one of its size, mtime_ns and inode changed, the other two as they were: a
    copy that keeps mtimes (`cp -p`, rsync), an edit in place of the same size, an edit whose mtime was put back."""
    from PIL import Image

    ds = tmp_path / "ds"
    colours = iter((i, 2 * i, 3 * i) for i in range(1, 100))

    def bmp(path: Path, size: tuple[int, int] = (8, 8)) -> bytes:
        Image.new("RGB", size, next(colours)).save(path, format="BMP")  # the size on disk depends only on the size
        return path.read_bytes()

    ds.mkdir()
    for name in ("inode", "mtime", "size"):
        bmp(ds / f"{name}.bmp")
        (ds / f"{name}.txt").write_text(name)
        os.utime(ds / f"{name}.bmp", ns=(10**18, 10**18))
    params = ScanParams(datasets=(DatasetParams(path=str(ds)),), workers=1)
    _scan(tmp_path / "out", params)

    new = tmp_path / "new.tmp"  # beside the dataset: moved in by a rename
    bmp(new)  # same size, same mtime, another inode
    os.utime(new, ns=(10**18, 10**18))
    new.replace(ds / "inode.bmp")
    st = (ds / "mtime.bmp").stat()
    with open(ds / "mtime.bmp", "r+b") as fh:  # same size, same inode, another mtime
        fh.write(bmp(new))
    os.utime(ds / "mtime.bmp", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with open(ds / "size.bmp", "r+b") as fh:  # same mtime, same inode, another size
        fh.truncate()
        fh.write(bmp(new, size=(9, 9)))
    os.utime(ds / "size.bmp", ns=(10**18, 10**18))
    report = _rescan_equals_a_fresh_scan(tmp_path, params, rebuilt=3)
    assert report["run"]["files_probed"] == 3


def test_what_only_the_listing_shows_reaches_a_rescan(tmp_path, world):
    """A rescan reuses the last scan whole only if its listing is the same, including what has no stat key: files
    that are neither media nor captions (counted), why a file can't be stat'ed, and the walk's warnings."""
    plain, _, params = world
    first, _ = _scan(tmp_path / "out", params)
    broken = 1  # the dangling symlink: never in the stat cache, its row is rebuilt on every rescan
    (plain / "notes.md").write_text("not media")
    report = _rescan_equals_a_fresh_scan(tmp_path, params, rebuilt=broken)
    assert report["ignored_files"] == first["ignored_files"] + 1
    (plain / "dangling.png").unlink()
    (plain / "dangling.png").symlink_to("dangling.png")  # a link to itself: a loop instead of a missing target
    report = _rescan_equals_a_fresh_scan(tmp_path, params, rebuilt=broken)
    assert report["excluded_by_reason"]["symlink_loop"] == 1 and "broken_symlink" not in report["excluded_by_reason"]
    outside = tmp_path / "outside"
    outside.mkdir()
    (plain / "elsewhere").symlink_to(outside)  # a directory link out of the root: skipped, with a warning
    report = _rescan_equals_a_fresh_scan(tmp_path, params, rebuilt=broken)
    assert any("elsewhere" in w and "outside the dataset root" in w for w in report["warnings"])
