"""Training data from the store: bucketed micro-batches in a deterministic order, noised by the objective.

The order is a pure function of (seed, epoch, data-parallel rank): any process can recompute the micro-batch at
any position, which makes resuming exact and lets the first and the last pipeline stage draw identical batches
without talking to each other.
"""

from __future__ import annotations

import collections
import functools
import json
import random
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow.parquet as pq
import torch

from diffusion_pipe.bucket_labels import parse_bucket
from diffusion_pipe.errors import UserError
from diffusion_pipe.hashing import hash_json
from diffusion_pipe.models.base import Adapter, Batch, Spec
from diffusion_pipe.store import Store
from diffusion_pipe.store.pack import REPAIR_HINT
from diffusion_pipe.train.objectives import (DDPM_OBJECTIVES, Noised, ddpm_alphas_cumprod, flow_matching,
                                             min_snr_weights, offset_noise, quantile_to_discrete,
                                             sample_discrete_timesteps, sample_timesteps, within)

if TYPE_CHECKING:
    from diffusion_pipe.train.caption_dropout import CaptionDropout


class DataError(UserError):
    """The encoded data cannot be trained on as configured; the message names the key or param."""


@dataclass(frozen=True)
class Row:
    sample_id: str
    bucket: str
    repeats: int
    latent_key: str
    text_key: str
    conditioning_keys: tuple[str, ...] = ()  # latent entries of its control images (edit families)
    variant_keys: tuple[str, ...] = ()  # text entries of its caption's tag orders (shuffle_tags): train uses these
    loss_weight: float = 1.0  # its dataset's loss_weight
    empty_text_key: str = ""  # the empty caption read with its image, which caption dropout gives it (edit, i2v)
    mask_key: str = ""  # its loss mask at latent resolution ('': none, every element weighs 1)


def read_rows(encoded_path, split: str) -> list[Row]:
    """Rows of one split of the encoded table, in table order (a table without conditioning has no column
    for it, nor for tag orders, loss weights or per-image empty captions: encode.py's `write_encoded_table`)."""
    table = pq.read_table(encoded_path)
    return [Row(r["sample_id"], r["bucket"], r["repeats"], r["latent_key"], r["text_key"],
                tuple(r.get("conditioning_latent_keys") or ()), tuple(r.get("text_variant_keys") or ()),
                r.get("loss_weight", 1.0), r.get("empty_text_key") or "", r.get("mask_key") or "")
            for r in table.to_pylist() if r["split"] == split]


def check_entries(rows: list[Row], store: Store, adapter: Adapter, text_max_length: int) -> None:
    """Before step 1: every entry exists and has the shape/dtype the model expects; else a DataError naming
    the key and both shapes (never a tensor-shape error deep inside the model)."""
    text_spec = adapter.text_spec(text_max_length)
    specs: dict[str, Spec] = {}
    wanted = adapter.capabilities.conditioning_latents
    for row in rows:
        if len(row.conditioning_keys) != wanted:
            raise DataError(f"sample {row.sample_id} has {len(row.conditioning_keys)} control image(s), but model "
                            f"family '{adapter.name}' trains on {wanted} per sample; re-run encode with the same "
                            "model params as train")
        if row.bucket not in specs:
            specs[row.bucket] = adapter.latent_spec(*parse_bucket(row.bucket))
        # a loss mask is one weight per latent cell: the latent grid (its last two axes)
        mask_spec = {"mask": ((1, *specs[row.bucket]["latents"][0][-2:]), "float32")}
        # control images are encoded at their target's bucket: the same latent spec
        for family, key, expected in (("latent", row.latent_key, specs[row.bucket]),
                                      *(("latent", k, specs[row.bucket]) for k in row.conditioning_keys),
                                      ("text", row.text_key, text_spec),
                                      *(("text", k, text_spec) for k in row.variant_keys),
                                      *(("text", k, text_spec) for k in (row.empty_text_key,) if k),
                                      *(("mask", k, mask_spec) for k in (row.mask_key,) if k)):
            if not store.contains(family, key):
                raise DataError(f"{family} entry {key} of sample {row.sample_id} is not in the store at "
                                f"{store.root}: {REPAIR_HINT}, or pull them from the store's remote")
            got = {name: (tuple(shape), dtype) for name, (shape, dtype) in store.spec(family, key).items()}
            want = {name: (tuple(shape), dtype) for name, (shape, dtype) in expected.items()}
            if got != want:
                raise DataError(f"{family} entry {key} of sample {row.sample_id} holds {got}, but model "
                                f"family '{adapter.name}' expects {want}; the encoded data does not match "
                                "the model: re-run encode with the same model params as train")


def steps_for_epochs(rows: list[Row], train, dp_world: int) -> int:
    """Optimizer steps that make `train.epochs` passes over `rows` (each row `repeats` times) on `dp_world`
    data-parallel ranks, a partial last step rounded up."""
    per_rank = len(epoch_order(rows, train.micro_batch_size, train.seed, 0)) // dp_world
    if per_rank == 0:
        raise DataError(f"train.epochs: the train split has too few samples for one micro-batch of "
                        f"{train.micro_batch_size} per data-parallel rank; lower train.micro_batch_size or add data")
    return -(-train.epochs * per_rank // train.gradient_accumulation_steps)


def training_text_keys(rows: list[Row], seed: int, dp_rank: int, position: int) -> list[str]:
    """The text key each row of the micro-batch at `position` trains with: one of its caption's tag orders
    (shuffle_tags), drawn from an RNG of (seed, rank, position) so a resumed run draws the same, else its
    caption's."""
    if not any(row.variant_keys for row in rows):
        return [row.text_key for row in rows]
    rng = random.Random(hash_json(["tag_order", seed, dp_rank, position]))
    return [rng.choice(row.variant_keys) if row.variant_keys else row.text_key for row in rows]


def epoch_order(rows: list[Row], micro_batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Micro-batches (lists of row indices, one bucket each) of one epoch, each row `repeats` times.
    Incomplete micro-batches are dropped; the order depends only on (rows, seed, epoch)."""
    rng = random.Random(hash_json(["order", seed, epoch]))
    by_bucket: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        by_bucket.setdefault(row.bucket, []).extend([i] * row.repeats)
    batches = []
    for bucket in sorted(by_bucket):
        idx = by_bucket[bucket]
        rng.shuffle(idx)
        batches += [idx[j:j + micro_batch_size] for j in range(0, len(idx) - micro_batch_size + 1,
                                                                micro_batch_size)]
    rng.shuffle(batches)
    return batches


def noise_latents(adapter: Adapter, latents: torch.Tensor, noise: torch.Tensor, quantiles: torch.Tensor | None,
                  sampling: str, shift: float, generator: torch.Generator,
                  train_range: tuple[float, float] = (0.0, 1.0)) -> Noised:
    """Noise `latents` by the adapter's objective: at timesteps drawn by `sampling` (train) within the
    `train_range` part (train.timestep_range) of the adapter's `timestep_range` (all of it but for Wan 2.2's
    experts), or at `quantiles` of the adapter's range (eval; `train_range` does not apply).
    The one place the objective is chosen; `shift` applies to flow matching only."""
    objective = adapter.objective()
    lo, hi = adapter.timestep_range() if quantiles is not None else within(adapter.timestep_range(), train_range)
    if objective == "flow":
        t = sample_timesteps(len(latents), sampling, shift, generator) if quantiles is None else quantiles.float()
        return flow_matching(latents, noise, lo + (hi - lo) * t)
    if objective in DDPM_OBJECTIVES:
        alphas_cumprod = _alphas_cumprod(adapter)
        if quantiles is None:
            timesteps = sample_discrete_timesteps(len(latents), sampling, len(alphas_cumprod), generator, lo, hi)
        else:
            timesteps = quantile_to_discrete(lo + (hi - lo) * quantiles, len(alphas_cumprod))
        return DDPM_OBJECTIVES[objective](latents, noise, timesteps, alphas_cumprod)
    raise ValueError(f"model family '{adapter.name}': unknown objective {objective!r} "
                     f"(known: flow, {', '.join(DDPM_OBJECTIVES)})")


def _alphas_cumprod(adapter: Adapter) -> torch.Tensor:
    """The adapter's DDPM schedule; the scheduler config is a small file, the cumprod is computed once."""
    return _alphas_cumprod_of(json.dumps(adapter.noise_schedule(), sort_keys=True))


@functools.lru_cache(maxsize=8)
def _alphas_cumprod_of(schedule_json: str) -> torch.Tensor:
    return ddpm_alphas_cumprod(json.loads(schedule_json))


class MicroBatches:
    """The endless sequence of (inputs, labels) micro-batches of one data-parallel rank, by position: `at(n)`
    is a pure function of n, so a run resumed at the position its checkpoint stores continues the same
    sequence (`Prefetcher` walks it during training)."""

    def __init__(self, rows: list[Row], store: Store, adapter: Adapter, *, micro_batch_size: int, seed: int,
                 dp_rank: int, dp_world: int, timestep_sampling: str, flow_shift: float, guidance: float,
                 noise_offset: float = 0.0, min_snr_gamma: float = 0.0,
                 caption_dropout: CaptionDropout | None = None,
                 timestep_range: tuple[float, float] = (0.0, 1.0), mask_min_weight: float = 0.0) -> None:
        self.rows, self.store, self.adapter = rows, store, adapter
        self.caption_dropout = caption_dropout  # train/caption_dropout.py; training batches only, never eval
        self.mbs, self.seed, self.dp_rank, self.dp_world = micro_batch_size, seed, dp_rank, dp_world
        self.sampling, self.shift, self.guidance = timestep_sampling, flow_shift, guidance
        self.noise_offset, self.min_snr_gamma, self.timestep_range = noise_offset, min_snr_gamma, timestep_range
        self.mask_min_weight = mask_min_weight
        if min_snr_gamma and adapter.objective() not in DDPM_OBJECTIVES:
            raise DataError(f"train.min_snr_gamma: applies to epsilon and v prediction, but model family "
                            f"'{adapter.name}' trains with {adapter.objective()!r}; set it to 0")
        self._epoch_cache: tuple[int, list[list[int]]] | None = None
        if not self._rank_batches(0):
            raise DataError(
                f"the train split has too few samples for train.micro_batch_size={micro_batch_size} on "
                f"{dp_world} data-parallel rank(s) in any one bucket; lower train.micro_batch_size or add data"
            )

    def _rank_batches(self, epoch: int) -> list[list[int]]:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            batches = epoch_order(self.rows, self.mbs, self.seed, epoch)
            per_rank = len(batches) // self.dp_world
            self._epoch_cache = (epoch, batches[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank])
        return self._epoch_cache[1]

    @property
    def batches_per_epoch(self) -> int:
        return len(self._rank_batches(0))

    def indices_at(self, position: int) -> list[int]:
        """Row indices of the micro-batch at `position` of this rank's sequence."""
        epoch, offset = divmod(position, self.batches_per_epoch)
        return self._rank_batches(epoch)[offset]

    def _latents(self, keys: list[str]) -> torch.Tensor:
        return self.adapter.normalise_latents(torch.stack([self.store.get("latent", k)["latents"]
                                                           for k in keys]).float())

    def load(self, indices: list[int], text_keys: list[str] | None = None) -> Batch:
        """Normalised latents (B, ...), stacked text conditioning and normalised conditioning latents (one (B, ...)
        per slot) for rows `indices`."""
        rows = [self.rows[i] for i in indices]
        texts = [self.store.get("text", k) for k in text_keys or [row.text_key for row in rows]]
        text = {name: torch.stack([t[name] for t in texts]) for name in texts[0]}
        conditioning = tuple(self._latents([row.conditioning_keys[slot] for row in rows])
                             for slot in range(len(rows[0].conditioning_keys)))
        return Batch(self._latents([row.latent_key for row in rows]), text, conditioning)

    def make(self, indices: list[int], generator: torch.Generator, timesteps: torch.Tensor | None = None,
             text_keys: list[str] | None = None):
        """(inputs, labels) for the pipeline engine: inputs for the first layer, labels = (target,), or
        (target, per-sample loss weights) with min-SNR weighting or datasets' loss weights. `timesteps`, when
        given (eval), are fractions of the noise schedule in [0, 1], mapped to the adapter's objective; otherwise
        they are sampled (and only then do noise offset and loss weights apply, so eval losses stay comparable
        across runs). `text_keys` replace the rows' captions (tag orders, caption dropout)."""
        batch = self.load(indices, text_keys)
        latents = batch.latents
        noise = self.draw_noise(latents.shape, generator, offset=timesteps is None)
        noised = noise_latents(self.adapter, latents, noise, timesteps, self.sampling, self.shift, generator,
                               self.timestep_range)
        noisy, target = self.adapter.keep_clean(noised.noisy, noised.target, latents)
        inputs = self.adapter.conditioned_inputs(noisy, noised.timesteps, batch.text, self.guidance,
                                                 batch.conditioning)
        target = target.to(inputs[0].dtype)
        weights = self._loss_weights(indices, noised.timesteps) if timesteps is None else None
        element_weights = self._mask_weights(indices, target) if timesteps is None else None
        if element_weights is not None:  # the labels travel to the last pipeline stage as the target does
            return inputs, (target, torch.ones(len(indices)) if weights is None else weights, element_weights)
        return inputs, (target,) if weights is None else (target, weights)

    def _mask_weights(self, indices: list[int], target: torch.Tensor) -> torch.Tensor | None:
        """Per-element loss weights of a training batch with a loss mask, min_w + (1 - min_w) mask
        (train.mask_min_weight), shaped (B, 1, ..., h, w) to broadcast over the target's channels (and frames); an
        unmasked sample of the batch weighs 1 everywhere. None when no sample of the batch has a mask, so training
        without masks is what it was."""
        rows = [self.rows[i] for i in indices]
        if not any(row.mask_key for row in rows):
            return None
        grid = tuple(target.shape[-2:])
        masks = []
        for row in rows:
            mask = self.store.get("mask", row.mask_key)["mask"].float() if row.mask_key else torch.ones(1, *grid)
            if tuple(mask.shape[-2:]) != grid:
                raise DataError(f"mask entry {row.mask_key} of sample {row.sample_id} is {tuple(mask.shape)}, its "
                                f"latents' grid {grid}: re-run encode with the same model params as train")
            masks.append(mask)
        weights = self.mask_min_weight + (1.0 - self.mask_min_weight) * torch.stack(masks)
        return weights.view(len(rows), *([1] * (target.dim() - 3)), *grid)

    def draw_noise(self, shape: torch.Size, generator: torch.Generator, offset: bool = True) -> torch.Tensor:
        """The micro-batch's noise from its `generator`, with `train.noise_offset` when `offset` (training
        batches): the offsets come from the same generator, so they differ by seed, rank and position."""
        noise = torch.randn(shape, generator=generator)
        return offset_noise(noise, self.noise_offset, generator) if self.noise_offset and offset else noise

    def _loss_weights(self, indices: list[int], timesteps: torch.Tensor) -> torch.Tensor | None:
        """Per-sample loss weights of a training batch: min-SNR (train.min_snr_gamma) times each row's dataset
        loss weight; None when every weight is 1."""
        weights = None
        if self.min_snr_gamma:
            weights = min_snr_weights(_alphas_cumprod(self.adapter), timesteps, self.min_snr_gamma,
                                      self.adapter.objective())
        dataset = [self.rows[i].loss_weight for i in indices]
        if any(w != 1.0 for w in dataset):
            dataset_weights = torch.tensor(dataset, dtype=torch.float32)
            weights = dataset_weights if weights is None else weights * dataset_weights
        return weights

    def generator_at(self, position: int) -> torch.Generator:
        """The generator of the noise, timesteps and noise offsets of the micro-batch at `position`: seeded by
        (seed, this data-parallel rank, position), so ranks draw their own and a resumed run draws the same."""
        return torch.Generator().manual_seed(int(hash_json(["noise", self.seed, self.dp_rank, position])[:15], 16))

    def text_keys_at(self, position: int) -> list[str]:
        """The text key each sample of the micro-batch at `position` trains with: its tag order, then caption
        dropout, both drawn for this data-parallel rank (another rank's draws would repeat on every rank)."""
        indices = self.indices_at(position)
        keys = training_text_keys([self.rows[i] for i in indices], self.seed, self.dp_rank, position)
        if self.caption_dropout:
            keys = self.caption_dropout.text_keys(self.dp_rank, position, keys,
                                                  [self.rows[i].empty_text_key for i in indices])
        return keys

    def at(self, position: int):
        """The micro-batch at `position` of this rank's sequence: a pure function of the position."""
        return self.make(self.indices_at(position), self.generator_at(position),
                         text_keys=self.text_keys_at(position))


class Prefetcher:
    """The micro-batches of `source` from `position` on, prepared `depth` ahead in a background thread (store
    reads, noise, pinned host memory) while the device runs the current one, and handed over on `device` by
    asynchronous copies. `position` is that of the next micro-batch to hand over, so a checkpoint taken between
    steps resumes at the first batch not yet trained on."""

    def __init__(self, source: MicroBatches, device: torch.device, position: int = 0, depth: int = 2) -> None:
        self.source, self.device, self.depth = source, device, depth
        self.position = position
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="train-data")
        self._pending: collections.deque[Future] = collections.deque()

    def _prepare(self, position: int):
        batch = self.source.at(position)
        return _map_tensors(batch, torch.Tensor.pin_memory) if self.device.type == "cuda" else batch

    def __iter__(self) -> Iterator:
        return self

    def _fill(self) -> None:
        while len(self._pending) < self.depth:
            self._pending.append(self._pool.submit(self._prepare, self.position + len(self._pending)))

    def __next__(self):
        self._fill()
        batch = self._pending.popleft().result()
        self.position += 1
        self._fill()
        return _map_tensors(batch, lambda t: t.to(self.device, non_blocking=True))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _map_tensors(batch, fn):
    """`batch` (nested tuples and lists of tensors) with `fn` applied to every tensor."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_map_tensors(x, fn) for x in batch)
    return batch


def eval_batches(rows: list[Row], store: Store, adapter: Adapter, train, timestep: float) -> list:
    """Fixed eval micro-batches (one sample each, its caption as written) at one timestep, with fixed noise:
    comparable across runs. What only training batches take (noise offset, min-SNR and dataset loss weights,
    caption dropout, tag orders) is left out, so changing those does not move the eval loss."""
    loader = MicroBatches(rows, store, adapter, micro_batch_size=1, seed=train.seed, dp_rank=0, dp_world=1,
                          timestep_sampling=train.timestep_sampling, flow_shift=train.flow_shift,
                          guidance=train.guidance)
    out = []
    for i in range(len(rows)):
        generator = torch.Generator().manual_seed(int(hash_json(["eval", train.seed, i])[:15], 16))
        out.append(loader.make([i], generator, timesteps=torch.tensor([timestep])))
    return out
