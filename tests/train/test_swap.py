"""Block swapping changes where frozen weights wait, not what is computed."""

import ast
import dataclasses
import subprocess
import sys

import pytest
import torch
from torch import nn

from diffusion_pipe.models.flux import FluxAdapter
from diffusion_pipe.train.build import build_local_model
from diffusion_pipe.train.swap import SwappedLayer, apply_block_swap
from tests.conftest import REPO


def test_swapped_layers_give_same_outputs_and_grads(tiny_flux_dir):
    adapter = FluxAdapter(tiny_flux_dir, torch.float32)
    local = build_local_model(adapter, 1, 0, targets=adapter.default_lora_targets, rank=4, alpha=4.0,
                              dropout=0.0, seed=0)
    for name, p in local.denoiser.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    latents = torch.randn(1, 4, 8, 8)
    inputs = adapter.model_inputs(latents, torch.tensor([0.4]), {"t5": torch.randn(1, 6, 32),
                                                                "clip_pooled": torch.randn(1, 32)}, 1.0)

    def run(layers):
        x = inputs
        for layer in layers:
            x = layer(x)
        x.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in local.denoiser.named_parameters() if p.grad is not None}
        local.denoiser.zero_grad(set_to_none=True)
        return x.detach(), grads

    plain_out, plain_grads = run(local.layers)
    swapped = apply_block_swap(local.layers, (local.start, local.stop), 3, torch.device("cpu"))
    assert sum(isinstance(layer, SwappedLayer) for layer in swapped) == 3
    assert not isinstance(swapped[0], SwappedLayer) and not isinstance(swapped[-1], SwappedLayer)
    # between uses, a swapped layer's frozen weights are placeholders
    assert all(p.numel() == 0 for p in swapped[1].layer.parameters() if not p.requires_grad)
    out, grads = run(swapped)
    assert torch.allclose(out, plain_out, atol=1e-6)
    assert grads.keys() == plain_grads.keys() and len(grads) > 0
    for name in grads:
        assert torch.allclose(grads[name], plain_grads[name], atol=1e-6), name


class Frozen(nn.Module):
    """A block whose weight is frozen (so it swaps) and whose scale trains; each forward logs (block, pass, the
    block whose copy is under way or None)."""

    def __init__(self, index: int, log: list) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4).requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(4))
        self.index, self.log, self.queue = index, log, None

    def forward(self, inputs):
        x, label = inputs
        ahead = self.queue.ahead.layer.layer.index if self.queue and self.queue.ahead else None
        self.log.append((self.index, "backward" if torch._C._current_graph_task_id() != -1 else "forward", ahead))
        return torch.tanh(self.linear(x)) * self.scale, label


# Six Frozen blocks, blocks 1-3 swapped, in a PipelineModule built as the train stage builds it (a world of one
# on gloo), one forward and backward; prints the log and the blocks whose weights loaded, in order.
# argv: checkpointing share (0: off), prefetch (0/1).
_PIPELINE_SCRIPT = """
import sys, torch
from diffusion_pipe.train.pipeline import build_pipeline_module, init_distributed
from diffusion_pipe.train.swap import SwappedLayer, apply_block_swap
from tests.train.test_swap import Frozen
init_distributed("cpu")
log = []
torch.manual_seed(0)
layers = apply_block_swap([Frozen(i, log) for i in range(6)], (0, 6), 3, torch.device("cpu"),
                          prefetch=sys.argv[2] == "1")
loads = []
for layer in layers:
    if isinstance(layer, SwappedLayer):
        layer.layer.queue = queue = layer.queue
weights = queue.weights
queue.weights = lambda layer, *args: loads.append(layer.layer.index) or weights(layer, *args)
share = float(sys.argv[1])
module = build_pipeline_module(layers, 1, None, share > 0, 0, (0, 6), checkpointing_share=share or 1.0)
module._precompute_checkpointable_values()  # what the pipeline engine does at its start
module((torch.randn(2, 4), torch.ones(2)))[0].sum().backward()
print(log, loads)
"""


def _pipeline_log(share: float, prefetch: bool) -> tuple[list[tuple], list[int]]:
    out = subprocess.run([sys.executable, "-c", _PIPELINE_SCRIPT, str(share), str(int(prefetch))], cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=True)
    return ast.literal_eval(out.stdout.strip().splitlines()[-1].replace("] [", "], ["))


@pytest.mark.parametrize("share, recomputed", [(1.0, {0, 1, 2, 3, 4, 5}), (0.5, {1, 3, 5}), (0, set())])
def test_a_swapped_block_loads_twice_a_step_whoever_checkpoints_it(share, recomputed):
    """Forward, and once again for the recomputation in backward, whether the pipeline recomputes the block
    (every layer, or a share that picks it) or the block checkpoints itself."""
    log, loads = _pipeline_log(share, prefetch=True)
    runs = {i: sum(entry[0] == i for entry in log) for i in range(6)}
    assert runs == {i: 2 if i in {1, 2, 3} | recomputed else 1 for i in range(6)}
    assert loads == [1, 2, 3, 3, 2, 1]


@pytest.mark.parametrize("share", [1.0, 0])
def test_the_next_swapped_block_copies_while_one_computes(share):
    """While a swapped block computes, the copy under way is the next one's: the block after it in forward, the
    block before it while backward recomputes; none past either end, and none with `swap_prefetch: false`."""
    swapped = [entry for entry in _pipeline_log(share, prefetch=True)[0] if entry[0] in {1, 2, 3}]
    assert swapped == [(1, "forward", 2), (2, "forward", 3), (3, "forward", None),
                       (3, "backward", 2), (2, "backward", 1), (1, "backward", None)]
    assert {entry[2] for entry in _pipeline_log(share, prefetch=False)[0]} == {None}


def test_copying_ahead_is_not_part_of_the_run():
    """`swap_prefetch` changes when weights copy, not what is trained: switching it continues the run."""
    from diffusion_pipe.params import TrainParams, load_params
    from diffusion_pipe.train.loop import run_identity

    model = load_params(REPO / "params.yaml").model

    def identity(train: TrainParams) -> dict:
        return run_identity(model, train, REPO / "params.yaml", 32, 1)

    train = TrainParams(blocks_to_swap=2)
    assert identity(dataclasses.replace(train, swap_prefetch=False)) == identity(train)
    assert identity(dataclasses.replace(train, blocks_to_swap=3)) != identity(train)
