"""Eval losses stay comparable across runs (README, params.yaml: noise offset, loss weights, min-SNR and caption
dropout apply to training batches only; eval uses each caption as written): the eval micro-batches
(train/data.py `eval_batches`) are the same whatever those training-only settings are, while the settings that
define the noising (timestep shift) do change them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffusion_pipe.models.flux import FluxAdapter
from diffusion_pipe.params import TrainParams
from diffusion_pipe.store import Store
from diffusion_pipe.train.data import MicroBatches, Row, eval_batches


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("flux")
    FluxAdapter.build_tiny(out, seed=0)
    adapter = FluxAdapter(out, torch.float32)
    store = Store(out / "store")
    g = torch.Generator().manual_seed(0)
    with store.writer("latent") as writer:
        for i in range(2):
            writer.add(f"l{i}", {name: torch.randn(shape, generator=g) for name, (shape, _) in
                                 adapter.latent_spec(32, 32, 1).items()})
    with store.writer("text") as writer:
        for key in ("t0", "t1", "empty"):
            writer.add(key, {name: torch.randn(shape, generator=g) for name, (shape, _) in
                             adapter.text_spec(16).items()})
    # a dataset loss weight and an empty-caption entry on each row: what training batches would use
    rows = [Row(f"s{i}", "32x32x1", 1, f"l{i}", f"t{i}", loss_weight=3.0, empty_text_key="empty") for i in range(2)]
    return rows, store, adapter


def _flat(batches) -> list[torch.Tensor]:
    out = []
    for inputs, labels in batches:
        assert len(labels) == 1  # the target alone: no per-sample loss weights in eval
        out += [t for t in (*inputs, *labels) if isinstance(t, torch.Tensor)]
    return out


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def test_training_only_settings_leave_the_eval_batches_alone(data):
    rows, store, adapter = data
    plain = TrainParams()
    training_only = dataclasses.replace(plain, noise_offset=0.1, caption_dropout=0.5, learning_rate=1e-3)
    for t in (0.25, 0.75):
        assert _same(_flat(eval_batches(rows, store, adapter, plain, t)),
                     _flat(eval_batches(rows, store, adapter, training_only, t)))
    # the same settings do change what training draws, so the comparison above has something to miss
    def first_training_batch(noise_offset):
        return MicroBatches(rows, store, adapter, micro_batch_size=1, seed=0, dp_rank=0, dp_world=1,
                            timestep_sampling=plain.timestep_sampling, flow_shift=plain.flow_shift,
                            guidance=plain.guidance, noise_offset=noise_offset).at(0)
    trained, untouched = first_training_batch(0.1), first_training_batch(0.0)
    assert len(trained[1]) == 2  # the target and the rows' loss weights
    assert not _same(_flat([(trained[0], trained[1][:1])]), _flat([(untouched[0], untouched[1][:1])]))


def test_a_batch_at_given_timesteps_takes_no_noise_offset_or_loss_weight(data):
    """The loader's own guard: batches at given timesteps (eval's) skip what only sampled ones take."""
    rows, store, adapter = data
    plain = TrainParams()

    def at_half(noise_offset):
        loader = MicroBatches(rows, store, adapter, micro_batch_size=1, seed=0, dp_rank=0, dp_world=1,
                              timestep_sampling=plain.timestep_sampling, flow_shift=plain.flow_shift,
                              guidance=plain.guidance, noise_offset=noise_offset)
        return loader.make([0], torch.Generator().manual_seed(5), timesteps=torch.tensor([0.5]))
    assert _same(_flat([at_half(0.1)]), _flat([at_half(0.0)]))


def test_eval_batches_are_fixed_and_follow_the_noising_settings(data):
    rows, store, adapter = data
    plain = TrainParams()
    assert _same(_flat(eval_batches(rows, store, adapter, plain, 0.5)),
                 _flat(eval_batches(rows, store, adapter, plain, 0.5)))
    assert not _same(_flat(eval_batches(rows, store, adapter, plain, 0.5)),
                     _flat(eval_batches(rows, store, adapter, plain, 0.25)))
    assert not _same(_flat(eval_batches(rows, store, adapter, dataclasses.replace(plain, seed=plain.seed + 1), 0.5)),
                     _flat(eval_batches(rows, store, adapter, plain, 0.5)))
