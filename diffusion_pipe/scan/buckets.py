"""Aspect-ratio buckets: which (width, height, frames) each item trains at. Pure functions, no I/O.

A *layout* is the list of buckets for one target side `res`: every (W, H) with W and H multiples of `step`,
H the largest multiple of `step` with W * H <= res * res (so a bucket never costs more memory than the square
res x res), and min_aspect <= W / H <= max_aspect. An item goes to the bucket of the layout whose aspect is
closest to its own in log space (so 2:1 and 1:2 are equally far from 1:1).

Bound (checked by the property tests): without `never_upscale`, the chosen bucket's aspect differs from the
item's aspect, clamped to [min_aspect, max_aspect], by at most `aspect_error_bound(...)` in |ln|, namely the
largest ln-ratio between neighbouring buckets of the layout, including the two ends of the allowed range
(half of that inside the range, where a bucket lies on each side). For res = 512, step = 64 and the default
range [0.5, 2] the layout is 384x640 .. 640x384 and the bound is ln(2 / (640/384)) = ln 1.2 = 0.18 (at the
ends; 0.13 between buckets); for res = 1024, step = 64 it is 0.13; it shrinks roughly as step / res.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from diffusion_pipe.bucket_labels import bucket_label

Bucket = tuple[int, int]  # (width, height) in pixels


def bucket_layout(res: int, step: int, min_aspect: float, max_aspect: float) -> tuple[Bucket, ...]:
    """Every bucket for target side `res`, ordered by increasing aspect (W / H); empty if none exists."""
    area = res * res
    out: list[Bucket] = []
    w = step
    while True:
        h = (area // w) // step * step
        if h < step or w > max_aspect * h:
            # H only shrinks as W grows, so once W / H is too wide every later bucket is too.
            break
        if w >= min_aspect * h:
            out.append((w, h))
        w += step
    return tuple(out)


def aspect_error_bound(layout: Sequence[Bucket], min_aspect: float, max_aspect: float) -> float:
    """The largest |ln(bucket aspect) - ln(clamped item aspect)| that `choose_bucket` can produce."""
    logs = [math.log(w / h) for w, h in layout]
    inner = max((b - a for a, b in zip(logs, logs[1:])), default=0.0) / 2
    ends = max(logs[0] - math.log(min_aspect), math.log(max_aspect) - logs[-1])
    return max(inner, ends)


def choose_bucket(width: int, height: int, layout: Sequence[Bucket], never_upscale: bool = False) -> Bucket | None:
    """The bucket of `layout` closest in aspect to a width x height item, or None if none is allowed.

    With `never_upscale`, only buckets no larger than the item in either dimension are candidates. Ties (equal
    aspect distance) go to the larger area, then the wider bucket, so the choice is deterministic.
    """
    if width <= 0 or height <= 0:
        return None
    target = math.log(width / height)
    best: Bucket | None = None
    best_key: tuple[float, int, int] | None = None
    for w, h in layout:
        if never_upscale and (w > width or h > height):
            continue
        key = (abs(math.log(w / h) - target), -w * h, -w)
        if best_key is None or key < best_key:
            best, best_key = (w, h), key
    return best


def frame_bucket(num_frames: int, frames: Sequence[int]) -> int | None:
    """The largest configured frame count <= num_frames, or None when the clip is shorter than all of them."""
    fitting = [f for f in frames if f <= num_frames]
    return max(fitting) if fitting else None


def frame_windows(num_frames: int, bucket_frames: int, extraction: str, windows: int = 0) -> tuple[tuple[int, ...], int]:
    """Where a clip of `num_frames` frames fills a frame bucket of `bucket_frames`: (start frames, stride). Each
    start is one training sample of frames start, start + stride, .., (bucket_frames of them).

    `first`: ((0,), 1), the clip's first frames. `windows`: `windows` starts spread evenly from 0 to the last that
    fits (duplicates dropped), or with 0 as many back-to-back windows as fit. `whole`: ((0,), k) with the largest
    k that keeps every picked frame inside the clip, so the window spans it at 1/k of its frame rate.
    """
    if bucket_frames <= 1 or num_frames <= bucket_frames or extraction == "first":
        return (0,), 1
    if extraction == "whole":
        return (0,), max(1, (num_frames - 1) // (bucket_frames - 1))
    if extraction != "windows":
        raise ValueError(f"frame_extraction: unknown {extraction!r} (first, windows, whole)")
    last = num_frames - bucket_frames
    if windows <= 0:
        return tuple(range(0, last + 1, bucket_frames)), 1
    if windows == 1:
        return (0,), 1
    return tuple(sorted({round(i * last / (windows - 1)) for i in range(windows)})), 1


def item_buckets(
    width: int,
    height: int,
    num_frames: int,
    is_video: bool,
    layouts: Sequence[Sequence[Bucket]],
    frames: Sequence[int],
    never_upscale: bool,
) -> tuple[tuple[str, ...], str]:
    """Every bucket label an item trains at (one per layout, duplicates dropped) and an exclusion reason.

    Returns ((), 'too_short') for a video shorter than every frame bucket, ((), 'too_small') when
    `never_upscale` leaves no bucket in any layout, else (labels, ''). Images always use 1 frame.
    """
    n_frames = frame_bucket(num_frames, frames) if is_video else 1
    if n_frames is None:
        return (), "too_short"
    labels: list[str] = []
    for layout in layouts:
        chosen = choose_bucket(width, height, layout, never_upscale)
        if chosen is not None:
            label = bucket_label(chosen[0], chosen[1], n_frames)
            if label not in labels:
                labels.append(label)
    if not labels:
        return (), "too_small"
    return tuple(labels), ""


def rounding_note(res: int, step: int, layout: Sequence[Bucket]) -> str:
    """What a resolution that is not a multiple of `step` turns into ('' when it is one): its buckets have
    sides that are multiples of `step`, so a square item trains at the square bucket below, not at res x res."""
    if res % step == 0 or not layout:
        return ""
    w, h = choose_bucket(1, 1, layout) or layout[0]
    return (f"resolution {res} is not a multiple of bucket_step {step}: bucket sides are rounded to multiples of "
            f"{step}, so square items train at {w}x{h}; use a multiple of {step} (e.g. {res // step * step} or "
            f"{(res // step + 1) * step}) to choose the size yourself")
