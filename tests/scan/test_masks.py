"""Loss masks in the scan (issue 36): `<name>.mask.png` beside an image is its mask, never an item; the manifest
records its path and content hash; a mask that can't weigh its image stops the scan, naming it."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image

from diffusion_pipe.scan import scan_to_files
from diffusion_pipe.scan.errors import ScanError
from diffusion_pipe.scan.manifest import MANIFEST_VERSION, item_stem
from tests.scan.conftest import make_animation, make_image, make_video, params_for


def _scan(tmp_path: Path, ds: Path) -> tuple[dict[str, dict], dict]:
    out = tmp_path / "out"
    report = scan_to_files(params_for(ds), out / "manifest.parquet", out / "scan.json", out / "cache.parquet")
    return {r["path"]: r for r in pq.read_table(out / "manifest.parquet").to_pylist()}, report


def _mask(path: Path, size: tuple[int, int], value: int = 255) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("L", size, value).save(path)
    return path


def test_masks_are_recorded_beside_their_items_and_never_items(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    make_image(ds / "cat.png", size=(64, 48))
    make_image(ds / "sub/dog.jpg", size=(64, 48), color=(1, 2, 3))
    make_image(ds / "owl.png", size=(64, 48), color=(3, 2, 1))
    _mask(ds / "cat.mask.png", (64, 48))
    _mask(ds / "sub/dog.MASK.PNG", (32, 24), 0)  # any case, half the size: the same aspect
    rows, report = _scan(tmp_path, ds)
    assert sorted(rows) == ["cat.png", "owl.png", "sub/dog.jpg"]  # the masks are not items
    assert all(r["status"] == "ok" for r in rows.values())
    assert rows["cat.png"]["mask_path"] == "cat.mask.png" and len(rows["cat.png"]["mask_hash"]) == 32
    assert rows["sub/dog.jpg"]["mask_path"] == "sub/dog.MASK.PNG"
    assert rows["cat.png"]["mask_hash"] != rows["sub/dog.jpg"]["mask_hash"]
    assert rows["owl.png"]["mask_path"] == rows["owl.png"]["mask_hash"] == ""  # unmasked: weighs 1 everywhere
    assert report["masked"] == 2 and report["images"] == 3 and report["ignored_files"] == 0
    meta = pq.read_schema(tmp_path / "out/manifest.parquet").metadata
    assert meta[b"diffusion_pipe.manifest_version"] == MANIFEST_VERSION.encode() == b"5"
    assert item_stem("sub/dog.mask.png") == "sub/dog" == item_stem("sub/dog.jpg")


def test_an_edited_or_removed_mask_changes_its_row_on_rescan(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    make_image(ds / "cat.png", size=(64, 48))
    make_image(ds / "owl.png", size=(64, 48), color=(3, 2, 1))
    _mask(ds / "cat.mask.png", (64, 48))
    rows, _ = _scan(tmp_path, ds)
    _mask(ds / "cat.mask.png", (64, 48), 128)
    edited, report = _scan(tmp_path, ds)
    assert report["run"]["rows_rebuilt"] == 1  # the cat's row alone: the mask is a file of its item's stem
    assert edited["cat.png"]["mask_hash"] not in ("", rows["cat.png"]["mask_hash"])
    assert edited["owl.png"] == rows["owl.png"]
    (ds / "cat.mask.png").unlink()
    removed, _ = _scan(tmp_path, ds)
    assert removed["cat.png"]["mask_path"] == removed["cat.png"]["mask_hash"] == ""
    _mask(ds / "owl.mask.png", (64, 48))  # a new mask
    added, _ = _scan(tmp_path, ds)
    assert added["owl.png"]["mask_path"] == "owl.mask.png"


def test_an_image_copy_with_another_mask_is_not_a_duplicate(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    make_image(ds / "a.png", size=(64, 48))
    make_image(ds / "b.png", size=(64, 48))  # the same bytes
    _mask(ds / "b.mask.png", (64, 48))
    rows, _ = _scan(tmp_path, ds)
    assert rows["a.png"]["status"] == rows["b.png"]["status"] == "ok"


@pytest.mark.parametrize("case, match", [
    ("aspect", r"cat\.mask\.png is 40x48 but its image is 64x48: a mask must have its image's aspect ratio.*"
               r"\(mask_aspect\)"),
    ("corrupt", r"cat\.mask\.png: .*\(mask_corrupt\)"),
    ("animated", r"cat\.mask\.png is an animation.*\(mask_not_image\)"),
    ("video", r"clip\.mask\.png masks a video; masks apply to images only.*\(mask_on_video\)"),
])
def test_a_bad_mask_stops_the_scan_naming_it(tmp_path: Path, case: str, match: str) -> None:
    ds = tmp_path / "ds"
    make_image(ds / "cat.png", size=(64, 48))
    make_image(ds / "fine.png", size=(64, 48), color=(1, 1, 1))
    if case == "aspect":
        _mask(ds / "cat.mask.png", (40, 48))
    elif case == "corrupt":
        (ds / "cat.mask.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    elif case == "animated":
        make_animation(ds / "cat.mask.png", n_frames=3, duration_ms=100, size=(64, 48), caption=None)
    else:
        make_video(ds / "clip.mp4", n_frames=3)
        _mask(ds / "clip.mask.png", (32, 32))
    with pytest.raises(ScanError, match=match):
        _scan(tmp_path, ds)
    assert not (tmp_path / "out/manifest.parquet").exists()  # nothing written: the item never trains unmasked


def test_a_mask_without_its_image_is_a_warning(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    make_image(ds / "cat.png", size=(64, 48))
    _mask(ds / "cta.mask.png", (64, 48))  # a typo
    rows, report = _scan(tmp_path, ds)
    assert sorted(rows) == ["cat.png"] and rows["cat.png"]["mask_path"] == ""
    assert [w.split(": ", 1)[1] for w in report["warnings"]] == [
        "mask cta.mask.png has no image beside it (no cta.<image extension>); it is not used"]
