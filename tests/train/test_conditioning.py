"""Training data of an edit family: each micro-batch carries its samples' control latents (normalised, never
noised) into the first layer's inputs, and the entry check before step 1 covers them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffusion_pipe.models.flux import pack_latents
from diffusion_pipe.models.flux_kontext import FluxKontextAdapter
from diffusion_pipe.store import Store
from diffusion_pipe.train.data import DataError, MicroBatches, Row, check_entries


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> FluxKontextAdapter:
    out = tmp_path_factory.mktemp("kontext")
    FluxKontextAdapter.build_tiny(out, seed=0)
    return FluxKontextAdapter(out, torch.float32)


def _store(root: Path, adapter: FluxKontextAdapter) -> tuple[Store, list[Row], dict[str, torch.Tensor]]:
    """Two samples at 32x32: latents, control latents and text entries with recognisable values."""
    store = Store(root)
    g = torch.Generator().manual_seed(0)
    (shape, _), = adapter.latent_spec(32, 32, 1).values()
    latents = {key: torch.randn(shape, generator=g) for key in ("t0", "t1", "c0", "c1")}
    text = {name: torch.randn(s, generator=g) for name, (s, _) in adapter.text_spec(16).items()}
    with store.writer("latent") as writer:
        for key, value in latents.items():
            writer.add(key, {"latents": value})
    with store.writer("text") as writer:
        writer.add("x", text)
    rows = [Row(f"s{i}", "32x32x1", 1, f"t{i}", "x", (f"c{i}",)) for i in range(2)]
    return store, rows, latents


def test_micro_batches_carry_the_normalised_control_latents(adapter, tmp_path):
    store, rows, latents = _store(tmp_path / "store", adapter)
    check_entries(rows, store, adapter, 16)
    loader = MicroBatches(rows, store, adapter, micro_batch_size=2, seed=0, dp_rank=0, dp_world=1,
                          timestep_sampling="uniform", flow_shift=1.0, guidance=1.0)
    (inputs, (target,)) = loader.at(0)
    order = [rows[i] for i in loader.indices_at(0)]
    controls = torch.stack([latents[row.conditioning_keys[0]] for row in order])
    tokens = target.shape[-2] // 2 * target.shape[-1] // 2
    assert inputs[0].shape[1] == 2 * tokens and inputs[4].shape[1] == 2 * tokens
    assert torch.allclose(inputs[0][:, tokens:], pack_latents(adapter.normalise_latents(controls)))
    assert (inputs[4][:, tokens:, 0] == 1).all() and (inputs[4][:, :tokens, 0] == 0).all()


def test_the_entry_check_covers_control_latents(adapter, tmp_path):
    store, rows, _ = _store(tmp_path / "store", adapter)
    with pytest.raises(DataError, match=r"latent entry nope of sample s0 is not in the store"):
        check_entries([Row("s0", "32x32x1", 1, "t0", "x", ("nope",))], store, adapter, 16)
    with pytest.raises(DataError, match=r"sample s0 has 0 control image\(s\), but model family 'flux_kontext' "
                                        r"trains on 1 per sample"):
        check_entries([Row("s0", "32x32x1", 1, "t0", "x")], store, adapter, 16)
