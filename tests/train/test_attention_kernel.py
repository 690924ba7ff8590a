"""train.attention: which SDPA kernels the train stage allows, in which order."""

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


def test_cudnn_goes_first_and_flash_turns_it_off(priority):
    use_attention_kernel("cudnn")
    # compiled code takes flash whenever it is allowed, whatever the order: cudnn turns it off
    assert torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
    assert priority()[:2] == [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    use_attention_kernel("flash")
    assert priority()[:2] == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
