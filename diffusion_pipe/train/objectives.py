"""Training objectives, once for every family: timestep sampling, noising, targets and the loss.

Flow matching (Flux, Wan, SD3): x_t = (1 - t) x_0 + t * noise, target = noise - x_0, t in [0, 1].
Timesteps are drawn uniformly or logit-normally and then shifted, t' = s t / (1 + (s - 1) t), as Flux and SD3
do at higher resolutions.

DDPM (SD, SDXL): x_t = sqrt(a_t) x_0 + sqrt(1 - a_t) noise with a_t the cumulative product of (1 - beta) from the
model's own scheduler config, at a discrete timestep 0 .. N-1. Epsilon prediction targets the noise; v prediction
targets v = sqrt(a_t) noise - sqrt(1 - a_t) x_0. Timesteps are drawn by the same method (uniform or logit-normal)
on [0, 1) and mapped onto the N discrete steps; `flow_shift` does not apply.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
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


def ddpm_alphas_cumprod(schedule: dict) -> torch.Tensor:
    """Cumulative alphas (N,) in float64 from a diffusers scheduler config, as DDPMScheduler computes them."""
    n = int(schedule.get("num_train_timesteps", 1000))
    start, end = float(schedule.get("beta_start", 0.0001)), float(schedule.get("beta_end", 0.02))
    kind = schedule.get("beta_schedule", "linear")
    if kind == "linear":
        betas = torch.linspace(start, end, n, dtype=torch.float64)
    elif kind == "scaled_linear":
        betas = torch.linspace(start**0.5, end**0.5, n, dtype=torch.float64) ** 2
    else:
        raise ValueError(f"scheduler beta_schedule {kind!r} is not supported for DDPM training "
                         "(supported: linear, scaled_linear)")
    return torch.cumprod(1.0 - betas, dim=0)


def quantile_to_discrete(q: torch.Tensor, num_steps: int) -> torch.Tensor:
    """Fractions of the schedule in [0, 1] -> discrete timesteps 0 .. num_steps-1 (as floats); 1.0 is the
    noisiest step, so an eval quantile means the same noise level for every objective."""
    return torch.clamp(torch.floor(q.double() * num_steps), 0, num_steps - 1).float()


def sample_discrete_timesteps(n: int, method: str, num_steps: int, generator: torch.Generator,
                              lo: float = 0.0, hi: float = 1.0) -> torch.Tensor:
    """`n` discrete DDPM timesteps drawn by `method` over the [lo, hi) fraction of the schedule."""
    u = sample_timesteps(n, method, 1.0, generator)
    return quantile_to_discrete(lo + (hi - lo) * u, num_steps)


def _ddpm_scales(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor, like: torch.Tensor):
    a = alphas_cumprod[timesteps.long()].view(-1, *([1] * (like.dim() - 1)))
    return a.sqrt().to(like.dtype), (1 - a).sqrt().to(like.dtype)


def epsilon_prediction(latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
                       alphas_cumprod: torch.Tensor) -> Noised:
    """DDPM noising at discrete `timesteps`; the added noise is the target."""
    signal, sigma = _ddpm_scales(alphas_cumprod, timesteps, latents)
    return Noised(noisy=signal * latents + sigma * noise, timesteps=timesteps, target=noise)


def v_prediction(latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
                 alphas_cumprod: torch.Tensor) -> Noised:
    """DDPM noising at discrete `timesteps`; the velocity sqrt(a) noise - sqrt(1-a) x_0 is the target."""
    signal, sigma = _ddpm_scales(alphas_cumprod, timesteps, latents)
    return Noised(noisy=signal * latents + sigma * noise, timesteps=timesteps,
                  target=signal * noise - sigma * latents)


DDPM_OBJECTIVES = {"epsilon": epsilon_prediction, "v": v_prediction}


def min_snr_weights(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor, gamma: float,
                    objective: str) -> torch.Tensor:
    """Min-SNR-gamma loss weights (Hang et al. 2023) per sample at discrete DDPM `timesteps`: min(SNR, gamma)
    divided by SNR for epsilon prediction, by SNR + 1 for v prediction, with SNR = a / (1 - a). Noisy timesteps
    keep weight 1; nearly clean ones, whose easy loss would otherwise dominate, are weighted down."""
    a = alphas_cumprod[timesteps.long()]
    snr = a / (1 - a)
    clipped = torch.clamp(snr, max=gamma)
    return (clipped / (snr + 1) if objective == "v" else clipped / snr).float()


def offset_noise(noise: torch.Tensor, offset: float, generator: torch.Generator) -> torch.Tensor:
    """`noise` plus `offset` times one normal draw per sample and channel, constant over the spatial (and frame)
    axes: lets a model learn to change an image's overall brightness, which pure per-pixel noise hides."""
    shape = noise.shape[:2] + (1,) * (noise.dim() - 2)
    return noise + offset * torch.randn(shape, generator=generator, dtype=noise.dtype)


def mse_loss(prediction: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error in float32, whatever the compute dtype; with per-sample `weights` (B,), the mean of
    each sample's error times its weight."""
    if weights is None:
        return torch.nn.functional.mse_loss(prediction.float(), target.float())
    per_sample = (prediction.float() - target.float()).square().flatten(1).mean(1)
    return (per_sample * weights.float()).mean()


LOSSES = ("mse", "huber", "pseudo_huber")


def elementwise_loss(prediction: torch.Tensor, target: torch.Tensor, kind: str, huber_c: float) -> torch.Tensor:
    """The error of each element in float32 by `kind` ('mse' | 'huber' | 'pseudo_huber'). Both Huber losses are
    scaled to equal the squared error for errors well below `huber_c` (so a learning rate tuned on MSE carries
    over) and grow linearly, with slope 2 huber_c, past it: huber is 2 x torch's huber_loss(delta=huber_c), and
    pseudo_huber its smooth form 2 c (sqrt(d^2 + c^2) - c)."""
    error = prediction.float() - target.float()
    if kind == "mse":
        return error.square()
    if kind == "huber":
        return 2 * torch.nn.functional.huber_loss(error, torch.zeros_like(error), reduction="none", delta=huber_c)
    if kind == "pseudo_huber":
        return 2 * huber_c * ((error.square() + huber_c**2).sqrt() - huber_c)
    raise ValueError(f"train.loss: unknown loss {kind!r} (known: {', '.join(LOSSES)})")


def training_loss(prediction: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None, kind: str,
                  huber_c: float, element_weights: torch.Tensor | None = None) -> torch.Tensor:
    """The loss of a training micro-batch by `kind` (train.loss), with per-sample `weights` (B,) (min-SNR, dataset
    loss weights) as for MSE: the mean of each sample's mean error times its weight. 'mse' is `mse_loss` itself,
    bit for bit. With `element_weights` (loss masks: `masked_loss`), each sample's error is their weighted mean."""
    if element_weights is not None:
        return masked_loss(prediction, target, weights, element_weights, kind, huber_c)
    if kind == "mse":
        return mse_loss(prediction, target, weights)
    per_sample = elementwise_loss(prediction, target, kind, huber_c).flatten(1).mean(1)
    return weighted_mean(per_sample, weights)


def masked_loss(prediction: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None,
                element_weights: torch.Tensor, kind: str, huber_c: float) -> torch.Tensor:
    """The loss of a micro-batch with loss masks: each element's error (by `kind`) times its weight
    (`element_weights`, broadcast to the target: (B, 1, ..., h, w) over channels and frames), summed per sample and
    divided by that sample's weight sum: a weighted mean, so a sample counts as much as an unmasked one however
    little of it its mask keeps (a mask weighs where a sample learns, not how much). A sample whose weights are all
    0 adds 0. Then, as without masks, the mean over samples of each one's loss times its per-sample `weights`."""
    error = elementwise_loss(prediction, target, kind, huber_c)
    w = element_weights.float().expand_as(error)
    per_sample = (error * w).flatten(1).sum(1) / w.flatten(1).sum(1).clamp_min(1e-12)
    return weighted_mean(per_sample, weights)


def weighted_mean(per_sample: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """The mean over a micro-batch of each sample's loss (B,) times its per-sample `weights` (None: 1)."""
    return per_sample.mean() if weights is None else (per_sample * weights.float()).mean()


def within(outer: tuple[float, float], inner: tuple[float, float]) -> tuple[float, float]:
    """The `inner` fractions [lo, hi] of the `outer` range of the schedule: train.timestep_range inside an
    adapter's own range (all of it but for Wan 2.2's experts). Exact at inner (0, 1)."""
    if tuple(inner) == (0.0, 1.0):
        return outer
    lo, hi = outer
    return lo + (hi - lo) * inner[0], lo + (hi - lo) * inner[1]


class TrainingLoss:
    """train.loss for training micro-batches; evaluation (inside `evaluating()`) always measures MSE, so eval
    losses stay comparable across runs whatever loss each one trained with."""

    def __init__(self, kind: str = "mse", huber_c: float = 0.1) -> None:
        self.kind, self.huber_c, self._evaluating = kind, huber_c, False

    def __call__(self, prediction: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None,
                 element_weights: torch.Tensor | None = None) -> torch.Tensor:
        if self._evaluating:
            return mse_loss(prediction, target, weights)
        return training_loss(prediction, target, weights, self.kind, self.huber_c, element_weights)

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        self._evaluating = True
        try:
            yield
        finally:
            self._evaluating = False
