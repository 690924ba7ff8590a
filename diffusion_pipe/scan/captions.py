"""Captions: reading the `.txt` beside a media file, normalising it, and applying the dataset's policy.

A caption file has the media file's base name and a `.txt` extension (`cat.png` -> `cat.txt`). It is read as
UTF-8 (a leading BOM is dropped) and whitespace is normalised: every run of whitespace, newlines included,
becomes one space, and the ends are stripped. An empty or whitespace-only `.txt` counts as a *missing*
caption, so the policy decides (it never yields an empty caption). Bytes that are not UTF-8 exclude the item
with reason 'caption_not_utf8' whatever the policy: guessing an encoding would train on mojibake, and the
report names the file so it can be fixed.
A caption file over `scan.max_caption_bytes` excludes its item with reason 'caption_too_long', and no more
than the limit is read (a 50 MB caption took 3.7 GB of memory in encode).
Control characters: tab, newline and carriage return are whitespace (normalised as above); any other control
character (C0: NUL, ESC, ..., DEL, or C1: U+0080-U+009F) excludes the item with reason
'caption_control_character', the detail naming the first one and where it is. Such bytes are no text a model
should learn, and an ESC sequence printed to a terminal changes what the terminal shows; the caption is not
quietly cleaned, so what trains is what the file says. `caption_prefix` and `default_caption` follow the same
rule (a ConfigError).

Tag shuffling (`shuffle_tags` on a dataset): a caption's tags (split at `tag_separator`, blank ones dropped) are
also written in `shuffle_tags` other orders, the first `keep_tags` tags and the `caption_prefix` staying in
front. The orders are drawn from an RNG seeded by the caption's text alone, so a caption always gets the same
orders (on every machine and run), editing one caption changes only its orders, and raising `shuffle_tags`
keeps the orders already drawn (encode embeds only the new ones). Repeated orders are listed once.
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass
from typing import Literal

from diffusion_pipe.hashing import hash_json

CaptionSource = Literal["txt", "default", "none"]

# Control characters a caption may not hold: C0 but tab, newline and carriage return; DEL; C1.
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


@dataclass(frozen=True)
class CaptionRead:
    """The outcome of reading one `.txt`: normalised text ('' if empty), or a reason it can't be used."""

    text: str = ""
    reason: str = ""  # '', 'caption_not_utf8', 'caption_control_character', 'caption_unreadable', 'caption_too_long'
    detail: str = ""


def control_character(text: str) -> str | None:
    """Where `text` holds a control character a caption may not ('U+001B at character 5'), or None. Pure."""
    found = _CONTROL.search(text)
    return None if found is None else f"U+{ord(found.group()):04X} at character {found.start()}"


def normalise_caption(text: str) -> str:
    """Collapse every run of whitespace (Unicode whitespace included) to one space and strip the ends."""
    return " ".join(text.split())


def decode_caption(data: bytes) -> CaptionRead:
    """Decode caption bytes: UTF-8 with an optional BOM, normalised; non-UTF-8 gives reason 'caption_not_utf8', a
    control character other than tab, newline or carriage return reason 'caption_control_character'."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        return CaptionRead(reason="caption_not_utf8", detail=f"not UTF-8: byte {exc.start}")
    where = control_character(text)
    if where is not None:
        return CaptionRead(reason="caption_control_character",
                           detail=f"control character {where}; remove it (a caption may hold tab and newline, "
                                  "no other control character)")
    return CaptionRead(text=normalise_caption(text))


def read_caption(path: str, max_bytes: int | None = None) -> CaptionRead:
    """Read and decode one caption file; an I/O failure gives reason 'caption_unreadable', a file over
    `max_bytes` reason 'caption_too_long' (no more than `max_bytes` + 1 bytes are read)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read() if max_bytes is None else fh.read(max_bytes + 1)
            if max_bytes is not None and len(data) > max_bytes:
                size = os.fstat(fh.fileno()).st_size
                return CaptionRead(reason="caption_too_long",
                                   detail=f"{size} bytes > scan.max_caption_bytes {max_bytes}")
    except OSError as exc:
        return CaptionRead(reason="caption_unreadable", detail=f"{type(exc).__name__}: {exc.strerror or exc}")
    return decode_caption(data)


@dataclass(frozen=True)
class ResolvedCaption:
    """The caption an item trains with, where it came from, and an exclusion reason ('' if usable)."""

    caption: str
    source: CaptionSource
    reason: str = ""
    missing: bool = False  # no usable .txt (absent or empty), whatever the policy did about it
    detail: str = ""  # why the .txt could not be used, for the report


def resolve_caption(
    read: CaptionRead | None,
    policy: Literal["error", "default", "skip"],
    default_caption: str,
    prefix: str,
) -> ResolvedCaption:
    """Apply the dataset's caption policy to what was read (None: no .txt file). Pure.

    The final caption is `prefix + text`, the prefix taken verbatim (include its own separator, e.g. 'sks, ').
    With policy 'error' a missing caption gets reason 'missing_caption' too; the scan turns those into one
    ScanError listing them, after counting them all.
    """
    if read is not None and read.reason:
        return ResolvedCaption("", "none", read.reason, detail=read.detail)
    if read is not None and read.text:
        return ResolvedCaption(prefix + read.text, "txt")
    if policy == "default":
        return ResolvedCaption(prefix + normalise_caption(default_caption), "default", missing=True)
    return ResolvedCaption("", "none", "missing_caption", missing=True)


def tag_orders(text: str, count: int, keep: int, separator: str) -> tuple[str, ...]:
    """`count` orders of the tags of `text` (a caption without its prefix), its first `keep` tags in place, each
    order listed once. Pure: the orders depend on (text, count, keep, separator) only, and the first n of
    `count` are those of `count` = n. Tags are rejoined as written: with `separator` and a space when `text` had
    one after its separators, else with `separator` alone."""
    tags = [tag.strip() for tag in text.split(separator)]
    tags = [tag for tag in tags if tag]
    joiner = separator + " " if separator + " " in text else separator
    kept, rest = tags[:keep], tags[keep:]
    rng = random.Random(hash_json(["shuffle_tags", text, separator]))
    orders: dict[str, None] = {}
    for _ in range(count):
        rng.shuffle(rest)
        orders.setdefault(joiner.join(kept + rest))
    return tuple(orders)
