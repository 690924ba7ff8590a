"""The private stat cache: (dataset, path, kind) + (size, mtime_ns, inode) -> probe result and content hash.

It lives outside DVC (`.diffusion-pipe/scan-cache.parquet`), so a rescan hashes and decodes only the files whose
stat key changed. It is only ever an optimisation: a missing, unreadable or outdated cache file (other
`CACHE_VERSION`, other probe limits) is ignored and rebuilt. Results that depend on the environment
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


def _meta(limits: dict[str, int]) -> bytes:
    return json.dumps({"version": CACHE_VERSION, **limits}, sort_keys=True).encode()


# Reasons that depend on permissions rather than on the file's bytes: a chmod leaves the stat key unchanged.
ENVIRONMENT_REASONS = frozenset({"unreadable", "caption_unreadable"})


def cacheable(result: Probe | CaptionRead) -> bool:
    """Whether a probe result depends only on the file's bytes (and so may be reused while its stat is unchanged)."""
    return result.reason not in ENVIRONMENT_REASONS


def load_cache(path: Path | None, limits: dict[str, int]) -> dict[CacheKey, CacheEntry]:
    """Read the cache; {} when there is none or it was written under other settings or another version."""
    if path is None or not path.is_file():
        return {}
    try:
        # ParquetFile.read, not pq.read_table: the latter imports pyarrow.dataset (0.3 s) on every rescan.
        table = pq.ParquetFile(path).read()
    except Exception:  # a damaged private cache is rebuilt, never fatal
        return {}
    if (table.schema.metadata or {}).get(_META_KEY) != _meta(limits) or table.schema.remove_metadata() != _SCHEMA:
        return {}
    c = {name: table.column(name).to_pylist() for name in _SCHEMA.names}
    out: dict[CacheKey, CacheEntry] = {}
    for (dataset, rel, kind, size, mtime_ns, inode, media, content_hash, size_bytes, width, height, num_frames, fps,
         reason, detail, text) in zip(*(c[name] for name in _SCHEMA.names)):
        result: Probe | CaptionRead
        if kind == "caption":
            result = CaptionRead(text, reason, detail)
        else:
            result = Probe(media, size_bytes, content_hash, width, height, num_frames, fps, reason, detail)
        out[(dataset, rel, kind)] = ((size, mtime_ns, inode), result)
    return out


def save_cache(path: Path, entries: dict[CacheKey, CacheEntry], limits: dict[str, int]) -> None:
    """Atomically replace the cache with `entries` (only the files present now, so it never grows stale)."""
    keys = sorted(k for k, (_, result) in entries.items() if cacheable(result))
    stats = [entries[k][0] for k in keys]
    results = [entries[k][1] for k in keys]
    blank = Probe(media="image")  # probe columns of caption rows
    probes = [r if isinstance(r, Probe) else blank for r in results]
    # Column by column with comprehensions: this runs over every file on each rescan that changed anything.
    cols = {
        "dataset": [k[0] for k in keys], "path": [k[1] for k in keys], "kind": [k[2] for k in keys],
        "size": [st[0] for st in stats], "mtime_ns": [st[1] for st in stats], "inode": [st[2] for st in stats],
        "media": [p.media for p in probes], "content_hash": [p.content_hash for p in probes],
        "size_bytes": [p.size_bytes for p in probes], "width": [p.width for p in probes],
        "height": [p.height for p in probes], "num_frames": [p.num_frames for p in probes],
        "fps": [p.fps for p in probes], "reason": [r.reason for r in results], "detail": [r.detail for r in results],
        "text": [r.text if isinstance(r, CaptionRead) else "" for r in results],
    }
    schema = _SCHEMA.with_metadata({_META_KEY: _meta(limits)})
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pydict(cols, schema=schema), sink)
    write_bytes_atomic(path, sink.getvalue().to_pybytes())
