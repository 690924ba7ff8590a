"""The encode stage: manifest rows -> latents and text embeddings in the store -> `data/encoded.parquet`.

Only entries whose keys are in neither the local store nor its remote are computed. The encoded table holds
input-derived fields only (sample id, keys, bucket, split, repeats), so it is byte-identical across machines
and runs for the same inputs, and DVC stops the cascade when a re-encode changed nothing.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from diffusion_pipe.config import ConfigError
from diffusion_pipe.encode.keys import latent_key, text_key
from diffusion_pipe.encode.media import RESIZE_SPEC, frames_spec, load_pixels, parse_bucket
from diffusion_pipe.fileio import atomic_writer, write_json_atomic
from diffusion_pipe.models import adapter_class
from diffusion_pipe.models.base import Adapter
from diffusion_pipe.models.common import DTYPES, dtype_name, resolve_model_dir
from diffusion_pipe.params import EncodeParams, ModelParams, ScanParams
from diffusion_pipe.store import Store
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

    @property
    def sample_id(self) -> str:
        return f"{self.dataset}/{self.path}@{self.bucket}"


def pick_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; 'cuda' without a GPU is an error naming the param."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: 'cuda' asked for but no CUDA GPU is visible; set it to 'auto' or 'cpu'")
    return torch.device(name)


def load_adapter(model: ModelParams) -> Adapter:
    """The family's adapter over the resolved model directory."""
    return adapter_class(model.family)(resolve_model_dir(model.path), DTYPES[model.dtype])


def plan_samples(manifest: pa.Table, adapter: Adapter, model: ModelParams, encode: EncodeParams) -> list[Sample]:
    """Every (item, bucket) of the manifest's usable rows with its latent and text keys. Pure but for hashing
    the encoders' weights files (cached by stat)."""
    vae_hash = component_hash(adapter.vae_dir())
    encoder_dirs, tokenizer_dirs = adapter.text_component_dirs()
    encoder_hashes = {name: component_hash(d) for name, d in encoder_dirs.items()}
    tokenizer_hashes = {name: tokenizer_hash(d) for name, d in tokenizer_dirs.items()}
    multiple = adapter.pixel_multiple
    samples = []
    for row in manifest.to_pylist():
        if row["status"] != "ok":
            continue
        tkey = text_key(caption=row["caption"], template="", encoder_hashes=encoder_hashes,
                        tokenizer_hashes=tokenizer_hashes, max_length=encode.text_max_length, dtype=model.dtype)
        for bucket in row["buckets"]:
            width, height, frames = parse_bucket(bucket)
            if width % multiple or height % multiple:
                raise ConfigError(
                    f"scan.bucket_step: bucket {bucket} of {row['dataset']}/{row['path']} is not a multiple of "
                    f"{multiple} pixels, which model family '{adapter.name}' needs; set scan.bucket_step to a "
                    f"multiple of {multiple}"
                )
            lkey = latent_key(content_hash=row["content_hash"], bucket=bucket, resize=RESIZE_SPEC,
                              frames=frames_spec(row["media"], frames), vae_hash=vae_hash, vae_dtype=model.dtype)
            samples.append(Sample(row["dataset"], row["path"], bucket, row["split"], row["repeats"],
                                  row["content_hash"], row["caption"], lkey, tkey, row["media"]))
    return sorted(samples, key=lambda s: s.sample_id)


class _PixelSet(torch.utils.data.Dataset):
    """Decodes and resizes media in DataLoader workers, overlapping with the encoder."""

    def __init__(self, items: list[tuple[Path, str, str]]) -> None:
        self.items = items  # (path, media kind, bucket)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        """(3, frames, height, width) in [-1, 1]."""
        path, media, bucket = self.items[i]
        return load_pixels(path, media, *parse_bucket(bucket))


def _encode_latents(adapter: Adapter, todo: list[Sample], roots: dict[str, Path], store: Store,
                    encode: EncodeParams, device: torch.device) -> int:
    vae = adapter.load_vae(device)
    by_bucket: dict[str, list[Sample]] = {}
    for s in todo:
        by_bucket.setdefault(s.bucket, []).append(s)
    done = 0
    with store.writer("latent", pack_bytes=encode.pack_size_mb << 20) as writer, \
            tqdm(total=len(todo), desc="encode latents", unit="img", file=sys.stderr) as bar:
        for bucket, samples in sorted(by_bucket.items()):
            items = [(roots[s.dataset] / s.path, s.media, bucket) for s in samples]
            loader = torch.utils.data.DataLoader(_PixelSet(items), batch_size=encode.batch_size,
                                                 num_workers=encode.workers, shuffle=False)
            offset = 0
            for pixels in loader:
                entries = adapter.encode_media(vae, pixels)
                for s, entry in zip(samples[offset:offset + len(entries)], entries):
                    writer.add(s.latent_key, entry)
                offset += len(entries)
                done += len(entries)
                bar.update(len(entries))
    return done


def _encode_texts(adapter: Adapter, todo: dict[str, str], store: Store, encode: EncodeParams,
                  device: torch.device) -> int:
    encoders = adapter.load_text_encoders(device)
    keys = sorted(todo)
    with store.writer("text", pack_bytes=encode.pack_size_mb << 20) as writer, \
            tqdm(total=len(keys), desc="encode text", unit="caption", file=sys.stderr) as bar:
        for i in range(0, len(keys), encode.batch_size):
            chunk = keys[i:i + encode.batch_size]
            entries = adapter.encode_text(encoders, [todo[k] for k in chunk], encode.text_max_length)
            for key, entry in zip(chunk, entries):
                writer.add(key, entry)
            bar.update(len(chunk))
    return len(keys)


def write_encoded_table(samples: list[Sample], path: Path) -> None:
    """The stage output, written atomically and deterministically (no timestamps, fixed schema, sorted)."""
    table = pa.Table.from_pylist(
        [{"sample_id": s.sample_id, "dataset": s.dataset, "path": s.path, "bucket": s.bucket, "split": s.split,
          "repeats": s.repeats, "latent_key": s.latent_key, "text_key": s.text_key} for s in samples],
        schema=ENCODED_SCHEMA,
    )
    with atomic_writer(path) as fh:
        pq.write_table(table, fh, compression="zstd", write_statistics=False, store_schema=False)


def encode_manifest(model: ModelParams, scan: ScanParams, encode: EncodeParams, manifest_path: Path,
                    encoded_path: Path, report_path: Path, store: Store) -> dict:
    """Encode every missing latent and text entry of the manifest into `store`; write the encoded table and
    the report. Returns the report."""
    started = time.perf_counter()
    manifest = pq.read_table(manifest_path)
    adapter = load_adapter(model)
    samples = plan_samples(manifest, adapter, model, encode)
    roots = {_dataset_name(d.name, d.path): Path(d.path) for d in scan.datasets}
    device = pick_device(encode.device)

    latent_keys = list(dict.fromkeys(s.latent_key for s in samples))
    captions = {s.text_key: s.caption for s in samples}
    missing_latents = set(store.missing("latent", latent_keys))
    missing_texts = {k: captions[k] for k in store.missing("text", list(captions))}

    latent_todo = list({s.latent_key: s for s in samples if s.latent_key in missing_latents}.values())
    t0 = time.perf_counter()
    computed_latents = _encode_latents(adapter, latent_todo, roots, store, encode, device) if latent_todo else 0
    t1 = time.perf_counter()
    computed_texts = _encode_texts(adapter, missing_texts, store, encode, device) if missing_texts else 0
    t2 = time.perf_counter()

    write_encoded_table(samples, encoded_path)
    report = {
        "samples": len(samples),
        "samples_by_split": {split: sum(s.split == split for s in samples) for split in ("train", "eval")},
        "latent": {"entries": len(latent_keys), "computed": computed_latents,
                   "reused_local": len(latent_keys) - len(missing_latents),
                   "per_second": round(computed_latents / (t1 - t0), 2) if computed_latents else None},
        "text": {"entries": len(captions), "computed": computed_texts,
                 "reused_local": len(captions) - len(missing_texts),
                 "per_second": round(computed_texts / (t2 - t1), 2) if computed_texts else None},
        "device": str(device),
        "seconds": round(time.perf_counter() - started, 2),
    }
    write_json_atomic(report_path, report)
    print(f"encode: {len(samples)} samples; latents computed {computed_latents}, reused "
          f"{report['latent']['reused_local']}; text computed {computed_texts}, reused "
          f"{report['text']['reused_local']}", file=sys.stderr)
    return report


def _dataset_name(name: str, path: str) -> str:
    return name or Path(path).name
