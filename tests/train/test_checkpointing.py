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
from diffusion_pipe.train.swap import SwapQueue, SwappedLayer
from tests.conftest import REPO
from tests.train.test_options import _encoded_repo, _train

# A PipelineModule over six counting layers, built as the train stage builds it (a world of one on gloo), one
# forward and backward; prints how often each layer's forward ran.
_MODULE_SCRIPT = """
import sys, torch
from diffusion_pipe.train.pipeline import build_pipeline_module, init_distributed
from tests.train.test_checkpointing import Counting
from torch.utils._python_dispatch import TorchDispatchMode
init_distributed("cpu")
layers = [Counting() for _ in range(6)]
keep = sys.argv[2] if len(sys.argv) > 2 else ""
module = build_pipeline_module(layers, 1, None, True, 0, (0, 6), checkpointing_share=float(sys.argv[1]),
                               checkpointing_keep=keep)
module._precompute_checkpointable_values()  # what the pipeline engine does at its start
x = (torch.randn(2, 4, requires_grad=True), torch.ones(2))
products = []
class Count(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        products.extend([func] if func.overloadpacket.__name__ == "addmm" else [])
        return func(*args, **(kwargs or {}))
with Count():
    module(x)[0].sum().backward()
print([layer.calls for layer in layers], len(products))
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


@pytest.mark.parametrize("share, keep, calls, products", [
    (1.0, "", [2] * 6, 12), (0.5, "", [1, 2, 1, 2, 1, 2], 9),
    (1.0, "narrow", [2] * 6, 6), (0.5, "narrow", [1, 2, 1, 2, 1, 2], 6)])
def test_the_pipeline_module_recomputes_the_layers_of_the_share(share, keep, calls, products):
    """Each recomputed layer's forward runs again in backward; what it keeps (`keep: narrow`: the products no wider than their input, here
    each layer's addmm, 4 -> 4 wide) does not run again, through DeepSpeed's per-layer checkpointing and a share's
    alike."""
    out = subprocess.run([sys.executable, "-c", _MODULE_SCRIPT, str(share), keep], cwd=REPO, capture_output=True,
                         text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == f"{calls} {products}"


def test_the_share_needs_checkpointing_on():
    with pytest.raises(ConfigError, match=r"activation_checkpointing_share is 0.5, but activation_checkpointing is "
                                          r"off"):
        from_dict(TrainParams, {"activation_checkpointing_share": 0.5}, "train")
    with pytest.raises(ConfigError, match=r"train.activation_checkpointing_share: 0 is out of range \(0, 1\]"):
        from_dict(TrainParams, {"activation_checkpointing": True, "activation_checkpointing_share": 0}, "train")


@pytest.mark.slow  # four short train runs of the bundled example: about 80 s on 2 shared cores
def test_checkpointing_whole_or_in_part_trains_the_same(tmp_path):
    repo, store = _encoded_repo(tmp_path)
    quiet = {"eval_every_steps: 40": "eval_every_steps: 0", "steps: 120": "steps: 3"}
    _, plain = _train(repo, store, "plain", quiet)
    _, whole = _train(repo, store, "whole", {**quiet, "pipeline_stages: 1": "pipeline_stages: 1\n  "
                                             "activation_checkpointing: true"})
    _, part = _train(repo, store, "part", {**quiet, "pipeline_stages: 1": "pipeline_stages: 1\n  "
                                           "activation_checkpointing: true\n  activation_checkpointing_share: 0.5"})
    _, kept = _train(repo, store, "kept", {**quiet, "pipeline_stages: 1": "pipeline_stages: 1\n  "
                                           "activation_checkpointing: true\n  activation_checkpointing_keep: narrow"})
    assert len(plain) == 3
    assert whole == pytest.approx(plain, rel=1e-6) and part == pytest.approx(plain, rel=1e-6)
    assert kept == pytest.approx(plain, rel=1e-6)


class Attending(nn.Module):
    """A transformer-like layer: norm, projections, attention, an MLP."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.qkv, self.out = nn.LayerNorm(8), nn.Linear(8, 24), nn.Linear(8, 8)
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, inputs):
        x, label = inputs
        q, k, v = self.qkv(self.norm(x)).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        x = x + self.out(torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        return x + self.down(torch.nn.functional.gelu(self.up(x))), label


def _op_counts(keep: str | None, swapped: bool = False) -> tuple[dict[str, int], torch.Tensor]:
    """How often each kind of op ran in one forward and backward of an `Attending` layer recomputed with `keep`
    (None: not recomputed), and the input's gradient; `swapped`: its weights frozen and swapped (block swap)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"matmul": 0, "attention": 0, "norm": 0}
    kinds = {"mm": "matmul", "addmm": "matmul", "bmm": "matmul", "native_layer_norm": "norm",
             "_scaled_dot_product_flash_attention_for_cpu": "attention"}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kind = kinds.get(func.overloadpacket.__name__)
            if kind:
                counts[kind] += 1
            return func(*args, **(kwargs or {}))

    layer = Attending()
    if swapped:
        layer = SwappedLayer(layer.requires_grad_(False), SwapQueue(torch.device("cpu")))
    if keep is not None:
        recompute_in_backward(layer, keep=keep)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with Count():
        layer((x, torch.ones(2)))[0].square().sum().backward()
    return counts, x.grad


def test_selective_checkpointing_runs_again_only_what_it_does_not_keep():
    """Recomputing with keep='narrow' runs only the widening products again (and norms and activations), not
    attention; keep='attention' every product but not attention; keep='' everything; gradients are the same."""
    plain, grad = _op_counts(None)
    full, full_grad = _op_counts("")
    attention, attention_grad = _op_counts("attention")
    narrow, narrow_grad = _op_counts("narrow")
    assert full["matmul"] > plain["matmul"] and full["attention"] > plain["attention"] and full["norm"] > plain["norm"]
    # 'narrow' runs the two widening products again (qkv 8 -> 24, up 8 -> 32), not out (8 -> 8) or down (32 -> 8)
    assert narrow["matmul"] == plain["matmul"] + 2 and narrow["attention"] == plain["attention"]
    assert narrow["norm"] > plain["norm"]
    assert attention["matmul"] == full["matmul"] and attention["attention"] == plain["attention"]
    for g in (full_grad, attention_grad, narrow_grad):
        torch.testing.assert_close(g, grad)


def test_a_swapped_layer_recomputes_as_the_pipeline_says():
    """A swapped layer (which must recompute: its weights are gone after its forward) recomputed by the pipeline
    keeps what the pipeline's `keep` says, as any layer: its own checkpoint inside would recompute everything."""
    plain, grad = _op_counts(None)
    own, own_grad = _op_counts(None, swapped=True)  # not recomputed by the pipeline: its own checkpoint, whole
    attention, attention_grad = _op_counts("attention", swapped=True)
    assert attention["attention"] == plain["attention"] < own["attention"]
    torch.testing.assert_close(attention_grad, grad)
    torch.testing.assert_close(own_grad, grad)


def test_keep_needs_checkpointing_on():
    with pytest.raises(ConfigError, match=r"activation_checkpointing_keep is 'narrow', but activation_checkpointing "
                                          r"is off"):
        from_dict(TrainParams, {"activation_checkpointing_keep": "narrow"}, "train")
    with pytest.raises(ConfigError, match=r"train.activation_checkpointing_keep"):
        from_dict(TrainParams, {"activation_checkpointing": True, "activation_checkpointing_keep": "everything"},
                  "train")
