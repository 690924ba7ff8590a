"""train.loss (mse / huber / pseudo_huber, with huber_c) and train.timestep_range (issue 36): the pure functions in
train/objectives.py and train/data.py `noise_latents`, and the params' errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diffusion_pipe.config import ConfigError
from diffusion_pipe.params import load_params
from diffusion_pipe.train.data import noise_latents
from diffusion_pipe.train.objectives import TrainingLoss, elementwise_loss, mse_loss, training_loss
from tests.conftest import make_pipeline_repo, run_stages

BASE = "model: {path: some/model}\nscan:\n  datasets: [{path: data}]\n"


def _params(tmp_path: Path, train: str):
    path = tmp_path / "params.yaml"
    path.write_text(BASE + f"train: {train}\n")
    return load_params(path).train


def _pair(seed: int = 0, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(3, 4, 5, 5, generator=g), scale * torch.randn(3, 4, 5, 5, generator=g)


def test_mse_is_todays_loss_bit_for_bit():
    prediction, target = _pair()
    weights = torch.tensor([1.0, 2.0, 0.5])
    for w in (None, weights):
        assert torch.equal(training_loss(prediction, target, w, "mse", 0.1), mse_loss(prediction, target, w))
        assert torch.equal(TrainingLoss()(prediction, target, w), mse_loss(prediction, target, w))


def test_huber_losses_are_the_squared_error_for_small_errors_and_linear_past_c():
    d = torch.tensor([1e-4, -1e-4, 0.05, 3.0, -10.0])
    zero = torch.zeros_like(d)
    c = 0.5
    huber = elementwise_loss(d, zero, "huber", c)
    pseudo = elementwise_loss(d, zero, "pseudo_huber", c)
    assert torch.allclose(huber[:3], d[:3].square())  # quadratic below c, at MSE's scale
    assert torch.allclose(huber[3:], 2 * c * (d[3:].abs() - c / 2))  # linear, slope 2c, past it
    assert torch.allclose(pseudo[:2], d[:2].square(), rtol=1e-3)
    assert torch.allclose(pseudo, 2 * c * ((d.square() + c * c).sqrt() - c))
    assert (pseudo[3:] < d[3:].square() / 2).all()  # large errors count far less than under MSE


def test_huber_losses_take_the_per_sample_weights_as_mse_does():
    prediction, target = _pair(scale=3.0)
    weights = torch.tensor([1.0, 2.0, 0.0])
    for kind in ("huber", "pseudo_huber"):
        per_sample = elementwise_loss(prediction, target, kind, 0.1).flatten(1).mean(1)
        assert torch.allclose(training_loss(prediction, target, weights, kind, 0.1), (per_sample * weights).mean())
        assert torch.allclose(training_loss(prediction, target, None, kind, 0.1), per_sample.mean())
        assert not torch.allclose(training_loss(prediction, target, None, kind, 0.1), mse_loss(prediction, target))


def test_eval_measures_mse_whatever_the_training_loss():
    prediction, target = _pair(scale=3.0)
    loss = TrainingLoss("pseudo_huber", 0.1)
    trained = loss(prediction, target)
    with loss.evaluating():
        assert torch.equal(loss(prediction, target), mse_loss(prediction, target))
    assert torch.equal(loss(prediction, target), trained)  # back to the training loss after eval
    assert not torch.equal(trained, mse_loss(prediction, target))


def test_loss_params_and_their_errors(tmp_path):
    assert _params(tmp_path, "{}").loss == "mse"
    assert _params(tmp_path, "{loss: huber, huber_c: 0.3}").huber_c == 0.3
    with pytest.raises(ConfigError, match=r"train\.loss: got 'l1', expected one of"):
        _params(tmp_path, "{loss: l1}")
    with pytest.raises(ConfigError, match=r"huber_c"):
        _params(tmp_path, "{loss: huber, huber_c: 0}")
    with pytest.raises(ConfigError, match=r"huber_c is 0.3, but loss is 'mse'"):
        _params(tmp_path, "{huber_c: 0.3}")


class _Stub:
    """What noise_latents reads of an adapter."""

    name = "stub"

    def __init__(self, objective: str, outer=(0.0, 1.0)) -> None:
        self._objective, self._outer = objective, outer

    def objective(self) -> str:
        return self._objective

    def timestep_range(self):
        return self._outer

    def noise_schedule(self) -> dict:
        return {"num_train_timesteps": 1000}


@pytest.mark.parametrize("objective", ["flow", "epsilon", "v"])
@pytest.mark.parametrize("sampling", ["uniform", "logit_normal"])
def test_training_timesteps_stay_inside_timestep_range(objective, sampling):
    latents = torch.zeros(4000, 1, 1, 1)
    g = torch.Generator().manual_seed(0)

    def fractions(train_range, outer=(0.0, 1.0), shift=3.0):
        t = noise_latents(_Stub(objective, outer), latents, latents, None, sampling, shift, g, train_range).timesteps
        return t if objective == "flow" else t / 1000

    t = fractions((0.2, 0.4))
    assert t.min() >= 0.2 and t.max() <= 0.4 and t.max() - t.min() > 0.15  # inside, and spread over it
    t = fractions((0.5, 1.0), outer=(0.0, 0.5))  # the upper half of an expert's range (Wan 2.2)
    assert t.min() >= 0.25 and t.max() <= 0.5
    everything = fractions((0.0, 1.0))
    assert everything.min() < 0.1 and everything.max() > 0.9


def test_the_default_range_draws_todays_timesteps():
    latents = torch.zeros(64, 1, 1, 1)
    for objective in ("flow", "epsilon"):
        a = noise_latents(_Stub(objective), latents, latents, None, "logit_normal", 3.0,
                          torch.Generator().manual_seed(1)).timesteps
        b = noise_latents(_Stub(objective), latents, latents, None, "logit_normal", 3.0,
                          torch.Generator().manual_seed(1), (0.0, 1.0)).timesteps
        assert torch.equal(a, b)


def test_eval_timesteps_ignore_timestep_range():
    latents = torch.zeros(3, 1, 1, 1)
    q = torch.tensor([0.1, 0.5, 0.9])
    t = noise_latents(_Stub("flow"), latents, latents, q, "uniform", 1.0, torch.Generator(), (0.4, 0.6)).timesteps
    assert torch.allclose(t, q)


@pytest.mark.parametrize("bad", ["[0.5, 0.5]", "[0.6, 0.4]", "[-0.1, 1.0]", "[0.0, 1.5]", "[0.2]"])
def test_timestep_range_must_be_min_below_max_within_0_1(tmp_path, bad):
    with pytest.raises(ConfigError, match=r"timestep_range"):
        _params(tmp_path, f"{{timestep_range: {bad}}}")
    assert _params(tmp_path, "{timestep_range: [0.1, 0.9]}").timestep_range == (0.1, 0.9)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The bundled example scanned and encoded once, then trained 2 steps twice: with today's recipe, and with
    pseudo-Huber in the upper half of the schedule. Both train reports."""
    root = tmp_path_factory.mktemp("recipe")
    store = root / "store"
    edits = {"steps: 120": "steps: 2", "eval_every_steps: 40": "eval_every_steps: 0",
             "warmup_steps: 10": "warmup_steps: 0", "every_steps: 60": "every_steps: 0"}
    repo = make_pipeline_repo(root / "repo", store, edits, dvc=False)
    run_stages(repo, store)
    reports = {}
    params = (repo / "params.yaml").read_text()
    for name, extra in (("mse", ""), ("pseudo_huber", "  loss: pseudo_huber\n  timestep_range: [0.5, 1.0]\n")):
        (repo / "params.yaml").write_text(params.replace("train:\n", "train:\n" + extra, 1))
        run_stages(repo, store, ("train",))
        reports[name] = json.loads((repo / "reports/train.json").read_text())
    return reports


@pytest.mark.slow  # scan, encode and two 2-step trains of the example: about a minute on 2 shared cores
def test_a_huber_run_trains_on_its_loss_and_evaluates_mse(two_runs):
    mse, huber = two_runs["mse"], two_runs["pseudo_huber"]
    assert mse["run_id"] != huber["run_id"]
    # the same untrained LoRA, the same fixed eval batches: the eval loss at step 0 is MSE in both runs
    assert huber["eval_loss_start"] == mse["eval_loss_start"]
    # pseudo-Huber (c 0.1) counts errors of order 1 far below their square: the training loss says which ran
    assert huber["train_loss_first"] < 0.5 * mse["train_loss_first"]
