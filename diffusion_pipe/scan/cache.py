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
import pyarrow.compute as pc
import pyarrow.parquet as pq

from diffusion_pipe.fileio import write_bytes_atomic
from diffusion_pipe.hashing import hash_bytes
from diffusion_pipe.scan.captions import CaptionRead
from diffusion_pipe.scan.files import StatKey
from diffusion_pipe.scan.media import Probe

# Bump when probing or caption normalisation changes meaning, so old results are not reused.
# 2: 'wrong_extension' (a PNG named .mp4 is no longer a one-frame video), 'caption_control_character', details
# without object addresses or paths.
CACHE_VERSION = 2
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


# How the scan's private parquet files (this cache, the last scan's rows) are written: for speed, as they are
# rewritten on every rescan that changed anything (lz4 without dictionaries or statistics: about 3x faster to
# write than the defaults, and no larger for columns of unique paths and hashes).
PRIVATE_PARQUET = {"compression": "lz4", "use_dictionary": False, "write_statistics": False}


def _meta(limits: dict[str, int]) -> bytes:
    return json.dumps({"version": CACHE_VERSION, **limits}, sort_keys=True).encode()


# Reasons that depend on permissions rather than on the file's bytes: a chmod leaves the stat key unchanged.
ENVIRONMENT_REASONS = frozenset({"unreadable", "caption_unreadable"})


def cacheable(result: Probe | CaptionRead) -> bool:
    """Whether a probe result depends only on the file's bytes (and so may be reused while its stat is unchanged)."""
    return result.reason not in ENVIRONMENT_REASONS


class StatCache:
    """The cache as loaded: its table, matched against a listing in Arrow (a rescan of 100k files does no Python
    work per unchanged file), and probe results built only for the rows asked for."""

    def __init__(self, table: pa.Table, digest: str = "") -> None:
        self.table, self.digest = table, digest  # digest: of the file's bytes ('' for no file)
        self._keys: pa.Array | None = None

    def __len__(self) -> int:
        return self.table.num_rows

    def match(self, dataset: str, kinds: list[str], rels: list[str], stats: list[StatKey | None]) -> list[int | None]:
        """For each listed file (parallel lists), the cache row holding its result if its stat key is the cached
        one, else None (changed, new, or not stat'ed)."""
        if not rels or not len(self):
            return [None] * len(rels)
        if self._keys is None:
            self._keys = pc.binary_join_element_wise(self.table["dataset"], self.table["kind"], self.table["path"],
                                                     "\x00")
        listed = pc.binary_join_element_wise(dataset, pa.array(kinds, pa.string()), pa.array(rels, pa.string()),
                                             "\x00")
        rows = pc.index_in(listed, value_set=self._keys)
        same = None
        for name, values in zip(("size", "mtime_ns", "inode"), zip(*(st or (-1, -1, 0) for st in stats))):
            equal = pc.equal(pc.take(self.table[name], rows), pa.array(values, self.table.schema.field(name).type))
            same = equal if same is None else pc.and_(same, equal)
        return pc.if_else(same, rows, None).to_pylist()

    def keys(self, rows: list[int]) -> list[CacheKey]:
        """The keys of `rows` (indices)."""
        part = self.table.select(["dataset", "path", "kind"]).take(pa.array(rows, pa.int64()))
        return list(zip(*(part[name].to_pylist() for name in ("dataset", "path", "kind"))))

    def results(self, rows: list[int]) -> list[Probe | CaptionRead]:
        """The probe results stored in `rows` (indices), in order."""
        part = self.table.take(pa.array(rows, pa.int64()))
        c = {name: part.column(name).to_pylist() for name in _SCHEMA.names[6:]}
        out: list[Probe | CaptionRead] = []
        for kind, media, content_hash, size_bytes, width, height, num_frames, fps, reason, detail, text in zip(
                part.column("kind").to_pylist(), *(c[name] for name in _SCHEMA.names[6:])):
            if kind == "caption":
                out.append(CaptionRead(text, reason, detail))
            else:
                out.append(Probe(media, size_bytes, content_hash, width, height, num_frames, fps, reason, detail))
        return out


def rows_mask(count: int, rows: list[int]) -> pa.Array:
    """A boolean array of `count` entries, true at `rows`."""
    flags = bytearray(count)
    for i in rows:
        flags[i] = 1
    return pa.Array.from_buffers(pa.uint8(), count, [None, pa.py_buffer(bytes(flags))]).cast(pa.bool_())


def load_cache(path: Path | None, limits: dict[str, int]) -> StatCache:
    """Read the cache; an empty one when there is none or it was written under other settings or another version."""
    empty = StatCache(_SCHEMA.empty_table())
    if path is None or not path.is_file():
        return empty
    try:
        data = path.read_bytes()
        # ParquetFile.read, not pq.read_table: the latter imports pyarrow.dataset (0.3 s) on every rescan.
        table = pq.ParquetFile(pa.BufferReader(data)).read()
    except Exception:  # a damaged private cache is rebuilt, never fatal
        return empty
    if (table.schema.metadata or {}).get(_META_KEY) != _meta(limits) or table.schema.remove_metadata() != _SCHEMA:
        return empty
    return StatCache(table.replace_schema_metadata(None), hash_bytes(data))


def save_cache(path: Path, cache: StatCache, keep: pa.Array, entries: dict[CacheKey, CacheEntry],
               limits: dict[str, int]) -> str:
    """Atomically replace the cache with the rows of `cache` where `keep` is true (files unchanged since) and
    `entries` (files probed now): only the files present now, so it never grows stale. Returns the digest of the
    bytes written."""
    keys = [k for k, (_, result) in entries.items() if cacheable(result)]
    stats = [entries[k][0] for k in keys]
    results = [entries[k][1] for k in keys]
    blank = Probe(media="image")  # probe columns of caption rows
    probes = [r if isinstance(r, Probe) else blank for r in results]
    # Column by column with comprehensions, for the files probed now; the rest are rows of the old table.
    cols = {
        "dataset": [k[0] for k in keys], "path": [k[1] for k in keys], "kind": [k[2] for k in keys],
        "size": [st[0] for st in stats], "mtime_ns": [st[1] for st in stats], "inode": [st[2] for st in stats],
        "media": [p.media for p in probes], "content_hash": [p.content_hash for p in probes],
        "size_bytes": [p.size_bytes for p in probes], "width": [p.width for p in probes],
        "height": [p.height for p in probes], "num_frames": [p.num_frames for p in probes],
        "fps": [p.fps for p in probes], "reason": [r.reason for r in results], "detail": [r.detail for r in results],
        "text": [r.text if isinstance(r, CaptionRead) else "" for r in results],
    }
    table = pa.concat_tables([cache.table.filter(keep), pa.Table.from_pydict(cols, schema=_SCHEMA)])
    sink = pa.BufferOutputStream()
    pq.write_table(table.replace_schema_metadata({_META_KEY: _meta(limits)}), sink, **PRIVATE_PARQUET)
    data = sink.getvalue().to_pybytes()
    write_bytes_atomic(path, data)
    return hash_bytes(data)
