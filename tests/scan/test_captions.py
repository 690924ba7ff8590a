"""Caption decoding, normalisation and policies."""

from __future__ import annotations

from pathlib import Path

from diffusion_pipe.scan.captions import CaptionRead, decode_caption, normalise_caption, read_caption, resolve_caption


def test_normalise_collapses_whitespace_and_strips() -> None:
    assert normalise_caption("  a\tred\n\n  cat \u00a0 ") == "a red cat"
    assert normalise_caption(" \n\t ") == ""


def test_decode_strips_bom_and_normalises() -> None:
    assert decode_caption("\ufeffa  dog\r\n".encode()) == CaptionRead(text="a dog")
    assert decode_caption("café ☕".encode()) == CaptionRead(text="café ☕")


def test_non_utf8_bytes_are_a_reason_not_a_guess() -> None:
    read = decode_caption("café".encode("latin-1"))
    assert read.reason == "caption_not_utf8" and read.text == "" and "byte 3" in read.detail


def test_read_caption_of_a_missing_file_is_unreadable(tmp_path: Path) -> None:
    assert read_caption(str(tmp_path / "nope.txt")).reason == "caption_unreadable"


def test_policies() -> None:
    txt = CaptionRead(text="a cat")
    assert resolve_caption(txt, "error", "", "sks, ").caption == "sks, a cat"
    assert resolve_caption(txt, "error", "", "sks, ").source == "txt"
    for empty in (None, CaptionRead(text="")):  # no .txt and an empty .txt are the same thing
        error = resolve_caption(empty, "error", "", "")
        assert (error.caption, error.source, error.reason, error.missing) == ("", "none", "missing_caption", True)
        skip = resolve_caption(empty, "skip", "", "")
        assert (skip.source, skip.reason, skip.missing) == ("none", "missing_caption", True)
        default = resolve_caption(empty, "default", "  a  photo ", "sks, ")
        assert (default.caption, default.source, default.reason) == ("sks, a photo", "default", "")
    bad = resolve_caption(CaptionRead(reason="caption_not_utf8"), "default", "x", "")
    assert (bad.caption, bad.reason) == ("", "caption_not_utf8")  # a broken file is not silently defaulted
