"""End-to-end scans of real tiny datasets: manifest contents, determinism, cache, policies and bad input."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from diffusion_pipe.config import ConfigError
from diffusion_pipe.hashing import hash_bytes
from diffusion_pipe.params import DatasetParams, ScanParams
from diffusion_pipe.scan import ScanError, scan_datasets, scan_to_files
from diffusion_pipe.scan.manifest import SCHEMA, split_for
from tests.scan.conftest import make_animation, make_image, make_video, params_for


def run(tmp_path: Path, params: ScanParams, cache: bool = True) -> tuple[list[dict], dict, bytes]:
    """Scan to files under tmp_path/out; return the manifest rows, the report and the manifest bytes."""
    out = tmp_path / "out"
    report = scan_to_files(params, out / "manifest.parquet", out / "scan.json",
                           out / "cache.parquet" if cache else None)
    data = (out / "manifest.parquet").read_bytes()
    return pq.read_table(out / "manifest.parquet").to_pylist(), report, data


def by_path(rows: list[dict]) -> dict[str, dict]:
    return {r["path"]: r for r in rows}


def small_dataset(root: Path) -> None:
    make_image(root / "a.png", size=(640, 480), caption="  a red\n\n image ")
    make_image(root / "sub" / "b.jpg", size=(300, 600), caption="b")
    make_video(root / "clips" / "c.mp4", n_frames=12, fps=10, caption="a clip")
    make_animation(root / "d.gif", n_frames=5, duration_ms=100, caption="gif")
    (root / "notes.md").write_text("not media")


def test_manifest_rows_and_schema(tmp_path: Path, ds: Path) -> None:
    small_dataset(ds)
    rows, report, _ = run(tmp_path, params_for(ds, frames=(1, 8), resolutions=(256, 512)))
    table = pq.read_table(tmp_path / "out" / "manifest.parquet")
    assert table.schema.equals(SCHEMA, check_metadata=False)
    assert [r["path"] for r in rows] == ["a.png", "clips/c.mp4", "d.gif", "sub/b.jpg"]
    a = by_path(rows)["a.png"]
    assert a["caption"] == "a red image" and a["caption_hash"] == hash_bytes(b"a red image")
    assert a["content_hash"] == hash_bytes((ds / "a.png").read_bytes())
    assert (a["media"], a["width"], a["height"], a["num_frames"], a["fps"]) == ("image", 640, 480, 1, 0.0)
    assert a["buckets"] == ["320x192x1", "576x448x1"] and a["status"] == "ok" and a["reason"] == ""
    assert (a["dataset"], a["split"], a["repeats"], a["caption_source"]) == ("ds", "train", 1, "txt")
    c = by_path(rows)["clips/c.mp4"]
    assert (c["media"], c["num_frames"], c["fps"], c["buckets"]) == ("video", 12, 10.0, ["256x256x8", "512x512x8"])
    assert by_path(rows)["d.gif"]["media"] == "video"
    assert report["images"] == 2 and report["videos"] == 2 and report["ok"] == 4 and report["ignored_files"] == 1
    assert report["buckets"]["256x256x8"] == 1 and report["datasets"]["ds"]["ok"] == 4
    assert report["samples_per_epoch"] == 8


def test_manifest_is_byte_identical_across_runs_and_locations(tmp_path: Path, ds: Path) -> None:
    small_dataset(ds)
    make_image(ds / "bad.png", caption=None)
    (ds / "bad.png").write_bytes(b"junk")
    params = params_for(ds, frames=(1, 8), caption_policy="skip", eval_fraction=0.5)
    _, _, first = run(tmp_path, params)
    _, _, second = run(tmp_path, params)  # from the cache
    _, _, uncached = run(tmp_path, params, cache=False)
    # The same files at another absolute path, with other mtimes and inodes, under the same dataset name.
    other = tmp_path / "elsewhere" / "deeper" / "ds"
    shutil.copytree(ds, other)
    _, _, moved = run(tmp_path / "o", params_for(other, frames=(1, 8), caption_policy="skip", eval_fraction=0.5))
    assert first == second == uncached == moved
    meta = pq.read_metadata(tmp_path / "out" / "manifest.parquet").metadata
    assert str(ds).encode() not in b"".join(meta.values()) and str(tmp_path).encode() not in first


def test_rescan_probes_only_changed_files(tmp_path: Path, ds: Path) -> None:
    for i in range(6):
        make_image(ds / f"{i}.png", color=(i * 40, 0, 0))
    params = params_for(ds)
    _, first, _ = run(tmp_path, params)
    assert (first["run"]["files_probed"], first["run"]["files_cached"]) == (12, 0)
    _, again, _ = run(tmp_path, params)
    assert (again["run"]["files_probed"], again["run"]["files_cached"]) == (0, 12)
    make_image(ds / "3.png", size=(10, 20), caption="changed")
    rows, changed, _ = run(tmp_path, params)
    assert (changed["run"]["files_probed"], changed["run"]["files_cached"]) == (2, 10)
    assert by_path(rows)["3.png"]["width"] == 10 and by_path(rows)["3.png"]["caption"] == "changed"
    # A touch (same bytes, new mtime) re-probes but changes nothing in the manifest.
    before = (tmp_path / "out" / "manifest.parquet").read_bytes()
    os.utime(ds / "1.png", ns=(1, 1))
    _, touched, after = run(tmp_path, params)
    assert touched["run"]["files_probed"] == 1 and after == before


def test_outdated_cache_is_ignored(tmp_path: Path, ds: Path) -> None:
    make_image(ds / "a.png")
    run(tmp_path, params_for(ds))
    (tmp_path / "out" / "cache.parquet").write_bytes(b"garbage")
    (tmp_path / "out" / "cache.last-scan.json").unlink()  # else the unchanged rescan reuses the last scan whole
    _, report, _ = run(tmp_path, params_for(ds))
    assert report["run"]["files_probed"] == 2
    # Another pixel limit changes what probing means: everything is probed again.
    _, report, _ = run(tmp_path, params_for(ds, scan={"max_image_pixels": 1_000_000}))
    assert report["run"]["files_probed"] == 2


def test_a_cache_of_another_cache_version_is_not_read(tmp_path: Path, ds: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Results probed by other code (CACHE_VERSION: probing or caption rules changed meaning) are probed again."""
    from diffusion_pipe.scan import cache

    make_image(ds / "a.png")
    with monkeypatch.context() as patched:
        patched.setattr(cache, "CACHE_VERSION", cache.CACHE_VERSION - 1)
        run(tmp_path, params_for(ds))
    (tmp_path / "out" / "cache.last-scan.json").unlink()  # else the unchanged rescan reuses the last scan whole
    _, report, _ = run(tmp_path, params_for(ds))
    assert (report["run"]["files_probed"], report["run"]["files_cached"]) == (2, 0)


def test_unchanged_rescan_reuses_the_last_scan_and_any_change_does_not(tmp_path: Path, ds: Path) -> None:
    small_dataset(ds)
    params = params_for(ds, frames=(1, 8))
    _, first, data = run(tmp_path, params)
    assert first["run"]["reused_last_scan"] is False and first["run"]["files_probed"] == 8
    rows, again, same = run(tmp_path, params)
    assert again["run"]["reused_last_scan"] is True and again["run"]["files_probed"] == 0
    assert same == data and {k: v for k, v in again.items() if k != "run"} == \
        {k: v for k, v in first.items() if k != "run"}
    assert again["run"]["files_cached"] == 8

    # an edited caption: probed alone, and the manifest says so
    (ds / "sub" / "b.txt").write_text("b, edited")
    rows, edited, _ = run(tmp_path, params)
    assert edited["run"]["reused_last_scan"] is False and edited["run"]["files_probed"] == 1
    assert by_path(rows)["sub/b.jpg"]["caption"] == "b, edited"
    # a param: nothing to probe, but the rows change
    rows, more, _ = run(tmp_path, params_for(ds, frames=(1, 8), repeats=3))
    assert more["run"]["reused_last_scan"] is False and more["run"]["files_probed"] == 0
    assert {r["repeats"] for r in rows} == {3}
    # a new file
    make_image(ds / "e.png", caption="e")
    rows, added, _ = run(tmp_path, params_for(ds, frames=(1, 8), repeats=3))
    assert added["run"]["reused_last_scan"] is False and "e.png" in by_path(rows)
    # each result equals a scan without any cache
    assert run(tmp_path / "fresh", params_for(ds, frames=(1, 8), repeats=3), cache=False)[0] == rows


def test_damaged_snapshot_is_not_used(tmp_path: Path, ds: Path) -> None:
    small_dataset(ds)
    _, _, data = run(tmp_path, params_for(ds))
    snapshot = tmp_path / "out" / "cache.last-manifest.parquet"
    snapshot.write_bytes(snapshot.read_bytes()[:-10] + b"0123456789")
    _, report, again = run(tmp_path, params_for(ds))
    assert report["run"]["reused_last_scan"] is False and again == data


def test_process_pool_gives_the_same_manifest(tmp_path: Path, ds: Path) -> None:
    small_dataset(ds)
    for i in range(20):
        make_image(ds / "many" / f"{i:02d}.png", color=(i, 2 * i, 3 * i))
    _, serial_report, serial = run(tmp_path / "serial", params_for(ds, frames=(1, 8), workers=1), cache=False)
    _, pool_report, pooled = run(tmp_path / "pool", params_for(ds, frames=(1, 8), workers=2), cache=False)
    assert serial == pooled and pool_report["run"]["workers"] == 2 and serial_report["ok"] == 24


def test_missing_captions_with_policy_error_raise(tmp_path: Path, ds: Path) -> None:
    make_image(ds / "has.png")
    for i in range(7):
        make_image(ds / f"no{i}.png", caption=None)
    make_image(ds / "empty.png", caption="  \n ")
    with pytest.raises(ScanError, match=r"8 item\(s\) have no caption.*empty\.png, no0\.png.*, \.\.\..*"
                                        r"caption_policy.*scan\.datasets\[0\]"):
        run(tmp_path, params_for(ds))
    assert not (tmp_path / "out" / "manifest.parquet").exists()


def test_missing_captions_skip_and_default(tmp_path: Path, ds: Path) -> None:
    make_image(ds / "has.png", caption="own")
    make_image(ds / "no.png", caption=None, color=(1, 2, 3))
    make_image(ds / "empty.png", caption="", color=(4, 5, 6))
    rows, report, _ = run(tmp_path, params_for(ds, caption_policy="skip"))
    r = by_path(rows)
    assert (r["no.png"]["status"], r["no.png"]["reason"], r["no.png"]["caption_source"]) == (
        "excluded", "missing_caption", "none")
    assert r["no.png"]["caption"] == "" and r["no.png"]["buckets"] == [] and r["empty.png"]["reason"] == "missing_caption"
    assert report["missing_captions"] == 2 and report["excluded_by_reason"] == {"missing_caption": 2}
    rows, report, _ = run(tmp_path, params_for(ds, caption_policy="default", default_caption="a thing",
                                               caption_prefix="sks, "))
    r = by_path(rows)
    assert (r["no.png"]["caption"], r["no.png"]["caption_source"], r["no.png"]["status"]) == (
        "sks, a thing", "default", "ok")
    assert r["has.png"]["caption"] == "sks, own" and report["missing_captions"] == 2
    assert report["caption_sources"] == {"default": 2, "txt": 1}


def test_caption_extension_per_dataset(tmp_path: Path, ds: Path) -> None:
    """`caption_extension: .caption` reads `a.caption` beside `a.png` (any case, the exact one preferred); `.txt`
    files are then neither captions nor media (counted as ignored), and a missing caption names the extension.
    A media extension is refused, naming the param."""
    make_image(ds / "a.png", caption=None)
    (ds / "a.caption").write_text("from the caption file")
    (ds / "a.txt").write_text("not read")
    make_image(ds / "b.png", caption=None, color=(9, 9, 9))
    (ds / "b.CAPTION").write_text("upper case")
    rows, report, _ = run(tmp_path, params_for(ds, caption_extension=".caption"))
    r = by_path(rows)
    assert r["a.png"]["caption"] == "from the caption file" and r["b.png"]["caption"] == "upper case"
    assert report["ignored_files"] == 1
    make_image(ds / "c.png", caption=None, color=(7, 7, 7))
    with pytest.raises(ScanError, match=r"1 item\(s\) have no caption \(no \.caption beside them.*c\.png"):
        run(tmp_path, params_for(ds, caption_extension=".caption"))
    with pytest.raises(ConfigError, match=r"scan.datasets\[0\].caption_extension: '.png' is a media extension"):
        run(tmp_path, params_for(ds, caption_extension=".png"))
    with pytest.raises(ValueError, match=r"caption_extension 'txt' is not a file extension"):
        DatasetParams(path=str(ds), caption_extension="txt")


def test_non_utf8_caption_excludes_the_item(tmp_path: Path, ds: Path) -> None:
    make_image(ds / "a.png")
    (ds / "a.txt").write_bytes("caf\xe9".encode("latin-1"))
    rows, report, _ = run(tmp_path, params_for(ds, caption_policy="default", default_caption="x"))
    assert (rows[0]["status"], rows[0]["reason"], rows[0]["caption"]) == ("excluded", "caption_not_utf8", "")
    assert report["excluded_examples"]["caption_not_utf8"] == ["ds/a.png (not UTF-8: byte 3)"]  # which byte


def test_bad_files_are_excluded_not_fatal(tmp_path: Path, ds: Path) -> None:
    make_image(ds / "good.png")
    make_image(ds / "empty.png")
    (ds / "empty.png").write_bytes(b"")
    make_image(ds / "corrupt.jpg")
    (ds / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 broken")
    make_video(ds / "broken.mp4", n_frames=10)
    (ds / "broken.mp4").write_bytes((ds / "broken.mp4").read_bytes()[:300])
    make_image(ds / "huge.png", size=(300, 300))
    (ds / "gone.png").symlink_to(ds / "nowhere.png")
    (ds / "gone.txt").write_text("caption of a broken link")
    (ds / "loop1.png").symlink_to(ds / "loop2.png")
    (ds / "loop2.png").symlink_to(ds / "loop1.png")
    (ds / "sub").mkdir()
    (ds / "sub" / "up").symlink_to(ds)  # a directory loop: scanned once, with a warning
    os.mkfifo(ds / "pipe.png")  # opening a FIFO would block the scan forever
    make_image(ds / "still.png", color=(5, 6, 7), caption="a still image named like a clip")
    (ds / "still.png").rename(ds / "still.mp4")  # FFmpeg reads it as a one-frame video
    rows, report, _ = run(tmp_path, params_for(ds, caption_policy="skip", scan={"max_image_pixels": 300 * 300 - 1}))
    reasons = {r["path"]: r["reason"] for r in rows}
    assert reasons == {
        "broken.mp4": "corrupt", "corrupt.jpg": "corrupt", "empty.png": "empty_file", "gone.png": "broken_symlink",
        "good.png": "", "huge.png": "too_large", "loop1.png": "symlink_loop", "loop2.png": "symlink_loop",
        "pipe.png": "not_regular_file", "still.mp4": "wrong_extension",
    }
    assert by_path(rows)["gone.png"]["caption"] == "caption of a broken link"
    assert report["excluded_by_reason"] == {"broken_symlink": 1, "corrupt": 2, "empty_file": 1,
                                            "not_regular_file": 1, "symlink_loop": 2, "too_large": 1,
                                            "wrong_extension": 1}
    assert report["excluded_examples"]["wrong_extension"] == [
        "ds/still.mp4 (the bytes are a PNG image, not a video as the extension .mp4 says; rename it to .png)"]
    assert any("sub/up" in w and "already scanned" in w for w in report["warnings"])


def test_a_png_named_mp4_does_not_stop_an_image_familys_encode(tmp_path: Path, ds: Path, tiny_flux_dir: Path,
                                                               store_env: Path) -> None:
    """FFmpeg reads a PNG named .mp4 as a one-frame video; as an ok 'video' row it stopped a Flux encode (a
    family of images). The scan excludes it, so encode plans the rest."""
    from diffusion_pipe.config import from_dict
    from diffusion_pipe.encode.encode import plan_samples
    from diffusion_pipe.models import load_adapter
    from diffusion_pipe.params import EncodeParams, ModelParams

    make_image(ds / "a.png", size=(64, 64))
    make_image(ds / "still.png", size=(64, 64), color=(9, 9, 9), caption="a still image")
    (ds / "still.png").rename(ds / "still.mp4")
    run(tmp_path, params_for(ds, resolutions=(64,), scan={"bucket_step": 16}))
    manifest = pq.read_table(tmp_path / "out" / "manifest.parquet")
    model = from_dict(ModelParams, {"family": "flux", "path": str(tiny_flux_dir)}, "model")
    samples = plan_samples(manifest, load_adapter(model), model, from_dict(EncodeParams, {}, "encode"))
    assert [s.path for s in samples] == ["a.png"]


def test_identical_scans_write_identical_reports(tmp_path: Path, ds: Path) -> None:
    """Every detail of an excluded file is the same on every run: no object address (Pillow quotes its input as
    `<_io.BytesIO object at 0x7f...>`), whichever process probed it."""
    make_image(ds / "good.png")
    for name, data in (("junk.png", b"not a png"), ("junk.webp", b"RIFF1234WEBP no"), ("junk.mp4", b"not a video"),
                       ("cut.jpg", b"\xff\xd8\xff\xe0 broken"), ("cut.gif", b"GIF89a broken")):
        (ds / name).write_bytes(data)
        (ds / name).with_suffix(".txt").write_text(name)
    make_video(ds / "clip.mp4", n_frames=10)
    (ds / "clip.mp4").rename(ds / "clip.png")
    reports = []
    for workers in (1, 2, 1):  # in this process twice, then in a pool's
        out = tmp_path / f"out{len(reports)}"
        scan_to_files(params_for(ds, workers=workers), out / "manifest.parquet", out / "scan.json", None)
        report = json.loads((out / "scan.json").read_text())
        reports.append({k: v for k, v in report.items() if k != "run"})
    assert reports[0] == reports[1] == reports[2]
    details = json.dumps([reports[0]["excluded_examples"], reports[0]["excluded_first"]])
    assert reports[0]["excluded"] == 6 and not re.search(r"0x[0-9a-f]{6}", details) and str(ds) not in details


@contextlib.contextmanager
def as_nobody() -> Iterator[None]:
    """Drop the effective uid to nobody (root keeps its saved uid, so it can come back)."""
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


def test_unreadable_file(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        root = tmp_path / "ds"
    else:
        # As root chmod 000 blocks nothing, so read as nobody, from a directory nobody can traverse.
        root = Path(tempfile.mkdtemp(prefix="scan-unreadable-", dir="/tmp")) / "ds"
        root.parent.chmod(0o755)
    try:
        make_image(root / "ok.png")
        make_image(root / "locked.png", color=(0, 0, 255))
        (root / "locked.png").chmod(0)
        params = params_for(root)
        scan_datasets(params, None, progress=False)  # imports and Pillow plugins load before dropping uid
        with as_nobody() if os.geteuid() == 0 else contextlib.nullcontext():
            rows, report = scan_datasets(params, None, progress=False)
        got = {r.path: r.reason for r in rows}
        assert got == {"locked.png": "unreadable", "ok.png": ""}
        assert "Permission denied" in report["excluded_examples"]["unreadable"][0]
    finally:
        if root.parent != tmp_path:
            shutil.rmtree(root.parent)


def test_duplicates_within_a_dataset_are_excluded_and_across_datasets_counted(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    make_image(one / "a.png", caption="first")
    (one / "z").mkdir()
    shutil.copy(one / "a.png", one / "z" / "copy.png")
    (one / "z" / "copy.txt").write_text("second")
    make_image(one / "other.png", color=(0, 255, 0))
    two.mkdir()
    shutil.copy(one / "a.png", two / "a.png")
    (two / "a.txt").write_text("other dataset")
    rows, report, _ = run(tmp_path, params_for(one, two))
    got = {(r["dataset"], r["path"]): (r["status"], r["reason"]) for r in rows}
    assert got == {("one", "a.png"): ("ok", ""), ("one", "other.png"): ("ok", ""),
                   ("one", "z/copy.png"): ("excluded", "duplicate"), ("two", "a.png"): ("ok", "")}
    assert report["duplicates"] == {"groups": 1, "extra_copies": 2, "excluded": 1,
                                    "examples": [["one/a.png", "one/z/copy.png", "two/a.png"]]}


def test_hidden_unicode_and_uppercase_names(tmp_path: Path, ds: Path) -> None:
    make_image(ds / ".hidden.png")
    make_image(ds / ".cache" / "x.png")
    make_image(ds / "Été ☀" / "café 猫.PNG", caption="unicode")
    make_video(ds / "CLIP.MOV", n_frames=4, caption="upper")
    rows, report, _ = run(tmp_path, params_for(ds, frames=(1, 4)))
    assert [r["path"] for r in rows] == ["CLIP.MOV", "Été ☀/café 猫.PNG"]
    assert by_path(rows)["Été ☀/café 猫.PNG"]["caption"] == "unicode"
    assert by_path(rows)["CLIP.MOV"]["buckets"] == ["512x512x4"]


def test_video_too_short_for_its_frame_buckets(tmp_path: Path, ds: Path) -> None:
    make_video(ds / "short.mp4", n_frames=5)
    make_video(ds / "long.mkv", n_frames=17)
    make_image(ds / "still.png", size=(64, 64))
    rows, report, _ = run(tmp_path, params_for(ds, frames=(8, 16)))
    r = by_path(rows)
    assert (r["short.mp4"]["status"], r["short.mp4"]["reason"], r["short.mp4"]["num_frames"]) == (
        "excluded", "too_short", 5)
    assert r["long.mkv"]["buckets"] == ["512x512x16"] and r["still.png"]["buckets"] == ["512x512x1"]
    assert report["excluded_by_reason"] == {"too_short": 1}


def test_never_upscale_excludes_small_items(tmp_path: Path, ds: Path) -> None:
    make_image(ds / "small.png", size=(300, 300))
    make_image(ds / "big.png", size=(700, 600), color=(9, 9, 9))
    rows, report, _ = run(tmp_path, params_for(ds, never_upscale=True, resolutions=(256, 512)))
    r = by_path(rows)
    assert r["small.png"]["buckets"] == ["256x256x1"] and r["big.png"]["buckets"] == ["256x256x1", "576x448x1"]
    rows, report, _ = run(tmp_path, params_for(ds, never_upscale=True, resolutions=(512,)))
    assert by_path(rows)["small.png"]["reason"] == "too_small" and report["excluded_by_reason"] == {"too_small": 1}


def test_eval_split_is_from_the_content_hash(tmp_path: Path, ds: Path) -> None:
    for i in range(40):
        make_image(ds / f"{i:02d}.png", color=(i, 100, 200))
    rows, report, _ = run(tmp_path, params_for(ds, eval_fraction=0.3))
    for r in rows:
        assert r["split"] == ("eval" if int(r["content_hash"][:8], 16) / 2**32 < 0.3 else "train")
    n_eval = sum(r["split"] == "eval" for r in rows)
    assert 0 < n_eval < 40 and report["split"] == {"train": 40 - n_eval, "eval": n_eval}
    assert report["warnings"] == []
    assert split_for("ffffffff" + "0" * 24, 0.99) == "train" and split_for("00000000" + "0" * 24, 0.01) == "eval"


def test_warning_when_eval_fraction_gives_no_eval_item(tmp_path: Path, ds: Path) -> None:
    make_image(ds / "a.png")
    rows, report, _ = run(tmp_path, params_for(ds, eval_fraction=1e-9))
    assert rows[0]["split"] == "train"
    assert any("eval_fraction" in w and "no item landed in eval" in w for w in report["warnings"])


def test_summary_on_stderr_and_report_file(tmp_path: Path, ds: Path, capsys: pytest.CaptureFixture[str]) -> None:
    small_dataset(ds)
    _, report, _ = run(tmp_path, params_for(ds, frames=(1, 8)))
    err = capsys.readouterr().err
    assert "scan: 4 items (2 images, 2 videos) in 1 dataset(s): 4 ok, 0 excluded" in err
    import json

    assert json.loads((tmp_path / "out" / "scan.json").read_text()) == report


def test_dataset_errors(tmp_path: Path, ds: Path) -> None:
    other = tmp_path / "x" / "ds"
    other.mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"scan\.datasets\[1\]: dataset name 'ds' is already used.*distinct `name`"):
        scan_datasets(params_for(ds, other), None)
    with pytest.raises(ConfigError, match=r"scan\.datasets\[0\]\.path: '.*nope' is not a directory"):
        scan_datasets(params_for(tmp_path / "nope"), None)
    make_image(ds / "a.png")
    named = ScanParams(datasets=(DatasetParams(path=str(ds)), DatasetParams(path=str(other), name="second")))
    rows, _ = scan_datasets(named, None, progress=False)
    assert [r.dataset for r in rows] == ["ds"]


def test_params_validation() -> None:
    ds = (DatasetParams(path="d"),)
    with pytest.raises(ValueError, match="bucket_step must be > 0"):
        ScanParams(datasets=ds, bucket_step=0)
    with pytest.raises(ValueError, match="min_aspect and max_aspect"):
        ScanParams(datasets=ds, min_aspect=1.5)
    with pytest.raises(ValueError, match="max_image_pixels must be >= 0"):
        ScanParams(datasets=ds, max_image_pixels=-1)
    with pytest.raises(ValueError, match="workers must be >= 0"):
        ScanParams(datasets=ds, workers=-1)
    with pytest.raises(ValueError, match=r"datasets\[0\]\.resolutions: 100 has no bucket"):
        ScanParams(datasets=(DatasetParams(path="d", resolutions=(100,)),), min_aspect=1.0, max_aspect=1.0)
    with pytest.raises(ValueError, match=r"datasets\[0\]\.resolutions: 32 has no bucket"):
        ScanParams(datasets=(DatasetParams(path="d", resolutions=(32,)),))
