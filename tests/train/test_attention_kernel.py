"""The SDPA kernels the train stage lets torch pick on GPUs, in which order: flash first, cuDNN's never (it trained on
wrong gradients on an H100 and crashed on an H200, so train.attention: cudnn was removed)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from diffusion_pipe.train.pipeline import use_attention_kernel


@pytest.fixture
def priority():
    """Restores the process's SDPA kernel order after a test changes it."""
    before = torch._C._get_sdp_priority_order(), torch.backends.cuda.cudnn_sdp_enabled()
    yield lambda: [SDPBackend(i) for i in torch._C._get_sdp_priority_order()]
    torch._C._set_sdp_priority_order(before[0])
    torch.backends.cuda.enable_cudnn_sdp(before[1])


def test_flash_goes_first_and_cudnn_is_off(priority):
    torch.backends.cuda.enable_cudnn_sdp(True)  # torch's own default on recent GPUs
    use_attention_kernel()
    assert priority()[:2] == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
