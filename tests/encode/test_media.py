"""Pixel loading for the VAE: images and videos (PyAV containers, animated GIF) share one resize rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffusion_pipe.encode.encode import LatentSource, _PixelSet
from diffusion_pipe.encode.media import (
    FRAME_RULE,
    MediaError,
    frames_spec,
    load_image_pixels,
    load_pixels,
    load_pixels_uint8,
    load_video_pixels,
)

# Distinct flat colours per frame, so the frame order can be read back from the pixels.
COLOURS = [(230, 20, 20), (20, 230, 20), (20, 20, 230), (230, 230, 20), (20, 230, 230), (230, 20, 230)]


def _frame(i: int, width: int = 48, height: int = 32) -> np.ndarray:
    arr = np.zeros((height, width, 3), dtype=np.uint8)
    arr[:] = COLOURS[i]
    arr[: height // 4, : width // 4] = 255  # a corner mark, so the crop position matters
    return arr


def _write_mp4(path: Path, n: int, codec: str = "libx264") -> None:
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=8)
        stream.width, stream.height, stream.pix_fmt = 48, 32, "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "0", "preset": "ultrafast"}
        for i in range(n):
            for packet in stream.encode(av.VideoFrame.from_ndarray(_frame(i), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def _write_gif(path: Path, n: int) -> None:
    frames = [Image.fromarray(_frame(i)) for i in range(n)]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, loop=0)


def _mean_rgb(pixels_3FHW: torch.Tensor, f: int) -> list[float]:
    """Mean colour of frame f's bottom-right quarter (away from the corner mark), back in 0..255."""
    h, w = pixels_3FHW.shape[-2:]
    patch = pixels_3FHW[:, f, h // 2 :, w // 2 :]
    return ((patch.mean(dim=(1, 2)) + 1) * 127.5).tolist()


@pytest.mark.parametrize("codec", ["libx264", "mpeg4"])
def test_mp4_first_frames_in_order(tmp_path: Path, codec: str) -> None:
    path = tmp_path / "clip.mp4"
    _write_mp4(path, 6, codec)
    pixels = load_video_pixels(path, 32, 32, 4)
    assert pixels.shape == (3, 4, 32, 32) and pixels.dtype == torch.float32
    assert pixels.min() >= -1 and pixels.max() <= 1
    for f in range(4):
        assert _mean_rgb(pixels, f) == pytest.approx(list(COLOURS[f]), abs=12), f


def test_gif_frames_resized_exactly_like_images(tmp_path: Path) -> None:
    path = tmp_path / "anim.gif"
    _write_gif(path, 5)
    pixels = load_video_pixels(path, 16, 32, 3)
    assert pixels.shape == (3, 3, 32, 16)
    with Image.open(path) as im:
        for f in range(3):
            im.seek(f)
            still = tmp_path / f"frame{f}.png"
            im.convert("RGB").save(still)
            # the same cover + centre-crop as a still image of that frame, bit for bit
            assert torch.equal(pixels[:, f], load_image_pixels(still, 16, 32)), f


def test_too_short_clip_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "short.gif"
    _write_gif(path, 2)
    with pytest.raises(MediaError, match=r"short\.gif: decoded 2 frames, its window needs 5 \(5 from frame 0, "
                                         r"every 1\).*re-run the scan"):
        load_video_pixels(path, 16, 16, 5)


def test_a_window_takes_its_frames_from_its_start_every_stride(tmp_path: Path) -> None:
    """scan.datasets[].frame_extraction: a window of 2 frames from frame 1 every 3rd frame is frames 1 and 4 of
    the clip, each cropped as the clip's own first frames are; a window past the end names the file."""
    path = tmp_path / "clip.gif"
    _write_gif(path, 6)
    whole = load_pixels_uint8(path, "video", 16, 16, 6)
    assert torch.equal(load_pixels_uint8(path, "video", 16, 16, 2, start=1, stride=3), whole[:, [1, 4]])
    assert torch.equal(load_pixels_uint8(path, "video", 16, 16, 3, start=3), whole[:, 3:6])
    with pytest.raises(MediaError, match=r"clip\.gif: decoded 6 frames, its window needs 7 \(2 from frame 4, "
                                         r"every 2\)"):
        load_pixels_uint8(path, "video", 16, 16, 2, start=4, stride=2)


def test_image_dispatch_and_frames_check(tmp_path: Path) -> None:
    path = tmp_path / "still.png"
    Image.fromarray(_frame(2)).save(path)
    assert torch.equal(load_pixels(path, "image", 32, 32, 1)[:, 0], load_image_pixels(path, 32, 32))
    with pytest.raises(MediaError, match=r"still\.png: an image has one frame"):
        load_pixels(path, "image", 32, 32, 5)


def test_pixel_set_dispatches_on_media(tmp_path: Path) -> None:
    still, clip = tmp_path / "a.png", tmp_path / "b.mp4"
    Image.fromarray(_frame(0)).save(still)
    _write_mp4(clip, 5)
    items = _PixelSet([LatentSource("k0", still, "image", "32x32x1"), LatentSource("k1", clip, "video", "32x16x5"),
                       LatentSource("k2", clip, "video", "32x16x2", 1, 3),
                       LatentSource("k3", clip, "video", "32x16x5", 1, 1, condition_frames=5)])
    assert items[0].shape == (3, 1, 32, 32)
    assert items[1].shape == (3, 5, 16, 32)
    assert torch.equal(items[2], items[1][:, [1, 4]])  # a window: frames 1 and 4
    assert torch.equal(items[3], items[1][:, 1:2])  # an i2v conditioning source: its window's first frame only


def test_frame_rule_is_in_video_keys_only() -> None:
    assert frames_spec("image", 1) == {"count": 1}
    assert frames_spec("video", 5) == {"count": 5, "rule": FRAME_RULE}
    assert frames_spec("video", 5, 0, 1) == frames_spec("video", 5)  # a clip's first window keeps its old key
    assert frames_spec("video", 5, 5, 1) == {"count": 5, "rule": FRAME_RULE, "start": 5, "stride": 1}
    assert frames_spec("video", 5, 0, 2) == {"count": 5, "rule": FRAME_RULE, "start": 0, "stride": 2}
