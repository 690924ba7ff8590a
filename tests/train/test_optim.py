"""fp32 master weights for bf16 parameters: updates too small for bf16 still accumulate, and state round-trips."""

import torch

from diffusion_pipe.train.optim import MasterWeightAdamW, make_optimizer


def test_small_updates_accumulate_in_masters():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = MasterWeightAdamW([p], lr=1e-4, weight_decay=0.0)
    for _ in range(100):
        p.grad = torch.ones_like(p)
        opt.step()
        opt.zero_grad()
    # AdamW moves about lr per step: 100 steps of 1e-4 are visible in fp32 (each alone rounds away in bf16)
    assert abs(opt.masters[0][0].item() - (1 - 100 * 1e-4)) < 2e-5
    assert p.dtype == torch.bfloat16 and abs(p[0].item() - 0.99) < 4e-3


def test_state_dict_restores_masters_exactly():
    p = torch.nn.Parameter(torch.randn(8).bfloat16())
    opt = MasterWeightAdamW([p], lr=1e-3)
    p.grad = torch.randn(8).bfloat16()
    opt.step()
    state = opt.state_dict()
    q = torch.nn.Parameter(torch.zeros(8).bfloat16())
    fresh = MasterWeightAdamW([q], lr=1e-3)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.masters[0], opt.masters[0]) and torch.equal(q, p)


def test_fp32_parameters_get_plain_adamw():
    assert type(make_optimizer([torch.nn.Parameter(torch.ones(2))], fused=False, lr=1e-3)) is torch.optim.AdamW
