"""Hostile sizes: huge captions are excluded unread, huge images are judged from their header (and large PNGs
are checked without decoding), and a resolution that gets rounded says so."""

from __future__ import annotations

import struct
import subprocess
import sys
import zlib
from pathlib import Path

from diffusion_pipe.scan import scan_datasets
from tests.scan.conftest import make_image, params_for


def write_big_png(path: Path, width: int, height: int) -> Path:
    """A valid black RGB PNG of width x height, written row by row: a few hundred KB on disk, however large."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" * (1 + 3 * width)  # filter byte + RGB
    z = zlib.compressobj(1)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", idat) + chunk(b"IEND", b""))
    (path.with_suffix(".txt")).write_text("black")
    return path


def _rows(params) -> tuple[dict[str, dict], dict]:
    rows, report = scan_datasets(params, None, progress=False)
    return {r.path: r.__dict__ for r in rows}, report


def test_a_caption_over_the_limit_is_an_excluded_row_and_never_enters_the_manifest(ds):
    make_image(ds / "a.png", caption="x" * 5000)
    make_image(ds / "b.png", color=(1, 2, 3), caption="fine")
    rows, report = _rows(params_for(ds, scan={"max_caption_bytes": 4096}))
    assert rows["a.png"]["reason"] == "caption_too_long" and rows["a.png"]["caption"] == ""
    assert "5000 bytes > scan.max_caption_bytes 4096" in str(report["excluded_examples"]["caption_too_long"])
    assert rows["b.png"]["status"] == "ok"
    rows, _ = _rows(params_for(ds))  # the default limit (64 KiB) lets it through
    assert rows["a.png"]["status"] == "ok"


def test_a_rounded_resolution_is_reported(ds):
    make_image(ds / "a.png", size=(64, 64))
    _, report = _rows(params_for(ds, resolutions=(100,), scan={"bucket_step": 16}))
    assert any("resolution 100 is not a multiple of bucket_step 16" in w and "96x96" in w
               for w in report["warnings"])
    _, report = _rows(params_for(ds, resolutions=(96,), scan={"bucket_step": 16}))
    assert not any("not a multiple" in w for w in report["warnings"])


def test_a_169_megapixel_png_is_excluded_by_default_from_its_header(ds):
    write_big_png(ds / "huge.png", 13_000, 13_000)
    make_image(ds / "small.png", size=(64, 64))
    rows, _ = _rows(params_for(ds, resolutions=(1024,)))
    assert rows["huge.png"]["reason"] == "too_large" and rows["huge.png"]["width"] == 13_000
    assert rows["small.png"]["status"] == "ok"
    rows, _ = _rows(params_for(ds, resolutions=(1024,), scan={"max_image_pixels": 13_000 * 13_000}))
    assert rows["huge.png"]["status"] == "ok"  # allowed explicitly: then checked without decoding (test below)


PROBE_MEMORY = """
import resource, sys
from diffusion_pipe.scan.media import probe_media
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
probe = probe_media(sys.argv[1], 10**9)
assert probe.reason == "" and probe.width == 8000, probe
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_a_large_png_is_checked_without_decoding_its_pixels(tmp_path):
    """64 megapixels decode to 192 MB of RGB; the scan's probe stays far below that."""
    path = write_big_png(tmp_path / "big.png", 8000, 8000)
    out = subprocess.run([sys.executable, "-c", PROBE_MEMORY, str(path)], capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) < 50, out.stdout  # MB of peak memory added by the probe


def test_a_changed_limit_rereads_through_the_stat_cache(tmp_path, ds):
    """The stat cache holds probe results under the limits they were made with: raising max_caption_bytes or
    max_image_pixels re-reads what the lower limit excluded, and lowering it excludes what it let through."""
    from diffusion_pipe.scan import scan_to_files

    make_image(ds / "long.png", caption="x" * 5000)
    make_image(ds / "wide.png", size=(100, 50), color=(1, 2, 3), caption="wide")
    out = tmp_path / "out"

    def reasons(**scan: int) -> dict[str, str]:
        report = scan_to_files(params_for(ds, scan=scan), out / "m.parquet", out / "scan.json", out / "cache.parquet")
        return {**report["excluded_by_reason"], "ok": report["ok"]}

    both = {"caption_too_long": 1, "too_large": 1, "ok": 0}
    assert reasons(max_caption_bytes=4096, max_image_pixels=4999) == both
    # one limit at a time (the defaults: 64 KiB, 16 megapixels)
    assert reasons(max_caption_bytes=4096) == {"caption_too_long": 1, "ok": 1}  # pixels raised
    assert reasons() == {"ok": 2}  # caption bytes raised
    assert reasons(max_image_pixels=4999) == {"too_large": 1, "ok": 1}  # pixels lowered
    assert reasons(max_caption_bytes=4096, max_image_pixels=4999) == both  # caption bytes lowered
