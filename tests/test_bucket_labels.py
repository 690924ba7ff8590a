"""The bucket label ('512x768x1'): formatted by the scan, parsed by encode and train, in one module."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from diffusion_pipe.bucket_labels import bucket_label, parse_bucket
from diffusion_pipe.errors import UserError
from diffusion_pipe.scan.buckets import bucket_layout, item_buckets

LIBRARY = Path(__file__).resolve().parents[1] / "diffusion_pipe"


@given(st.integers(1, 10_000), st.integers(1, 10_000), st.integers(1, 1_000))
def test_round_trip(width, height, frames):
    assert parse_bucket(bucket_label(width, height, frames)) == (width, height, frames)


def test_the_scans_labels_parse_to_their_bucket():
    layout = bucket_layout(512, 64, 0.5, 2.0)
    labels, reason = item_buckets(1000, 500, 33, True, [layout], [1, 17, 33], False)
    assert reason == "" and [parse_bucket(label) for label in labels] == [(640, 384, 33)]


@pytest.mark.parametrize("label", ["512x512", "512x512x1x1", "512X512X1", "axbx1", "512x0x1", "-1x2x3", "", " 1x2x3"])
def test_a_malformed_label_names_itself_and_the_fix(label):
    with pytest.raises(UserError, match=re.escape(repr(label)) + r" is not WIDTHxHEIGHTxFRAMES .*re-run it"):
        parse_bucket(label)


def test_no_other_module_parses_a_label():
    """Encode and train once parsed labels with their own `split("x")`: every reader goes through here."""
    offenders = [str(p.relative_to(LIBRARY)) for p in LIBRARY.rglob("*.py")
                 if p.name != "bucket_labels.py" and re.search(r"""\.split\(\s*["']x["']""", p.read_text())]
    assert not offenders, offenders
