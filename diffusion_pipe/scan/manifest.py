"""The manifest: one row per media item, built by pure functions from probe results, written deterministically.

Row rules, in order (the first that applies sets `status='excluded'` and `reason`):
1. the file itself: 'broken_symlink', 'symlink_loop', 'outside_root' (a symlink leaving the dataset root),
   'not_regular_file', 'unreadable', 'empty_file', 'wrong_extension' (its bytes are an image and its name a
   video's, or the reverse: media.py), 'too_large' (over scan.max_image_pixels), 'corrupt' (fails to decode
   fully);
2. the caption: 'caption_not_utf8', 'caption_control_character' (captions.py), 'caption_unreadable',
   'caption_outside_root', 'caption_too_long' (over scan.max_caption_bytes), 'missing_caption' (policy 'skip';
   with policy 'error' the scan raises ScanError instead of writing anything);
3. the control image, in a dataset with `control` (edit families): 'missing_control' (no file of the control
   directory has the item's relative path without extension), 'control_ambiguous' (several do, e.g. cat.png and
   cat.jpg), 'control_not_image' (a video), or 'control_<reason>' for a control file that fails rule 1
   ('control_corrupt', 'control_outside_root', 'control_broken_symlink', ...). An item never trains without
   its control image;
3b. the mask, for an item with `<name>.mask.png` beside it: 'mask_<reason>' for a mask file that fails
   rule 1, 'mask_not_image' (animated), 'mask_on_video' (masks apply to images only), 'mask_aspect' (its aspect
   ratio is not its image's). These stop the scan with a ScanError naming the mask (scanner._check_masks): a mask is
   never silently dropped, nor its item trained unmasked;
4. the buckets: 'too_short' (a video shorter than every frame bucket), 'too_small' (never_upscale and no bucket
   fits);
5. 'duplicate': the same bytes (and the same control images' and mask's bytes) as an earlier ok item (by path)
   *of the same dataset*. The first copy trains,
   later copies are excluded, so an image is not trained twice per epoch by accident. Copies in different
   datasets are all kept (datasets may deliberately share images with other captions or resolutions); every
   duplicate group is counted in the report either way.

`split` is derived from the content hash alone (so it is the same on every machine, and identical copies land
in the same split): 'eval' when int(content_hash[:8], 16) / 2**32 < eval_fraction.

Control images are matched by the item's relative path without extension inside the control directory, which
must lie outside the dataset directory (else they would be scanned as items too); they are hashed and checked
like media files (same probe, same stat cache, same symlink rule) and listed per row in `control_paths` (relative
to the control directory) and `control_hashes`: lists, so a family with several reference images per item needs
no new columns. Encode resizes each control image to its item's bucket.

The parquet file holds only input-derived values (no mtime, inode, absolute path or timestamp), rows sorted by
(dataset, path), with a fixed schema, so the same inputs give the same bytes on every run and machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from diffusion_pipe.bucket_labels import parse_bucket
from diffusion_pipe.hashing import hash_bytes
from diffusion_pipe.params import DatasetParams
from diffusion_pipe.scan.buckets import Bucket, frame_windows, item_buckets
from diffusion_pipe.scan.captions import CaptionRead, resolve_caption, tag_orders
from diffusion_pipe.scan.files import MASK_SUFFIX, Entry
from diffusion_pipe.scan.media import Probe, media_kind

# 2: control_paths, control_hashes; 3: frame_starts, frame_stride; 4: caption_variants, loss_weight; 5: mask_path,
# mask_hash. Readers take a missing column as its empty value (an older manifest has no masks).
MANIFEST_VERSION = "5"

SCHEMA = pa.schema(
    [
        pa.field("path", pa.string(), nullable=False),
        pa.field("dataset", pa.string(), nullable=False),
        pa.field("media", pa.string(), nullable=False),
        pa.field("content_hash", pa.string(), nullable=False),
        pa.field("size_bytes", pa.int64(), nullable=False),
        pa.field("width", pa.int32(), nullable=False),
        pa.field("height", pa.int32(), nullable=False),
        pa.field("num_frames", pa.int32(), nullable=False),
        pa.field("fps", pa.float64(), nullable=False),
        pa.field("caption", pa.string(), nullable=False),
        pa.field("caption_hash", pa.string(), nullable=False),
        pa.field("caption_source", pa.string(), nullable=False),
        pa.field("buckets", pa.list_(pa.string()), nullable=False),
        pa.field("split", pa.string(), nullable=False),
        pa.field("repeats", pa.int32(), nullable=False),
        pa.field("status", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("control_paths", pa.list_(pa.string()), nullable=False),
        pa.field("control_hashes", pa.list_(pa.string()), nullable=False),
        # videos: the first frame of each window that trains (one sample per window and bucket) and the step
        # between its frames (scan.datasets[].frame_extraction); images: [0] and 1
        pa.field("frame_starts", pa.list_(pa.int32()), nullable=False),
        pa.field("frame_stride", pa.int32(), nullable=False),
        # the caption's tag orders that train in its place (scan.datasets[].shuffle_tags; captions.py), [] for none
        pa.field("caption_variants", pa.list_(pa.string()), nullable=False),
        pa.field("loss_weight", pa.float64(), nullable=False),  # scan.datasets[].loss_weight
        # the item's loss mask (`<name>.mask.png` beside it, relative to the dataset root) and its content hash;
        # '' for an item without a mask (which weighs 1 everywhere)
        pa.field("mask_path", pa.string(), nullable=False),
        pa.field("mask_hash", pa.string(), nullable=False),
    ],
    metadata={b"diffusion_pipe.manifest_version": MANIFEST_VERSION.encode()},
)

# The rows as the scan keeps them between runs (snapshot.py) and reports on: the manifest's columns plus what the
# report needs beyond them (`Row.detail`, `Row.caption_missing`).
ROWS_SCHEMA = SCHEMA.append(pa.field("detail", pa.string(), nullable=False)).append(
    pa.field("caption_missing", pa.bool_(), nullable=False))
_LIST_FIELDS = tuple(f.name for f in ROWS_SCHEMA if pa.types.is_list(f.type))


@dataclass(frozen=True)
class DatasetSpec:
    """A configured dataset, resolved: its manifest name, its root directory and its bucket layouts."""

    name: str
    root: str
    params: DatasetParams
    layouts: tuple[tuple[Bucket, ...], ...]  # one per entry of params.resolutions
    control_root: str = ""  # the directory of control images (params.control), '' for none


@dataclass(frozen=True)
class Row:
    """One manifest row, plus what the report needs beyond the manifest (`detail`, `caption_missing`)."""

    path: str
    dataset: str
    media: str
    content_hash: str
    size_bytes: int
    width: int
    height: int
    num_frames: int
    fps: float
    caption: str
    caption_hash: str
    caption_source: str
    buckets: tuple[str, ...]
    split: str
    repeats: int
    status: str
    reason: str
    control_paths: tuple[str, ...] = ()  # relative to the dataset's control directory
    control_hashes: tuple[str, ...] = ()
    frame_starts: tuple[int, ...] = (0,)
    frame_stride: int = 1
    caption_variants: tuple[str, ...] = ()
    loss_weight: float = 1.0
    mask_path: str = ""
    mask_hash: str = ""
    detail: str = ""
    caption_missing: bool = False


def split_for(content_hash: str, eval_fraction: float) -> str:
    """'eval' or 'train', from the first 32 bits of the content hash; 'train' when there is no hash."""
    if not content_hash or eval_fraction <= 0:
        return "train"
    return "eval" if int(content_hash[:8], 16) / 2**32 < eval_fraction else "train"


def item_stem(rel: str) -> str:
    """'dir/name' of 'dir/name.ext' (os.path.splitext's answer for the names a listing holds, which all have
    a media or caption extension; cheaper, as this runs twice per item). An item's caption and control image
    are the files of its stem, and so is its mask ('dir/name.mask.png')."""
    if rel[-9:].lower() == MASK_SUFFIX:  # 'dir/name.mask.png': the mask of 'dir/name.<ext>'
        return rel[:-9]
    stem, dot, _ = rel.rpartition(".")
    return stem if dot and not stem.endswith("/") and stem else rel


# A caption file's listing problem -> the reason of the media row it captions (others: 'caption_unreadable').
_CAPTION_PROBLEMS = {"outside_root": "caption_outside_root"}


def captions_by_stem(entries: Sequence[Entry], reads: dict[str, CaptionRead],
                     extension: str = ".txt") -> dict[str, CaptionRead]:
    """Map 'dir/name' (no extension) to the read of 'dir/name.txt' (the dataset's caption extension); the
    extension as written wins over other cases ('.txt' over '.TXT')."""
    out: dict[str, CaptionRead] = {}
    for e in entries:
        if e.kind != "caption":
            continue
        read = CaptionRead(reason=_CAPTION_PROBLEMS.get(e.problem, "caption_unreadable"), detail=e.detail) \
            if e.problem else reads[e.rel]
        stem = item_stem(e.rel)
        if stem not in out or e.rel.endswith(extension):
            out[stem] = read
    return out


@dataclass(frozen=True)
class ControlMatch:
    """The control image of one item: its relative path and content hash, or why it can't be used."""

    path: str = ""
    content_hash: str = ""
    reason: str = ""
    detail: str = ""


def controls_by_stem(entries: Sequence[Entry], results: dict[str, Probe]) -> dict[str, list[tuple[Entry, Probe]]]:
    """The control directory's media files by 'dir/name' (no extension), each with its probe (a listing problem
    becomes a probe with that reason, as for media files)."""
    out: dict[str, list[tuple[Entry, Probe]]] = {}
    for e in entries:
        if e.kind != "media":
            continue
        probe = Probe(media=media_kind(e.rel) or "image", reason=e.problem, detail=e.detail) if e.problem \
            else results[e.rel]
        out.setdefault(item_stem(e.rel), []).append((e, probe))
    return out


def match_control(candidates: Sequence[tuple[Entry, Probe]]) -> ControlMatch:
    """The control image among the control files sharing an item's stem (rule 3 of the module docstring). Pure."""
    if not candidates:
        return ControlMatch(reason="missing_control", detail="no control image with this name")
    if len(candidates) > 1:
        return ControlMatch(reason="control_ambiguous",
                            detail="several control images: " + ", ".join(e.rel for e, _ in candidates))
    entry, probe = candidates[0]
    if probe.reason:
        return ControlMatch(path=entry.rel, reason=f"control_{probe.reason}", detail=f"{entry.rel}: {probe.detail}")
    if probe.media != "image":
        return ControlMatch(path=entry.rel, reason="control_not_image", detail=f"{entry.rel} is a video")
    return ControlMatch(path=entry.rel, content_hash=probe.content_hash)


def masks_by_stem(entries: Sequence[Entry], results: dict[str, Probe | CaptionRead]) -> dict[str, tuple[Entry, Probe]]:
    """The dataset's mask files (`<name>.mask.png`) by the stem of the item they mask, each with its probe (a
    listing problem becomes a probe with that reason)."""
    out: dict[str, tuple[Entry, Probe]] = {}
    for e in entries:
        if e.kind != "mask":
            continue
        probe = Probe(media="image", reason=e.problem, detail=e.detail) if e.problem else results[e.rel]
        assert isinstance(probe, Probe), e.rel
        out[item_stem(e.rel)] = (e, probe)
    return out


def check_mask(item: Probe, entry: Entry, mask: Probe) -> tuple[str, str]:
    """(reason, detail) of a mask that can't weigh its item ('' when it can): rule 3b of the module docstring.
    The scan stops on any of these (`scanner._check_masks`). Pure."""
    if mask.reason:
        return f"mask_{mask.reason}", f"{entry.rel}: {mask.detail or mask.reason}"
    if mask.media != "image":
        return "mask_not_image", f"{entry.rel} is an animation; a mask is one greyscale image"
    if item.media != "image":
        return "mask_on_video", (f"{entry.rel} masks a video; masks apply to images only (a video trains "
                                 "unmasked): remove the mask")
    # the same aspect as the image, up to rounding of a mask saved at another resolution: |mw h - mh w| is at
    # most (w + h) / 2 when mw = w s and mh = h s are each rounded to an integer
    if 2 * abs(mask.width * item.height - mask.height * item.width) > item.width + item.height:
        return "mask_aspect", (f"{entry.rel} is {mask.width}x{mask.height} but its image is {item.width}x"
                               f"{item.height}: a mask must have its image's aspect ratio (ideally its size)")
    return "", ""


def build_rows(spec: DatasetSpec, entries: Sequence[Entry], results: dict[str, Probe | CaptionRead],
               control_entries: Sequence[Entry] = (), control_results: dict[str, Probe] | None = None) -> list[Row]:
    """The manifest rows of one dataset, sorted by path, from its listing and the probe results by rel path (and,
    with a control directory, its listing and probe results)."""
    p = spec.params
    controls = controls_by_stem(control_entries, control_results or {}) if spec.control_root else None
    masks = masks_by_stem(entries, results)
    caption_reads = captions_by_stem(entries, {k: v for k, v in results.items() if isinstance(v, CaptionRead)},
                                     p.caption_extension)
    rows: list[Row] = []
    bucket_memo: dict[tuple[int, int, int, bool], tuple[tuple[str, ...], str]] = {}
    for e in entries:
        if e.kind != "media":
            continue
        if e.problem:
            probe = Probe(media=media_kind(e.rel) or "image", reason=e.problem, detail=e.detail)
        else:
            result = results[e.rel]
            assert isinstance(result, Probe), e.rel
            probe = result
        cap = resolve_caption(caption_reads.get(item_stem(e.rel)), p.caption_policy, p.default_caption,
                              p.caption_prefix)
        reason = probe.reason or cap.reason
        control = ControlMatch()
        if controls is not None and not reason:
            control = match_control(controls.get(item_stem(e.rel), ()))
            reason = control.reason
        mask_entry, mask_probe = masks.get(item_stem(e.rel), (None, None))
        mask_detail = ""
        if mask_entry is not None and mask_probe is not None and not probe.reason:
            mask_reason, mask_detail = check_mask(probe, mask_entry, mask_probe)
            reason = mask_reason or reason  # a bad mask is an error of the scan, whatever else the item has
        labels: tuple[str, ...] = ()
        if not reason:
            shape = (probe.width, probe.height, probe.num_frames, probe.media == "video")
            if shape not in bucket_memo:  # datasets repeat a few shapes many times
                bucket_memo[shape] = item_buckets(*shape, spec.layouts, p.frames, p.never_upscale)
            labels, reason = bucket_memo[shape]
        variants: tuple[str, ...] = ()
        if p.shuffle_tags and not reason:
            body = cap.caption[len(p.caption_prefix):]  # the caption is prefix + text (resolve_caption)
            variants = tuple(p.caption_prefix + order
                             for order in tag_orders(body, p.shuffle_tags, p.keep_tags, p.tag_separator))
        starts, stride = (0,), 1
        if labels and probe.media == "video":  # every label of an item has the same frame count
            starts, stride = frame_windows(probe.num_frames, parse_bucket(labels[0])[2], p.frame_extraction,
                                           p.frame_windows)
        rows.append(Row(
            path=e.rel, dataset=spec.name, media=probe.media, content_hash=probe.content_hash,
            size_bytes=probe.size_bytes, width=probe.width, height=probe.height, num_frames=probe.num_frames,
            fps=probe.fps, caption=cap.caption, caption_hash=hash_bytes(cap.caption.encode("utf-8")),
            caption_source=cap.source, buckets=labels, split=split_for(probe.content_hash, p.eval_fraction),
            repeats=p.repeats, status="excluded" if reason else "ok", reason=reason,
            control_paths=(control.path,) if control.content_hash else (),
            control_hashes=(control.content_hash,) if control.content_hash else (),
            frame_starts=starts, frame_stride=stride, caption_variants=variants, loss_weight=p.loss_weight,
            mask_path=mask_entry.rel if mask_entry is not None and not reason else "",
            mask_hash=mask_probe.content_hash if mask_probe is not None and not reason else "",
            detail=(mask_detail if mask_detail else probe.detail if probe.reason else cap.detail if cap.reason
                    else control.detail),
            caption_missing=cap.missing and not probe.reason,
        ))
    return sorted(rows, key=lambda r: r.path)


def rows_table(rows: Sequence[Row]) -> pa.Table:
    """Rows (before rule 5, `mark_duplicates`) as an Arrow table of ROWS_SCHEMA, sorted by (dataset, path)."""
    ordered = sorted(rows, key=lambda r: (r.dataset, r.path))
    cols = {name: [getattr(r, name) for r in ordered] for name in ROWS_SCHEMA.names}
    for name in _LIST_FIELDS:
        cols[name] = [list(b) for b in cols[name]]
    return pa.Table.from_pydict(cols, schema=ROWS_SCHEMA)


def sort_rows(table: pa.Table) -> pa.Table:
    """The table in manifest order, (dataset, path), in one chunk (Arrow compares the UTF-8 bytes, which orders as
    Python orders the strings)."""
    order = pc.sort_indices(table, sort_keys=[("dataset", "ascending"), ("path", "ascending")])
    return table.take(order).combine_chunks()


def table_rows(table: pa.Table) -> list[Row]:
    """A rows table back as `Row`s (for callers that want Python objects)."""
    return [Row(**{k: tuple(v) if k in _LIST_FIELDS else v for k, v in r.items()}) for r in table.to_pylist()]


def mark_duplicates(table: pa.Table) -> pa.Table:
    """Rule 5 over a rows table sorted by (dataset, path): exclude each ok row whose dataset, content hash and
    control images' hashes an earlier ok row already has (an edit dataset may pair one target with several
    different control images). Only rows whose key repeats are looked at in Python."""
    ok = pc.equal(table["status"], "ok")
    key = pc.binary_join_element_wise(table["dataset"], table["content_hash"],
                                      pc.binary_join(table["control_hashes"], "\x01"), table["mask_hash"], "\x00")
    counts = pc.value_counts(key.filter(ok))
    repeated = counts.field("values").filter(pc.greater(counts.field("counts"), 1))
    if not len(repeated):
        return table
    candidates = pc.and_(ok, pc.is_in(key, value_set=repeated))
    first: dict[str, str] = {}
    dup: dict[int, str] = {}  # row index -> the path of the first copy
    for i, k, path in zip(pc.indices_nonzero(candidates).to_pylist(), key.filter(candidates).to_pylist(),
                          table["path"].filter(candidates).to_pylist()):
        if first.setdefault(k, path) != path:
            dup[i] = first[k]
    mask = pa.array([i in dup for i in range(table.num_rows)]) if dup else None
    empty = pa.scalar([], pa.list_(pa.string()))
    changed = {
        "status": pc.if_else(mask, "excluded", table["status"]),
        "reason": pc.if_else(mask, "duplicate", table["reason"]),
        "buckets": pc.if_else(mask, empty, table["buckets"]),
        "caption_variants": pc.if_else(mask, empty, table["caption_variants"]),
        "detail": pc.replace_with_mask(table["detail"].combine_chunks(), mask,
                                       pa.array([f"same content as {dup[i]}" for i in sorted(dup)])),
    }
    return pa.Table.from_arrays([changed.get(n, table[n]) for n in table.column_names], schema=table.schema)


def manifest_bytes(table: pa.Table) -> bytes:
    """The manifest parquet file of a final rows table (after `mark_duplicates`) as bytes: same rows, same bytes
    (fixed schema and options, no timestamps)."""
    manifest = pa.Table.from_arrays([table[n] for n in SCHEMA.names], schema=SCHEMA).combine_chunks()
    sink = pa.BufferOutputStream()
    pq.write_table(manifest, sink, compression="zstd", compression_level=3, write_statistics=True,
                   row_group_size=1 << 20)
    return sink.getvalue().to_pybytes()
