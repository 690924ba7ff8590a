"""Loss masks in training (issue 36): the per-element loss weighted by each sample's mask at latent resolution,
min_w + (1 - min_w) mask (train.mask_min_weight), normalised by each sample's weight sum; unmasked samples weigh 1;
a run without masks at the default params is what it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffusion_pipe.config import ConfigError
from diffusion_pipe.params import load_params
from diffusion_pipe.train.data import MicroBatches, Row
from diffusion_pipe.train.loop import run_identity
from diffusion_pipe.train.objectives import TrainingLoss, elementwise_loss, masked_loss, training_loss


def _pair(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)


def test_masked_loss_is_the_hand_computed_weighted_mean() -> None:
    prediction, target = _pair()
    mask = torch.zeros(2, 1, 4, 4)
    mask[0, :, :, :2] = 1.0  # sample 0: the left half (columns 0-1)
    mask[1, :, 1, 3] = 0.25  # sample 1: one cell, a quarter weight
    sq = (prediction - target).square()
    # by hand: sample 0's mean error over its left half, all 3 channels; sample 1's error at that one cell
    want0 = sq[0, :, :, :2].sum() / (3 * 4 * 2)
    want1 = sq[1, :, 1, 3].sum() * 0.25 / (3 * 0.25)
    assert torch.allclose(masked_loss(prediction, target, None, mask, "mse", 0.1), (want0 + want1) / 2)
    weights = torch.tensor([2.0, 0.5])  # per-sample weights multiply as without masks
    assert torch.allclose(masked_loss(prediction, target, weights, mask, "mse", 0.1), (2 * want0 + 0.5 * want1) / 2)
    # what the loss fn of train/loop.py calls: the training loss with element weights; eval ignores them
    loss = TrainingLoss("mse")
    assert torch.equal(loss(prediction, target, None, mask), masked_loss(prediction, target, None, mask, "mse", 0.1))
    # the transposed mask weighs other elements
    assert not torch.allclose(masked_loss(prediction, target, None, mask.transpose(-1, -2), "mse", 0.1),
                              (want0 + want1) / 2)


def test_a_mask_of_ones_is_the_unmasked_loss_and_huber_is_weighted_alike() -> None:
    prediction, target = _pair(1)
    ones = torch.ones(2, 1, 4, 4)
    for kind in ("mse", "huber", "pseudo_huber"):
        assert torch.allclose(training_loss(prediction, target, None, kind, 0.1, ones),
                              training_loss(prediction, target, None, kind, 0.1))
    mask = torch.zeros(2, 1, 4, 4)
    mask[:, :, 2:] = 1.0  # the bottom half
    err = elementwise_loss(prediction, target, "huber", 0.1)
    assert torch.allclose(training_loss(prediction, target, None, "huber", 0.1, mask),
                          err[:, :, 2:].flatten(1).mean(1).mean())


def test_an_all_black_mask_adds_nothing_and_gives_no_nan() -> None:
    prediction, target = _pair(2)
    mask = torch.zeros(2, 1, 4, 4)
    mask[1] = 1.0
    loss = masked_loss(prediction, target, None, mask, "mse", 0.1)
    assert torch.isfinite(loss)
    assert torch.allclose(loss, (prediction[1] - target[1]).square().mean() / 2)


class _Store:
    """The store's `get` for mask entries (what MicroBatches reads of masks)."""

    def __init__(self, masks: dict[str, torch.Tensor]) -> None:
        self.masks = masks

    def get(self, family: str, key: str) -> dict[str, torch.Tensor]:
        assert family == "mask"
        return {"mask": self.masks[key]}


def _weights(rows: list[Row], masks: dict[str, torch.Tensor], min_weight: float, target_shape=(2, 3, 4, 4)):
    loader = MicroBatches.__new__(MicroBatches)  # only what _mask_weights reads
    loader.rows, loader.store, loader.mask_min_weight = rows, _Store(masks), min_weight
    return loader._mask_weights(list(range(len(rows))), torch.zeros(target_shape))


def test_mask_weights_take_the_min_weight_and_unmasked_samples_weigh_one() -> None:
    mask = torch.zeros(1, 4, 4)
    mask[0, 0, 0], mask[0, 1, 1] = 1.0, 0.5
    rows = [Row("a", "32x32x1", 1, "la", "ta", mask_key="m"), Row("b", "32x32x1", 1, "lb", "tb")]
    got = _weights(rows, {"m": mask}, 0.0)
    assert got.shape == (2, 1, 4, 4)
    assert torch.equal(got[0, 0], mask[0]) and torch.equal(got[1], torch.ones(1, 4, 4))
    got = _weights(rows, {"m": mask}, 0.2)
    assert torch.allclose(got[0, 0], 0.2 + 0.8 * mask[0])  # min_w + (1 - min_w) mask
    assert got[0, 0, 3, 3].item() == pytest.approx(0.2) and got[0, 0, 1, 1].item() == pytest.approx(0.6)
    assert torch.equal(got[1], torch.ones(1, 4, 4))
    assert _weights(rows[1:], {}, 0.2) is None  # no mask in the batch: the labels are what they were
    # a video-shaped target (B, C, F, h, w): the weights broadcast over channels and frames
    assert _weights(rows, {"m": mask}, 0.0, (2, 3, 5, 4, 4)).shape == (2, 1, 1, 4, 4)


def test_mask_min_weight_param_and_the_run_identity(tmp_path: Path) -> None:
    path = tmp_path / "params.yaml"
    base = "model: {path: some/model}\nscan:\n  datasets: [{path: data}]\n"
    path.write_text(base + "train: {}\n")
    train = load_params(path).train
    assert train.mask_min_weight == 0.0
    encoded = tmp_path / "encoded.parquet"
    encoded.write_bytes(b"table")
    model = load_params(path).model
    # the default leaves the run identity as it was before masks (no key), so existing runs resume
    assert "mask_min_weight" not in run_identity(model, train, encoded, 32, 1)["train"]
    path.write_text(base + "train: {mask_min_weight: 0.1}\n")
    assert run_identity(model, load_params(path).train, encoded, 32, 1)["train"]["mask_min_weight"] == 0.1
    path.write_text(base + "train: {mask_min_weight: 1.5}\n")
    with pytest.raises(ConfigError, match=r"train\.mask_min_weight"):
        load_params(path)


def test_a_missing_or_misshapen_mask_entry_is_named_before_step_1(tmp_path: Path, tiny_flux_dir: Path) -> None:
    from diffusion_pipe.models.flux import FluxAdapter
    from diffusion_pipe.store import Store
    from diffusion_pipe.train.data import DataError, check_entries

    adapter = FluxAdapter(tiny_flux_dir, torch.float32)
    store = Store(tmp_path / "store")
    latent = {n: torch.zeros(s, dtype=getattr(torch, d)) for n, (s, d) in adapter.latent_spec(32, 32, 1).items()}
    text = {n: torch.zeros(s, dtype=getattr(torch, d)) for n, (s, d) in adapter.text_spec(16).items()}
    with store.writer("latent") as writer:
        writer.add("l", latent)
    with store.writer("text") as writer:
        writer.add("t", text)
    with store.writer("mask") as writer:
        writer.add("good", {"mask": torch.ones(1, 8, 8)})  # 32 pixels, 4 per latent cell
        writer.add("bad", {"mask": torch.ones(1, 16, 16)})  # made for another grid
    check_entries([Row("s", "32x32x1", 1, "l", "t", mask_key="good"), Row("u", "32x32x1", 1, "l", "t")], store,
                  adapter, 16)
    with pytest.raises(DataError, match=r"mask entry bad of sample s holds .*\(1, 16, 16\).*expects .*\(1, 8, 8\)"):
        check_entries([Row("s", "32x32x1", 1, "l", "t", mask_key="bad")], store, adapter, 16)
    with pytest.raises(DataError, match=r"mask entry gone of sample s is not in the store"):
        check_entries([Row("s", "32x32x1", 1, "l", "t", mask_key="gone")], store, adapter, 16)
