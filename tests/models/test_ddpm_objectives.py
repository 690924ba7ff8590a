"""Epsilon and v-prediction (the objectives SDXL trains with) against diffusers' own DDPM scheduler maths.
(Here rather than tests/train/ because it was written with the SDXL adapter; move it when convenient.)"""

import torch
from diffusers import DDPMScheduler

from diffusion_pipe.train.objectives import (ddpm_alphas_cumprod, epsilon_prediction, quantile_to_discrete,
                                             sample_discrete_timesteps, v_prediction)

SDXL_SCHEDULE = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
                 "beta_schedule": "scaled_linear"}


def test_alphas_and_noising_match_diffusers():
    scheduler = DDPMScheduler(**SDXL_SCHEDULE)
    alphas = ddpm_alphas_cumprod(SDXL_SCHEDULE)
    assert torch.allclose(alphas.float(), scheduler.alphas_cumprod, atol=1e-6)
    x0, noise = torch.randn(3, 4, 8, 8), torch.randn(3, 4, 8, 8)
    t = torch.tensor([0.0, 499.0, 999.0])
    eps = epsilon_prediction(x0, noise, t, alphas)
    assert torch.allclose(eps.noisy, scheduler.add_noise(x0, noise, t.long()), atol=1e-5)
    assert torch.equal(eps.target, noise)
    v = v_prediction(x0, noise, t, alphas)
    assert torch.allclose(v.noisy, eps.noisy)
    assert torch.allclose(v.target, scheduler.get_velocity(x0, noise, t.long()), atol=1e-5)


def test_discrete_timesteps_cover_the_schedule_and_its_ranges():
    assert quantile_to_discrete(torch.tensor([0.0, 0.5, 1.0]), 1000).tolist() == [0, 500, 999]
    g = torch.Generator().manual_seed(0)
    t = sample_discrete_timesteps(4096, "uniform", 1000, g)
    assert t.min() >= 0 and t.max() <= 999 and torch.equal(t, t.round()) and t.unique().numel() > 900
    high = sample_discrete_timesteps(512, "logit_normal", 1000, g, lo=0.875, hi=1.0)
    assert high.min() >= 875
