"""DeepSpeed from the outside: process group set-up and the PipelineModule over an adapter's layers.

Adapters never import DeepSpeed; this module turns `pipeline_layers()` into a `PipelineModule` and an engine.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from diffusion_pipe.models.common import DTYPES, resolve_device
from diffusion_pipe.train.swap import SwappedLayer


@dataclass(frozen=True)
class Dist:
    """Where this process sits: global rank/world, local rank, and the device it computes on."""

    rank: int
    world: int
    local_rank: int
    device: torch.device


def process_layout(env: Mapping[str, str]) -> tuple[int, int, int]:
    """(global rank, world size, local rank) as the launcher set them in `env`; (0, 1, 0) without a launcher.

    The local rank picks this process's GPU on its node; the global rank its place in the pipeline topology. On
    one node they coincide, on several they do not, so a launcher that sets RANK but not LOCAL_RANK is refused:
    every process of a node would take GPU 0. Tasks that `srun` started without a launcher (no RANK, several
    SLURM tasks) are refused too: each would train alone, as a world of one, and write the same outputs."""
    from diffusion_pipe.config import ConfigError

    if "RANK" not in env:
        tasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or "1"
        if tasks.isdigit() and int(tasks) > 1:
            raise ConfigError(f"started as one of {tasks} Slurm tasks without RANK/WORLD_SIZE: each task would "
                              "train alone. Run one task per node that starts the node's workers: `srun "
                              "--ntasks-per-node=1 torchrun --nnodes $SLURM_NNODES --nproc-per-node GPUS "
                              "--rdzv-backend c10d --rdzv-endpoint HOST:29500 -m stages.train` (docs/multi-node.md)")
        return 0, 1, 0
    try:
        rank, world = int(env["RANK"]), int(env.get("WORLD_SIZE", ""))
        local_rank = int(env["LOCAL_RANK"]) if "LOCAL_RANK" in env else (0 if world == 1 else -1)
    except ValueError as exc:
        raise ConfigError(f"RANK, WORLD_SIZE and LOCAL_RANK must be integers ({exc}); check the launcher") from exc
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={world}; check the launcher's settings")
    if local_rank < 0:
        raise ConfigError(f"RANK={rank} of WORLD_SIZE={world} without LOCAL_RANK: every process of a node would "
                          "take its GPU 0; launch through torchrun or the DeepSpeed launcher, which set it")
    return rank, world, local_rank


def process_device(use_cuda: bool, local_rank: int, gpus: int) -> torch.device:
    """The device of the process with `local_rank` on a node with `gpus` GPUs: GPU `local_rank` (never the
    global rank, which exceeds a node's GPU count on every node but the first), or the CPU."""
    if not use_cuda:
        return torch.device("cpu")
    if local_rank >= gpus:
        from diffusion_pipe.config import ConfigError

        raise ConfigError(f"LOCAL_RANK={local_rank}, but this node has {gpus} GPU(s): launch at most {gpus} "
                          "processes per node (--nproc-per-node, or the slots of this host in the hostfile)")
    return torch.device("cuda", local_rank)


def process_placement(env: Mapping[str, str], use_cuda: bool, gpus: int) -> tuple[int, int, int, torch.device]:
    """(global rank, world size, local rank, device) of this process, from the launcher's `env`."""
    rank, world, local_rank = process_layout(env)
    return rank, world, local_rank, process_device(use_cuda, local_rank, gpus)


def use_attention_kernel() -> None:
    """The SDPA kernels torch may pick for the rest of the process, in the order it tries them: torch's flash
    attention, then memory-efficient, then math. cuDNN's is off: its backward gave gradients a relative 5.9 away
    from flash's on an H100 and hit an illegal memory access on an H200 (torch 2.11; BENCHMARKS.md), and a kernel
    torch may pick must never train on wrong gradients (`bench/bench_attention.py --flux-blocks` re-measures it)."""
    from torch.nn.attention import SDPBackend, _sdpa_kernel

    _sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
                 set_priority=True)  # what `sdpa_kernel` enters, kept for the process


def init_distributed(device_name: str) -> Dist:
    """Join (or, without a launcher, create) the process group: NCCL on GPUs, gloo on CPU. On GPUs, set the
    attention kernels torch may pick (`use_attention_kernel`)."""
    use_cuda = resolve_device(device_name, "train.device").type == "cuda"
    if not use_cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    backend = "nccl" if use_cuda else "gloo"
    rank, world, local_rank, device = process_placement(os.environ, use_cuda,
                                                        torch.cuda.device_count() if use_cuda else 0)
    if use_cuda:
        torch.cuda.set_device(device)
        use_attention_kernel()
        # The fp32 LoRA matmuls may use TF32 tensor cores; the frozen base runs in its own dtype.
        torch.backends.cuda.matmul.allow_tf32 = True
    if "RANK" not in os.environ and not torch.distributed.is_initialized():
        # A plain `python -m stages.train`: a world of one, over an in-process store. No TCP port is picked, so
        # none can be taken by another job between picking and binding it.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)

    if not use_cuda:
        # DeepSpeed builds a C++ shared-memory op on CPU at init (about a minute on a fresh machine); gloo does
        # not need it. The module name clashes with torch, hence importlib.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    return Dist(rank=rank, world=world, local_rank=local_rank, device=device)


def check_dtype_supported(dtype: str) -> None:
    """Stop with an error naming `model.dtype` when DeepSpeed's accelerator cannot reduce gradients of that dtype
    (its CPU backend has float16 only on processors with AVX512-FP16/AMX-FP16: elsewhere a float16 run would fail
    at its first step with an AssertionError inside DeepSpeed)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    supported = accelerator.supported_dtypes()
    if DTYPES[dtype] not in supported:
        from diffusion_pipe.config import ConfigError

        names = ", ".join(str(d).removeprefix("torch.") for d in supported)
        raise ConfigError(f"model.dtype: {dtype} training is not supported on this {accelerator.device_name()} "
                          f"(DeepSpeed's {accelerator.device_name()} backend reduces {names} gradients only); "
                          "set model.dtype to bfloat16 or float32, or train on a GPU")


def pipeline_stage(rank: int, num_stages: int, dp_world: int) -> int:
    """The pipeline stage of global `rank`, from the same topology DeepSpeed's PipelineModule builds."""
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    return PipeDataParallelTopology(num_pp=num_stages, num_dp=dp_world).get_coord(rank).pipe


def ensure_grad(x: torch.Tensor) -> torch.Tensor:
    """A float tensor sent between pipeline stages must require grad; one computed only from frozen weights
    (time embedding, rotary tables) is detached and marked, which changes no gradient that exists."""
    if x.is_floating_point() and not x.requires_grad:
        return x.detach().requires_grad_()
    return x


class StageBoundary(nn.Module):
    """Wraps the last layer of a stage that sends to another: every float tensor it sends must require grad
    (DeepSpeed returns their gradients), including ones computed only from frozen weights such as the time
    embedding or rotary tables. Inside a stage nothing is marked, so autograd tracks no needless gradients."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, inputs):
        out = self.layer(inputs)
        return tuple(ensure_grad(x) for x in out) if isinstance(out, tuple) else ensure_grad(out)


def recomputed_layers(start: int, stop: int, share: float) -> list[int]:
    """The layers of [start, stop) that recompute their activations in backward: round(share x their count),
    spread evenly over the range (so what is kept is spread too)."""
    count = stop - start
    chosen = round(share * count)
    return [start + i for i in range(count) if (i + 1) * chosen // count > i * chosen // count]


_ATTENTION_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                  "_flash_attention_forward", "_efficient_attention_forward")
_PRODUCT_OPS = {"mm": 0, "bmm": 0, "_scaled_mm": 0, "addmm": 1, "baddbmm": 1}  # name -> index of the left operand


def _keeps(keep: str) -> Callable[..., bool]:
    """Whether a selective checkpoint keeps an op's output (given the op and its arguments): attention's always
    (every kernel torch may pick); with 'narrow' also every matrix product whose output is no wider than its left
    operand (q/k/v and output projections, an MLP's down projection), so only the widening products (an MLP's
    up projection, whose outputs take the most memory) and the cheap ops between run again. (Keeping every
    product was measured too: on Flux-dev it kept more than no checkpointing at all, BENCHMARKS.md.)"""
    aten = torch.ops.aten
    attention = {getattr(aten, n).default for n in _ATTENTION_OPS if hasattr(aten, n)}
    products = {getattr(aten, n).default: i for n, i in _PRODUCT_OPS.items() if hasattr(aten, n)}

    def kept(op, args) -> bool:
        if op in attention:
            return True
        if op not in products or keep == "attention":
            return False
        left, right = args[products[op]], args[products[op] + 1]
        return right.shape[-1] <= left.shape[-1]

    return kept


def checkpoint_function(keep: str = "") -> Callable:
    """torch's non-reentrant checkpoint (it takes the tuples layers pass between them): every op of the checkpointed
    function runs again in backward, or with `keep` ('attention', 'narrow') the outputs of the ops it
    names are kept (selective activation checkpointing, `_keeps`) and only the others run again."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    if not keep:
        return functools.partial(checkpoint, use_reentrant=False)
    kept = _keeps(keep)

    def policy(_ctx, op, *args, **_kwargs):
        return CheckpointPolicy.MUST_SAVE if kept(op, args) else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(checkpoint, use_reentrant=False,
                             context_fn=functools.partial(create_selective_checkpoint_contexts, policy))


def recompute_in_backward(layer: nn.Module, compile_forward: bool = False, keep: str = "") -> None:
    """Make `layer` keep none of its activations when gradients are computed (or only those `keep` names): they are
    recomputed in backward (`checkpoint_function`). Done by replacing the instance's forward, so the names of its
    parameters (checkpoints are keyed by them) do not change. With `compile_forward` the layer's own forward is
    compiled inside the checkpoint, as DeepSpeed's per-layer checkpointing wraps a compiled layer (a checkpoint
    traced by the compiler failed on the H200)."""
    checkpoint = checkpoint_function(keep)
    if isinstance(layer, SwappedLayer):  # it loads its weights in its forward: inside this checkpoint
        layer.recomputed_outside()
    forward = _compiled_forward(layer) if compile_forward else layer.forward

    def recomputed(inputs):
        return checkpoint(forward, inputs) if torch.is_grad_enabled() else forward(inputs)

    layer.forward = recomputed


def _compiled_forward(layer: nn.Module) -> Callable:
    """`layer`'s forward, compiled; a swapped layer compiles the layer it wraps and keeps its loading eager."""
    if isinstance(layer, SwappedLayer):
        layer.compile()
        return layer.forward
    return torch.compile(layer.forward)


def build_pipeline_module(layers: list[nn.Module], num_stages: int, loss_fn: Callable,
                          activation_checkpointing: bool, seed: int, local: tuple[int, int],
                          compile_layers: bool = False, checkpointing_share: float = 1.0,
                          checkpointing_keep: str = "") -> nn.Module:
    """A PipelineModule over `layers`, split evenly into `num_stages` stages; `local` is this rank's
    [start, stop) layer range (see `build.stage_bounds`). With `activation_checkpointing`, every layer of the
    stage recomputes its activations in backward (DeepSpeed's per-layer checkpointing), or only a
    `checkpointing_share` of them (`recomputed_layers`; inside a compiled layer when `compile_layers`), keeping
    what `checkpointing_keep` names (`checkpoint_function`)."""
    from deepspeed.pipe import PipelineModule

    layers = list(layers)
    start, stop = local
    every = activation_checkpointing and checkpointing_share >= 1.0  # DeepSpeed checkpoints every layer
    partial = activation_checkpointing and not every
    recomputed = set(recomputed_layers(start, stop, checkpointing_share)) if partial else set()
    for i in range(start, stop):
        if i in recomputed:
            recompute_in_backward(layers[i], compile_forward=compile_layers, keep=checkpointing_keep)
            continue
        if every and isinstance(layers[i], SwappedLayer):
            layers[i].recomputed_outside()
        if compile_layers:
            layers[i].compile()
    if stop < len(layers):
        layers[stop - 1] = StageBoundary(layers[stop - 1])

    checkpoint_kwargs = {}
    if every:
        # DeepSpeed's default (reentrant) checkpoint fails on tuple activations between stages.
        checkpoint_kwargs = {"activation_checkpoint_interval": 1,
                             "activation_checkpoint_func": checkpoint_function(checkpointing_keep)}
    module = PipelineModule(layers=layers, num_stages=num_stages, loss_fn=loss_fn, partition_method="uniform",
                            base_seed=seed, dynamic_shape=True, **checkpoint_kwargs)
    switch_modes_in_one_loop(module)
    return module


def switch_modes_in_one_loop(module: nn.Module) -> None:
    """Make `module.train(mode)` (and `eval()`) set the flag of every module it holds in one loop instead of
    nn.Module's recursion, whose Python calls are the whole cost: DeepSpeed's engine calls `train()` at the start
    of every step, while the device waits, and a LoRA-wrapped denoiser holds thousands of modules (peft adds about
    nine per adapted linear): HiDream-I1's 12,400 took 25-30 ms a step on a 2-core host, the loop about 1 ms. The
    modules are those held at the first switch (by then the layers are final); if any of them overrides `train` or
    `__setattr__`, nn.Module's recursion stays."""
    held: list[list[nn.Module] | None] = []

    def train(mode: bool = True) -> nn.Module:
        if not held:
            modules = list(module.modules())
            plain = all(type(m).train is nn.Module.train and type(m).__setattr__ is nn.Module.__setattr__
                        for m in modules)
            held.append(modules if plain else None)
        if held[0] is None:
            return nn.Module.train(module, mode)
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        for m in held[0]:
            object.__setattr__(m, "training", mode)  # where nn.Module.__setattr__ ends for a flag like this
        return module

    module.train = train


def trim_engine_step(engine, trainable: list[torch.Tensor], optimizer, dp_world: int) -> None:
    """Two chores of DeepSpeed's engine at the end of every step, done on the trainable tensors alone; the
    results are the same (tested), the host time is not (each was tens of ms a step for a large LoRA, while the
    device waits: HiDream-I1's has 2048 tensors among the 3700 parameters of 12,400 modules).

    - Gradient averaging over the data-parallel group, when that group is this process alone: DeepSpeed walks every
      parameter of the stage, copies every gradient into one flat tensor, all-reduces it over the one process and
      copies each back, tensor by tensor. What it does besides averaging over one is giving a trainable parameter
      without a gradient a zero one, which it still gets (`zero_missing_grads`).
    - Clearing gradients after the optimizer step: DeepSpeed's `zero_grad` walks every named parameter of the
      stage, frozen ones included (none has a gradient); the optimizer's clears the trainable tensors', and its
      fp32 masters' gradients, which were otherwise kept through the next forward and backward (4 bytes per
      trained parameter: 1 GB for HiDream-I1's LoRA).

    And one of the engine's at every micro-batch: with activation checkpointing it takes any checkpoint function
    but its own as reentrant, and so marks every float input of the first stage as requiring grad; ours is torch's
    non-reentrant one, which needs no such mark. Marked, the backward computed gradients of the latents, text
    embeddings and masks that nothing reads, and a family counting a float mask in integers failed."""
    engine._reentrant_activation_checkpointing = lambda: False
    if dp_world == 1:
        engine.allreduce_gradients = functools.partial(zero_missing_grads, trainable)
    engine.zero_grad = functools.partial(optimizer.zero_grad, set_to_none=True)


def zero_missing_grads(params: list[torch.Tensor], bucket_size: int | None = None) -> None:
    """A zero gradient for each of `params` that has none, as DeepSpeed's gradient reduction makes it (and so
    the optimizer steps them: weight decay, the moments); `bucket_size` is the reduction's, unused."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros(p.size(), dtype=p.dtype, device=p.device)
