"""Symlinks that leave the dataset root are excluded rows (never read), unless the dataset opts in."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from diffusion_pipe.scan import scan_to_files
from tests.scan.conftest import make_image, params_for


def _scan(tmp_path: Path, ds: Path, **dataset: object) -> tuple[dict[str, dict], dict, bytes]:
    out = tmp_path / "out"
    params = params_for(ds, caption_policy="skip", **dataset)
    report = scan_to_files(params, out / "manifest.parquet", out / "scan.json", out / "cache.parquet")
    data = (out / "manifest.parquet").read_bytes()
    return {r["path"]: r for r in pq.read_table(out / "manifest.parquet").to_pylist()}, report, data


def _hostile_dataset(tmp_path: Path) -> tuple[Path, Path]:
    """A dataset with links to an outside secret caption, an outside image and an outside directory, plus an
    inside link (allowed)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.txt"
    secret.write_text("SECRET-TOKEN-1234")
    make_image(outside / "private.png", size=(64, 64), color=(1, 2, 3), caption="private")
    make_image(outside / "dir" / "inner.png", size=(64, 64), color=(4, 5, 6), caption="inner")
    ds = tmp_path / "ds"
    make_image(ds / "leak.png", size=(64, 64), color=(7, 8, 9), caption=None)
    (ds / "leak.txt").symlink_to(secret)
    (ds / "outside.png").symlink_to(outside / "private.png")
    (ds / "outside.txt").write_text("a caption of our own")
    (ds / "more").symlink_to(outside / "dir")
    make_image(ds / "real.png", size=(64, 64), color=(9, 9, 9), caption="real")
    (ds / "z_alias.png").symlink_to(ds / "real.png")
    (ds / "z_alias.txt").write_text("alias")
    return ds, outside


def test_links_leaving_the_root_are_excluded_and_never_read(tmp_path):
    ds, outside = _hostile_dataset(tmp_path)
    rows, report, data = _scan(tmp_path, ds)
    assert b"SECRET-TOKEN" not in data  # the manifest DVC pushes holds nothing of the outside file
    assert rows["leak.png"]["status"] == "excluded" and rows["leak.png"]["reason"] == "caption_outside_root"
    assert rows["leak.png"]["caption"] == ""
    assert rows["outside.png"]["status"] == "excluded" and rows["outside.png"]["reason"] == "outside_root"
    assert rows["outside.png"]["content_hash"] == ""  # not even hashed
    assert not any(p.startswith("more/") for p in rows)  # the outside directory was not walked
    assert any("more" in w and "outside the dataset root" in w for w in report["warnings"])
    assert rows["real.png"]["status"] == "ok" and rows["z_alias.png"]["reason"] == "duplicate"  # inside links work
    assert report["excluded_by_reason"]["outside_root"] == 1
    assert report["excluded_by_reason"]["caption_outside_root"] == 1
    assert str(outside / "private.png") in str(report["excluded_examples"]["outside_root"])


def test_following_outside_links_is_a_per_dataset_opt_in(tmp_path):
    ds, _ = _hostile_dataset(tmp_path)
    rows, report, _ = _scan(tmp_path, ds, follow_outside_links=True)
    assert rows["outside.png"]["status"] == "ok"
    assert rows["more/inner.png"]["status"] == "ok" and rows["more/inner.png"]["caption"] == "inner"
    assert rows["leak.png"]["caption"] == "SECRET-TOKEN-1234"  # opted in: read like any caption


def test_a_dataset_root_that_is_itself_a_symlink_is_its_own_inside(tmp_path):
    ds, _ = _hostile_dataset(tmp_path)
    link = tmp_path / "link-to-ds"
    link.symlink_to(ds)
    rows, _, _ = _scan(tmp_path, link)
    assert rows["real.png"]["status"] == "ok" and rows["z_alias.png"]["reason"] == "duplicate"
    assert rows["outside.png"]["reason"] == "outside_root"


def test_a_sibling_whose_name_extends_the_roots_is_outside(tmp_path):
    """`data/set2` starts with the characters of `data/set` but is not inside it: the root check compares whole
    path components, so links into the sibling are outside the dataset."""
    ds, sibling = tmp_path / "set", tmp_path / "set2"
    sibling.mkdir()
    (sibling / "secret.txt").write_text("SECRET-TOKEN-1234")
    make_image(sibling / "private.png", size=(64, 64), color=(1, 2, 3), caption=None)
    make_image(sibling / "dir" / "inner.png", size=(64, 64), color=(4, 5, 6), caption="inner")
    make_image(ds / "leak.png", size=(64, 64), color=(7, 8, 9), caption=None)
    (ds / "leak.txt").symlink_to(sibling / "secret.txt")
    (ds / "peek.png").symlink_to(sibling / "private.png")
    (ds / "peek.txt").write_text("a caption of our own")
    (ds / "more").symlink_to(sibling / "dir")
    rows, report, data = _scan(tmp_path, ds)
    assert b"SECRET-TOKEN" not in data
    assert rows["leak.png"]["reason"] == "caption_outside_root" and rows["peek.png"]["reason"] == "outside_root"
    assert not any(p.startswith("more/") for p in rows)
    assert any("more" in w and "outside the dataset root" in w for w in report["warnings"])
