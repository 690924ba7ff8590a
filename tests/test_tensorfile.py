"""Deterministic safetensors bytes that the safetensors library reads back exactly."""

import torch
from safetensors import safe_open
from safetensors.torch import load

from diffusion_pipe.tensorfile import save_deterministic


def test_roundtrip_and_determinism(tmp_path):
    tensors = {"b.weight": torch.randn(3, 4), "a.bf16": torch.randn(5).bfloat16(), "c.int": torch.arange(6),
               "d.scalar": torch.tensor(2.0), "e.empty": torch.zeros(0, 3)}
    meta = {"z": "1", "a": "two", "format": "pt"}
    data = save_deterministic(tensors, meta)
    assert data == save_deterministic(dict(reversed(list(tensors.items()))), dict(reversed(list(meta.items()))))
    loaded = load(data)
    assert set(loaded) == set(tensors)
    for k, v in tensors.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v)
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == meta
