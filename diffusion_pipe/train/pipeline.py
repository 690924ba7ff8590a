"""DeepSpeed from the outside: process group set-up and the PipelineModule over an adapter's layers.

Adapters never import DeepSpeed; this module turns `pipeline_layers()` into a `PipelineModule` and an engine.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from diffusion_pipe.models.common import DTYPES, resolve_device


@dataclass(frozen=True)
class Dist:
    """Where this process sits: global rank/world, local rank, and the device it computes on."""

    rank: int
    world: int
    local_rank: int
    device: torch.device


def init_distributed(device_name: str) -> Dist:
    """Join (or, without a launcher, create) the process group: NCCL on GPUs, gloo on CPU."""
    use_cuda = resolve_device(device_name, "train.device").type == "cuda"
    if not use_cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    backend = "nccl" if use_cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        # cuDNN's attention backend hit an illegal memory access in a Flux backward on the H200 (NOTES.md);
        # flash/efficient SDPA kernels remain.
        torch.backends.cuda.enable_cudnn_sdp(False)
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
    return Dist(rank=int(os.environ["RANK"]), world=int(os.environ["WORLD_SIZE"]), local_rank=local_rank,
                device=torch.device("cuda", local_rank) if use_cuda else torch.device("cpu"))


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


def build_pipeline_module(layers: list[nn.Module], num_stages: int, loss_fn: Callable,
                          activation_checkpointing: bool, seed: int, local: tuple[int, int],
                          compile_layers: bool = False) -> nn.Module:
    """A PipelineModule over `layers`, split evenly into `num_stages` stages; `local` is this rank's
    [start, stop) layer range (see `build.stage_bounds`)."""
    from deepspeed.pipe import PipelineModule

    layers = list(layers)
    start, stop = local
    if compile_layers:
        for i in range(start, stop):
            layers[i].compile()
    if stop < len(layers):
        layers[stop - 1] = StageBoundary(layers[stop - 1])

    checkpoint_kwargs = {}
    if activation_checkpointing:
        from torch.utils.checkpoint import checkpoint

        # DeepSpeed's default (reentrant) checkpoint fails on tuple activations between stages.
        checkpoint_kwargs = {
            "activation_checkpoint_interval": 1,
            "activation_checkpoint_func": lambda fn, *args: checkpoint(fn, *args, use_reentrant=False),
        }
    return PipelineModule(layers=layers, num_stages=num_stages, loss_fn=loss_fn, partition_method="uniform",
                          base_seed=seed, dynamic_shape=True, **checkpoint_kwargs)
