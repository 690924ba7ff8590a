"""The encode stage: manifest rows -> latents and text embeddings in the store -> `data/encoded.parquet`.

Only entries whose keys are in neither the local store nor its remote are computed, and the remote is then made
to hold every pack the run's entries need (what this run computed, and what an earlier run failed to upload).
Another encode into the same store that claimed some keys first is waited for instead of computed after
(`diffusion_pipe.store.claims`). Media is decoded and resized in DataLoader workers (uint8, a quarter of the bytes of
float pixels) while the encoder runs; finished entries go to the pack writer on a background thread, so pack
writing overlaps the next batch. Several workers (GPUs, machines) split the missing keys: see `workers.py`. The encoded table holds
input-derived fields only (sample id, keys, bucket, split, repeats), so it is byte-identical across machines
and runs for the same inputs, and DVC stops the cascade when a re-encode changed nothing.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from diffusion_pipe.bucket_labels import bucket_label, parse_bucket
from diffusion_pipe.config import ConfigError
from diffusion_pipe.encode.keys import latent_key, mask_key, text_key
from diffusion_pipe.encode.media import (MASK_RESIZE_SPEC, RESIZE_SPEC, frames_spec, load_mask, load_pixels_uint8,
                                         to_unit_range)
from diffusion_pipe.encode.workers import WorkerLayout, wait_for_entries
from diffusion_pipe.fileio import atomic_writer, write_json_atomic
from diffusion_pipe.hashing import hash_file
from diffusion_pipe.models import load_adapter
from diffusion_pipe.models.base import Adapter, TensorDict
from diffusion_pipe.models.common import resolve_device
from diffusion_pipe.params import EncodeParams, ModelParams, SamplePrompt, ScanParams
from diffusion_pipe.sample.render import SampleText, prompt_texts
from diffusion_pipe.store import PackWriter, Remote, Store, StoreError
from diffusion_pipe.store.claims import share_work, wait_for_claimed
from diffusion_pipe.store.remote import RemoteError, lacking_packs, resolve_remote, secret_warning
from diffusion_pipe.weights import component_hash, tokenizer_hash

ENCODED_SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("dataset", pa.string()),
    ("path", pa.string()),
    ("bucket", pa.string()),
    ("split", pa.string()),
    ("repeats", pa.int32()),
    ("latent_key", pa.string()),
    ("text_key", pa.string()),
])
# Edit families' tables add the latent keys of each sample's control images. Only theirs: a column every table
# carried would change the bytes of every existing table, and so retrain every existing run once, for nothing.
CONDITIONING_FIELD = pa.field("conditioning_latent_keys", pa.list_(pa.string()))
# Likewise the text keys of a sample's tag orders (scan.datasets[].shuffle_tags), which train in place of its
# caption, and its loss weight (scan.datasets[].loss_weight): only in tables with a sample that has them.
VARIANTS_FIELD = pa.field("text_variant_keys", pa.list_(pa.string()))
LOSS_WEIGHT_FIELD = pa.field("loss_weight", pa.float64())
# With train.caption_dropout > 0, a family whose text encoder reads the sample's image drops a caption to the empty
# caption read with that same image: each sample's own empty-caption entry (other families share one, not a row).
EMPTY_TEXT_FIELD = pa.field("empty_text_key", pa.string())
# A sample's loss mask at latent resolution (`<name>.mask.png`): only in tables with a masked sample.
MASK_FIELD = pa.field("mask_key", pa.string())


@dataclass(frozen=True)
class Sample:
    """One training sample: a media item at one bucket, with its caption."""

    dataset: str
    path: str
    bucket: str
    split: str
    repeats: int
    content_hash: str
    caption: str
    latent_key: str
    text_key: str
    media: str = "image"  # 'image' | 'video', as the scan measured it (animated GIF/WebP are videos)
    control_paths: tuple[str, ...] = ()  # its control images, relative to the dataset's control directory
    conditioning_keys: tuple[str, ...] = ()  # their latent keys, at this sample's bucket
    frame_start: int = 0  # a video's window: its first frame and the step between its frames
    frame_stride: int = 1
    caption_variants: tuple[str, ...] = ()  # its caption's tag orders (shuffle_tags), and their text keys
    variant_keys: tuple[str, ...] = ()
    loss_weight: float = 1.0
    condition_frames: int = 0  # conditioning made by the family's rule (i2v), at this many frames; 0: as it is
    empty_text_key: str = ""  # the empty caption read with its image (caption dropout, text_reads_conditioning)
    mask_path: str = ""  # its loss mask, relative to the dataset root, and the mask's key at this bucket
    mask_key: str = ""

    @property
    def sample_id(self) -> str:
        window = f"#{self.frame_start}" if self.frame_start else ""
        window += f"/{self.frame_stride}" if self.frame_stride != 1 else ""
        return f"{self.dataset}/{self.path}@{self.bucket}{window}"


@dataclass(frozen=True)
class LatentSource:
    """What one latent entry is encoded from: a media file (an item, or a control image) at a bucket; for a
    conditioning latent made by the family's rule (`condition_frames` > 0), the file's (window's) first frame,
    which `Adapter.conditioning_pixels` turns into `condition_frames` frames."""

    key: str
    path: Path
    media: str
    bucket: str
    frame_start: int = 0
    frame_stride: int = 1
    condition_frames: int = 0


def latent_sources(samples: list[Sample], roots: dict[str, Path], control_roots: dict[str, Path]
                   ) -> dict[str, LatentSource]:
    """Every latent key the samples need (items', control images' and first frames'), each with the first source
    naming it (the same bytes at the same bucket give the same key, whichever file they are in)."""
    out: dict[str, LatentSource] = {}
    for s in samples:
        item = roots[s.dataset] / s.path
        out.setdefault(s.latent_key, LatentSource(s.latent_key, item, s.media, s.bucket, s.frame_start,
                                                  s.frame_stride))
        for path, key in zip(s.control_paths, s.conditioning_keys):
            out.setdefault(key, LatentSource(key, control_roots[s.dataset] / path, "image", s.bucket,
                                             condition_frames=s.condition_frames))
        if s.condition_frames and not s.control_paths:  # the item's own first frame
            for key in s.conditioning_keys:
                out.setdefault(key, LatentSource(key, item, s.media, s.bucket, s.frame_start, 1,
                                                 condition_frames=s.condition_frames))
    return out


@dataclass(frozen=True)
class MaskSource:
    """What one mask entry is made from: a mask file, for a bucket of this many pixels and latent cells."""

    key: str
    path: Path
    bucket: str
    latent_factor: int


def mask_sources(samples: list[Sample], roots: dict[str, Path], factors: dict[str, int]) -> dict[str, MaskSource]:
    """Every mask key the samples need, each with the first mask file naming it (`factors`: the latent factor of
    each bucket)."""
    return {s.mask_key: MaskSource(s.mask_key, roots[s.dataset] / s.mask_path, s.bucket, factors[s.bucket])
            for s in reversed(samples) if s.mask_key}


def latent_factor(adapter: Adapter, bucket: str) -> int:
    """Pixels per latent cell along a side at `bucket`, from the family's latent spec (the stored latents' last
    two axes are its grid: a family that packs 2x2 cells into channels stores a coarser grid than its VAE's)."""
    width, height, frames = parse_bucket(bucket)
    shape = adapter.latent_spec(width, height, frames)["latents"][0]
    grid_h, grid_w = shape[-2], shape[-1]
    if not grid_h or height % grid_h or width % grid_w or height // grid_h != width // grid_w:
        raise ConfigError(f"model family '{adapter.name}' stores latents of {shape} for bucket {bucket}, which is "
                          "not a whole number of pixels per latent cell: it can't train with loss masks")
    return height // grid_h


@dataclass(frozen=True)
class TextSource:
    """What one text entry is encoded from: its caption, and for a family whose text encoder reads the sample's
    conditioning image (`capabilities.text_reads_conditioning`) that image, the first frame of `image` at its
    bucket."""

    caption: str
    image: LatentSource | None = None


def text_sources(samples: list[Sample], roots: dict[str, Path], control_roots: dict[str, Path],
                 reads_image: bool) -> dict[str, TextSource]:
    """Every text key the samples train on (their captions' and tag orders'), each with what it is encoded from:
    with `reads_image`, the sample's first control image, or its own (window's) first frame."""
    out: dict[str, TextSource] = {}
    for s in samples:
        image = None
        if reads_image:
            image = (LatentSource("", control_roots[s.dataset] / s.control_paths[0], "image", s.bucket)
                     if s.control_paths else
                     LatentSource("", roots[s.dataset] / s.path, s.media, s.bucket, s.frame_start))
        out.setdefault(s.text_key, TextSource(s.caption, image))
        for key, text in zip(s.variant_keys, s.caption_variants):
            out.setdefault(key, TextSource(text, image))
        if s.empty_text_key:
            out.setdefault(s.empty_text_key, TextSource("", image))
    return out


def check_media(row: dict, adapter: Adapter) -> None:
    """An item is of a medium the family trains on; else a ConfigError naming it: an image for a family that
    trains on clips only (one that generates clips from a first frame, or from text alone), a video for an image
    family."""
    caps = adapter.capabilities
    if "image" not in caps.media and row["media"] == "image":
        how = "turns a first frame into a video" if "i2v" in caps.tasks else "generates video only"
        raise ConfigError(f"scan.datasets: {row['dataset']}/{row['path']} is an image, but model family "
                          f"'{adapter.name}' {how} and trains on clips; move the images to a dataset of their "
                          "own trained with a family that takes images, or leave them out")
    if "video" not in caps.media and row["media"] == "video":
        raise ConfigError(f"scan.datasets: {row['dataset']}/{row['path']} is a video, but model family "
                          f"'{adapter.name}' trains on images; leave the videos out, or extract frames from them as "
                          "images")


def check_conditioning(row: dict, adapter: Adapter) -> None:
    """An item has as many control images as the family trains on per sample (the scan already excluded items
    whose control image is missing or unusable); else a ConfigError naming the dataset param to fix."""
    caps = adapter.capabilities
    wanted, got = caps.conditioning_latents, len(row.get("control_hashes") or ())
    if got == wanted or (caps.conditioning_rule and not got):  # an i2v family takes the clip's own first frame
        return
    if not wanted:
        raise ConfigError(f"scan.datasets: dataset {row['dataset']!r} has control images (`control`), but model "
                          f"family '{adapter.name}' trains on none; remove `control` from it, or set model.family "
                          "to an edit family (`diffusion-pipe models`, task edit)")
    raise ConfigError(f"scan.datasets: dataset {row['dataset']!r} has {got} control image(s) per item, but model "
                      f"family '{adapter.name}' trains on {wanted}: an edit family trains on (control, target) "
                      "pairs; set `control` on the dataset to the directory of its control images")


def text_keyer(adapter: Adapter, model: ModelParams, max_length: int) -> Callable[..., str]:
    """The text key of a caption (or sample prompt, or tag order), and of an image the family's text encoder
    reads with it (`text_image`), under this model: what `plan_samples` keys texts with."""
    encoder_dirs, tokenizer_dirs = adapter.text_component_dirs()
    encoder_hashes = {name: component_hash(d) for name, d in encoder_dirs.items()}
    tokenizer_hashes = {name: tokenizer_hash(d) for name, d in tokenizer_dirs.items()}
    template = adapter.text_template()

    def key(caption: str, image: dict | None = None) -> str:
        return text_key(caption=caption, template=template, encoder_hashes=encoder_hashes,
                        tokenizer_hashes=tokenizer_hashes, max_length=max_length, dtype=model.dtype, image=image)

    return key


def caption_text_keys(adapter: Adapter, model: ModelParams, max_length: int,
                      captions: tuple[str, ...]) -> dict[str, str]:
    """The text key of each caption read alone (no image)."""
    key = text_keyer(adapter, model, max_length)
    return {c: key(c) for c in captions}


def sample_text_keys(adapter: Adapter, model: ModelParams, max_length: int,
                     texts: tuple[SampleText, ...]) -> dict[SampleText, str]:
    """The text key of each sample-prompt text (`sample.render.prompt_texts`): read alone, or with its prompt's
    control image at the sample's size, keyed as a training sample's text read with its control image."""
    key = text_keyer(adapter, model, max_length)
    return {t: key(t.text, text_image(hash_file(t.control), bucket_label(t.width, t.height, 1), "image")
                   if t.control else None) for t in texts}


def text_image(content_hash: str, bucket: str, media: str, start: int = 0) -> dict:
    """The `image` part of a text key: the pixels a family with `text_reads_conditioning` reads with a caption,
    a control image's or a clip window's first frame, cover-cropped to the sample's bucket."""
    return {"content_hash": content_hash, "bucket": bucket, "resize": RESIZE_SPEC,
            "frames": frames_spec(media, 1, start)}


TRUNCATED_NAMES_SHOWN = 5  # items a truncation warning (and the report) names, of however many


def truncated_captions(rows: list[dict], tokenizers: dict[str, object], limits: dict[str, int],
                       caption_extensions: dict[str, str]) -> dict[str, dict]:
    """Per tokenizer (by component name) of `limits` (`Adapter.caption_token_limits`: the tokens its encoder
    reads of a caption): that limit, how many of the usable manifest `rows` have a caption (or tag order) longer
    than that, which the encoder reads cut, and the first TRUNCATED_NAMES_SHOWN of them as 'dataset/path (caption
    file)' (`caption_extensions`: each dataset's, by manifest name). Tokens are counted with the tokenizer's
    special tokens; a template the family wraps captions in is not counted."""
    rows = [row for row in rows if row["status"] == "ok"]
    texts = sorted({t for row in rows for t in (row["caption"], *(row.get("caption_variants") or ()))})
    out = {}
    for name, limit in limits.items():
        tokenizer = tokenizers[name]
        # verbose=False: transformers' own line per over-long text would repeat what the warning below says
        ids = tokenizer(texts, verbose=False)["input_ids"] if texts else []
        lengths = dict(zip(texts, map(len, ids)))
        cut = [row for row in rows
               if any(lengths[t] > limit for t in (row["caption"], *(row.get("caption_variants") or ())))]
        out[name] = {"limit": limit, "captions": len(cut),
                     "first": [_caption_name(row, caption_extensions) for row in cut[:TRUNCATED_NAMES_SHOWN]]}
    return out


def _caption_name(row: dict, caption_extensions: dict[str, str]) -> str:
    name = f"{row['dataset']}/{row['path']}"
    if row.get("caption_source") == "txt":
        return f"{name} ({Path(row['path']).with_suffix(caption_extensions.get(row['dataset'], '.txt')).name})"
    return f"{name} (caption: {row.get('caption_source')})"


def warn_truncated(truncated: dict[str, dict]) -> None:
    """One warning line per tokenizer that cut captions (`truncated_captions`), naming the first few."""
    for name, t in truncated.items():
        if t["captions"]:
            more = f" and {t['captions'] - len(t['first'])} more" if t["captions"] > len(t["first"]) else ""
            print(f"encode: warning: the encoder of {name} reads {t['limit']} tokens of a caption and cuts off the "
                  f"rest; captions longer than that: {t['captions']} ({', '.join(t['first'])}{more}). Shorten them, "
                  "or raise encode.text_max_length where it sets the limit (CLIP's 77 tokens are fixed)",
                  file=sys.stderr)


def plan_samples(manifest: pa.Table, adapter: Adapter, model: ModelParams, encode: EncodeParams,
                 caption_dropout: bool = False) -> list[Sample]:
    """Every (item, bucket) of the manifest's usable rows with its latent and text keys; with `caption_dropout`,
    a family whose text encoder reads the sample's image also keys the empty caption read with it. Pure but for
    hashing the encoders' weights files (cached by stat)."""
    vae_hash = component_hash(adapter.vae_dir())
    multiple = adapter.pixel_multiple
    rule = adapter.capabilities.conditioning_rule
    rows = [row for row in manifest.to_pylist() if row["status"] == "ok"]
    text_key_of = text_keyer(adapter, model, encode.text_max_length)
    texts = {c: text_key_of(c) for row in rows for c in (row["caption"], *(row.get("caption_variants") or ()))}
    reads_image = adapter.capabilities.text_reads_conditioning
    samples = []
    factors: dict[str, int] = {}  # pixels per latent cell by bucket, for the masks' keys
    for row in rows:
        check_media(row, adapter)
        check_conditioning(row, adapter)
        mask_hash = row.get("mask_hash") or ""  # a manifest of before masks (version < 5) has no column
        tkey = texts[row["caption"]]
        vkeys = tuple(texts[c] for c in row.get("caption_variants") or ())
        for bucket in row["buckets"]:
            width, height, frames = parse_bucket(bucket)
            if width % multiple or height % multiple:
                raise ConfigError(
                    f"scan.bucket_step: bucket {bucket} of {row['dataset']}/{row['path']} is not a multiple of "
                    f"{multiple} pixels, which model family '{adapter.name}' needs; set scan.bucket_step to a "
                    f"multiple of {multiple}"
                )
            # A control image is resized to its target's bucket and keyed as any image latent: by its own bytes,
            # so editing one control image recomputes that one latent.
            controls = tuple(latent_key(content_hash=h, bucket=bucket, resize=RESIZE_SPEC, vae_hash=vae_hash,
                                        vae_dtype=model.dtype, frames=conditioning_frames(adapter, "image", frames))
                             for h in row.get("control_hashes") or ())
            own_first_frame = bool(rule) and not controls  # an i2v family without a declared first frame
            if mask_hash and bucket not in factors:
                factors[bucket] = latent_factor(adapter, bucket)
            mkey = mask_key(mask_hash=mask_hash, bucket=bucket, resize=MASK_RESIZE_SPEC,
                            latent_factor=factors[bucket]) if mask_hash else ""
            stride = row.get("frame_stride") or 1
            for start in row.get("frame_starts") or (0,):  # a clip's windows: a sample and a latent each
                lkey = latent_key(content_hash=row["content_hash"], bucket=bucket, resize=RESIZE_SPEC,
                                  frames=frames_spec(row["media"], frames, start, stride), vae_hash=vae_hash,
                                  vae_dtype=model.dtype)
                ckeys = (latent_key(content_hash=row["content_hash"], bucket=bucket, resize=RESIZE_SPEC,
                                    vae_hash=vae_hash, vae_dtype=model.dtype,
                                    frames=conditioning_frames(adapter, row["media"], frames, start)),
                         ) if own_first_frame else controls
                ekey = ""
                if reads_image:  # the text entries read the sample's first conditioning image: one per image
                    image = (text_image(row["control_hashes"][0], bucket, "image") if controls else
                             text_image(row["content_hash"], bucket, row["media"], start))
                    tkey = text_key_of(row["caption"], image)
                    vkeys = tuple(text_key_of(c, image) for c in row.get("caption_variants") or ())
                    ekey = text_key_of("", image) if caption_dropout and row["split"] == "train" else ""
                samples.append(Sample(row["dataset"], row["path"], bucket, row["split"], row["repeats"],
                                      row["content_hash"], row["caption"], lkey, tkey, row["media"],
                                      tuple(row.get("control_paths") or ()), ckeys, start, stride,
                                      tuple(row.get("caption_variants") or ()), vkeys,
                                      row.get("loss_weight", 1.0), frames if rule else 0,
                                      ekey, row.get("mask_path") or "" if mkey else "", mkey))
    return sorted(samples, key=lambda s: s.sample_id)


def conditioning_frames(adapter: Adapter, media: str, frames: int, start: int = 0) -> dict:
    """The `frames` part of a conditioning latent's key. A control image as it is: an image's. Made by the
    family's rule (`capabilities.conditioning_rule`): the rule, the target's frame count and which first frame
    it starts from (a clip's window start; a stride does not change the first frame)."""
    rule = adapter.capabilities.conditioning_rule
    if not rule:
        return frames_spec("image", 1)
    return {"count": frames, "condition": rule, "first_frame": frames_spec(media, 1, start)}


class _PixelSet(torch.utils.data.Dataset):
    """Decodes and resizes media in DataLoader workers, overlapping with the encoder."""

    def __init__(self, sources: list[LatentSource], first_frames: bool = False) -> None:
        self.sources = sources
        self.first_frames = first_frames

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, i: int) -> torch.Tensor:
        """(3, frames, height, width) uint8; the encoding process scales it to [-1, 1] on its device. A source
        made by the family's conditioning rule loads its first frame only (the rule adds the rest), as do all
        with `first_frames` (the images text encoders read)."""
        s = self.sources[i]
        width, height, frames = parse_bucket(s.bucket)
        if s.condition_frames or self.first_frames:
            frames = 1
        return load_pixels_uint8(s.path, s.media, width, height, frames, s.frame_start, s.frame_stride)


class _BackgroundAdd:
    """Hands entries to a PackWriter from one thread, so the device->host copy, the pack write, its hash and
    fsync overlap the encoder's next batch instead of stalling it. At most `depth` batches wait in the queue,
    which bounds the device memory they hold."""

    def __init__(self, writer: PackWriter, depth: int = 4) -> None:
        self._writer = writer
        self._queue: queue.Queue[list[tuple[str, dict[str, torch.Tensor]]] | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"encode-writer-{writer.family}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            if self._error is not None:
                continue  # drain without writing: the run has failed
            try:
                for key, entry in batch:
                    self._writer.add(key, entry)
            except BaseException as exc:  # re-raised in the encoding thread by add() or close()
                self._error = exc

    def add(self, batch: list[tuple[str, dict[str, torch.Tensor]]]) -> None:
        """Queue one batch of (key, tensors); raise the writer thread's error, if it failed."""
        if self._error is not None:
            raise self._error
        self._queue.put(batch)

    def close(self) -> None:
        """Wait until every queued entry is with the writer; raise the writer thread's error, if any."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error


def _batches_by_bucket(samples: list[LatentSource], batch_size: int) -> list[list[int]]:
    """Index batches of `samples` (sorted by bucket, then by conditioning rule frames), each within one bucket and
    of one kind: one loader serves every bucket, so decoding workers start once and keep the encoder fed across
    bucket boundaries."""
    batches: list[list[int]] = []
    start = 0

    def kind(s: LatentSource) -> tuple[str, int]:
        return s.bucket, s.condition_frames

    for i in range(1, len(samples) + 1):
        if i == len(samples) or kind(samples[i]) != kind(samples[start]) or i - start == batch_size:
            batches.append(list(range(start, i)))
            start = i
    return batches


def _encode_latents(adapter: Adapter, todo: list[LatentSource], store: Store, encode: EncodeParams,
                    device: torch.device) -> tuple[int, list[str], float]:
    """Compute and publish the latents of `todo`; returns (entries written, pack ids published, seconds spent
    encoding and writing, without loading the model)."""
    vae = adapter.load_vae(device)
    started = time.perf_counter()
    todo = sorted(todo, key=lambda s: (s.bucket, s.condition_frames, s.key))
    loader = torch.utils.data.DataLoader(
        _PixelSet(todo), batch_sampler=_batches_by_bucket(todo, encode.batch_size), num_workers=encode.workers,
        pin_memory=device.type == "cuda", prefetch_factor=4 if encode.workers else None,
    )

    def batches():
        done = 0
        for pixels_uint8 in loader:
            pixels = to_unit_range(pixels_uint8.to(device, non_blocking=True))
            if todo[done].condition_frames:  # a batch is of one kind (_batches_by_bucket)
                pixels = adapter.conditioning_pixels(pixels, todo[done].condition_frames)
            with torch.no_grad():
                entries = adapter.encode_media(vae, pixels)
            yield [(s.key, e) for s, e in zip(todo[done:done + len(entries)], entries)]
            done += len(entries)

    written, packs = _publish(store, "latent", encode, batches(), len(todo), "encode latents", "item")
    return written, packs, time.perf_counter() - started


def _encode_texts(adapter: Adapter, todo: dict[str, TextSource], store: Store, encode: EncodeParams,
                  device: torch.device) -> tuple[int, list[str], float]:
    """Compute and publish the text embeddings of `todo` (key -> what it is encoded from); returns (entries, pack
    ids, seconds spent encoding and writing). Texts read with an image are batched by the image's bucket, their
    images decoded in DataLoader workers as latents' are."""
    encoders = adapter.load_text_encoders(device)
    started = time.perf_counter()
    alone = sorted(k for k, t in todo.items() if t.image is None)
    with_image = sorted((k for k, t in todo.items() if t.image is not None), key=lambda k: (todo[k].image.bucket, k))

    def batches():
        for i in range(0, len(alone), encode.batch_size):
            chunk = alone[i:i + encode.batch_size]
            with torch.no_grad():
                entries = adapter.encode_text(encoders, [todo[k].caption for k in chunk], encode.text_max_length)
            yield list(zip(chunk, entries))
        images = [todo[k].image for k in with_image]
        loader = torch.utils.data.DataLoader(
            _PixelSet(images, first_frames=True), batch_sampler=_batches_by_bucket(images, encode.batch_size),
            num_workers=encode.workers if images else 0, prefetch_factor=4 if encode.workers and images else None)
        done = 0
        for pixels_uint8 in loader:
            chunk = with_image[done:done + len(pixels_uint8)]
            with torch.no_grad():
                entries = adapter.encode_conditioned_text(encoders, [todo[k].caption for k in chunk],
                                                          to_unit_range(pixels_uint8.to(device)),
                                                          encode.text_max_length)
            yield list(zip(chunk, entries))
            done += len(chunk)

    written, packs = _publish(store, "text", encode, batches(), len(todo), "encode text", "caption")
    return written, packs, time.perf_counter() - started


def _encode_masks(sources: list[MaskSource], store: Store, encode: EncodeParams) -> tuple[int, list[str], float]:
    """Make the mask entries of `sources` on the CPU (decode, crop as its image, area mean to latent cells): no
    model is loaded. Returns (entries written, packs, seconds)."""
    started = time.perf_counter()
    chunk = 64

    def batches() -> Iterator[list[tuple[str, TensorDict]]]:
        for i in range(0, len(sources), chunk):
            part = sources[i:i + chunk]
            out = []
            for s in part:
                width, height, _ = parse_bucket(s.bucket)
                out.append((s.key, {"mask": load_mask(s.path, width, height, s.latent_factor)}))
            yield out

    written, packs = _publish(store, "mask", encode, batches(), len(sources), "encode masks", "mask")
    return written, packs, time.perf_counter() - started


def _publish(store: Store, family: str, encode: EncodeParams, batches: Iterator[list[tuple[str, TensorDict]]],
             total: int, desc: str, unit: str) -> tuple[int, list[str]]:
    """Write the (key, entry) batches that `batches` computes into the store, through a background writer and
    with a progress bar; returns (entries written, pack ids published)."""
    with store.writer(family, pack_bytes=encode.pack_bytes) as writer, \
            tqdm(total=total, desc=desc, unit=unit, file=sys.stderr) as bar:
        background = _BackgroundAdd(writer)
        try:
            for batch in batches:
                background.add(batch)
                bar.update(len(batch))
        finally:
            background.close()
    return writer.written, writer.packs


# The optional columns: each with its value for a sample and the value that needs no column.
_OPTIONAL_COLUMNS = (
    (CONDITIONING_FIELD, lambda s: list(s.conditioning_keys), []),
    (VARIANTS_FIELD, lambda s: list(s.variant_keys), []),
    (LOSS_WEIGHT_FIELD, lambda s: s.loss_weight, 1.0),
    (EMPTY_TEXT_FIELD, lambda s: s.empty_text_key, ""),
    (MASK_FIELD, lambda s: s.mask_key, ""),
)


def write_encoded_table(samples: list[Sample], path: Path) -> None:
    """The stage output, written atomically and deterministically (no timestamps, fixed schema, sorted); an
    optional column (control images' latent keys, tag orders' text keys, loss weights, empty captions read with
    each sample's image, loss masks' keys) is added when a sample has a value for it other than its default."""
    columns = [(f, value) for f, value, default in _OPTIONAL_COLUMNS if any(value(s) != default for s in samples)]
    schema = ENCODED_SCHEMA
    for f, _ in columns:
        schema = schema.append(f)
    table = pa.Table.from_pylist(
        [{"sample_id": s.sample_id, "dataset": s.dataset, "path": s.path, "bucket": s.bucket, "split": s.split,
          "repeats": s.repeats, "latent_key": s.latent_key, "text_key": s.text_key,
          **{f.name: value(s) for f, value in columns}} for s in samples],
        schema=schema,
    )
    with atomic_writer(path) as fh:
        pq.write_table(table, fh, compression="zstd", write_statistics=False, store_schema=False)


@dataclass
class FamilyCounts:
    """What one family's entries took: the report's numbers for it."""

    entries: int = 0
    reused_local: int = 0
    fetched_remote: int = 0
    computed: int = 0
    by_other_workers: int = 0
    by_other_encoders: int = 0  # computed meanwhile by another encode into the same store, which claimed them first
    uploaded_packs: int = 0
    remote_lacks_packs: int = 0  # packs holding this run's entries that the remote still lacks (encode.push false)
    quarantined_packs: int = 0  # reused packs that failed their check: moved aside, their entries recomputed
    seconds: float = 0.0  # the family's whole share of the run: lookups, transfers, model load, encoding
    encode_seconds: float = 0.0  # encoding and writing only: what `per_second` divides by

    def as_report(self) -> dict:
        return {
            "entries": self.entries, "reused_local": self.reused_local, "fetched_remote": self.fetched_remote,
            "computed": self.computed, "by_other_workers": self.by_other_workers,
            "by_other_encoders": self.by_other_encoders,
            "uploaded_packs": self.uploaded_packs, "remote_lacks_packs": self.remote_lacks_packs,
            "quarantined_packs": self.quarantined_packs,
            "seconds": round(self.seconds, 3),
            "encode_seconds": round(self.encode_seconds, 3),
            "per_second": (round(self.computed / self.encode_seconds, 2)
                           if self.computed and self.encode_seconds > 0 else None),
        }


def _remote_call(remote: Remote, what: str, fn: Callable[[], int]) -> int:
    """Run one transfer with the remote; a connection, credential or timeout failure becomes a StoreError naming
    encode.remote and the fix."""
    try:
        with remote.answering(what):
            return fn()
    except RemoteError as exc:
        raise StoreError(f"encode.remote: {exc}; or set encode.remote to '' to encode with the local store only"
                         ) from None  # the chained traceback would print the unredacted message


def _sync_remote(store: Store, remote: Remote, keys: dict[str, list[str]], counts: dict[str, FamilyCounts],
                 push: bool) -> None:
    """Make the remote hold every entry of `keys` (family -> keys, all in the store): upload the local packs
    holding those it lacks, whether computed by this run or an earlier one whose upload failed (the remote was
    down), at the cost of one listing per family. With `push` false, count them and say how to send them."""
    for fam, fam_keys in keys.items():
        if push:
            counts[fam].uploaded_packs = _remote_call(
                remote, "upload to", lambda fam=fam, fam_keys=fam_keys: store.push(remote, fam, keys=fam_keys))
            continue
        lacking = _remote_call(remote, "list", lambda fam=fam, fam_keys=fam_keys: len(
            lacking_packs(store, remote, fam, fam_keys)))
        counts[fam].remote_lacks_packs = lacking
        if lacking:
            print(f"encode: the store remote {remote.url} lacks {lacking} {fam} packs of this run's entries "
                  "(encode.push is false); `diffusion-pipe store push --all` sends them", file=sys.stderr)


def _check_reused(store: Store, wanted: dict[str, list[str]], counts: dict[str, FamilyCounts],
                  several_workers: bool) -> None:
    """Check the packs holding entries this run would reuse (Store.check_reused: size and sidecar always, the full
    hash once per pack per machine); a failing pack is quarantined, so its entries count as missing and are
    recomputed below, instead of surfacing minutes into training. With several workers the others have already
    split the missing keys, so the run stops and the next one recomputes them."""
    for fam, keys in wanted.items():
        problems = store.check_reused(fam, keys)
        counts[fam].quarantined_packs = len(problems)
        for problem in problems:
            print(f"encode: {problem}; recomputing its entries", file=sys.stderr)
        if problems and several_workers:
            raise StoreError(f"{len(problems)} {fam} packs failed their check and were quarantined "
                             f"({problems[0]}): run encode again to recompute their entries")


def encode_manifest(model: ModelParams, scan: ScanParams, encode: EncodeParams, manifest_path: Path,
                    encoded_path: Path, report_path: Path, store: Store, *, repo_root: Path = Path("."),
                    workers: WorkerLayout | None = None, sample_prompts: tuple[SamplePrompt, ...] = (),
                    caption_dropout: float = 0.0) -> dict:
    """Encode every latent and text entry of the manifest that neither the local store nor its remote holds (nor
    another running encode into the store has claimed); upload every pack of those entries the remote lacks; write
    the encoded table and the report (rank 0). Returns the report.

    The remote is `encode.remote` resolved against `repo_root` (by default the repo's DVC remote, if any).
    Under a launcher (`workers`, default from RANK/WORLD_SIZE), each worker handles its share of the missing
    keys and rank 0 waits for all of them before writing the outputs. The texts of `sample_prompts` (resolved
    `train.samples` prompts, as the adapter's `sample_texts` names them) are embedded into the store like captions, for training to render samples without its text encoders; they are
    not rows of the encoded table. With `caption_dropout` > 0 (train.caption_dropout) the empty caption is embedded
    the same way, for training to swap in (train/caption_dropout.py).
    """
    started = time.perf_counter()
    workers = workers or WorkerLayout.from_env()
    adapter = load_adapter(model)
    if sample_prompts:
        adapter.pipeline_class()  # a family that cannot render samples says so before anything is encoded
    manifest = pq.read_table(manifest_path)
    reads_image = adapter.capabilities.text_reads_conditioning
    samples = plan_samples(manifest, adapter, model, encode, caption_dropout=bool(caption_dropout))
    roots = {d.manifest_name: Path(d.path) for d in scan.datasets}
    control_roots = {d.manifest_name: Path(d.control) for d in scan.datasets if d.control}
    device = resolve_device(encode.device, "encode.device", workers.local_rank)
    remote = resolve_remote(encode.remote, repo_root)
    warning = secret_warning(encode.remote)
    if warning:
        print(f"encode: warning: {warning}", file=sys.stderr)
    # Checked before anything is encoded or reused: entries a broken tokenizer made would be reused as well.
    tokenizers = adapter.load_tokenizers()

    sources = latent_sources(samples, roots, control_roots)
    captions = text_sources(samples, roots, control_roots, reads_image)
    # the caption that dropped samples take: one entry, or (read with each sample's image) one per sample's image
    empty = (SampleText(""),) if caption_dropout and not reads_image else ()
    captions |= {key: TextSource(t.text, LatentSource("", Path(t.control), "image",
                                                      bucket_label(t.width, t.height, 1)) if t.control else None)
                 for t, key in sample_text_keys(adapter, model, encode.text_max_length,
                                                (*prompt_texts(adapter, sample_prompts), *empty)).items()}
    masks = mask_sources(samples, roots, {s.bucket: latent_factor(adapter, s.bucket) for s in samples if s.mask_key})
    wanted = {"latent": sorted(sources), "text": sorted(captions)}
    if masks:  # a family of its own, only where there are masks: the report of a run without is what it was
        wanted["mask"] = sorted(masks)
    counts = {fam: FamilyCounts(entries=len(keys)) for fam, keys in wanted.items()}
    todo: dict[str, list[str]] = {}
    # The lease lasts until the table naming the entries is published: gc keeps nothing it does not see named
    # by a table or written under a live lease.
    with store.lease("encode") as lease:
        if workers.rank == 0:
            _check_reused(store, wanted, counts, several_workers=workers.world > 1)
        for fam, keys in wanted.items():
            t0 = time.perf_counter()
            missing = store.missing(fam, keys)
            counts[fam].reused_local = len(keys) - len(missing)
            # Shares are cut from the wanted keys, which every worker plans alike, not from what this worker
            # finds missing: another worker may already have published some, and shares of two different
            # lists would leave keys that nobody computes.
            mine = store.missing(fam, workers.share(keys))
            if remote is not None and mine:
                counts[fam].fetched_remote = _remote_call(
                    remote, "download from", lambda fam=fam, mine=mine: store.pull(remote, fam, mine))
            todo[fam] = store.missing(fam, mine)
            counts[fam].seconds += time.perf_counter() - t0

        def compute(work: dict[str, list[str]]) -> None:  # once, and again for what another encode left undone
            t0 = time.perf_counter()
            if work["latent"]:
                c = counts["latent"]
                computed, _, seconds = _encode_latents(
                    adapter, [sources[k] for k in work["latent"]], store, encode, device)
                c.computed, c.encode_seconds = c.computed + computed, c.encode_seconds + seconds
            t1 = time.perf_counter()
            if work["text"]:
                c = counts["text"]
                computed, _, seconds = _encode_texts(
                    adapter, {k: captions[k] for k in work["text"]}, store, encode, device)
                c.computed, c.encode_seconds = c.computed + computed, c.encode_seconds + seconds
            t2 = time.perf_counter()
            if work.get("mask"):
                c = counts["mask"]
                computed, _, seconds = _encode_masks([masks[k] for k in work["mask"]], store, encode)
                c.computed, c.encode_seconds = c.computed + computed, c.encode_seconds + seconds
            counts["latent"].seconds += t1 - t0
            counts["text"].seconds += t2 - t1
            if "mask" in counts:
                counts["mask"].seconds += time.perf_counter() - t2

        # Another encode into this store (another clone, another run) may be computing some of these keys: wait
        # for those instead of computing them twice, and compute them here only if it stops without them.
        deferred = share_work(store, lease, todo)
        compute({fam: [k for k in keys if k not in deferred[fam]] for fam, keys in todo.items()})
        if any(deferred.values()):
            print(f"encode: waiting for {sum(map(len, deferred.values()))} entries another encode into "
                  f"{store.root} is computing", file=sys.stderr)
            left = wait_for_claimed(store, deferred, encode.worker_stall_timeout_s)
            for fam, c in counts.items():
                c.by_other_encoders = len(deferred[fam]) - len(left[fam])
            compute(left)

        if remote is not None:  # this worker's share of every wanted key, computed now or in an earlier run
            _sync_remote(store, remote, {fam: workers.share(keys) for fam, keys in wanted.items()}, counts,
                         encode.push)

        summary = "; ".join(
            f"{fam} computed {c.computed}, reused {c.reused_local}, fetched {c.fetched_remote}"
            for fam, c in counts.items())
        if workers.rank != 0:
            print(f"encode worker {workers.rank}/{workers.world}: {summary}", file=sys.stderr)
            return {fam: c.as_report() for fam, c in counts.items()}
        if workers.world > 1:
            arrived = wait_for_entries(
                store, remote, wanted, encode.worker_stall_timeout_s,
                lambda fam, keys: _remote_call(remote, "download from", lambda: store.pull(remote, fam, keys)))
            for fam, c in counts.items():
                c.by_other_workers = arrived[fam]  # still missing after rank 0's own share: the others' work
        write_encoded_table(samples, encoded_path)
    truncated = truncated_captions(
        manifest.to_pylist(), tokenizers, adapter.caption_token_limits(tokenizers, encode.text_max_length),
        {d.manifest_name: d.caption_extension for d in scan.datasets})
    warn_truncated(truncated)
    elapsed = time.perf_counter() - started
    report = {
        "samples": len(samples),
        "samples_by_split": {split: sum(s.split == split for s in samples) for split in ("train", "eval")},
        "conditioning_latents": len({k for s in samples for k in s.conditioning_keys}),
        **({"masked_samples": sum(bool(s.mask_key) for s in samples)} if masks else {}),
        **{fam: c.as_report() for fam, c in counts.items()},
        "truncated_captions": truncated,
        "remote": remote.url if remote is not None else None,
        "workers": workers.world,
        "device": str(device),
        "seconds": round(elapsed, 2),
        "samples_per_second": round(len(samples) / elapsed, 2) if elapsed > 0 else None,
    }
    write_json_atomic(report_path, report)
    print(f"encode: {len(samples)} samples; {summary}", file=sys.stderr)
    return report
