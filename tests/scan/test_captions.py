"""Caption decoding, normalisation and policies."""

from __future__ import annotations

from pathlib import Path

import pytest

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


@pytest.mark.parametrize("text,where", [
    ("a \x1b[31mred\x1b[0m cat", "U+001B at character 2"),  # an ESC sequence: recolours a terminal
    ("a cat\x00", "U+0000 at character 5"),
    ("bell\x07", "U+0007 at character 4"),
    ("del\x7f", "U+007F at character 3"),
    ("next\u0085line", "U+0085 at character 4"),  # C1 (NEL), which str.split() would take for whitespace
    ("csi\u009b2J", "U+009B at character 3"),
    ("form\x0cfeed", "U+000C at character 4"),
])
def test_a_control_character_excludes_the_caption(text: str, where: str) -> None:
    read = decode_caption(text.encode())
    assert (read.reason, read.text) == ("caption_control_character", "")
    assert read.detail == (f"control character {where}; remove it (a caption may hold tab and newline, no other "
                           "control character)")


def test_tab_newline_and_carriage_return_are_whitespace() -> None:
    assert decode_caption(b"a\tred\r\ncat\n") == CaptionRead(text="a red cat")


def test_a_control_character_in_the_prefix_or_default_caption_is_a_config_error(tmp_path: Path) -> None:
    from diffusion_pipe.config import ConfigError
    from diffusion_pipe.scan.scanner import resolve_datasets
    from tests.scan.conftest import params_for

    with pytest.raises(ConfigError, match=r"scan.datasets\[0\].caption_prefix: 'sks\\x1b\[0m, ' holds control "
                                          r"character U\+001B at character 3; remove it"):
        resolve_datasets(params_for(tmp_path, caption_prefix="sks\x1b[0m, "))
    with pytest.raises(ConfigError, match=r"scan.datasets\[0\].default_caption: 'a\\x00' holds control character "
                                          r"U\+0000 at character 1"):
        resolve_datasets(params_for(tmp_path, caption_policy="default", default_caption="a\x00"))
    resolve_datasets(params_for(tmp_path, caption_prefix="sks,\t"))  # whitespace is fine
