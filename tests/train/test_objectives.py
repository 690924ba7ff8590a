"""The shared training maths."""

import torch

from diffusion_pipe.train.objectives import flow_matching, resolution_shift, sample_timesteps, shift_timesteps


def test_flow_matching_endpoints_and_target():
    x0 = torch.randn(3, 4, 8, 8)
    noise = torch.randn_like(x0)
    at0 = flow_matching(x0, noise, torch.zeros(3))
    at1 = flow_matching(x0, noise, torch.ones(3))
    assert torch.allclose(at0.noisy, x0) and torch.allclose(at1.noisy, noise)
    assert torch.allclose(at0.target, noise - x0)
    # the velocity integrates the path: x_t + (1 - t) * v = noise
    mid = flow_matching(x0, noise, torch.full((3,), 0.3))
    assert torch.allclose(mid.noisy + 0.7 * mid.target, noise, atol=1e-6)


def test_shift_identity_and_monotone():
    t = torch.linspace(0, 1, 11)
    assert torch.allclose(shift_timesteps(t, 1.0), t)
    shifted = shift_timesteps(t, 3.0)
    assert torch.all(shifted >= t) and shifted[0] == 0 and shifted[-1] == 1
    assert resolution_shift(4096) > resolution_shift(256)


def test_sampling_is_seeded_and_in_range():
    a = sample_timesteps(64, "logit_normal", 1.0, torch.Generator().manual_seed(1))
    b = sample_timesteps(64, "logit_normal", 1.0, torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.min() > 0 and a.max() < 1
    u = sample_timesteps(4096, "uniform", 1.0, torch.Generator().manual_seed(2))
    assert abs(u.mean().item() - 0.5) < 0.03
