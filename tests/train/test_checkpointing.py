"""Activation checkpointing, whole or a share of each stage's layers: recomputation changes no loss, and a share
recomputes exactly the layers it picks."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from diffusion_pipe.config import ConfigError, from_dict
from diffusion_pipe.params import TrainParams
from diffusion_pipe.train.pipeline import recompute_in_backward, recomputed_layers
from tests.conftest import REPO
from tests.train.test_options import _encoded_repo, _train

# A PipelineModule over six counting layers, built as the train stage builds it (a world of one on gloo), one
# forward and backward; prints how often each layer's forward ran.
_MODULE_SCRIPT = """
import sys, torch
from diffusion_pipe.train.pipeline import build_pipeline_module, init_distributed
from tests.train.test_checkpointing import Counting
init_distributed("cpu")
layers = [Counting() for _ in range(6)]
module = build_pipeline_module(layers, 1, None, True, 0, (0, 6), checkpointing_share=float(sys.argv[1]))
module._precompute_checkpointable_values()  # what the pipeline engine does at its start
x = (torch.randn(2, 4, requires_grad=True), torch.ones(2))
module(x)[0].sum().backward()
print([layer.calls for layer in layers])
"""


def test_a_share_picks_layers_spread_over_the_stage():
    assert recomputed_layers(0, 10, 1.0) == list(range(10))
    assert recomputed_layers(0, 10, 0.5) == [1, 3, 5, 7, 9]
    assert recomputed_layers(4, 8, 0.5) == [5, 7]  # a later stage's own layers
    assert len(recomputed_layers(0, 57, 0.7)) == 40
    assert recomputed_layers(0, 3, 0.1) == []


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.calls = nn.Linear(4, 4), 0

    def forward(self, inputs):
        self.calls += 1
        x, label = inputs
        return torch.tanh(self.linear(x)), label


def test_a_recomputed_layer_runs_again_in_backward_only_when_training():
    plain, recomputed = Counting(), Counting()
    recomputed.load_state_dict(plain.state_dict())
    recompute_in_backward(recomputed)
    x = torch.randn(3, 4, requires_grad=True)
    for layer in (plain, recomputed):
        layer(layer((x, torch.ones(3))))[0].sum().backward()
    assert (plain.calls, recomputed.calls) == (2, 4)  # forward twice, and each recomputed in backward
    torch.testing.assert_close(plain.linear.weight.grad, recomputed.linear.weight.grad)
    assert [n for n, _ in recomputed.named_parameters()] == ["linear.weight", "linear.bias"]  # names kept
    with torch.no_grad():
        recomputed((x, torch.ones(3)))
    assert recomputed.calls == 5


@pytest.mark.parametrize("share, calls", [(1.0, [2] * 6), (0.5, [1, 2, 1, 2, 1, 2])])
def test_the_pipeline_module_recomputes_the_layers_of_the_share(share, calls):
    out = subprocess.run([sys.executable, "-c", _MODULE_SCRIPT, str(share)], cwd=REPO, capture_output=True,
                         text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == str(calls)


def test_the_share_needs_checkpointing_on():
    with pytest.raises(ConfigError, match=r"activation_checkpointing_share is 0.5, but activation_checkpointing is "
                                          r"off"):
        from_dict(TrainParams, {"activation_checkpointing_share": 0.5}, "train")
    with pytest.raises(ConfigError, match=r"train.activation_checkpointing_share: 0 is out of range \(0, 1\]"):
        from_dict(TrainParams, {"activation_checkpointing": True, "activation_checkpointing_share": 0}, "train")


@pytest.mark.slow  # three short train runs of the bundled example: about 60 s on 2 shared cores
def test_checkpointing_whole_or_in_part_trains_the_same(tmp_path):
    repo, store = _encoded_repo(tmp_path)
    quiet = {"eval_every_steps: 40": "eval_every_steps: 0", "steps: 120": "steps: 3"}
    _, plain = _train(repo, store, "plain", quiet)
    _, whole = _train(repo, store, "whole", {**quiet, "pipeline_stages: 1": "pipeline_stages: 1\n  "
                                             "activation_checkpointing: true"})
    _, part = _train(repo, store, "part", {**quiet, "pipeline_stages: 1": "pipeline_stages: 1\n  "
                                           "activation_checkpointing: true\n  activation_checkpointing_share: 0.5"})
    assert len(plain) == 3
    assert whole == pytest.approx(plain, rel=1e-6) and part == pytest.approx(plain, rel=1e-6)
