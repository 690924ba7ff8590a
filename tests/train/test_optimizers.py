"""`train.optimizer`: each choice is its library's optimizer stepping our fp32 masters (clipping, loss scaling);
its args are typed and checked at load; its state goes through our checkpoint format exactly; a schedule-free
optimizer's eval weights are the ones evaluated, sampled and exported, without changing what trains; and each one
trains the tiny example, resumed exactly, its choice in the run identity and the lineage."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import types
from pathlib import Path
from typing import get_args

import pytest
import torch

from diffusion_pipe.config import ConfigError, from_dict
from diffusion_pipe.params import OPTIMIZER_ARGS, MuonArgs, Optimizer, ProdigyArgs, TrainParams
from diffusion_pipe.train.checkpoint import CheckpointError, Checkpoints
from diffusion_pipe.train.optim import (OPTIMIZERS, LossScaler, MasterWeightAdamW, build_optimizer,
                                        check_optimizer_available, master_weight_class)
from tests.conftest import encoded_example, resumed_without, run_checked, run_env, trained_run

CPU = torch.device("cpu")
# what runs here: bitsandbytes' adamw8bit needs a CUDA GPU
ON_CPU = ["adamw", "prodigy", "schedulefree_adamw", "adafactor", "muon"]


def _train(name: str, **more) -> TrainParams:
    # no clipping: the comparisons below are with the library optimizer alone
    return TrainParams(optimizer=name, max_grad_norm=0.0, learning_rate=1.0 if name == "prodigy" else 1e-2, **more)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).bfloat16()) for shape in ((6, 4), (4, 6), (3, 5))]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=g).bfloat16() for shape in ((6, 4), (4, 6), (3, 5))]


def _step(opt, params, step: int) -> None:
    for p, grad in zip(params, _grads(step)):
        p.grad = grad.clone()
    opt.step()
    opt.zero_grad()


def test_every_choice_has_a_builder_and_typed_args():
    assert set(OPTIMIZERS) == set(OPTIMIZER_ARGS) == set(get_args(Optimizer))
    assert TrainParams().optimizer == "adamw"  # today's optimizer stays the default


@pytest.mark.parametrize(("data", "match"), [
    ({"optimizer": "prodigy", "optimizer_args": {"d_coeff": 2.0}},
     r"train\.optimizer_args\.d_coeff: unknown key; did you mean 'd_coef'\?"),
    ({"optimizer": "adamw", "optimizer_args": {"d_coef": 2.0}}, r"train\.optimizer_args\.d_coef: unknown key"),
    ({"optimizer": "prodigy", "optimizer_args": {"d_coef": "big"}},
     r"train\.optimizer_args\.d_coef: got 'big', expected float"),
    ({"optimizer": "muon", "optimizer_args": {"momentum": 1.5}},
     r"train\.optimizer_args\.momentum: 1\.5 is out of range \[0, 1\)"),
    ({"optimizer": "muon", "optimizer_args": {"adjust_lr_fn": "rms"}},
     r"train\.optimizer_args\.adjust_lr_fn: got 'rms', expected one of 'original' \| 'match_rms_adamw'"),
    ({"optimizer": "sgd"}, r"train\.optimizer: got 'sgd', expected one of 'adamw' \| 'adamw8bit'"),
    ({"optimizer": "schedulefree_adamw"}, r"schedulefree_adamw replaces the learning-rate schedule, and "
     r"train\.lr_scheduler is 'cosine'.*set lr_scheduler: constant and warmup_steps: 0 \(its own warmup is "
     r"train\.optimizer_args\.warmup_steps\)"),
    ({"optimizer": "schedulefree_adamw", "lr_scheduler": "constant"}, r"train\.warmup_steps 10"),
    ({"optimizer": "adafactor", "adam_betas": [0.8, 0.99]}, r"train\.adam_betas: adafactor does not use it"),
    ({"optimizer": "muon", "adam_eps": 1.0e-6}, r"train\.adam_eps: muon does not use it"),
    ({"optimizer": "muon", "adapter": "full"}, r"muon updates 2-D weight matrices only, and train\.adapter: full"),
])
def test_optimizer_params_are_checked_at_load(data, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(TrainParams, {"lr_scheduler": "cosine", "warmup_steps": 10} | data, "train")


def test_optimizer_args_load_typed_with_defaults():
    train = from_dict(TrainParams, {"optimizer": "prodigy", "learning_rate": 1.0,
                                    "optimizer_args": {"d_coef": 2, "growth_rate": 1.02}}, "train")
    assert train.optimizer_args == ProdigyArgs(d_coef=2.0, growth_rate=1.02)
    assert TrainParams(optimizer="muon").optimizer_args == MuonArgs()
    assert train.learning_rate == 1.0  # never changed for the user, whatever the optimizer
    with pytest.raises(ConfigError, match=r"holds ProdigyArgs, and train\.optimizer is 'muon', whose args are "
                                          r"MuonArgs"):
        dataclasses.replace(train, optimizer="muon")


def test_adamw8bit_where_it_cannot_run_is_a_clear_error(monkeypatch):
    train = TrainParams(optimizer="adamw8bit")
    with pytest.raises(ConfigError, match=r"train\.optimizer: adamw8bit \(bitsandbytes\) runs on CUDA GPUs only, and "
                                          r"this run is on cpu; use train\.optimizer: adamw"):
        check_optimizer_available(train, CPU)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"train\.optimizer: adamw8bit needs bitsandbytes, which is not installed.*"
                                          r"`pip install bitsandbytes`, or use train\.optimizer: adamw"):
        check_optimizer_available(train, torch.device("cuda"))
    check_optimizer_available(TrainParams(), CPU)


def test_adamw8bit_is_bitsandbytes_with_its_args(monkeypatch):
    """Where bitsandbytes is installed (a GPU host), its AdamW8bit with the run's args (a stand-in module here)."""
    fake = types.SimpleNamespace(optim=types.SimpleNamespace(AdamW8bit=object))
    monkeypatch.setitem(sys.modules, "bitsandbytes", fake)
    train = from_dict(TrainParams, {"optimizer": "adamw8bit", "optimizer_args": {"min_8bit_size": 16},
                                    "adam_betas": [0.8, 0.9], "weight_decay": 0.01}, "train")
    cls, kwargs = OPTIMIZERS["adamw8bit"].build(train, torch.device("cuda"))
    assert cls is object and kwargs == {"lr": train.learning_rate, "betas": (0.8, 0.9), "eps": train.adam_eps,
                                        "weight_decay": 0.01, "min_8bit_size": 16}


def test_muon_refuses_tensors_that_are_not_matrices():
    with pytest.raises(ConfigError, match=r"muon updates 2-D weight matrices only.*shapes \[\(3,\)\]"):
        build_optimizer([torch.nn.Parameter(torch.ones(3))], _train("muon"), CPU, LossScaler(False))



# every arg of each optimizer, off its default
CHANGED_ARGS = {
    "prodigy": {"d_coef": 0.5, "d0": 1.0e-5, "beta3": 0.9, "growth_rate": 1.02, "decouple": False,
                "use_bias_correction": True, "safeguard_warmup": True, "slice_p": 3},
    "schedulefree_adamw": {"warmup_steps": 5, "r": 0.5, "weight_lr_power": 1.0},
    "adafactor": {"scale_parameter": True, "clip_threshold": 0.5, "decay_rate": -0.5, "beta1": 0.9,
                  "eps": (1.0e-29, 1.0e-2)},
    "muon": {"momentum": 0.9, "nesterov": False, "ns_steps": 3, "eps": 1.0e-6, "adjust_lr_fn": "match_rms_adamw"},
}


@pytest.mark.parametrize("name", sorted(CHANGED_ARGS))
def test_every_arg_reaches_the_optimizer(name):
    args = OPTIMIZER_ARGS[name](**CHANGED_ARGS[name])
    assert all(getattr(args, f.name) != f.default for f in dataclasses.fields(args))
    train = dataclasses.replace(_train(name), optimizer_args=args, weight_decay=0.01)
    (group,) = build_optimizer(_params(), train, CPU, LossScaler(False)).param_groups
    assert group["lr"] == train.learning_rate and group["weight_decay"] == 0.01
    assert {k: group[k] for k in CHANGED_ARGS[name]} == CHANGED_ARGS[name]


@pytest.mark.parametrize("name", ON_CPU)
def test_the_library_optimizer_steps_fp32_masters(name):
    """bf16 parameters: the chosen library optimizer on fp32 copies of them and their gradients, bit for bit."""
    train = _train(name)
    params, ref = _params(), [torch.nn.Parameter(p.detach().float()) for p in _params()]
    opt = build_optimizer(params, train, CPU, LossScaler(False))
    cls, kwargs = OPTIMIZERS[name].build(train, CPU)
    ref_opt = cls(ref, **kwargs)
    if hasattr(ref_opt, "train"):
        ref_opt.train()
    for step in range(3):
        _step(opt, params, step)
        for r, grad in zip(ref, _grads(step)):
            r.grad = grad.float()
        ref_opt.step()
        ref_opt.zero_grad()
    assert all(torch.equal(m, r) for m, r in zip(opt.masters, ref))
    assert all(torch.equal(p, m.bfloat16()) for p, m in zip(params, opt.masters))
    assert not any(torch.equal(m, q.float()) for m, q in zip(opt.masters, _params()))  # each one moved


class _Engine(types.SimpleNamespace):
    """What Checkpoints reads of DeepSpeed's engine: one stage, one process."""


def _checkpoints(tmp_path: Path, params, opt, scheduler, device: torch.device = CPU) -> Checkpoints:
    module = torch.nn.Module()
    module.weights = torch.nn.ParameterList(params)
    grid = types.SimpleNamespace(get_stage_id=lambda: 0, get_data_parallel_rank=lambda: 0)
    engine = _Engine(grid=grid, num_stages=1, module=module, global_steps=0, global_samples=0, skipped_steps=0)
    return Checkpoints(tmp_path / "run", engine, opt, scheduler, types.SimpleNamespace(rank=0, world=1, device=device))


@pytest.mark.parametrize("name", ON_CPU)
def test_state_through_a_checkpoint_continues_exactly(tmp_path, name):
    """Saved (safetensors + JSON) after 2 steps and loaded into a fresh optimizer, whose next 2 steps are the
    unbroken optimizer's, bit for bit: every tensor and number of its state comes back as it was."""
    train = _train(name)
    params = _params()
    opt = build_optimizer(params, train, CPU, LossScaler(False))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    checkpoints = _checkpoints(tmp_path, params, opt, scheduler)
    for step in range(2):
        _step(opt, params, step)
        scheduler.step()
    checkpoints.save({"step": 2})
    fresh_params = _params(seed=1)  # other values: all of them must come from the checkpoint
    fresh = build_optimizer(fresh_params, train, CPU, LossScaler(False))
    fresh_scheduler = torch.optim.lr_scheduler.LambdaLR(fresh, lambda step: 1.0)
    _checkpoints(tmp_path, fresh_params, fresh, fresh_scheduler).load(tmp_path / "run" / "step2")
    for step in (2, 3):
        _step(opt, params, step)
        _step(fresh, fresh_params, step)
    assert all(torch.equal(a, b) for a, b in zip(opt.masters, fresh.masters))
    assert all(torch.equal(a, b) for a, b in zip(params, fresh_params))
    assert fresh.param_groups[0].keys() == opt.param_groups[0].keys()
    for key, value in opt.param_groups[0].items():
        if key != "params":
            assert fresh.param_groups[0][key] == value, key


class _NestedStateAdamW(torch.optim.AdamW):
    """torch's AdamW with each parameter's moments one level down in its state dict, as bitsandbytes' 8-bit
    optimizers keep theirs (`__bnb_optimizer_quant_state__`: {state1, qmap1, absmax1, ...})."""

    def state_dict(self):  # noqa: D102
        full = super().state_dict()
        full["state"] = {i: {"step": s["step"], "moments": {k: v for k, v in s.items() if k != "step"}}
                         for i, s in full["state"].items()}
        return full

    def load_state_dict(self, state_dict):  # noqa: D102
        state = {i: {"step": s["step"], **s["moments"]} for i, s in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": state})


def test_an_optimizer_state_nested_a_level_goes_through_a_checkpoint_exactly(tmp_path):
    """An optimizer whose per-parameter state holds a dict of tensors (bitsandbytes' adamw8bit does): each tensor
    of it is saved under `<key>[<sub key>]/<name>` and read back into the dict; the loaded optimizer then steps
    as the unbroken one, bit for bit. (It was a TypeError at the first checkpoint: a tensor in the JSON part.)"""
    cls = master_weight_class(_NestedStateAdamW)

    def build(params):
        opt = cls(params, max_grad_norm=0.0, loss_scaler=LossScaler(False), lr=1e-2)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)

    params = _params()
    opt, scheduler = build(params)
    for step in range(2):
        _step(opt, params, step)
        scheduler.step()
    _checkpoints(tmp_path, params, opt, scheduler).save({"step": 2})
    from safetensors import safe_open
    with safe_open(str(tmp_path / "run/step2/stage0.safetensors"), "pt") as f:
        assert {k.split("/")[0] for k in f.keys()} == {"master", "step", "moments[exp_avg]", "moments[exp_avg_sq]"}
    fresh_params = _params(seed=1)
    fresh, fresh_scheduler = build(fresh_params)
    _checkpoints(tmp_path, fresh_params, fresh, fresh_scheduler).load(tmp_path / "run" / "step2")
    for step in (2, 3):
        _step(opt, params, step)
        _step(fresh, fresh_params, step)
    assert all(torch.equal(a, b) for a, b in zip(opt.masters, fresh.masters))


def test_a_checkpoint_of_another_optimizer_is_refused(tmp_path):
    params = _params()
    opt = build_optimizer(params, _train("adamw"), CPU, LossScaler(False))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    _step(opt, params, 0)
    _checkpoints(tmp_path, params, opt, scheduler).save({"step": 1})
    other = build_optimizer(params, _train("adafactor"), CPU, LossScaler(False))
    with pytest.raises(CheckpointError, match=r"optimizer was torch\.optim\.adamw\.AdamW, and this run's "
                                              r"train\.optimizer is transformers\.optimization\.Adafactor"):
        _checkpoints(tmp_path, params, other, torch.optim.lr_scheduler.LambdaLR(other, lambda step: 1.0)).load(
            tmp_path / "run" / "step1")


def test_schedule_free_eval_weights_are_its_average_and_training_continues_exactly():
    """Within `eval_weights` the parameters hold schedule-free's eval-mode weights; after it, the masters are
    those it left, bit for bit, so a run that evaluates trains exactly as one that does not."""
    from schedulefree import AdamWScheduleFree

    train = dataclasses.replace(_train("schedulefree_adamw"), learning_rate=0.5)  # z far from y: the round trip rounds
    params, quiet_params = _params(), _params()
    opt = build_optimizer(params, train, CPU, LossScaler(False))
    quiet = build_optimizer(quiet_params, train, CPU, LossScaler(False))
    ref = [torch.nn.Parameter(p.detach().float()) for p in _params()]
    ref_opt = AdamWScheduleFree(ref, **OPTIMIZERS["schedulefree_adamw"].build(train, CPU)[1])
    ref_opt.train()
    for step in range(6):
        _step(opt, params, step)
        _step(quiet, quiet_params, step)
        for r, grad in zip(ref, _grads(step)):
            r.grad = grad.float()
        ref_opt.step()
    y = [r.detach().clone() for r in ref]
    ref_opt.eval()
    with opt.eval_weights():
        assert all(torch.equal(p, r.bfloat16()) for p, r in zip(params, ref))
        assert not all(torch.equal(p, q) for p, q in zip(params, quiet_params))
    assert all(torch.equal(m, q) for m, q in zip(opt.masters, quiet.masters))
    assert all(torch.equal(p, q) for p, q in zip(params, quiet_params))
    ref_opt.train()  # the library's own way back rounds: what eval_weights must not leave behind
    assert not all(torch.equal(r, before) for r, before in zip(ref, y))
    with opt.eval_weights(active=False):
        assert all(torch.equal(p, q) for p, q in zip(params, quiet_params))
    _step(opt, params, 6)
    _step(quiet, quiet_params, 6)
    assert all(torch.equal(m, q) for m, q in zip(opt.masters, quiet.masters))


def test_eval_weights_change_nothing_for_adamw():
    params = _params()
    opt = MasterWeightAdamW(params, lr=1e-2)
    _step(opt, params, 0)
    before = [p.detach().clone() for p in params]
    with opt.eval_weights():
        assert all(torch.equal(p, b) for p, b in zip(params, before))


# --- the tiny example, trained with each optimizer ----------------------------------------------------------

STEPS = 6
PARAMS = {"steps: 120": f"steps: {STEPS}", "lr_scheduler: cosine": "lr_scheduler: constant",
          "warmup_steps: 10": "warmup_steps: 0",
          "eval_every_steps: 40": "eval_every_steps: 0\n  checkpoint_every_steps: 3\n  lora_dropout: 0.1",
          "every_steps: 60": "every_steps: 3"}  # samples at steps 0, 3 and 6: eval weights mid-run
# lr: what each wants on this example (prodigy: 1.0, a multiplier of its own estimate)
RECIPES = {
    "prodigy": "learning_rate: 1.0\n  optimizer: prodigy\n  optimizer_args: {d0: 1.0e-4}",
    "schedulefree_adamw": "learning_rate: 1.0e-2\n  optimizer: schedulefree_adamw\n  optimizer_args: {warmup_steps: 2}",
    "adafactor": "learning_rate: 1.0e-2\n  optimizer: adafactor",
    "muon": "learning_rate: 2.0e-2\n  optimizer: muon",
}


def _with_recipe(params: str, name: str) -> str:
    """The bundled params with optimizer `name` and its learning rate in place of adamw's."""
    params = re.sub(r"\n  optimizer: adamw\b.*", "", params)
    assert "optimizer:" not in params
    return params.replace("learning_rate: 2.0e-3", RECIPES[name])


@pytest.fixture(scope="module")
def encoded_repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("optimizers")
    return encoded_example(root, PARAMS)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_optimizer_trains_the_example_and_resumes_exactly(encoded_repo, tmp_path, name):
    """6 steps, checkpoints at 3 and 6: the eval loss falls; the LoRA written is the weights evaluation uses; the
    same run resumed from its step-3 checkpoint ends with the same losses, evaluations and LoRA bytes; the
    optimizer and its args are in the run's identity and lineage."""
    repo, store = encoded_repo
    params = tmp_path / "params.yaml"
    params.write_text(_with_recipe((repo / "params.yaml").read_text(), name))
    runs = tmp_path / "runs"
    cmd, whole, report = trained_run(params, runs, repo, store)
    assert report["eval_loss_end"] < report["eval_loss_start"], report
    (run_dir,) = (runs / "checkpoints").iterdir()
    identity = json.loads((run_dir / "identity.json").read_text())
    assert identity["train"]["optimizer"] == name
    lineage = json.loads((run_dir / "lineage.json").read_text())
    assert lineage["params"]["train"]["optimizer"] == name
    assert lineage["params"]["train"]["optimizer_args"] == identity["train"]["optimizer_args"]
    assert dataclasses.asdict(OPTIMIZER_ARGS[name]()).keys() == identity["train"]["optimizer_args"].keys()

    assert _exported_weights_match(runs / "out/lora.safetensors", run_dir / f"step{STEPS}")

    # the run as it was when stopped after its step-3 checkpoint, run again
    assert resumed_without(run_dir / f"step{STEPS}", cmd, repo, store, whole, report)["resumed_from"] == 3



def _exported_weights_match(lora: Path, step_dir: Path) -> bool:
    """Whether each tensor of the LoRA is the eval weight of one of the checkpoint's (fp32) masters: the master
    itself, or for a schedule-free optimizer its average x (schedulefree's `eval()`: y lerped towards z), which
    a LoRA of the masters y would fail."""
    from safetensors.torch import load_file

    tensors = load_file(step_dir / "stage0.safetensors")
    masters = {key.split("/", 1)[1]: value for key, value in tensors.items() if key.startswith("master/")}
    (group,) = json.loads((step_dir / "stage0.json").read_text())["param_groups"]
    if "z/" + next(iter(masters)) in tensors:
        masters = {name: torch.lerp(y, tensors[f"z/{name}"], 1 - 1 / group["betas"][0]) for name, y in masters.items()}
        assert not any(torch.equal(y, x) for y, x in zip(tensors.values(), masters.values()))
    exported = load_file(lora)
    return len(exported) == len(masters) and all(any(torch.equal(t, m) for m in masters.values())
                                                 for t in exported.values())


# Runs the train stage with spies: which mode the optimizer is in (schedule-free's train_mode) whenever the loop
# evaluates, renders samples, gathers a LoRA to write, or saves a checkpoint. The observations go to argv[1].
SPY = """
import atexit, json, runpy, sys
from diffusion_pipe.train import loop, optim, samples, step_loras
out, sys.argv = sys.argv[1], ["stages.train", *sys.argv[2:]]
made, seen = [], []
init = optim.MasterWeights.__init__
def spy_init(self, *args, **kwargs):
    init(self, *args, **kwargs)
    made.append(self)
optim.MasterWeights.__init__ = spy_init
def spy(owner, name, what):
    real = getattr(owner, name)
    def wrapper(*args, **kwargs):
        seen.append([what, "train" if made[0].param_groups[0]["train_mode"] else "eval"])
        return real(*args, **kwargs)
    setattr(owner, name, wrapper)
spy(loop, "_mean_eval_loss", "eval")
spy(samples.TrainingSamples, "_render", "sample")
spy(step_loras, "gather_lora", "step lora")
spy(loop, "gather_lora", "lora")
spy(loop.Checkpoints, "save", "checkpoint")
atexit.register(lambda: open(out, "w").write(json.dumps(seen)))
runpy.run_module("stages.train", run_name="__main__")
"""


def test_schedule_free_evaluates_samples_and_writes_loras_at_its_eval_weights(encoded_repo, tmp_path):
    """Evaluation, samples, the LoRAs written along the way and the final LoRA use schedule-free's eval weights;
    checkpoints hold its training state (train mode), from which a resumed run continues."""
    repo, store = encoded_repo
    params = tmp_path / "params.yaml"
    params.write_text(_with_recipe((repo / "params.yaml").read_text(), "schedulefree_adamw")
                      .replace("eval_every_steps: 0", "eval_every_steps: 3\n  save_lora_every_steps: 3"))
    runs = tmp_path / "runs"
    run_checked([sys.executable, "-c", SPY, str(tmp_path / "seen.json"), "--params", str(params), "--runs", str(runs),
                 "--out", str(runs / "out"), "--report", str(runs / "report.json"), "--loss-plot",
                 str(runs / "loss.csv")], cwd=repo, env=run_env(store))
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert {what for what, _ in seen} == {"eval", "sample", "step lora", "lora", "checkpoint"}, seen
    assert all(mode == ("train" if what == "checkpoint" else "eval") for what, mode in seen), seen
