"""Tiny media generators for the scan tests: real files written with Pillow and PyAV into tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_pipe.params import DatasetParams, ScanParams


def make_image(path: Path, size: tuple[int, int] = (64, 48), color: tuple[int, int, int] = (200, 30, 30),
               orientation: int | None = None, caption: str | None = "a photo") -> Path:
    """Write an image (format from the suffix) and, unless caption is None, its .txt."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", size, color)
    fmt = {".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".webp": "WEBP", ".bmp": "BMP", ".tif": "TIFF",
           ".tiff": "TIFF", ".gif": "GIF"}[path.suffix.lower()]
    kwargs = {}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kwargs["exif"] = exif.tobytes()
    img.save(path, format=fmt, **kwargs)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


def make_animation(path: Path, n_frames: int, duration_ms: int, size: tuple[int, int] = (40, 20),
                   caption: str | None = "an animation") -> Path:
    """Write an animated GIF or WebP with n_frames frames of duration_ms each."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    frames = [Image.new("RGB", size, (i * 40 % 256, 100, 50)) for i in range(n_frames)]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=duration_ms, loop=0)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


def make_video(path: Path, n_frames: int, fps: int = 10, size: tuple[int, int] = (32, 32),
               codec: str = "mpeg4", caption: str | None = "a clip") -> Path:
    """Write a tiny video with PyAV: n_frames frames at fps."""
    import av
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(n_frames):
            frame = av.VideoFrame.from_ndarray(np.full((size[1], size[0], 3), i * 7 % 256, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption, encoding="utf-8")
    return path


def params_for(*paths: Path, workers: int = 1, scan: dict | None = None, **dataset: object) -> ScanParams:
    """ScanParams over the given dataset dirs, each with the same DatasetParams keyword arguments."""
    datasets = tuple(DatasetParams(path=str(p), **dataset) for p in paths)  # type: ignore[arg-type]
    return ScanParams(datasets=datasets, workers=workers, **(scan or {}))


@pytest.fixture
def ds(tmp_path: Path) -> Path:
    """An empty dataset directory."""
    d = tmp_path / "ds"
    d.mkdir()
    return d
