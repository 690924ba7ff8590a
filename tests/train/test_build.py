"""Per-stage model building: only this stage's layers are materialised, base and LoRA in the asked dtype."""

import pytest
import torch

from diffusion_pipe.models.flux import FluxAdapter
from diffusion_pipe.train.build import build_local_model, seed_lora_dropout, stage_bounds


@pytest.fixture(scope="module")
def model_dir(tiny_flux_dir):
    return tiny_flux_dir


def build(model_dir, dtype, stages, stage):
    adapter = FluxAdapter(model_dir, dtype)
    return build_local_model(adapter, stages, stage, targets=adapter.default_lora_targets, rank=4, alpha=4.0,
                             dropout=0.0, seed=0)


def test_stage_bounds_cover_every_layer_once():
    bounds = [stage_bounds(7, 3, s) for s in range(3)]
    assert bounds[0][0] == 0 and bounds[-1][1] == 7
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_only_local_layers_hold_weights(model_dir):
    local = build(model_dir, torch.bfloat16, stages=2, stage=1)
    for i, layer in enumerate(local.layers):
        devices = {p.device.type for p in layer.parameters()}
        assert devices == ({"cpu"} if local.start <= i < local.stop else {"meta"}), i
    base = [p for n, p in local.layers[-2].named_parameters() if "lora_" not in n]
    lora = [p for n, p in local.layers[-2].named_parameters() if "lora_" in n]
    assert base and all(p.dtype == torch.bfloat16 and not p.requires_grad for p in base)
    assert lora and all(p.dtype == torch.bfloat16 and p.requires_grad for p in lora)


def test_lora_init_does_not_depend_on_layout(model_dir):
    whole = build(model_dir, torch.float32, stages=1, stage=0)
    second = build(model_dir, torch.float32, stages=2, stage=1)
    want = dict(whole.denoiser.named_parameters())
    compared = 0
    for name, p in second.denoiser.named_parameters():
        if "lora_A" in name and p.device.type != "meta":
            assert torch.equal(p, want[name]), name
            compared += 1
    assert compared > 0


def test_lora_dropout_draws_differ_by_data_parallel_rank_and_repeat_by_seed():
    """LoRA dropout draws from torch's global RNG, seeded per data-parallel rank: two ranks drop different units
    (the same masks on every rank would correlate what their averaged gradients miss); a rank seeded again draws
    the same."""
    dropout = torch.nn.Dropout(0.5)
    x = torch.ones(256)

    def mask(seed: int, dp_rank: int) -> torch.Tensor:
        seed_lora_dropout(seed, dp_rank)
        return dropout(x) == 0

    assert torch.equal(mask(0, 1), mask(0, 1))
    assert not torch.equal(mask(0, 0), mask(0, 1)) and not torch.equal(mask(0, 1), mask(1, 1))
