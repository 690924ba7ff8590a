"""The check before step 1 (train/data.py `check_entries`): an entry the store holds at another shape or dtype than
the model expects (encoded at another bucket, with another text length, or by another family's encoder) is a
DataError naming the entry, the sample and both specs, never a tensor-shape error inside the model."""

from __future__ import annotations

import pytest
import torch

from diffusion_pipe.models.flux import FluxAdapter
from diffusion_pipe.store import Store
from diffusion_pipe.train.data import DataError, Row, check_entries


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> FluxAdapter:
    out = tmp_path_factory.mktemp("flux")
    FluxAdapter.build_tiny(out, seed=0)
    return FluxAdapter(out, torch.float32)


def _entries(adapter: FluxAdapter, width: int, height: int, text_length: int) -> tuple[dict, dict]:
    latent = {name: torch.zeros(shape, dtype=getattr(torch, dtype)) for name, (shape, dtype) in
              adapter.latent_spec(width, height, 1).items()}
    text = {name: torch.zeros(shape, dtype=getattr(torch, dtype)) for name, (shape, dtype) in
            adapter.text_spec(text_length).items()}
    return latent, text


def _store(root, latents: dict[str, dict], texts: dict[str, dict]) -> Store:
    store = Store(root)
    with store.writer("latent") as writer:
        for key, value in latents.items():
            writer.add(key, value)
    with store.writer("text") as writer:
        for key, value in texts.items():
            writer.add(key, value)
    return store


def test_entries_of_the_expected_specs_pass(adapter, tmp_path):
    latent, text = _entries(adapter, 32, 32, 16)
    store = _store(tmp_path, {"l": latent}, {"t": text})
    check_entries([Row("s0", "32x32x1", 1, "l", "t")], store, adapter, 16)


def test_a_latent_of_another_bucket_is_refused_naming_both_shapes(adapter, tmp_path):
    small, text = _entries(adapter, 16, 16, 16)
    store = _store(tmp_path, {"l": small}, {"t": text})
    want = adapter.latent_spec(32, 32, 1)["latents"][0]
    got = small["latents"].shape
    assert tuple(want) != tuple(got)
    with pytest.raises(DataError) as err:
        check_entries([Row("s0", "32x32x1", 1, "l", "t")], store, adapter, 16)
    message = str(err.value)
    assert message.startswith("latent entry l of sample s0 holds")
    assert str(tuple(got)) in message and str(tuple(want)) in message
    assert "re-run encode with the same model params as train" in message


def test_a_text_entry_of_another_length_or_dtype_is_refused(adapter, tmp_path):
    latent, long_text = _entries(adapter, 32, 32, 24)
    _, text = _entries(adapter, 32, 32, 16)
    half = {name: value.to(torch.float16) for name, value in text.items()}
    store = _store(tmp_path, {"l": latent}, {"long": long_text, "half": half})
    with pytest.raises(DataError, match=r"text entry long of sample s0 holds .*24.* expects .*16"):
        check_entries([Row("s0", "32x32x1", 1, "l", "long")], store, adapter, 16)
    with pytest.raises(DataError, match=r"text entry half of sample s1 holds .*float16.* expects .*float32"):
        check_entries([Row("s1", "32x32x1", 1, "l", "half")], store, adapter, 16)
