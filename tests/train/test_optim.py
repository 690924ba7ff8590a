"""fp32 master weights for bf16 parameters: updates too small for bf16 still accumulate, state round-trips, and
gradient clipping matches torch's on the same gradients."""

import pytest
import torch

from diffusion_pipe.train import optim
from diffusion_pipe.train.optim import MasterWeightAdamW


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


def test_fp32_parameters_are_their_own_masters():
    p = torch.nn.Parameter(torch.ones(2))
    opt = MasterWeightAdamW([p], lr=1e-3)
    assert opt.masters[0] is p
    p.grad = torch.ones(2)
    opt.step()
    assert p[0].item() < 1


@pytest.mark.parametrize("buffer_numel, buffers", [(1 << 26, 1), (64, 3)])
def test_masters_of_many_shapes_step_as_adamw_on_fp32_copies_and_a_missing_gradient_is_no_update(
        monkeypatch, buffer_numel, buffers):
    monkeypatch.setattr(optim, "_GRAD_BUFFER_NUMEL", buffer_numel)  # 64: buffers of 64, 64 and 7 + 30 + 1 elements
    g = torch.Generator().manual_seed(0)
    shapes = [(16, 4), (4, 16), (7,), (3, 5, 2), (1,)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16()) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().float()) for p in ours]
    opt, ref_opt = MasterWeightAdamW(ours, lr=1e-2), torch.optim.AdamW(ref, lr=1e-2)
    for without in (None, 2):  # the second step: one parameter has no gradient
        for i, (p, q) in enumerate(zip(ours, ref)):
            grad = None if i == without else torch.randn(p.shape, generator=g).bfloat16()
            p.grad, q.grad = grad, None if grad is None else grad.float()
        before = opt.masters[2].clone()
        opt.step()
        if without is None:
            assert len({m.grad.untyped_storage().data_ptr() for m in opt.masters}) == buffers
        ref_opt.step()
        for master, q in zip(opt.masters, ref):
            assert master.dtype == torch.float32 and torch.allclose(master, q, atol=1e-6)
        if without is not None:
            assert opt.masters[without].grad is None and torch.equal(opt.masters[without], before)
        for p, master in zip(ours, opt.masters):
            assert torch.equal(p, master.bfloat16())
        # no zero_grad: the masters' gradients follow the parameters' at every step, whoever clears them


def test_clipping_matches_torch_and_reports_the_norm():
    g = torch.Generator().manual_seed(0)
    shapes = [(16, 4), (4, 16), (7,)]
    grads = [torch.randn(s, generator=g) * 10 for s in shapes]
    ours = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = MasterWeightAdamW(ours, lr=1e-2, max_grad_norm=0.5)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    for p, q, grad in zip(ours, ref, grads):
        p.grad, q.grad = grad.clone(), grad.clone()
    opt.step()
    norm = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    ref_opt.step()
    assert norm > 0.5  # the clip was active
    assert torch.allclose(opt._global_grad_norm, norm)
    for p, q, grad in zip(ours, ref, grads):  # fp32 parameters are their own masters: clipped in place
        assert torch.allclose(p.grad, q.grad) and not torch.allclose(p.grad, grad)
        assert torch.allclose(p, q, atol=1e-7)


def test_loss_scaling_unscales_skips_overflow_and_round_trips():
    from diffusion_pipe.train.optim import LossScaler

    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    ref = torch.nn.Parameter(torch.ones(4))
    scaler = LossScaler(enabled=True, init_scale=1024.0, growth_interval=2)
    opt = MasterWeightAdamW([p], lr=1e-2, max_grad_norm=0.0, loss_scaler=scaler)
    ref_opt = MasterWeightAdamW([ref], lr=1e-2)
    grad = torch.tensor([0.5, -0.25, 0.125, 1.0])
    p.grad = (grad * 1024).half()  # what backward of a loss scaled by 1024 gives
    ref.grad = grad.clone()
    opt.step()
    ref_opt.step()
    assert torch.allclose(opt.masters[0], ref, atol=1e-6)  # the same update as unscaled fp32 gradients
    assert torch.allclose(opt._global_grad_norm, grad.norm())

    before = opt.masters[0].clone()
    p.grad = torch.tensor([float("inf"), 1, 1, 1], dtype=torch.float16)
    assert opt.step() is None  # overflow: no update, the scale halves
    assert torch.equal(opt.masters[0], before) and scaler.scale == 512.0 and scaler.skipped_steps == 1
    for _ in range(2):  # two clean steps: the scale doubles again
        p.grad = (grad * scaler.scale).half()
        opt.step()
    assert scaler.scale == 1024.0

    fresh = MasterWeightAdamW([torch.nn.Parameter(torch.ones(4, dtype=torch.float16))], lr=1e-2,
                              loss_scaler=LossScaler(enabled=True))
    fresh.load_state_dict(opt.state_dict())
    assert fresh.loss_scaler.state_dict() == scaler.state_dict()


def test_scaling_is_off_for_bf16():
    from diffusion_pipe.train.optim import LossScaler

    scaler = LossScaler(enabled=False)
    assert scaler.scale == 1.0
    p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    opt = MasterWeightAdamW([p], lr=1e-2, loss_scaler=scaler)
    p.grad = torch.tensor([float("nan"), 1.0], dtype=torch.bfloat16)
    opt.step()  # not skipped: without scaling, a non-finite gradient is the model's problem, as in torch
    assert scaler.skipped_steps == 0
