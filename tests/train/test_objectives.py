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


def test_min_snr_weights_match_the_papers_formula_through_diffusers_snr():
    from diffusers import DDPMScheduler
    from diffusers.training_utils import compute_snr

    from diffusion_pipe.train.objectives import ddpm_alphas_cumprod, min_snr_weights

    config = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}
    t = torch.tensor([0, 10, 100, 400, 999])
    snr = compute_snr(DDPMScheduler(**config), t)  # diffusers' own SNR, as its min-SNR training script uses it
    alphas = ddpm_alphas_cumprod(config)
    eps = min_snr_weights(alphas, t.float(), 5.0, "epsilon")
    v = min_snr_weights(alphas, t.float(), 5.0, "v")
    assert torch.allclose(eps, torch.clamp(snr, max=5.0) / snr, rtol=1e-3)
    assert torch.allclose(v, torch.clamp(snr, max=5.0) / (snr + 1), rtol=1e-3)
    assert eps[-1] == 1.0 and eps[0] < 0.01  # the noisiest step keeps its weight; nearly clean ones lose it


def test_offset_noise_adds_one_constant_per_sample_and_channel():
    from diffusion_pipe.train.objectives import offset_noise

    noise = torch.randn(2, 3, 4, 5, 6)
    shifted = offset_noise(noise, 0.1, torch.Generator().manual_seed(0))
    delta = shifted - noise
    assert torch.allclose(delta, delta[..., :1, :1, :1].expand_as(delta))  # constant over frames, height, width
    assert delta[:, :, 0, 0, 0].abs().min() > 0 and delta.abs().max() < 0.6
    assert len(set(delta[:, :, 0, 0, 0].flatten().tolist())) == 6  # one draw per sample and channel
    # drawn from the micro-batch's own generator: the same seed draws the same offsets, another seed others
    again = offset_noise(noise, 0.1, torch.Generator().manual_seed(0)) - noise
    other = offset_noise(noise, 0.1, torch.Generator().manual_seed(1)) - noise
    assert torch.equal(again, delta) and not torch.allclose(other, delta)


def test_weighted_mse_is_the_mean_of_weighted_per_sample_errors():
    from diffusion_pipe.train.objectives import mse_loss

    pred, target = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    per_sample = ((pred - target) ** 2).mean(dim=(1, 2, 3))
    w = torch.tensor([1.0, 0.5, 0.0])
    assert torch.allclose(mse_loss(pred, target, w), (per_sample * w).mean())
    assert torch.allclose(mse_loss(pred, target, torch.ones(3)), mse_loss(pred, target))


def test_loss_weights_multiply_min_snr_by_each_rows_dataset_weight(tmp_path):
    """MicroBatches' per-sample weights of a training batch: min-SNR times the dataset's loss_weight; None (the
    plain mean) when every weight is 1."""
    from diffusion_pipe.config import from_dict
    from diffusion_pipe.models import load_adapter
    from diffusion_pipe.params import ModelParams
    from diffusion_pipe.store import Store
    from diffusion_pipe.train.data import MicroBatches, Row, _alphas_cumprod
    from diffusion_pipe.train.objectives import min_snr_weights
    from tests.conftest import REPO

    adapter = load_adapter(from_dict(ModelParams, {"family": "sdxl", "path": str(REPO / "examples/sdxl-tiny/model")},
                                     "model"))
    rows = [Row("a", "64x64x1", 1, "la", "ta", loss_weight=2.0), Row("b", "64x64x1", 1, "lb", "tb")]

    def weights(gamma: float, rows: list[Row]):
        loader = MicroBatches(rows, Store(tmp_path), adapter, micro_batch_size=1, seed=0, dp_rank=0, dp_world=1,
                              timestep_sampling="uniform", flow_shift=1.0, guidance=1.0, min_snr_gamma=gamma)
        return loader._loss_weights([0, 1], timesteps)

    timesteps = torch.tensor([10, 900])
    snr = min_snr_weights(_alphas_cumprod(adapter), timesteps, 5.0, adapter.objective())
    assert snr[0] < 1  # a nearly clean sample: weighted down
    assert torch.allclose(weights(5.0, rows), snr * torch.tensor([2.0, 1.0]))
    assert torch.equal(weights(0.0, rows), torch.tensor([2.0, 1.0]))
    assert weights(0.0, [rows[1], rows[1]]) is None


def test_min_snr_weights_of_a_v_prediction_checkpoint_use_the_v_formula(tmp_path):
    """An SDXL checkpoint whose scheduler says v_prediction trains with min-SNR weights min(SNR, gamma) / (SNR + 1):
    the training batches' weights follow the checkpoint's objective, not epsilon's min(SNR, gamma) / SNR."""
    import json

    from diffusers import DDPMScheduler
    from diffusers.training_utils import compute_snr

    from diffusion_pipe.config import from_dict
    from diffusion_pipe.models import load_adapter
    from diffusion_pipe.params import ModelParams
    from diffusion_pipe.store import Store
    from diffusion_pipe.train.data import MicroBatches, Row
    from tests.conftest import REPO

    source = REPO / "examples/sdxl-tiny/model"
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for part in source.iterdir():
        if part.name != "scheduler":
            (model_dir / part.name).symlink_to(part)
    config = json.loads((source / "scheduler/scheduler_config.json").read_text())
    (model_dir / "scheduler").mkdir()
    (model_dir / "scheduler/scheduler_config.json").write_text(json.dumps({**config, "prediction_type": "v_prediction"}))
    adapter = load_adapter(from_dict(ModelParams, {"family": "sdxl", "path": str(model_dir)}, "model"))
    assert adapter.objective() == "v"
    loader = MicroBatches([Row("a", "64x64x1", 1, "la", "ta"), Row("b", "64x64x1", 1, "lb", "tb")], Store(tmp_path),
                          adapter, micro_batch_size=1, seed=0, dp_rank=0, dp_world=1, timestep_sampling="uniform",
                          flow_shift=1.0, guidance=1.0, min_snr_gamma=5.0)
    timesteps = torch.tensor([10, 900])
    snr = compute_snr(DDPMScheduler(**{k: config[k] for k in ("num_train_timesteps", "beta_start", "beta_end",
                                                               "beta_schedule")}), timesteps)
    assert torch.allclose(loader._loss_weights([0, 1], timesteps), torch.clamp(snr, max=5.0) / (snr + 1), rtol=1e-3)
