"""Media preprocessing for the VAE: decode, orient, resize to cover the bucket, centre-crop, scale to [-1, 1].

The exact recipe is named by `RESIZE_SPEC`, and the rule choosing a video's frames by `FRAME_RULE`; both enter
every latent key, so changing either recipe must change its constant.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

from diffusion_pipe.config import ConfigError

RESIZE_SPEC = "cover+center-crop/lanczos/pil"
# How a video bucket of F frames is filled: F decoded frames in presentation order, from the window's first frame
# (frame 0 unless scan.datasets[].frame_extraction makes several windows) and every stride-th (1: the file's own
# frame rate; no resampling to a target fps). The scan only gives a clip windows that fit in it.
FRAME_RULE = "first-n/native-fps"
# Files Pillow decodes as animations (the scan calls animated GIF/WebP/PNG videos); everything else goes to PyAV.
_PILLOW_ANIMATION_EXTS = frozenset({".gif", ".webp", ".png", ".apng"})


class MediaError(ConfigError):
    """A media file no longer matches what the scan recorded (too few frames, no video stream).

    A ConfigError, so the stage prints it as a user error (the fix is re-running the scan), without making
    encode import the scan package, which is not among its dvc.yaml deps."""


def frames_spec(media: str, frames: int, start: int = 0, stride: int = 1) -> dict[str, Any]:
    """The `frames` part of a latent key: the frame count, plus the selection rule for videos and, for a window
    other than the clip's first frames (scan.datasets[].frame_extraction), its first frame and stride.

    Images keep their historical spec ({"count": 1}) so their keys do not change, and so does a video's first
    window; a video's spec names FRAME_RULE, so changing how frames are picked re-encodes every video.
    """
    if media == "video":
        window = {"start": start, "stride": stride} if (start, stride) != (0, 1) else {}
        return {"count": frames, "rule": FRAME_RULE, **window}
    return {"count": frames}


def cover_crop_geometry(src_width: int, src_height: int, width: int, height: int) -> tuple[int, int, int, int]:
    """(resized width, resized height, left, top): the size a picture is resized to so that it covers the
    bucket, and the corner of the centred bucket-sized crop. The one geometry of images, control images and
    loss masks (a mask lands where its image does)."""
    scale = max(width / src_width, height / src_height)
    rw, rh = max(width, round(src_width * scale)), max(height, round(src_height * scale))
    return rw, rh, (rw - width) // 2, (rh - height) // 2


def _cover_crop_uint8(im: Image.Image, width: int, height: int) -> torch.Tensor:
    """(3, height, width) uint8 from an RGB image: resized to cover the bucket, centre-cropped."""
    rw, rh, left, top = cover_crop_geometry(im.width, im.height, width, height)
    im = im.resize((rw, rh), Image.Resampling.LANCZOS)  # Pillow returns a copy when the size already fits
    im = im.crop((left, top, left + width, top + height))
    return torch.from_numpy(np.asarray(im, dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()


def to_unit_range(pixels_uint8: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> float32 in [-1, 1]; the same arithmetic on any device, so CPU and GPU agree bit for bit."""
    return pixels_uint8.float().div(127.5).sub(1.0)


def _cover_crop(im: Image.Image, width: int, height: int) -> torch.Tensor:
    return to_unit_range(_cover_crop_uint8(im, width, height))


def load_image_pixels(path: Path, width: int, height: int) -> torch.Tensor:
    """(3, height, width) float32 in [-1, 1]: EXIF-oriented, resized to cover, centre-cropped."""
    with Image.open(path) as im:
        return _cover_crop(ImageOps.exif_transpose(im).convert("RGB"), width, height)


def _pillow_frames(path: Path, frames: int) -> list[Image.Image]:
    # Pillow composites each GIF/WebP frame onto the previous ones (disposal handled), so frame i is the picture
    # shown at step i, as the scan counted it.
    out = []
    with Image.open(path) as im:
        n = int(getattr(im, "n_frames", 1))
        for i in range(min(frames, n)):
            im.seek(i)
            out.append(im.convert("RGB"))
    return out


def _av_frames(path: Path, frames: int) -> list[Image.Image]:
    """The first `frames` decoded frames (fewer when the clip has fewer)."""
    import av  # imported on use: only video datasets need it

    out: list[Image.Image] = []
    with av.open(str(path)) as container:
        if not container.streams.video:
            raise MediaError(f"{path}: no video stream; re-run the scan stage (the file changed since it ran?)")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"  # frame threads inside FFmpeg: decoding is the slow part of a video
        for frame in container.decode(stream):
            out.append(frame.to_image())
            if len(out) == frames:
                break
    return out


def _video_uint8(path: Path, width: int, height: int, frames: int, start: int = 0, stride: int = 1) -> torch.Tensor:
    path = Path(path)
    decode = _pillow_frames if os.path.splitext(path.name)[1].lower() in _PILLOW_ANIMATION_EXTS else _av_frames
    needed = start + (frames - 1) * stride + 1
    pictures = decode(path, needed)
    if len(pictures) < needed:
        raise MediaError(
            f"{path}: decoded {len(pictures)} frames, its window needs {needed} ({frames} from frame {start}, every "
            f"{stride}); the file changed since the scan: re-run the scan stage (dvc repro scan)"
        )
    picked = pictures[start:needed:stride]
    return torch.stack([_cover_crop_uint8(p, width, height) for p in picked], dim=1)


def load_video_pixels(path: Path, width: int, height: int, frames: int) -> torch.Tensor:
    """(3, frames, height, width) float32 in [-1, 1]: the first `frames` frames (FRAME_RULE), each resized to
    cover the bucket and centre-cropped exactly like an image.

    Containers (mp4, webm, mov, mkv) decode with PyAV; animated GIF/WebP/PNG with Pillow. A clip with fewer
    frames than its bucket is an error naming the file (the scan never assigns such a bucket).
    """
    return to_unit_range(_video_uint8(path, width, height, frames))


def load_pixels_uint8(path: Path, media: str, width: int, height: int, frames: int, start: int = 0,
                      stride: int = 1) -> torch.Tensor:
    """(3, frames, height, width) uint8 for a manifest item of kind `media` ('image' or 'video').

    A video's window starts at frame `start` and takes every `stride`-th frame (scan.datasets[].frame_extraction).
    What the encode stage's CPU workers produce: a quarter of the bytes of float pixels to pass between
    processes and to the GPU, where `to_unit_range` finishes the job.
    """
    if media == "video":
        return _video_uint8(path, width, height, frames, start, stride)
    if frames != 1:
        raise MediaError(f"{path}: an image has one frame, its bucket asks for {frames}; re-run the scan stage")
    with Image.open(path) as im:
        return _cover_crop_uint8(ImageOps.exif_transpose(im).convert("RGB"), width, height).unsqueeze(1)


def load_pixels(path: Path, media: str, width: int, height: int, frames: int) -> torch.Tensor:
    """(3, frames, height, width) float32 in [-1, 1] for a manifest item of kind `media` ('image' or 'video')."""
    return to_unit_range(load_pixels_uint8(path, media, width, height, frames))


# How a loss mask becomes its latent-resolution weights: greyscale in [0, 1] (white 1 = learn, black 0 = ignore),
# resized and centre-cropped with its image's geometry (`cover_crop_geometry`) by a box filter (no ringing outside
# [0, 1]), then averaged over each latent cell's pixels (an area mean). Enters every mask key.
MASK_RESIZE_SPEC = "grey/cover+center-crop/box/pil/area-mean"


def _mask_grey(im: Image.Image, path: Path) -> np.ndarray:
    """A mask's pixels as float32 in [0, 1]; a MediaError naming the file for a mask that is not greyscale (a
    colour image, or one with transparency: which would white or black mean?)."""
    mode = im.mode
    if mode in ("1", "L"):
        return np.asarray(im.convert("L"), dtype=np.float32) / 255.0
    if mode.startswith("I"):  # 16-bit PNG
        return np.clip(np.asarray(im, dtype=np.float32) / 65535.0, 0.0, 1.0)
    if mode == "F":
        return np.clip(np.asarray(im, dtype=np.float32), 0.0, 1.0)
    if mode in ("P", "PA", "LA", "RGB", "RGBA"):
        has_alpha = mode in ("PA", "LA", "RGBA") or (mode == "P" and "transparency" in im.info)
        rgba = np.asarray(im.convert("RGBA"), dtype=np.uint8)
        if has_alpha and (rgba[..., 3] != 255).any():
            raise MediaError(f"{path}: a loss mask with transparency; save it as an opaque greyscale PNG (white = "
                             "learn, black = ignore)")
        if (rgba[..., 0] != rgba[..., 1]).any() or (rgba[..., 1] != rgba[..., 2]).any():
            raise MediaError(f"{path}: a loss mask in colour; save it as a greyscale PNG (white = learn, black = "
                             "ignore)")
        return rgba[..., 0].astype(np.float32) / 255.0
    raise MediaError(f"{path}: a loss mask of image mode {mode!r}, which is not greyscale; save it as a greyscale "
                     "PNG (white = learn, black = ignore)")


def load_mask(path: Path, width: int, height: int, latent_factor: int) -> torch.Tensor:
    """(1, height // latent_factor, width // latent_factor) float32 in [0, 1]: the mask at `path` (EXIF-oriented
    like its image) through MASK_RESIZE_SPEC for a bucket of `width` x `height` pixels."""
    with Image.open(path) as im:
        grey = _mask_grey(ImageOps.exif_transpose(im), Path(path))
    rw, rh, left, top = cover_crop_geometry(grey.shape[1], grey.shape[0], width, height)
    resized = Image.fromarray(grey).resize((rw, rh), Image.Resampling.BOX)
    pixels = torch.from_numpy(np.asarray(resized.crop((left, top, left + width, top + height)),
                                         dtype=np.float32).copy())
    cells = torch.nn.functional.avg_pool2d(pixels[None, None], latent_factor)[0]
    return cells.clamp_(0.0, 1.0).contiguous()
