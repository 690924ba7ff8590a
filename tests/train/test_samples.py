"""Samples during training: files at step 0 and at the end with the same seeds, the LoRA as it is at each step,
block-swapped layers staying swapped out, the training RNG untouched, prompts missing from the store refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from diffusion_pipe.config import ConfigError
from diffusion_pipe.models.flux import FluxAdapter
from diffusion_pipe.sample.render import grid_layout
from diffusion_pipe.store import Store
from diffusion_pipe.train.pipeline import Dist
from diffusion_pipe.train.samples import TrainingSamples
from diffusion_pipe.train.swap import SwappedLayer, apply_block_swap
from tests.sample.helpers import lora_model, model_params, sample_params, store_prompts, train_a_little

CPU = Dist(rank=0, world=1, local_rank=0, device=torch.device("cpu"))


def _samples(adapter, model_dir, store, local, layers, run_dir, publish_dir=None) -> TrainingSamples:
    return TrainingSamples.create(sample_params(), 4, model_params(model_dir), 32, adapter, store, local.denoiser,
                                  nn.ModuleList(layers), CPU, 1, 1, run_dir, publish_dir, writer=None)


def _pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).astype(int)


def test_samples_at_step_0_and_the_end_show_the_lora_learn(tiny_flux_dir, tmp_path):
    adapter = FluxAdapter(tiny_flux_dir, torch.float32)
    store = Store(tmp_path / "store")
    store_prompts(adapter, tiny_flux_dir, sample_params(), store)
    local = lora_model(adapter, dropout=0.5)  # samples render without it, drawing no random numbers
    run_dir, publish = tmp_path / "run", tmp_path / "reports" / "samples"
    samples = _samples(adapter, tiny_flux_dir, store, local, local.layers, run_dir, publish)

    rng = torch.get_rng_state()
    samples.render(0)
    samples.render(1)  # not a sample step (every 2)
    samples.render(2)
    train_a_little(local.denoiser)
    samples.render(4, final=True)
    assert torch.equal(torch.get_rng_state(), rng)  # a run with samples draws the same random numbers
    dropouts = [m for name, m in local.denoiser.named_modules() if name.endswith("lora_dropout.default")]
    assert dropouts and all(m.training for m in dropouts)  # and trains on with its LoRA dropout
    # the same LoRA built without dropout renders the same pictures: samples run without it
    plain = lora_model(adapter)
    train_a_little(plain.denoiser)
    _samples(adapter, tiny_flux_dir, store, plain, plain.layers, tmp_path / "plain").render(4)

    assert sorted(p.name for p in run_dir.iterdir()) == ["step000000", "step000000.png", "step000002",
                                                         "step000002.png", "step000004", "step000004.png"]
    assert sorted(p.name for p in publish.iterdir()) == ["progress.png", "step000000.png", "step000002.png",
                                                         "step000004.png"]
    start, middle, end = (_pixels(run_dir / f"step00000{s}" / "00.png") for s in (0, 2, 4))
    assert start.shape == (32, 32, 3)
    assert np.array_equal(start, middle)  # same seed, LoRA unchanged (B = 0): the very same image
    assert np.abs(end - start).mean() > 2  # the LoRA changed: same noise, a different picture
    assert np.array_equal(end, _pixels(tmp_path / "plain" / "step000004" / "00.png"))
    # a row per prompt, a column per step, labelled; each cell is its step's file scaled up 4 times (32 px to 128)
    progress = _pixels(publish / "progress.png")
    layout = grid_layout([[(32, 32)] * 3] * 2, [p.prompt for p in sample_params().resolved()],
                         ["step 0", "step 2", "step 4"])
    assert progress.shape == (layout.height, layout.width, 3)
    for i, boxes in enumerate(layout.cells):
        for step, (top, left, bottom, right) in zip((0, 2, 4), boxes):
            assert np.array_equal(progress[top:bottom, left:right],
                                  _pixels(run_dir / f"step00000{step}" / f"{i:02d}.png").repeat(4, 0).repeat(4, 1))
    step_grid = grid_layout([[(32, 32)] * 2], ["step 4"], [p.prompt for p in sample_params().resolved()])
    assert _pixels(publish / "step000004.png").shape == (step_grid.height, step_grid.width, 3)
    assert samples.seconds > 0


def test_block_swapped_layers_render_the_same_and_stay_swapped(tiny_flux_dir, tmp_path):
    adapter = FluxAdapter(tiny_flux_dir, torch.float32)
    store = Store(tmp_path / "store")
    store_prompts(adapter, tiny_flux_dir, sample_params(), store)
    local = lora_model(adapter)
    train_a_little(local.denoiser)
    _samples(adapter, tiny_flux_dir, store, local, local.layers, tmp_path / "plain").render(0)

    swapped = apply_block_swap(local.layers, (0, len(local.layers)), 3, torch.device("cpu"))
    assert sum(isinstance(layer, SwappedLayer) for layer in swapped) == 3
    _samples(adapter, tiny_flux_dir, store, local, swapped, tmp_path / "swapped").render(0)

    for i in range(2):
        assert np.array_equal(_pixels(tmp_path / "plain" / "step000000" / f"{i:02d}.png"),
                              _pixels(tmp_path / "swapped" / "step000000" / f"{i:02d}.png"))
    frozen = [p for layer in swapped if isinstance(layer, SwappedLayer) for p in layer.parameters()
              if not p.requires_grad]
    assert frozen and all(p.numel() == 0 for p in frozen)  # the weights went back to CPU after the render


def test_prompts_missing_from_the_store_are_refused_before_training(tiny_flux_dir, tmp_path):
    adapter = FluxAdapter(tiny_flux_dir, torch.float32)
    local = lora_model(adapter)
    with pytest.raises(ConfigError, match=r"2 prompt texts \('a blue square on a black background', 'a red "
                                          r"circle on a white background'\) have no text entry in the store.*dvc "
                                          r"repro --force --single-item encode"):
        _samples(adapter, tiny_flux_dir, Store(tmp_path / "empty"), local, local.layers, tmp_path / "run")


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_with_two_stages_rank_0_stands_in_for_the_other_stage(family):
    """What rank 0 runs remotely with 2 stages: the second stage's blocks and output modules, and parameters its
    forward reads directly (Wan's scale_shift_table), each by the rank holding that stage."""
    from accelerate import init_empty_weights

    from diffusion_pipe.models import adapter_class
    from diffusion_pipe.train.samples import remote_owners
    from tests.conftest import REPO

    adapter = adapter_class(family)(REPO / f"examples/{family}-tiny/model", torch.float32)
    cls = adapter.denoiser_class()
    with init_empty_weights(include_buffers=False):
        denoiser = cls.from_config(cls.load_config(adapter.denoiser_dir()))
    owners = remote_owners(adapter, denoiser, num_stages=2, dp_world=2)
    expected = {"flux": {"norm_out", "proj_out", "single_transformer_blocks.0", "single_transformer_blocks.1"},
                "wan": {"blocks.1", "norm_out", "proj_out", "parameter:scale_shift_table"}}[family]
    assert set(owners) == expected
    assert set(owners.values()) == {2}  # stage 1 of data-parallel replica 0: global rank 2 when dp_world is 2
