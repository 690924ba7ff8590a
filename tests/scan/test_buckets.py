"""Bucket assignment: property tests (valid bucket, bounded aspect error, optimality, determinism) and examples."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffusion_pipe.scan.buckets import (
    aspect_error_bound,
    bucket_layout,
    choose_bucket,
    frame_bucket,
    item_buckets,
)

steps = st.sampled_from([8, 16, 32, 64])
min_aspects = st.floats(0.25, 1.0)
max_aspects = st.floats(1.0, 4.0)
sides = st.integers(1, 20_000)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, int, float, float, tuple[tuple[int, int], ...]]:
    step = draw(steps)
    res = draw(st.integers(step, 2048))
    lo, hi = draw(min_aspects), draw(max_aspects)
    layout = bucket_layout(res, step, lo, hi)
    if not layout:  # only possible for a res that is not a multiple of step; params validation rejects those
        res = res // step * step
        layout = bucket_layout(res, step, lo, hi)
    return res, step, lo, hi, layout


@settings(max_examples=300, deadline=None)
@given(layouts(), sides, sides)
def test_every_item_lands_in_a_valid_bucket(lay, width: int, height: int) -> None:
    res, step, lo, hi, layout = lay
    w, h = choose_bucket(width, height, layout)
    assert w % step == 0 and h % step == 0 and w >= step and h >= step
    assert lo <= w / h <= hi
    # Area never above the target, and within one row of step pixels of it.
    assert res * res - w * step < w * h <= res * res


@settings(max_examples=300, deadline=None)
@given(layouts(), sides, sides)
def test_aspect_error_is_bounded_and_minimal(lay, width: int, height: int) -> None:
    res, step, lo, hi, layout = lay
    w, h = choose_bucket(width, height, layout)
    clamped = min(max(width / height, lo), hi)
    error = abs(math.log(w / h) - math.log(clamped))
    assert error <= aspect_error_bound(layout, lo, hi) + 1e-9
    # No bucket of the layout is strictly closer to the item's own aspect.
    target = math.log(width / height)
    best = min(abs(math.log(bw / bh) - target) for bw, bh in layout)
    assert abs(math.log(w / h) - target) <= best + 1e-12


def test_stated_bound_for_512_step_64() -> None:
    layout = bucket_layout(512, 64, 0.5, 2.0)
    assert layout == ((384, 640), (448, 576), (512, 512), (576, 448), (640, 384))
    assert aspect_error_bound(layout, 0.5, 2.0) == pytest.approx(math.log(1.2))


@settings(max_examples=300, deadline=None)
@given(layouts(), sides, sides)
def test_never_upscale_fits_inside_the_item_or_excludes(lay, width: int, height: int) -> None:
    res, step, lo, hi, layout = lay
    chosen = choose_bucket(width, height, layout, never_upscale=True)
    fitting = [b for b in layout if b[0] <= width and b[1] <= height]
    if chosen is None:
        assert not fitting
    else:
        assert chosen in fitting
        labels, reason = item_buckets(width, height, 1, False, [layout], (1,), True)
        assert reason == "" and labels == (f"{chosen[0]}x{chosen[1]}x1",)


@settings(max_examples=200, deadline=None)
@given(layouts(), sides, sides, st.integers(0, 500), st.lists(st.integers(1, 200), min_size=1, max_size=5))
def test_item_buckets_is_deterministic(lay, width: int, height: int, n: int, frames: list[int]) -> None:
    layout = lay[4]
    first = item_buckets(width, height, n, True, [layout, layout], tuple(frames), False)
    assert first == item_buckets(width, height, n, True, [layout, layout], tuple(frames), False)
    labels, reason = first
    if n < min(frames):
        assert (labels, reason) == ((), "too_short")
    else:
        # Same layout twice: one label, not two.
        assert reason == "" and len(labels) == 1 and labels[0].endswith(f"x{frame_bucket(n, frames)}")


@given(st.integers(0, 1000), st.lists(st.integers(1, 300), min_size=1, max_size=6))
def test_frame_bucket_is_the_largest_that_fits(n: int, frames: list[int]) -> None:
    got = frame_bucket(n, frames)
    if got is None:
        assert all(f > n for f in frames)
    else:
        assert got <= n and got in frames and all(f <= got or f > n for f in frames)


def test_examples() -> None:
    layout = bucket_layout(512, 64, 0.5, 2.0)
    assert choose_bucket(1920, 1080, layout) == (640, 384)  # 16:9 -> widest allowed near 1.78
    assert choose_bucket(1080, 1920, layout) == (384, 640)
    assert choose_bucket(1000, 1000, layout) == (512, 512)
    assert choose_bucket(10_000, 10, layout) == (640, 384)  # far outside the range: clamped to the widest
    assert choose_bucket(300, 300, layout, never_upscale=True) is None
    assert item_buckets(300, 300, 1, False, [layout], (1,), True) == ((), "too_small")
    small = bucket_layout(256, 64, 0.5, 2.0)
    # Too small for 512 but fine for 256: trains at 256 only.
    assert item_buckets(300, 300, 1, False, [small, layout], (1,), True) == (("256x256x1",), "")
    assert item_buckets(32, 32, 12, True, [small], (1, 8, 16), False) == (("256x256x8",), "")
    assert item_buckets(32, 32, 4, True, [small], (8, 16), False) == ((), "too_short")
    assert item_buckets(32, 32, 4, False, [small], (8, 16), False) == (("256x256x1",), "")  # images: 1 frame
