"""Probing single files: real images and videos, measured by decoding, and every kind of bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_pipe.scan.media import media_kind, probe_media
from tests.scan.conftest import make_animation, make_image, make_video

LIMIT = 10_000_000


@pytest.mark.parametrize("name", ["a.png", "a.jpg", "a.JPEG", "a.webp", "a.bmp", "a.TIF", "a.gif"])
def test_images_of_every_format(tmp_path: Path, name: str) -> None:
    path = make_image(tmp_path / name, size=(64, 48))
    probe = probe_media(str(path), LIMIT)
    assert (probe.media, probe.width, probe.height, probe.num_frames, probe.fps, probe.reason) == (
        "image", 64, 48, 1, 0.0, "")
    assert probe.size_bytes == path.stat().st_size and len(probe.content_hash) == 32


def test_extension_matching_is_case_insensitive() -> None:
    assert media_kind("x/Y.PNG") == "image" and media_kind("clip.MP4") == "video"
    assert media_kind("a.txt") is None and media_kind("README") is None


@pytest.mark.parametrize("orientation,expected", [(1, (64, 48)), (3, (64, 48)), (6, (48, 64)), (8, (48, 64))])
def test_exif_orientation_is_applied(tmp_path: Path, orientation: int, expected: tuple[int, int]) -> None:
    path = make_image(tmp_path / "a.jpg", size=(64, 48), orientation=orientation)
    probe = probe_media(str(path), LIMIT)
    assert (probe.width, probe.height) == expected


def test_video_frames_and_fps_are_measured(tmp_path: Path) -> None:
    probe = probe_media(str(make_video(tmp_path / "v.mp4", n_frames=13, fps=25, size=(48, 32))), LIMIT)
    assert (probe.media, probe.width, probe.height, probe.num_frames, probe.reason) == ("video", 48, 32, 13, "")
    assert probe.fps == pytest.approx(25.0)


def test_h264_video(tmp_path: Path) -> None:
    probe = probe_media(str(make_video(tmp_path / "v.MKV", n_frames=9, fps=12, codec="libx264")), LIMIT)
    assert (probe.num_frames, probe.reason) == (9, "") and probe.fps == pytest.approx(12.0)


@pytest.mark.parametrize("name", ["a.gif", "a.webp"])
def test_animated_gif_and_webp_are_videos(tmp_path: Path, name: str) -> None:
    probe = probe_media(str(make_animation(tmp_path / name, n_frames=6, duration_ms=50)), LIMIT)
    assert (probe.media, probe.width, probe.height, probe.num_frames, probe.reason) == ("video", 40, 20, 6, "")
    assert probe.fps == pytest.approx(20.0)


def test_gif_without_delays_plays_at_browser_speed(tmp_path: Path) -> None:
    probe = probe_media(str(make_animation(tmp_path / "a.gif", n_frames=4, duration_ms=0)), LIMIT)
    assert probe.fps == pytest.approx(10.0)


def test_zero_byte_file(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(b"")
    probe = probe_media(str(tmp_path / "a.png"), LIMIT)
    assert (probe.reason, probe.size_bytes) == ("empty_file", 0)


@pytest.mark.parametrize("name", ["a.png", "a.jpg", "a.gif"])
def test_truncated_image_is_corrupt(tmp_path: Path, name: str) -> None:
    from PIL import Image

    path = tmp_path / name
    Image.effect_noise((256, 256), 64).convert("RGB").save(path)  # noise: no tiny all-in-one-block encoding
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    probe = probe_media(str(path), LIMIT)
    assert probe.reason == "corrupt" and probe.detail and probe.size_bytes == len(data) // 2


def test_garbage_with_an_image_name_is_corrupt(tmp_path: Path) -> None:
    (tmp_path / "a.webp").write_bytes(b"this is not an image at all" * 10)
    assert probe_media(str(tmp_path / "a.webp"), LIMIT).reason == "corrupt"


@pytest.mark.parametrize("cut", [0.5, 0.9])
def test_truncated_video_is_corrupt(tmp_path: Path, cut: float) -> None:
    path = make_video(tmp_path / "v.mp4", n_frames=20)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * cut)])
    assert probe_media(str(path), LIMIT).reason == "corrupt"


def test_garbage_video_is_corrupt(tmp_path: Path) -> None:
    (tmp_path / "v.webm").write_bytes(bytes(range(256)) * 20)
    assert probe_media(str(tmp_path / "v.webm"), LIMIT).reason == "corrupt"


def test_image_over_the_pixel_limit_is_not_decoded(tmp_path: Path) -> None:
    path = make_image(tmp_path / "big.png", size=(400, 300))
    probe = probe_media(str(path), max_image_pixels=400 * 300 - 1)
    assert probe.reason == "too_large" and (probe.width, probe.height) == (400, 300)
    assert probe_media(str(path), max_image_pixels=400 * 300).reason == ""


def test_decompression_bomb_far_over_the_limit(tmp_path: Path) -> None:
    # More than twice the limit: Pillow itself refuses at open (DecompressionBombError).
    path = make_image(tmp_path / "bomb.png", size=(1000, 1000))
    assert probe_media(str(path), max_image_pixels=1000).reason == "too_large"


def test_pillow_limit_is_restored(tmp_path: Path) -> None:
    from PIL import Image

    before = Image.MAX_IMAGE_PIXELS
    probe_media(str(make_image(tmp_path / "a.png")), max_image_pixels=5)
    assert Image.MAX_IMAGE_PIXELS == before


@pytest.mark.parametrize("size", [0, 1, 4097, 3 << 20])
def test_file_hash_matches_hash_of_bytes(tmp_path: Path, size: int) -> None:
    """hash_file (mmap, or chunked reads where mapping fails, as for an empty file) equals xxh3 in memory."""
    import os

    from diffusion_pipe.hashing import hash_bytes, hash_file

    data = os.urandom(size)
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    assert hash_file(path) == hash_bytes(data)


def _renamed(tmp_path: Path, source: Path, name: str) -> str:
    """`source`'s bytes under another name (the extension is what lies)."""
    target = tmp_path / "renamed" / name
    target.parent.mkdir(exist_ok=True)
    target.write_bytes(source.read_bytes())
    return str(target)


@pytest.mark.parametrize("made,name,detail", [
    ("a.png", "a.mp4", "the bytes are a PNG image, not a video as the extension .mp4 says; rename it to .png"),
    ("a.jpg", "a.MOV", "the bytes are a JPEG image, not a video as the extension .MOV says; rename it to .jpg"),
    ("anim.gif", "a.mp4", "the bytes are a GIF image, not a video as the extension .mp4 says; rename it to .gif"),
    ("v.mp4", "a.png", "the bytes are an MP4/QuickTime video, not an image as the extension .png says; rename it "
                       "to .mp4"),
    ("v.mkv", "a.jpg", "the bytes are a Matroska video, not an image as the extension .jpg says; rename it to .mkv"),
])
def test_bytes_of_the_other_kind_are_a_wrong_extension(tmp_path: Path, made: str, name: str, detail: str) -> None:
    """A PNG named .mp4 would decode as a one-frame video (FFmpeg's png_pipe) and stop an image family's encode."""
    if made.endswith((".mp4", ".mkv")):
        source = make_video(tmp_path / made, n_frames=3, caption=None)
    elif made == "anim.gif":
        source = make_animation(tmp_path / made, n_frames=3, duration_ms=50, caption=None)
    else:
        source = make_image(tmp_path / made, caption=None)
    probe = probe_media(_renamed(tmp_path, source, name), LIMIT)
    assert (probe.reason, probe.detail) == ("wrong_extension", detail)
    assert probe.content_hash and probe.size_bytes == source.stat().st_size  # hashed like any excluded file


def test_an_image_ffmpeg_opens_as_a_video_is_a_wrong_extension(tmp_path: Path) -> None:
    """A format without a signature known to `sniff` (PPM): FFmpeg's demuxer tells it is a still image."""
    from PIL import Image

    path = tmp_path / "a.mp4"
    Image.new("RGB", (16, 16), (1, 2, 3)).save(path, format="PPM")
    probe = probe_media(str(path), LIMIT)
    assert probe.reason == "wrong_extension"
    assert probe.detail == ("the bytes are a still image (piped ppm sequence), not a video as the extension .mp4 "
                            "says; rename it to its image format's extension")


def test_a_wrong_extension_of_the_same_kind_decodes(tmp_path: Path) -> None:
    """Pillow and FFmpeg go by the bytes: a PNG named .jpg is an image, an MP4 named .webm a video, and an animated
    GIF named .png the video it is."""
    png = probe_media(_renamed(tmp_path, make_image(tmp_path / "a.png", caption=None), "a.jpg"), LIMIT)
    assert (png.media, png.reason, png.width) == ("image", "", 64)
    mp4 = probe_media(_renamed(tmp_path, make_video(tmp_path / "v.mp4", n_frames=3, caption=None), "v.webm"), LIMIT)
    assert (mp4.media, mp4.reason, mp4.num_frames) == ("video", "", 3)
    gif = make_animation(tmp_path / "g.gif", n_frames=3, duration_ms=50, caption=None)
    assert probe_media(_renamed(tmp_path, gif, "g.png"), LIMIT).media == "video"


def test_a_detail_is_the_same_from_memory_and_from_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pillow quotes its input (`<_io.BytesIO object at 0x7f...>`, or the path of a file over the in-memory size),
    PyAV the path: a detail drops both, so reports/scan.json is the same on every run and at every location."""
    import diffusion_pipe.scan.media as media

    (tmp_path / "junk.png").write_bytes(b"not a png")
    (tmp_path / "junk.mp4").write_bytes(b"not a video at all")
    in_memory = [probe_media(str(tmp_path / name), LIMIT).detail for name in ("junk.png", "junk.mp4")]
    monkeypatch.setattr(media, "_IN_MEMORY_BYTES", 1)  # larger files are decoded from disk, by path
    from_disk = [probe_media(str(tmp_path / name), LIMIT).detail for name in ("junk.png", "junk.mp4")]
    assert in_memory == from_disk
    assert in_memory[0] == "UnidentifiedImageError: cannot identify image file"
    assert in_memory[1].startswith("InvalidDataError: ") and in_memory[1].endswith("processing input")
