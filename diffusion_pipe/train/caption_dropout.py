"""`train.caption_dropout`: each training sample takes the empty caption's text embedding instead of its own with
this probability, so the LoRA also learns the unconditional prediction that classifier-free guidance subtracts.

The empty caption is a text entry like any caption (keyed by its text, the family's template and encoders):
encode embeds it when `train.caption_dropout` > 0. A family whose text encoder reads the sample's image
(`capabilities.text_reads_conditioning`: edit and Wan 2.1 I2V) reads the empty caption with each sample's image,
as its pipeline's unconditional pass does: one entry per image, named by the sample's row of the encoded table.
Which samples drop is a pure function of (seed, data-parallel rank, micro-batch position), drawn from an RNG of
its own: a resumed run drops the same samples, and a run with dropout 0 draws nothing, so it trains exactly as one
without the param. Eval batches never drop (their losses stay comparable across runs).
"""

from __future__ import annotations

import random

from diffusion_pipe.encode.encode import caption_text_keys
from diffusion_pipe.hashing import hash_json
from diffusion_pipe.models.base import Adapter
from diffusion_pipe.params import ModelParams
from diffusion_pipe.store import Store
from diffusion_pipe.store.pack import REPAIR_HINT
from diffusion_pipe.train.data import DataError, Row

EMPTY_CAPTION = ""


def empty_caption_key(adapter: Adapter, model: ModelParams, text_max_length: int) -> str:
    """The text key of the empty caption, as encode computes it."""
    return caption_text_keys(adapter, model, text_max_length, (EMPTY_CAPTION,))[EMPTY_CAPTION]


class CaptionDropout:
    """Replaces the text keys of a micro-batch's samples by the empty caption's, each with `probability`: the one
    empty caption's entry, or (`empty_key` "") each sample's own."""

    def __init__(self, probability: float, seed: int, empty_key: str) -> None:
        self.probability, self.seed, self.empty_key = probability, seed, empty_key

    @classmethod
    def create(cls, probability: float, seed: int, adapter: Adapter, model: ModelParams,
               text_max_length: int, store: Store, rows: list[Row]) -> CaptionDropout | None:
        """None when `probability` is 0; else check (before step 1) that the store holds the empty caption's
        entry with the shape the model expects, a DataError naming the fix when not. For a family that reads the
        empty caption with each sample's image, that every training row names its entry (`check_entries` checks
        the entries)."""
        if not probability:
            return None
        if adapter.capabilities.text_reads_conditioning:
            lacking = [row.sample_id for row in rows if not row.empty_text_key]
            if lacking:
                raise DataError(f"train.caption_dropout is {probability:g}, but sample {lacking[0]} (and "
                                f"{len(lacking) - 1} more) has no empty-caption entry read with its image; the "
                                f"encode stage embeds them when train.caption_dropout > 0: {REPAIR_HINT}")
            return cls(probability, seed, "")
        key = empty_caption_key(adapter, model, text_max_length)
        if not store.contains("text", key):
            raise DataError(f"train.caption_dropout is {probability:g}, but the empty caption's text entry {key} is "
                            f"not in the store at {store.root}; the encode stage embeds it when "
                            f"train.caption_dropout > 0: {REPAIR_HINT}")
        got = {name: (tuple(shape), dtype) for name, (shape, dtype) in store.spec("text", key).items()}
        want = {name: (tuple(shape), dtype) for name, (shape, dtype) in adapter.text_spec(text_max_length).items()}
        if got != want:
            raise DataError(f"the empty caption's text entry {key} holds {got}, but model family '{adapter.name}' "
                            f"expects {want}: re-run encode with the same model params as train")
        return cls(probability, seed, key)

    def text_keys(self, dp_rank: int, position: int, keys: list[str], empty_keys: list[str]) -> list[str]:
        """`keys` (the captions of data-parallel rank `dp_rank`'s micro-batch at `position`) with the dropped ones
        replaced by the empty caption's: the one entry, or the sample's own in `empty_keys` (its rows')."""
        rng = random.Random(hash_json(["caption_dropout", self.seed, dp_rank, position]))
        return [(own or self.empty_key) if rng.random() < self.probability else key
                for key, own in zip(keys, empty_keys, strict=True)]
