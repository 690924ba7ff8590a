"""Shared fixtures of the store tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffusion_pipe.store import Store
# fixtures shared with tests/encode
from tests.store.servers import seaweedfs, seaweedfs_server, sftp, sftp_server  # noqa: F401


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store")


def make_entry(i: int) -> dict[str, torch.Tensor]:
    """Several tensors of several dtypes, with content derived from `i`."""
    g = torch.Generator().manual_seed(i)
    return {
        "latents": torch.randn(4, 8, 8, generator=g),
        "half": torch.randn(3, 5, generator=g).to(torch.float16),
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "ids": torch.arange(6, dtype=torch.int64) * i,
    }


ENTRY_BYTES = sum(t.numel() * t.element_size() for t in make_entry(0).values())


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name
