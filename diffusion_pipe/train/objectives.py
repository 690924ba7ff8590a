"""Training objectives, once for every family: timestep sampling, noising, targets and the loss.

Flow matching (Flux, Wan, SD3): x_t = (1 - t) x_0 + t * noise, target = noise - x_0, t in [0, 1].
Timesteps are drawn uniformly or logit-normally and then shifted, t' = s t / (1 + (s - 1) t), as Flux and SD3
do at higher resolutions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def shift_timesteps(t: torch.Tensor, shift: float) -> torch.Tensor:
    """Flux/SD3 timestep shift; shift 1.0 is the identity, larger values favour noisier timesteps."""
    return shift * t / (1 + (shift - 1) * t)


def resolution_shift(num_tokens: int, base_tokens: int = 256, max_tokens: int = 4096,
                     base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """Flux-dev's resolution-dependent shift exp(mu), mu linear in the image's token count."""
    slope = (max_shift - base_shift) / (max_tokens - base_tokens)
    return math.exp(base_shift + slope * (num_tokens - base_tokens))


def sample_timesteps(n: int, method: str, shift: float, generator: torch.Generator) -> torch.Tensor:
    """`n` timesteps in (0, 1) drawn by `method` ('uniform' | 'logit_normal'), then shifted."""
    if method == "uniform":
        t = torch.rand(n, generator=generator)
    elif method == "logit_normal":
        t = torch.sigmoid(torch.randn(n, generator=generator))
    else:
        raise ValueError(f"train.timestep_sampling: unknown method {method!r}")
    return shift_timesteps(t, shift)


@dataclass(frozen=True)
class Noised:
    """What the denoiser sees (noisy latents, timesteps) and what it must predict."""

    noisy: torch.Tensor
    timesteps: torch.Tensor
    target: torch.Tensor


def flow_matching(latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> Noised:
    """Rectified-flow noising: linear path from data (t=0) to noise (t=1); the velocity is the target."""
    t = timesteps.view(-1, *([1] * (latents.dim() - 1))).to(latents.dtype)
    return Noised(noisy=(1 - t) * latents + t * noise, timesteps=timesteps, target=noise - latents)


def mse_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error in float32, whatever the compute dtype."""
    return torch.nn.functional.mse_loss(prediction.float(), target.float())
