"""Content hashing: xxh3-128 over file bytes and over canonical JSON. Pure except for file reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import xxhash

_CHUNK = 8 << 20


def hash_bytes(data: bytes) -> str:
    """xxh3-128 of `data`, as 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(data)


def hash_file(path: str | Path) -> str:
    """xxh3-128 of a file's bytes, as 32 hex digits.

    Hashed through mmap, so the page cache is read in place: about 100% of in-memory xxh3 speed here, against
    60% for chunked reads, which pay a copy into the read buffer (BENCHMARKS.md, Scan). Falls back to 8 MiB
    chunked reads where a file cannot be mapped (empty files, some filesystems).
    """
    import mmap

    with open(path, "rb", buffering=0) as fh:
        try:
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            h = xxhash.xxh3_128()
            buf = bytearray(_CHUNK)
            view = memoryview(buf)
            while n := fh.readinto(buf):
                h.update(view[:n])
            return h.hexdigest()
        with mapped:
            mapped.madvise(mmap.MADV_SEQUENTIAL)
            return xxhash.xxh3_128(mapped).hexdigest()


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: the same value always gives the same text."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def hash_json(obj: Any) -> str:
    """xxh3-128 of the canonical JSON of `obj`."""
    return hash_bytes(canonical_json(obj).encode("utf-8"))
