"""Training data of a family conditioned on part of the sample itself (Wan 2.2 TI2V): a clip's micro-batch enters
the model with its first latent frame clean (timestep 0 on its tokens), and the target is the frames after it;
an image's micro-batch is noised and targeted whole."""

from __future__ import annotations

import pytest
import torch

from diffusion_pipe.models.wan_ti2v import WanTI2VAdapter
from diffusion_pipe.store import Store
from diffusion_pipe.train.data import MicroBatches, Row, check_entries


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> WanTI2VAdapter:
    out = tmp_path_factory.mktemp("wan_ti2v")
    WanTI2VAdapter.build_tiny(out, seed=0)
    return WanTI2VAdapter(out, torch.float32)


def _loader(tmp_path, adapter, frames: int) -> tuple[MicroBatches, torch.Tensor]:
    """Two samples of `frames` frames at 64x32 and their normalised latents, in the first micro-batch's order."""
    store = Store(tmp_path / "store")
    g = torch.Generator().manual_seed(0)
    (shape, _), = adapter.latent_spec(64, 32, frames).values()
    latents = {f"l{i}": torch.randn(shape, generator=g) for i in range(2)}
    with store.writer("latent") as writer:
        for key, value in latents.items():
            writer.add(key, {"latents": value})
    with store.writer("text") as writer:
        writer.add("x", {name: torch.randn(s, generator=g) for name, (s, _) in adapter.text_spec(16).items()})
    rows = [Row(f"s{i}", f"64x32x{frames}", 1, f"l{i}", "x") for i in range(2)]
    check_entries(rows, store, adapter, 16)
    loader = MicroBatches(rows, store, adapter, micro_batch_size=2, seed=0, dp_rank=0, dp_world=1,
                          timestep_sampling="uniform", flow_shift=1.0, guidance=1.0)
    clean = adapter.normalise_latents(torch.stack([latents[rows[i].latent_key] for i in loader.indices_at(0)]))
    return loader, clean


def test_a_clip_enters_with_its_first_latent_frame_clean_and_is_targeted_after_it(adapter, tmp_path):
    loader, clean = _loader(tmp_path, adapter, frames=5)
    (latents, timesteps, _text), (target,) = loader.at(0)
    assert clean.shape[2] == 2 and target.shape[2] == 1  # two latent frames: the condition, one generated
    assert torch.equal(latents[:, :, 0], clean[:, :, 0])
    assert not torch.allclose(latents[:, :, 1], clean[:, :, 1])
    per_frame = timesteps.shape[1] // 2
    assert (timesteps[:, :per_frame] == 0).all() and (timesteps[:, per_frame:] > 0).all()


def test_an_image_is_noised_and_targeted_whole(adapter, tmp_path):
    loader, clean = _loader(tmp_path, adapter, frames=1)
    (latents, timesteps, _text), (target,) = loader.at(0)
    assert target.shape == clean.shape and not torch.allclose(latents, clean)
    assert (timesteps > 0).all()
