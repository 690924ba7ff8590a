"""Samples during training: `train.samples.prompts` rendered at step 0, every `every_steps` steps and at the end,
with the LoRA as it is then, through the family's own diffusers pipeline and scheduler.

Where they go: `runs/samples/<run id>/step<N>/<i>.png` (and `.mp4` for videos), one grid per step beside them
(`step<N>.png`, prompts left to right) and in TensorBoard (`samples`); at the end the grids are copied to the
train stage's `reports/samples/` (DVC image plots) with `progress.png`, one row per prompt across the steps. Every
grid is labelled: its prompts and its steps.

Nothing extra sits on the device during training: prompts are text-store entries (encode embeds them like
captions), and the VAE waits in CPU memory, visiting the device only while samples render. The denoiser is the
one being trained; layers under block swapping load their weights only while they compute, as in training.

With several pipeline stages, rank 0 renders and the layers of the other stages run where they live: in rank 0's
denoiser each module of another stage is replaced, for the render, by a stand-in that sends its inputs to the
rank of that stage (in rank 0's pipeline) and returns what that rank computed. Each rank keeps only its own
weights, as in training, so sampling fits wherever training fits, however the model is split; gathering the
whole denoiser on one rank would not (a model is split across stages because it does not fit on one device).
The LoRA needs no gathering either: each stage's LoRA weights are used where they are trained.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager, nullcontext
from pathlib import Path

import numpy as np
import torch
from torch import nn

from diffusion_pipe.config import ConfigError
from diffusion_pipe.fileio import write_bytes_atomic
from diffusion_pipe.models.base import Adapter
from diffusion_pipe.params import ModelParams, SampleParams
from diffusion_pipe.encode.encode import sample_text_keys
from diffusion_pipe.sample.render import (check_prompt, grid, png_bytes, poster, prompt_texts, render_prompts,
                                          write_media)
from diffusion_pipe.store import Store
from diffusion_pipe.store.pack import REPAIR_HINT
from diffusion_pipe.train.pipeline import Dist
from diffusion_pipe.train.swap import SwappedLayer


def sample_steps(samples: SampleParams, total_steps: int) -> list[int]:
    """The steps whose samples a run of `total_steps` renders: 0, every `every_steps`, and the last."""
    every = samples.every_steps
    steps = {0, total_steps} | (set(range(every, total_steps, every)) if every else set())
    return sorted(steps) if samples.prompts else []


class TrainingSamples:
    """Renders the sample prompts at the steps `sample_steps` names. Every rank calls `render` at every step;
    rank 0 renders, the ranks holding the other stages of rank 0's pipeline serve their layers meanwhile, and
    the rest return at once."""

    def __init__(self, samples: SampleParams, total_steps: int, adapter: Adapter, denoiser: nn.Module,
                 module: nn.Module, dist: Dist, owners: dict[str, int], texts: dict[str, dict], run_dir: Path,
                 publish_dir: Path | None, writer, eval_weights: Callable[[], ContextManager] = nullcontext) -> None:
        self.prompts = samples.resolved()
        self.steps = set(sample_steps(samples, total_steps))
        self.adapter, self.denoiser, self.module, self.dist = adapter, denoiser, module, dist
        self.owners = owners  # module name in the denoiser -> global rank that holds it (other stages only)
        self.texts = texts
        self.run_dir, self.publish_dir, self.writer = run_dir, publish_dir, writer
        self.eval_weights = eval_weights  # entered on every rank around a render: the weights samples show
        self.serving = dist.rank != 0 and dist.rank in set(owners.values())
        self.vae = adapter.load_vae(torch.device("cpu")) if dist.rank == 0 and self.prompts else None
        self.done: set[int] = set()
        self.seconds = 0.0  # wall time rank 0 spent rendering and writing samples

    @classmethod
    def create(cls, samples: SampleParams, total_steps: int, model: ModelParams, text_max_length: int,
               adapter: Adapter, store: Store, denoiser: nn.Module, module: nn.Module, dist: Dist,
               num_stages: int, dp_world: int, run_dir: Path, publish_dir: Path | None, writer,
               eval_weights: Callable[[], ContextManager] = nullcontext) -> TrainingSamples:
        """Check the prompts against the model and the store (before step 1), and plan who computes what.
        `eval_weights` (the optimizer's): what the parameters hold while samples render (a schedule-free
        optimizer's average)."""
        if samples.prompts and adapter.expert:
            raise ConfigError(f"train.samples.prompts: rendering needs every expert of the model, and this run "
                              f"trains only '{adapter.expert}'; leave the prompts empty for expert runs")
        texts: dict[str, dict] = {}
        for prompt in samples.resolved():
            check_prompt(adapter, prompt)
        if samples.prompts and dist.rank == 0:
            keys = sample_text_keys(adapter, model, text_max_length, prompt_texts(adapter, samples.resolved()))
            missing = sorted({t.text for t, key in keys.items() if not store.contains("text", key)})
            if missing:
                shown = ", ".join(repr(t) for t in missing[:3]) + (", ..." if len(missing) > 3 else "")
                shown += "; '' is the empty negative prompt" if "" in missing else ""
                raise ConfigError(f"train.samples.prompts: {len(missing)} prompt texts ({shown}) have no text entry "
                                  f"in the store at {store.root}; the encode stage embeds the sample prompts like "
                                  f"captions: {REPAIR_HINT}")
            texts = {text: store.get("text", key) for text, key in keys.items()}
        owners = remote_owners(adapter, denoiser, num_stages, dp_world) if num_stages > 1 else {}
        return cls(samples, total_steps, adapter, denoiser, module, dist, owners, texts, run_dir, publish_dir,
                   writer, eval_weights)

    def due(self, step: int) -> bool:
        """Whether `render(step)` renders the samples of `step`."""
        return step in self.steps and step not in self.done

    def render(self, step: int, final: bool = False) -> None:
        """Render the samples of `step` if it is one of the sample steps (at most once per step); `final` at
        the end of training also publishes the grids to the stage's output."""
        if self.due(step):
            self.done.add(step)
            with self.eval_weights():
                if self.dist.rank == 0:
                    self._render(step)
                elif self.serving:
                    _serve(self.denoiser, self.module, self.dist.device)
        if final and self.dist.rank == 0 and self.publish_dir is not None:
            self.publish_dir.mkdir(parents=True, exist_ok=True)  # the stage's output, also without prompts
            if self.prompts:
                self._publish()

    def _render(self, step: int) -> None:
        started = time.perf_counter()
        device = self.dist.device
        was_training = self.module.training
        self.denoiser.eval()  # no LoRA dropout
        forked = [device] if device.type == "cuda" else []
        try:
            # The training RNG is left as it was: a run with samples trains exactly like one without.
            with torch.random.fork_rng(devices=forked), _swapped_in(self.module), \
                    _remote_modules(self.denoiser, self.owners, device):
                self.vae.to(device)
                pipe = self.adapter.sample_pipeline(self.denoiser, self.vae)
                rendered = render_prompts(pipe, self.adapter, self.prompts, self.texts, device)
        finally:
            self.vae.to("cpu")
            self.module.train(was_training)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        step_dir = self.run_dir / f"step{step:06d}"
        for i, pixels in enumerate(rendered):
            write_media(step_dir / f"{i:02d}", pixels)
        row = grid([[poster(p) for p in rendered]], row_labels=[f"step {step}"],
                   column_labels=[p.prompt for p in self.prompts])
        write_bytes_atomic(self.run_dir / f"step{step:06d}.png", png_bytes(row))
        if self.writer is not None:
            self.writer.add_image("samples", row, step, dataformats="HWC")
        self.seconds += time.perf_counter() - started

    def _publish(self) -> None:
        """Every step's grid of this run, and one row per prompt across the steps, into `publish_dir`."""
        from PIL import Image

        steps = sorted(int(p.name[4:]) for p in self.run_dir.glob("step*") if p.is_dir() and p.name[4:].isdigit())
        for step in steps:
            write_bytes_atomic(self.publish_dir / f"step{step:06d}.png",
                               (self.run_dir / f"step{step:06d}.png").read_bytes())
        files = [[self.run_dir / f"step{step:06d}" / f"{i:02d}.png" for step in steps]
                 for i in range(len(self.prompts))]
        rows = [[np.asarray(Image.open(f).convert("RGB")) if f.is_file() else None for f in row] for row in files]
        progress = grid(rows, row_labels=[p.prompt for p in self.prompts],
                        column_labels=[f"step {step}" for step in steps])
        write_bytes_atomic(self.publish_dir / "progress.png", png_bytes(progress))


def remote_owners(adapter: Adapter, denoiser: nn.Module, num_stages: int, dp_world: int) -> dict[str, int]:
    """For rank 0's pipeline: each denoiser module that a layer of stage 1.. wraps, by name, and the global rank
    holding that stage. A layer's modules are its direct children (FluxBlock wraps a transformer block, FluxOut
    the output norm and projection); each must be a module of the denoiser, so that rank 0 can stand in for it,
    or hold parameters of the denoiser that its forward uses directly (Wan's `scale_shift_table`): those are
    named `parameter:<name>`, and rank 0 borrows their values for the render."""
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from diffusion_pipe.train.build import stage_bounds

    names = {id(m): name for name, m in denoiser.named_modules() if name}
    parameters = {id(p): name for name, p in denoiser.named_parameters()}
    layers = adapter.pipeline_layers(denoiser)
    topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=dp_world)
    owners: dict[str, int] = {}
    for stage in range(1, num_stages):
        start, stop = stage_bounds(len(layers), num_stages, stage)
        for layer in layers[start:stop]:
            for child in layer.children():
                rank = topology.get_rank(pipe=stage, data=0)
                if id(child) in names:
                    owners[names[id(child)]] = rank
                    continue
                held = [parameters[id(p)] for p in child.parameters() if id(p) in parameters]
                if not held:
                    raise TypeError(f"{type(layer).__name__}: child {type(child).__name__} is neither a module of "
                                    "the denoiser nor holds its parameters; pipeline layers must wrap the "
                                    "denoiser's own modules")
                owners |= {f"parameter:{name}": rank for name in held}
    return owners


def _tree_to(obj, device: torch.device):
    """`obj` (tensors in tuples, lists, dicts) with every tensor on `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_tree_to(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _tree_to(v, device) for k, v in obj.items()}
    return obj


class _RemoteModule(nn.Module):
    """Stands in for module `name` of another pipeline stage: its call runs on rank `owner` (see `_serve`)."""

    def __init__(self, name: str, owner: int, device: torch.device) -> None:
        super().__init__()
        self.name, self.owner, self.device = name, owner, device

    def forward(self, *args, **kwargs):
        cpu = torch.device("cpu")  # pickled CUDA tensors would land on the sender's GPU index
        torch.distributed.send_object_list([(self.name, _tree_to(args, cpu), _tree_to(kwargs, cpu))], dst=self.owner)
        reply = [None]
        torch.distributed.recv_object_list(reply, src=self.owner)
        return _tree_to(reply[0], self.device)


@contextlib.contextmanager
def _remote_modules(denoiser: nn.Module, owners: dict[str, int], device: torch.device) -> Iterator[None]:
    """Rank 0's denoiser with the other stages' modules replaced by stand-ins and their parameters that the
    forward reads directly borrowed from their ranks; afterwards the originals are back and every serving rank
    is told the render is over."""
    modules = {name: owner for name, owner in owners.items() if not name.startswith("parameter:")}
    originals = {name: denoiser.get_submodule(name) for name in modules}
    borrowed: list[tuple[nn.Module, str, nn.Parameter]] = []
    try:
        for name, owner in owners.items():
            if name in modules:
                denoiser.set_submodule(name, _RemoteModule(name, owner, device))
                continue
            path, _, leaf = name.removeprefix("parameter:").rpartition(".")
            holder = denoiser.get_submodule(path)
            borrowed.append((holder, leaf, holder._parameters[leaf]))
            value = _RemoteModule(name, owner, device)()
            holder._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        yield
    finally:
        for name, module in originals.items():
            denoiser.set_submodule(name, module)
        for holder, leaf, original in borrowed:
            holder._parameters[leaf] = original
        for owner in sorted(set(owners.values())):
            torch.distributed.send_object_list([None], dst=owner)


@torch.no_grad()
def _serve(denoiser: nn.Module, module: nn.Module, device: torch.device) -> None:
    """On a rank of another stage of rank 0's pipeline: run the module calls rank 0 sends until it says done."""
    was_training = module.training
    denoiser.eval()
    try:
        with _swapped_in(module):
            while True:
                message = [None]
                torch.distributed.recv_object_list(message, src=0)
                if message[0] is None:
                    return
                name, args, kwargs = message[0]
                if name.startswith("parameter:"):
                    out = denoiser.get_parameter(name.removeprefix("parameter:")).detach()
                else:
                    out = denoiser.get_submodule(name)(*_tree_to(args, device), **_tree_to(kwargs, device))
                torch.distributed.send_object_list([_tree_to(out, torch.device("cpu"))], dst=0)
    finally:
        module.train(was_training)


@contextlib.contextmanager
def _swapped_in(module: nn.Module) -> Iterator[None]:
    """Layers under block swapping, called from the pipeline's forward instead of their wrapper: each of their
    modules loads the layer's frozen weights for its call and drops them after, as training does."""
    handles = []
    for swapped in (m for m in module.modules() if isinstance(m, SwappedLayer)):
        for child in swapped.layer.children():
            stack = contextlib.ExitStack()
            handles.append(child.register_forward_pre_hook(
                lambda _m, _a, s=swapped, st=stack: st.enter_context(s.loaded())))
            handles.append(child.register_forward_hook(lambda _m, _a, _o, st=stack: st.close()))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
