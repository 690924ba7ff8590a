"""The bundled example: a small, learnable dataset of coloured shapes with captions."""

from __future__ import annotations

import itertools
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15), "gray": (128, 128, 128)}
SHAPES = ("circle", "square", "triangle")


def _draw(shape: str, colour: tuple[int, int, int], bg: tuple[int, int, int], size: tuple[int, int]) -> Image.Image:
    w, h = size
    img = Image.new("RGB", size, bg)
    draw = ImageDraw.Draw(img)
    r = min(w, h) * 0.32
    cx, cy = w / 2, h / 2
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=colour)
    return img


def make_shapes_dataset(out_dir: str | Path, wide_every: int = 4) -> int:
    """Write one PNG + caption per (shape, colour, background): 36 items, 64x64, every `wide_every`-th 96x64
    (a second aspect bucket). Captions name exactly what is drawn, so a model can learn the mapping.
    Returns the number of items written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    combos = list(itertools.product(SHAPES, COLOURS, BACKGROUNDS))
    for i, (shape, colour, bg) in enumerate(combos):
        size = (96, 64) if wide_every and i % wide_every == wide_every - 1 else (64, 64)
        stem = f"{i:03d}_{colour}_{shape}_on_{bg}"
        _draw(shape, COLOURS[colour], BACKGROUNDS[bg], size).save(out / f"{stem}.png", optimize=True)
        (out / f"{stem}.txt").write_text(f"a {colour} {shape} on a {bg} background\n", encoding="utf-8")
    return len(combos)


def make_moving_shapes_videos(out_dir: str | Path, frames: int, size: int = 64, fps: int = 8,
                              direction: str = "right") -> int:
    """Write one short H.264 clip + caption per colour: a square moving right (or left) over a white background,
    `frames` frames of `size` x `size` (video families' tiny examples; their frame buckets need that many frames).
    Left-moving clips are named `v<i>_<colour>_left`. Returns the number of clips written."""
    import imageio.v3 as iio
    import numpy as np

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if direction == "right" else f"_{direction}"
    for i, (name, colour) in enumerate(COLOURS.items()):
        clip = []
        for f in range(frames):
            img = Image.new("RGB", (size, size), BACKGROUNDS["white"])
            step = f if direction == "right" else frames - 1 - f
            x = size * 0.1 + step * size * 0.5 / max(frames - 1, 1)
            ImageDraw.Draw(img).rectangle((x, size * 0.35, x + size * 0.3, size * 0.65), fill=colour)
            clip.append(np.asarray(img))
        iio.imwrite(out / f"v{i}_{name}{suffix}.mp4", np.stack(clip), extension=".mp4", plugin="pyav",
                    codec="libx264", fps=fps)
        (out / f"v{i}_{name}{suffix}.txt").write_text(f"a {name} square moving {direction}\n", encoding="utf-8")
    return len(COLOURS)


def make_edit_dataset(out_dir: str | Path, control_dir: str | Path, wide_every: int = 4) -> int:
    """An edit dataset (edit families' tiny examples): per (shape, colour, background), a control image of the
    shape in that colour, and a target of the same shape in the next colour, captioned with the instruction
    ('make the circle green'): targets and captions in `out_dir`, control images under the same names in
    `control_dir`. Sizes as in `make_shapes_dataset`. Returns the number of pairs written."""
    out, control = Path(out_dir), Path(control_dir)
    out.mkdir(parents=True, exist_ok=True)
    control.mkdir(parents=True, exist_ok=True)
    names = list(COLOURS)
    combos = list(itertools.product(SHAPES, COLOURS, BACKGROUNDS))
    for i, (shape, colour, bg) in enumerate(combos):
        size = (96, 64) if wide_every and i % wide_every == wide_every - 1 else (64, 64)
        new = names[(names.index(colour) + 1) % len(names)]
        stem = f"{i:03d}_{shape}_{colour}_to_{new}_on_{bg}"
        _draw(shape, COLOURS[colour], BACKGROUNDS[bg], size).save(control / f"{stem}.png", optimize=True)
        _draw(shape, COLOURS[new], BACKGROUNDS[bg], size).save(out / f"{stem}.png", optimize=True)
        (out / f"{stem}.txt").write_text(f"make the {shape} {new}\n", encoding="utf-8")
    return len(combos)
