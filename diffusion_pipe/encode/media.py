"""Media preprocessing for the VAE: decode, orient, resize to cover the bucket, centre-crop, scale to [-1, 1].

The exact recipe is named by `RESIZE_SPEC`, which enters every latent key: changing the recipe must change it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

RESIZE_SPEC = "cover+center-crop/lanczos/pil"


def parse_bucket(bucket: str) -> tuple[int, int, int]:
    """'512x768x1' -> (width, height, frames)."""
    w, h, f = (int(x) for x in bucket.split("x"))
    return w, h, f


def load_image_pixels(path: Path, width: int, height: int) -> torch.Tensor:
    """(3, height, width) float32 in [-1, 1]: EXIF-oriented, resized to cover, centre-cropped."""
    with Image.open(path) as im:
        im = ImageOps.exif_transpose(im).convert("RGB")
        scale = max(width / im.width, height / im.height)
        rw, rh = max(width, round(im.width * scale)), max(height, round(im.height * scale))
        im = im.resize((rw, rh), Image.Resampling.LANCZOS)
        left, top = (rw - width) // 2, (rh - height) // 2
        im = im.crop((left, top, left + width, top + height))
        arr = np.asarray(im, dtype=np.float32)
    return torch.from_numpy(arr).permute(2, 0, 1).div(127.5).sub(1.0).contiguous()
