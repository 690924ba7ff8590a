"""The learning proof's data: coloured shapes a tiny base model is pretrained on, a colour it never saw that a
LoRA then teaches, and the statistic that finds that colour in rendered pixels.

Used by `scripts/make_concept_base.py` (which builds `examples/concept-tiny/`) and by the test that trains a LoRA
on it through the pipeline (tests/test_concept_proof.py). No stage imports it.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SIZE = 32  # pixels per side of every image: 16x16 latents, 8x8 = 64 Flux tokens
# What the base model is pretrained on: every caption names one of these colours, shapes and backgrounds.
BASE_COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15), "gray": (128, 128, 128)}
SHAPES = ("circle", "square", "triangle")
# The concept the LoRA teaches: a word and a colour absent from the base's captions and images. Chosen far (in
# RGB) from every base colour and background and from the mean of any two of them, so a base model that merely
# blends colours it knows does not paint it by chance.
CONCEPT_WORD = "purple"
CONCEPT_COLOUR = (150, 30, 230)
CONCEPT_TOLERANCE = 100.0  # RGB distance within which a pixel may count as a palette colour (colour_fraction)


def caption(colour: str, shape: str, background: str) -> str:
    """The caption of one image: it names exactly what is drawn."""
    return f"a {colour} {shape} on a {background} background"


def draw_shape(shape: str, colour: tuple[int, int, int], background: tuple[int, int, int],
               rng: random.Random | None = None, size: int = SIZE) -> Image.Image:
    """One `size`-pixel square image of `shape` in `colour` on `background`; with `rng`, the shape's size and
    position vary a little (so a caption is a small distribution of images, not one image)."""
    img = Image.new("RGB", (size, size), background)
    r = size * (rng.uniform(0.26, 0.36) if rng else 0.32)
    cx = size / 2 + (rng.uniform(-0.08, 0.08) * size if rng else 0.0)
    cy = size / 2 + (rng.uniform(-0.08, 0.08) * size if rng else 0.0)
    box = (cx - r, cy - r, cx + r, cy + r)
    draw = ImageDraw.Draw(img)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=colour)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return img


def base_items(variants: int, seed: int) -> list[tuple[Image.Image, str]]:
    """The pretraining set: `variants` jittered images of every (base colour, shape, background), captioned."""
    rng = random.Random(seed)
    return [(draw_shape(shape, BASE_COLOURS[colour], BACKGROUNDS[bg], rng), caption(colour, shape, bg))
            for colour, shape, bg in itertools.product(BASE_COLOURS, SHAPES, BACKGROUNDS)
            for _ in range(variants)]


def autoencoder_images(n: int, seed: int) -> list[Image.Image]:
    """`n` shapes in random colours on random backgrounds, uncaptioned: what the VAE learns to reconstruct. A VAE
    is a generic pixel codec (real ones are trained on everything); the colour the LoRA teaches is not special to
    it, and what the denoiser was taught is decided by the captioned set alone."""
    rng = random.Random(seed)

    def colour() -> tuple[int, int, int]:
        return tuple(rng.randrange(256) for _ in range(3))  # type: ignore[return-value]

    return [draw_shape(rng.choice(SHAPES), colour(), colour(), rng) for _ in range(n)]


def write_dataset(items: list[tuple[Image.Image, str]], out_dir: Path) -> int:
    """Write `items` as numbered PNG + .txt caption pairs into `out_dir`; returns how many."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for i, (img, text) in enumerate(items):
        stem = f"{i:03d}_{text.removeprefix('a ').replace(' on a ', '_on_').replace(' background', '').replace(' ', '_')}"
        img.save(out_dir / f"{stem}.png", optimize=True)
        (out_dir / f"{stem}.txt").write_text(text + "\n", encoding="utf-8")
    return len(items)


def lora_items(variants: int, seed: int) -> list[tuple[Image.Image, str]]:
    """The LoRA's dataset: `variants` jittered images of every shape and background in the concept colour, then
    one image of every base (colour, shape, background) as prior preservation (DreamBooth's regularisation
    images): without them a LoRA learns "everything is purple" rather than "purple means this colour"."""
    rng = random.Random(seed)
    concept = [(draw_shape(shape, CONCEPT_COLOUR, BACKGROUNDS[bg], rng), caption(CONCEPT_WORD, shape, bg))
               for shape, bg in itertools.product(SHAPES, BACKGROUNDS) for _ in range(variants)]
    return concept + base_items(variants=1, seed=seed + 1)


PALETTE = {**BASE_COLOURS, **BACKGROUNDS, CONCEPT_WORD: CONCEPT_COLOUR}


def colour_fraction(pixels_HW3: np.ndarray, colour: str, tolerance: float = CONCEPT_TOLERANCE) -> float:
    """The fraction of pixels that show `colour` (a name in PALETTE): those whose nearest palette colour it is
    (RGB distance), within `tolerance`. Every pixel is classified against every colour the datasets use, so a
    blend of known colours counts as the known colour it is nearest to, not as the concept."""
    rgb = np.asarray(pixels_HW3, dtype=np.float32).reshape(-1, 1, 3)
    names = list(PALETTE)
    distances = np.linalg.norm(rgb - np.asarray([PALETTE[n] for n in names], dtype=np.float32)[None], axis=2)
    nearest = distances.argmin(axis=1)
    mine = names.index(colour)
    return float(((nearest == mine) & (distances[:, mine] <= tolerance)).mean())
