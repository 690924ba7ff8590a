"""The bucket label: how a training bucket is written in the manifest and the encoded table ('512x768x1': width,
height, frames). Written by the scan, read by encode and train; this module is the one place that formats and
parses it. Pure functions."""

from __future__ import annotations

from diffusion_pipe.errors import UserError


def bucket_label(width: int, height: int, frames: int) -> str:
    """The label of a bucket, e.g. '512x512x1'."""
    return f"{width}x{height}x{frames}"


def parse_bucket(label: str) -> tuple[int, int, int]:
    """'512x768x1' -> (width, height, frames); a label of another shape is an error naming it."""
    parts = label.split("x") if isinstance(label, str) else []
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise UserError(f"bucket {label!r} is not WIDTHxHEIGHTxFRAMES with positive integers (such as '512x512x1'); "
                        "the manifest was written by another version of the scan: re-run it (`dvc repro scan`)")
    width, height, frames = (int(p) for p in parts)
    return width, height, frames
