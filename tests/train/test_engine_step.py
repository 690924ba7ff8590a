"""The engine's per-step chores, trimmed to the trainable tensors: the same weights as DeepSpeed's own, without its
walks over every module and parameter (host time that grows with a LoRA's module count)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from diffusion_pipe.train.pipeline import switch_modes_in_one_loop
from tests.conftest import REPO

# Three steps of a one-stage pipeline engine as the train stage builds it (a world of one on gloo) over bf16
# trainable tensors, one of which gets no gradient, with or without `trim_engine_step` (argv[1]), with or without
# activation checkpointing (argv[2]); prints the weights, how often DeepSpeed's bucketed reduction ran, whether the
# masters' gradients outlived the step, whether the module switches modes in one loop and whether the first layer
# got inputs that require grad.
_ENGINE_SCRIPT = """
import json, sys, torch
import deepspeed
from deepspeed.runtime.engine import DeepSpeedEngine
from diffusion_pipe.params import TrainParams
from diffusion_pipe.train.loop import deepspeed_config
from diffusion_pipe.train.optim import MasterWeightAdamW
from diffusion_pipe.train.pipeline import build_pipeline_module, init_distributed, trim_engine_step
from tests.train.test_engine_step import Scaling
init_distributed("cpu")
torch.manual_seed(0)
layers = [Scaling() for _ in range(3)]
checkpointed = sys.argv[2] == "checkpointed"
module = build_pipeline_module(layers, 1, lambda out, labels: (out - labels[0]).square().mean(), checkpointed, 0,
                               (0, 3))
trainable = [p for p in module.parameters() if p.requires_grad]
optimizer = MasterWeightAdamW(trainable, lr=1e-2, weight_decay=0.1, max_grad_norm=1.0)
engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=deepspeed_config(TrainParams(), 1))
if sys.argv[1] == "trimmed":
    trim_engine_step(engine, trainable, optimizer, 1)
reductions = []
fallback = DeepSpeedEngine.buffered_allreduce_fallback
DeepSpeedEngine.buffered_allreduce_fallback = lambda self, *a, **k: reductions.append(1) or fallback(self, *a, **k)
g = torch.Generator().manual_seed(1)
batches = iter([(torch.randn(2, 8, generator=g), (torch.randn(2, 8, generator=g),)) for _ in range(3)])
for _ in range(3):
    engine.train_batch(batches)
print(json.dumps({"weights": [p.float().tolist() for p in trainable], "reductions": len(reductions),
                  "master_grads_kept": any(m.grad is not None for m in optimizer.masters),
                  "one_loop_switch": "train" in vars(module), "input_grad": any(layers[0].input_grad)}))
"""


class Scaling(nn.Module):
    """A frozen linear scaled by a trainable bf16 vector, and a trainable vector the loss never reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8).requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
        self.unused = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        self.input_grad: list[bool] = []  # whether each input it got required grad

    def forward(self, x):
        self.input_grad.append(x.requires_grad)
        return self.linear(x) * self.scale.float()


def _engine_run(variant: str, checkpointing: str = "plain") -> dict:
    out = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT, variant, checkpointing], cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_trimmed_engine_steps_to_deepspeeds_weights_without_its_reduction():
    """One process: no bucketed reduction, the masters' gradients freed after the step, and the same weights as
    DeepSpeed's own chores give, the never-reached vector's included (it steps on the zero gradient DeepSpeed's
    reduction gives it: weight decay moves it)."""
    own, trimmed = _engine_run("own"), _engine_run("trimmed")
    assert own["reductions"] == 3 and trimmed["reductions"] == 0
    assert own["master_grads_kept"] and not trimmed["master_grads_kept"]
    assert own["one_loop_switch"]  # build_pipeline_module's
    assert trimmed["weights"] == own["weights"]
    assert own["weights"][1] != [1.0] * 4  # the unused vector (second parameter) moved
    assert not own["input_grad"] and not trimmed["input_grad"]


def test_checkpointed_engine_feeds_inputs_that_need_no_grad():
    """With activation checkpointing DeepSpeed marks the first stage's float inputs as requiring grad (it takes our
    non-reentrant checkpoint for a reentrant one); the trimmed engine does not, and the weights are the same: the
    gradients it spared were the inputs', which nothing reads."""
    own, trimmed = _engine_run("own", "checkpointed"), _engine_run("trimmed", "checkpointed")
    assert own["input_grad"] and not trimmed["input_grad"]
    assert trimmed["weights"] == own["weights"]


def test_mode_switch_sets_every_module_without_recursion(monkeypatch):
    """train(False), eval() and train() set every module's flag in one call (nn.Module.train runs for none of
    them) and return the module; a non-boolean mode is refused as nn.Module refuses it."""
    module = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Dropout(), nn.Sequential(nn.LayerNorm(2))))
    switch_modes_in_one_loop(module)
    calls = []
    recursion = nn.Module.train
    monkeypatch.setattr(nn.Module, "train", lambda self, mode=True: calls.append(self) or recursion(self, mode))
    assert module.train(False) is module and not any(m.training for m in module.modules())
    assert module.train() is module and all(m.training for m in module.modules())
    module.eval()
    assert not any(m.training for m in module.modules()) and not calls
    with pytest.raises(ValueError, match="boolean"):
        module.train("yes")


def test_mode_switch_keeps_the_recursion_for_a_module_with_its_own_train():
    class Frozen(nn.Linear):
        def train(self, mode: bool = True):
            return super().train(False)

    module = nn.Sequential(nn.Linear(2, 2), Frozen(2, 2))
    switch_modes_in_one_loop(module)
    module.train()
    assert module[0].training and not module[1].training
