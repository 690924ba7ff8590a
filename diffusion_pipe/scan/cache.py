"""The private stat cache: (dataset, path, kind) + (size, mtime_ns, inode) -> probe result and content hash.

It lives outside DVC (`.diffusion-pipe/scan-cache.parquet`), so a rescan hashes and decodes only the files whose
stat key changed. It is only ever an optimisation: a missing, unreadable or outdated cache file (other
`CACHE_VERSION`, other `max_image_pixels`) is ignored and rebuilt. Results that depend on the environment
rather than on the file's bytes ('unreadable') are never cached: a chmod does not change the stat key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from diffusion_pipe.fileio import write_bytes_atomic
from diffusion_pipe.scan.captions import CaptionRead
from diffusion_pipe.scan.files import StatKey
from diffusion_pipe.scan.media import Probe

# Bump when probing or caption normalisation changes meaning, so old results are not reused.
CACHE_VERSION = 1
_META_KEY = b"diffusion_pipe.scan_cache"

CacheKey = tuple[str, str, str]  # (dataset, rel path, 'media' | 'caption')
CacheEntry = tuple[StatKey, Probe | CaptionRead]

_SCHEMA = pa.schema([
    ("dataset", pa.string()), ("path", pa.string()), ("kind", pa.string()),
    ("size", pa.int64()), ("mtime_ns", pa.int64()), ("inode", pa.uint64()),
    ("media", pa.string()), ("content_hash", pa.string()), ("size_bytes", pa.int64()),
    ("width", pa.int32()), ("height", pa.int32()), ("num_frames", pa.int32()), ("fps", pa.float64()),
    ("reason", pa.string()), ("detail", pa.string()), ("text", pa.string()),
])


def _meta(max_image_pixels: int) -> bytes:
    return json.dumps({"version": CACHE_VERSION, "max_image_pixels": max_image_pixels}, sort_keys=True).encode()


def cacheable(result: Probe | CaptionRead) -> bool:
    """Whether a probe result depends only on the file's bytes (and so may be reused while its stat is unchanged)."""
    return result.reason not in ("unreadable", "caption_unreadable")


def load_cache(path: Path | None, max_image_pixels: int) -> dict[CacheKey, CacheEntry]:
    """Read the cache; {} when there is none or it was written under other settings or another version."""
    if path is None or not path.is_file():
        return {}
    try:
        table = pq.read_table(path)
    except Exception:  # a damaged private cache is rebuilt, never fatal
        return {}
    if (table.schema.metadata or {}).get(_META_KEY) != _meta(max_image_pixels) or table.schema.remove_metadata() != _SCHEMA:
        return {}
    cols = table.to_pydict()
    out: dict[CacheKey, CacheEntry] = {}
    for i in range(table.num_rows):
        key = (cols["dataset"][i], cols["path"][i], cols["kind"][i])
        stat_key = (cols["size"][i], cols["mtime_ns"][i], cols["inode"][i])
        result: Probe | CaptionRead
        if key[2] == "caption":
            result = CaptionRead(text=cols["text"][i], reason=cols["reason"][i], detail=cols["detail"][i])
        else:
            result = Probe(
                media=cols["media"][i], size_bytes=cols["size_bytes"][i], content_hash=cols["content_hash"][i],
                width=cols["width"][i], height=cols["height"][i], num_frames=cols["num_frames"][i],
                fps=cols["fps"][i], reason=cols["reason"][i], detail=cols["detail"][i],
            )
        out[key] = (stat_key, result)
    return out


def save_cache(path: Path, entries: dict[CacheKey, CacheEntry], max_image_pixels: int) -> None:
    """Atomically replace the cache with `entries` (only the files present now, so it never grows stale)."""
    cols: dict[str, list] = {name: [] for name in _SCHEMA.names}
    for key in sorted(entries):
        (size, mtime_ns, inode), result = entries[key]
        if not cacheable(result):
            continue
        probe = result if isinstance(result, Probe) else Probe(media="image")
        text = result.text if isinstance(result, CaptionRead) else ""
        row = {
            "dataset": key[0], "path": key[1], "kind": key[2], "size": size, "mtime_ns": mtime_ns, "inode": inode,
            "media": probe.media, "content_hash": probe.content_hash, "size_bytes": probe.size_bytes,
            "width": probe.width, "height": probe.height, "num_frames": probe.num_frames, "fps": probe.fps,
            "reason": result.reason, "detail": result.detail, "text": text,
        }
        for name, value in row.items():
            cols[name].append(value)
    schema = _SCHEMA.with_metadata({_META_KEY: _meta(max_image_pixels)})
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pydict(cols, schema=schema), sink)
    write_bytes_atomic(path, sink.getvalue().to_pybytes())
