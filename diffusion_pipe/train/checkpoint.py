"""Training checkpoints in our own format: safetensors and JSON, written by us, read by us, never unpickled.

A run's checkpoint directory (`runs/checkpoints/<run id>/`) holds one `step<N>/` directory per checkpoint and a
`latest` file naming the newest, for people and scripts. A step directory holds:

- `stage<S>.safetensors`, written by the first data-parallel rank of pipeline stage S: for each trainable (LoRA)
  parameter of the stage, keyed by its name in the pipeline module, its fp32 master weight and the optimizer's
  tensors for it (`master/<name>`; for AdamW `exp_avg/<name>`, `exp_avg_sq/<name>`, `step/<name>`, for any
  optimizer `<its state key>/<name>`); the LoRA weights are the masters;
- `stage<S>.json`: the stage's optimizer hyperparameters (its param groups, with whatever the optimizer keeps
  there: Prodigy's step-size estimate, a schedule-free optimizer's mode), the optimizer's per-parameter numbers
  that are not tensors (`state_scalars`, e.g. Prodigy's and Adafactor's step counts), loss scaler, LR scheduler
  and engine counters;
- `stage<S>.ema.safetensors` (with `train.ema_decay` only): the stage's moving average of the masters, by
  parameter name (train/ema.py), kept out of the optimizer's state;
- `rng.safetensors`: every rank's RNG states (`rank<R>/cpu`, `rank<R>/cuda`) as uint8 tensors;
- `state.json`: the loop's state (step, sampler position, losses, gradient norms, evaluations);
- `manifest.json`, written last, once every rank has written its files: the xxh3-128 of each of them.

DeepSpeed's own checkpoints are pickles, which `torch.load(weights_only=False)` runs as code: a planted or
downloaded checkpoint directory could run anything. safetensors and JSON carry data only, and no `.pt` file is
ever opened. On resume a step directory is used only when its manifest lists every file and each one matches
its hash: a truncated, missing or bit-flipped file (an optimizer tensor loads silently otherwise, and changes
the result) makes it damaged, and the newest intact checkpoint is used instead, with a warning naming what was
wrong. A step directory without a manifest is a save that was cut short (or an older diffusion-pipe's DeepSpeed
checkpoint) and is passed over.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from diffusion_pipe.errors import UserError
from diffusion_pipe.fileio import naming_write_errors, write_bytes_atomic, write_json_atomic
from diffusion_pipe.hashing import hash_bytes, hash_file
from diffusion_pipe.tensorfile import save_deterministic
from diffusion_pipe.train.pipeline import Dist

if TYPE_CHECKING:
    from diffusion_pipe.train.ema import Ema

FORMAT = 1
MANIFEST = "manifest.json"
# The optimizer of a checkpoint from before `optimizer` was recorded in its stage files.
_ADAMW = "torch.optim.adamw.AdamW"
# How long a rank waits for another node's checkpoint files to appear on the shared filesystem before stopping.
VISIBLE_WAIT_S = 10.0


class CheckpointError(UserError):
    """No checkpoint to resume from where one was expected, or a checkpoint that does not fit this run."""


@dataclass(frozen=True)
class Found:
    """The newest intact checkpoint of a directory (None: none), and what was wrong with each newer one."""

    step: int | None
    path: Path | None
    damaged: list[tuple[str, str]]  # ("step12", "stage0.safetensors is missing"), newest first
    incomplete: list[str]  # step directories without a manifest, passed over


def step_dirs(directory: Path) -> list[tuple[int, Path]]:
    """The `step<N>` directories of a run's checkpoint directory, newest first."""
    found = [(int(p.name[4:]), p) for p in directory.glob("step*") if p.name[4:].isdigit() and p.is_dir()]
    return sorted(found, reverse=True)


def expected_files(stages: int) -> set[str]:
    """The files a checkpoint of a run with `stages` pipeline stages must list in its manifest."""
    return {"rng.safetensors", "state.json"} | {f"stage{s}.{ext}" for s in range(stages) for ext in
                                                  ("safetensors", "json")}


def optional_files(stages: int) -> set[str]:
    """The files a checkpoint's manifest may list besides `expected_files`: the EMA's (train.ema_decay)."""
    return {f"stage{s}.ema.safetensors" for s in range(stages)}


def check_step_dir(path: Path, step: int) -> str | None:
    """What is wrong with the checkpoint in `path` (None: nothing): its manifest, and every file against its hash.
    Reads files; runs no code from them."""
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"{MANIFEST} is unreadable ({exc})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("step") != step:
        return f"{MANIFEST} is not a format-{FORMAT} manifest of step {step}"
    files, stages = manifest.get("files"), manifest.get("stages")
    if not isinstance(files, dict) or not isinstance(stages, int) or stages < 1:
        return f"{MANIFEST} lacks its file list or stage count"
    if missing := sorted(expected_files(stages) - set(files)):
        return f"{MANIFEST} does not list {', '.join(missing)}"
    for name, digest in sorted(files.items()):
        if name not in expected_files(stages) | optional_files(stages):  # a manifest names only our own files, never a path elsewhere
            return f"{MANIFEST} lists an unexpected file {name!r}"
        if not (path / name).is_file():
            return f"{name} is missing"
        if hash_file(path / name) != digest:
            return f"{name} does not match its hash in {MANIFEST} (truncated, damaged or changed since written)"
    return None


def find_newest_intact(directory: Path) -> Found:
    """The newest checkpoint in `directory` whose files are all intact; the damaged and incomplete ones newer
    than it, for the warning. `latest` is not trusted: an empty or stale one changes nothing."""
    damaged, incomplete = [], []
    for step, path in step_dirs(directory):
        if not (path / MANIFEST).exists():
            incomplete.append(path.name)
            continue
        if (problem := check_step_dir(path, step)) is None:
            return Found(step, path, damaged, incomplete)
        damaged.append((path.name, problem))
    return Found(None, None, damaged, incomplete)


def choose_checkpoint(directory: Path, announce: bool, required: bool = False) -> Found:
    """The checkpoint to resume from in `directory`, announcing (on stderr) every newer one passed over. Raises a
    CheckpointError when checkpoints exist but none is intact (or, with `required`, when there is none at all):
    starting over silently would throw away a run the user may want to repair."""
    found = find_newest_intact(directory)
    if found.step is None and (found.damaged or required):
        what = "; ".join([f"{name}: {problem}" for name, problem in found.damaged]
                         + [f"{name}: no {MANIFEST}" for name in found.incomplete]) or "none there"
        raise CheckpointError(f"{directory}: no intact checkpoint to resume from ({what}). Delete the damaged "
                              f"step directories (or the whole {directory.name}) to start this run over")
    if announce:
        for name, problem in found.damaged:
            print(f"train: warning: checkpoint {directory / name} is damaged and not used: {problem}",
                  file=sys.stderr)
        for name in found.incomplete:
            print(f"train: warning: {directory / name} has no {MANIFEST} and is not used: its save was cut short, "
                  "or an older diffusion-pipe wrote it in DeepSpeed's pickle format, which is never loaded",
                  file=sys.stderr)
        if found.step is not None and (found.damaged or found.incomplete):
            print(f"train: resuming from {found.path.name}, the newest intact checkpoint", file=sys.stderr)
    return found


def agree_on_step(step: int | None, dist: Dist) -> None:
    """Every rank must resume from the same step: they differ when the checkpoint directory is not one shared
    filesystem for all nodes (each then sees only its own node's files)."""
    if dist.world == 1:
        return
    mine = torch.tensor([-1 if step is None else step] * 2, dtype=torch.int64, device=dist.device)
    mine[1] = -mine[1]
    torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
    high, low = int(mine[0]), -int(mine[1])
    if high != low:
        raise CheckpointError(f"ranks found different checkpoints to resume from (steps {low} to {high}; -1: "
                              "none): every node must see the same runs/ directory (a shared filesystem), or "
                              "pass --runs a shared path")


class Checkpoints:
    """Saves and loads this process's part of the run's checkpoints: the pipeline stage's LoRA masters and
    optimizer state (first data-parallel rank of each stage), and, on rank 0, every rank's RNG states, the loop's
    state and the manifest."""

    def __init__(self, directory: Path, engine, optimizer, scheduler, dist: Dist, ema: Ema | None = None) -> None:
        self.directory, self.engine, self.optimizer, self.scheduler, self.dist = (directory, engine, optimizer,
                                                                                  scheduler, dist)
        self.ema = ema if ema is not None and ema.enabled else None  # train.ema_decay: stage<S>.ema.safetensors
        self.stage, self.stages = engine.grid.get_stage_id(), engine.num_stages
        self.writes_stage = engine.grid.get_data_parallel_rank() == 0
        name_of = {id(p): name for name, p in engine.module.named_parameters()}
        # the optimizer's parameters in its own order; names are global layer indices, the same in every layout
        self.names = [name_of[id(p)] for p in optimizer.model_params]
        self.last_step: int | None = None  # of the checkpoint last saved or loaded

    def save(self, state: dict, keep: int = 0) -> None:
        """Write the checkpoint of `state["step"]` (every rank calls this together); with `keep`, delete all but
        the newest `keep` checkpoints afterwards."""
        step, rank = state["step"], self.dist.rank
        path = self.directory / f"step{step}"
        started = time.perf_counter()
        rng = _gather_rng(self.dist)
        if rank == 0 and (path / MANIFEST).exists():  # an older save of this step (a run resumed before it)
            (path / MANIFEST).unlink()
        written: dict[str, str] = {}
        if self.writes_stage:
            tensors, meta = self._stage_state()
            written |= _publish(path, f"stage{self.stage}.safetensors", save_deterministic(tensors))
            written |= _publish(path, f"stage{self.stage}.json", _json_bytes(meta))
            if self.ema is not None:  # a file of its own: nothing in it is optimizer state
                written |= _publish(path, f"stage{self.stage}.ema.safetensors", save_deterministic(
                    dict(zip(self.names, self.ema.state()))))
        if rank == 0:
            rng_tensors = {f"rank{r}/{kind}": t for r, states in enumerate(rng)
                           for kind, t in states.items() if t is not None}
            written |= _publish(path, "rng.safetensors", save_deterministic(rng_tensors))
            written |= _publish(path, "state.json", _json_bytes(state))
        if self.dist.world > 1:
            sizes = {name: (path / name).stat().st_size for name in written}
            parts: list = [None] * self.dist.world
            torch.distributed.all_gather_object(parts, (socket.gethostname(), written, sizes))
            written = {name: digest for _, part, _ in parts for name, digest in part.items()}
            _check_visible(path, parts, self.dist)
        if rank == 0:
            with naming_write_errors(path / MANIFEST):
                write_json_atomic(path / MANIFEST, {"format": FORMAT, "step": step, "stages": self.stages,
                                                    "world": self.dist.world, "files": written})
            with naming_write_errors(self.directory / "latest"):
                write_bytes_atomic(self.directory / "latest", f"step{step}".encode())
            if keep:
                for _, old in step_dirs(self.directory)[keep:]:
                    shutil.rmtree(old, ignore_errors=True)
            from tqdm import tqdm  # writes above the training bar

            tqdm.write(f"train: checkpoint of step {step} saved to {path} in {time.perf_counter() - started:.1f} s",
                       file=sys.stderr)
        self.last_step = step

    def load(self, path: Path) -> dict:
        """Restore this rank's LoRA weights, optimizer, scheduler, engine counters and RNG states from the
        (verified) checkpoint in `path`; return the loop's state. A checkpoint of another pipeline layout loads
        too (--force): parameters are found by name in whichever stage file holds them."""
        from safetensors import SafetensorError

        try:
            tensors, meta, rng, state = self._read(path)
        except (SafetensorError, OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            # the files match their manifest, so they were written as they are: by something other than us
            raise CheckpointError(f"{path}: not a checkpoint this version of diffusion-pipe can read ({exc}); "
                                  "resume from another one, or delete it to start over") from exc
        theirs, ours = meta.get("optimizer", _ADAMW), self.optimizer.optimizer_class
        if theirs != ours:  # another optimizer's state would be misread (--resume-from of a run with another one)
            raise CheckpointError(f"{path} is a checkpoint of a run whose optimizer was {theirs}, and this run's "
                                  f"train.optimizer is {ours}: its state does not carry over; resume from a run of "
                                  "the same train.optimizer, or start this one afresh")
        if missing := [name for name in self.names if f"master/{name}" not in tensors]:
            raise CheckpointError(f"{path} holds no weights for {len(missing)} of this run's LoRA parameters (e.g. "
                                  f"{missing[0]}): it is a checkpoint of another model or LoRA setup")
        # JSON has no tuples: every list in a param group was one (betas, Adafactor's eps, Muon's coefficients)
        groups = [{**{k: tuple(v) if isinstance(v, list) else v for k, v in group.items()},
                   "params": list(range(len(self.names)))} for group in meta["param_groups"]]
        index = {name: i for i, name in enumerate(self.names)}
        optimizer_state: dict[int, dict] = {}
        for key, value in [*tensors.items(), *meta["state_scalars"].items()]:
            kind, name = key.split("/", 1)
            if kind != "master" and name in index:
                outer, inner = _NESTED.fullmatch(kind).groups()
                slot = optimizer_state.setdefault(index[name], {})
                (slot.setdefault(outer, {}) if inner is not None else slot)[inner or outer] = value
        self.optimizer.load_state_dict({
            "state": optimizer_state,
            "param_groups": groups, "masters": [tensors[f"master/{name}"] for name in self.names],
            "loss_scaler": meta["loss_scaler"]})
        if self.ema is not None:
            self.ema.load(self._read_ema(path))
        self.scheduler.load_state_dict(meta["scheduler"])
        for key, value in meta["engine"].items():
            setattr(self.engine, key, value)
        ranks = len({key.split("/")[0] for key in rng})
        mine = f"rank{self.dist.rank % ranks}"  # another world size (--force): rank r takes r % theirs
        torch.set_rng_state(rng[f"{mine}/cpu"])
        if self.dist.device.type == "cuda" and f"{mine}/cuda" in rng:
            torch.cuda.set_rng_state(rng[f"{mine}/cuda"], self.dist.device)
        if path.parent == self.directory:  # another run's checkpoint (--resume-from) is not one of this run's
            self.last_step = state["step"]
        return state

    def _read(self, path: Path) -> tuple[dict[str, torch.Tensor], dict, dict[str, torch.Tensor], dict]:
        """Everything this rank loads from `path`, read and parsed before anything is restored: its tensors by
        key, its stage's JSON, the RNG states, the loop's state."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        stages = json.loads((path / MANIFEST).read_text(encoding="utf-8"))["stages"]
        names = set(self.names)
        tensors: dict[str, torch.Tensor] = {}
        scalars: dict[str, object] = {}
        for stage in range(stages):
            with safe_open(path / f"stage{stage}.safetensors", framework="pt") as fh:
                tensors |= {key: fh.get_tensor(key) for key in fh.keys() if key.split("/", 1)[1] in names}
            stage_meta = json.loads((path / f"stage{stage}.json").read_text(encoding="utf-8"))
            scalars |= {k: v for k, v in stage_meta.get("state_scalars", {}).items() if k.split("/", 1)[1] in names}
        meta = json.loads((path / f"stage{min(self.stage, stages - 1)}.json").read_text(encoding="utf-8"))
        meta["state_scalars"] = scalars
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
        return tensors, meta, load_file(path / "rng.safetensors"), state

    def _read_ema(self, path: Path) -> list[torch.Tensor]:
        """This rank's EMA tensors (train.ema_decay) from every stage's EMA file in `path`, in the optimizer's
        order; a CheckpointError when the checkpoint was saved without an EMA."""
        from safetensors import safe_open

        stages = json.loads((path / MANIFEST).read_text(encoding="utf-8"))["stages"]
        found: dict[str, torch.Tensor] = {}
        for stage in range(stages):
            if (path / f"stage{stage}.ema.safetensors").is_file():
                with safe_open(path / f"stage{stage}.ema.safetensors", framework="pt") as fh:
                    found |= {key: fh.get_tensor(key) for key in fh.keys() if key in self.names}
        if missing := [name for name in self.names if name not in found]:
            raise CheckpointError(f"{path} holds no EMA of {len(missing)} of this run's LoRA parameters (e.g. "
                                  f"{missing[0]}): it is a checkpoint of a run without train.ema_decay, and an "
                                  "average cannot start mid-run; resume it with train.ema_decay: 0, or start "
                                  "this run afresh")
        return [found[name] for name in self.names]

    def _stage_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """This stage's tensors (masters, the optimizer's state by parameter name) and the rest, JSON-ready."""
        full = self.optimizer.state_dict()
        tensors = {f"master/{name}": master for name, master in zip(self.names, full["masters"])}
        scalars = {}  # plain numbers stay numbers: an optimizer may compute with a step count as a Python int
        for i, name in enumerate(self.names):
            for kind, value in _flat_state(full["state"].get(i, {})):
                if torch.is_tensor(value):
                    tensors[f"{kind}/{name}"] = value
                else:
                    scalars[f"{kind}/{name}"] = value
        groups = [{k: v for k, v in group.items() if k != "params"} for group in full["param_groups"]]
        engine = {key: getattr(self.engine, key) for key in ("global_steps", "global_samples", "skipped_steps")}
        meta = {"optimizer": self.optimizer.optimizer_class, "param_groups": groups, "loss_scaler": full["loss_scaler"],
                "scheduler": self.scheduler.state_dict(), "engine": engine}
        return tensors, meta | ({"state_scalars": scalars} if scalars else {})


# A parameter's optimizer state may nest one level: bitsandbytes' 8-bit optimizers keep their quantized state (the
# uint8 moments, their absmax and quantile maps) under one key of the state, as a dict. Each value of it is saved
# as `<key>[<sub key>]/<parameter name>`, and read back into the dict.
_NESTED = re.compile(r"([^\[]*)(?:\[([^\]]*)\])?")


def _flat_state(state: dict) -> list[tuple[str, object]]:
    """(key, value) of a parameter's optimizer state, a nested dict's values as `key[sub key]`."""
    flat: list[tuple[str, object]] = []
    for kind, value in state.items():
        flat += [(f"{kind}[{sub}]", v) for sub, v in value.items()] if isinstance(value, dict) else [(kind, value)]
    return flat


def _check_visible(path: Path, parts: list[tuple[str, dict[str, str], dict[str, int]]], dist: Dist,
                   wait_s: float = VISIBLE_WAIT_S) -> None:
    """Every rank must see every file of the checkpoint in `path` (`parts`: by rank, the writer's host, files and
    sizes), since every rank reads them all on resume. We assume runs/ is one filesystem that every node shares;
    on node-local disks each node sees only its own files, and the run must stop here, before a manifest
    vouches for files that rank 0's node does not have, with the same error on every rank. A shared filesystem
    may show another node's new file a little late (NFS caches directory lookups), hence the wait."""
    deadline = time.monotonic() + wait_s
    while True:
        unseen = [(writer, host, name) for writer, (host, _, sizes) in enumerate(parts)
                  for name, size in sizes.items() if not _has_size(path / name, size)]
        if not unseen or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    anyone = torch.tensor([int(bool(unseen))], dtype=torch.int32, device=dist.device)
    torch.distributed.all_reduce(anyone, op=torch.distributed.ReduceOp.MAX)
    if not anyone.item():
        return
    reports: list = [None] * dist.world
    torch.distributed.all_gather_object(reports, (socket.gethostname(), unseen))
    lines = [f"rank {rank} on {host} does not see " + ", ".join(f"{name} (written by rank {writer} on {by})"
                                                                 for writer, by, name in missing)
             for rank, (host, missing) in enumerate(reports) if missing]
    raise CheckpointError(f"{path}: checkpoint files written on one node are not visible on another: "
                          + "; ".join(lines) + ". Every node must see the same runs/ directory (checkpoints are "
                          "read by every rank on resume): put the repository, or --runs, on a filesystem that "
                          "every node mounts (NFS, Lustre, ...); node-local disks cannot hold a multi-node run's "
                          "checkpoints")


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except FileNotFoundError:
        return False


def _publish(directory: Path, name: str, data: bytes) -> dict[str, str]:
    with naming_write_errors(directory / name):  # a full disk names the file, not a temp file's errno
        write_bytes_atomic(directory / name, data)
    return {name: hash_bytes(data)}


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode("utf-8")


def _gather_rng(dist: Dist) -> list[dict[str, torch.Tensor | None]]:
    """Every rank's RNG states (CPU, and CUDA on GPUs: LoRA dropout draws there), by global rank: a stage's
    checkpoint is written by one rank but read by all of the stage's data-parallel ranks."""
    mine = {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(dist.device) if dist.device.type == "cuda" else None}
    if dist.world == 1:
        return [mine]
    states: list = [None] * dist.world
    torch.distributed.all_gather_object(states, mine)
    return states
