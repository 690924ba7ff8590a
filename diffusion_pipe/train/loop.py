"""The train stage, top to bottom: set up, resume if this exact run was interrupted, train, evaluate, save.

Checkpoints live under `runs/checkpoints/<run id>/`, where the run id hashes everything that defines the run
(model, train params, encoded table, parallel layout). Re-running an interrupted stage resumes it exactly; a
changed param starts a new run beside the old one, which is never deleted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from diffusion_pipe.config import ConfigError, to_dict
from diffusion_pipe.models import load_adapter
from diffusion_pipe.fileio import (WriteError, atomic_writer, naming_write_errors, write_bytes_atomic,
                                   write_json_atomic)
from diffusion_pipe.hashing import hash_file, hash_json
from diffusion_pipe.params import AdamWArgs, EncodeParams, ModelParams, Params, TrainParams
from diffusion_pipe.store import Store
from diffusion_pipe.tensorfile import save_deterministic
from diffusion_pipe.train.data import (DataError, MicroBatches, Prefetcher, check_entries, eval_batches, read_rows,
                                       steps_for_epochs)
from diffusion_pipe.train.build import build_local_model, seed_lora_dropout
from diffusion_pipe.train.caption_dropout import CaptionDropout
from diffusion_pipe.train.checkpoint import Checkpoints, agree_on_step, choose_checkpoint, step_dirs
from diffusion_pipe.train.ema import Ema, ema_lora_path
from diffusion_pipe.train.guards import diverged, step_is_finite
from diffusion_pipe.train.lora import AdapterKind, gather_lora
from diffusion_pipe.train.objectives import TrainingLoss
from diffusion_pipe.train.optim import LossScaler, build_optimizer, check_optimizer_available
from diffusion_pipe.train.samples import TrainingSamples
from diffusion_pipe.train.step_loras import StepLoras
from diffusion_pipe.train.swap import apply_block_swap
from diffusion_pipe.train.pipeline import (Dist, build_pipeline_module, check_dtype_supported, init_distributed,
                                           pipeline_stage, trim_engine_step)


def lr_lambda(train: TrainParams):
    """Multiplier of the base learning rate at optimizer step `step`: linear warmup, then the schedule."""
    def factor(step: int) -> float:
        if step < train.warmup_steps:
            return (step + 1) / train.warmup_steps
        progress = (step - train.warmup_steps) / max(1, train.steps - train.warmup_steps)
        if train.lr_scheduler == "linear":
            return max(0.0, 1.0 - progress)
        if train.lr_scheduler == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0
    return factor


def schedule_warnings(train: TrainParams) -> list[str]:
    """Params that are valid but almost surely not what was meant, each naming the param and the fix."""
    warnings = []
    if train.warmup_steps >= train.steps:
        warnings.append(f"train.warmup_steps ({train.warmup_steps}) >= train.steps ({train.steps}): the learning "
                        "rate never leaves warmup; lower warmup_steps (about 5-10% of steps is usual)")
    if train.optimizer == "prodigy" and train.learning_rate < 0.1:
        warnings.append(f"train.learning_rate is {train.learning_rate:g} with train.optimizer: prodigy, which "
                        "estimates the step size itself: learning_rate multiplies that estimate and is usually "
                        "1.0; set learning_rate: 1.0 (lower it, or optimizer_args.d_coef, only to be more cautious)")
    return warnings


def deepspeed_config(train: TrainParams, dp_world: int) -> dict:
    """The engine's config. Base and LoRA compute in `model.dtype`; fp32 master weights live in our optimizer
    (train/optim.py), so the engine runs in fp32 mode and DeepSpeed's bf16 optimizer, which keeps its masters
    in step with per-parameter Python loops, is not used; our optimizer also clips gradients (in foreach ops)
    and scales the loss for float16. DeepSpeed's fp16 mode is not used either: its optimizer wrapper replaces
    the wrapped optimizer's parameters with its own fp32 copies, which would leave our masters without
    gradients. No "optimizer" block: a torch optimizer is passed in (DeepSpeed's FusedAdam would compile). The
    throughput timer is off: it synchronises the device before every forward pass, which stalls the data
    prefetch and the kernel queue."""
    return {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "train_batch_size": train.micro_batch_size * train.gradient_accumulation_steps * dp_world,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0},
        "wall_clock_breakdown": False,
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
    }


# Train params added after runs existed that are left out of the run identity at these (their default) values, so
# that a run from before them still resumes; any other value is another run.
RECIPE_DEFAULTS = {"optimizer": "adamw", "optimizer_args": AdamWArgs(), "loss": "mse", "huber_c": 0.1,
                   "timestep_range": (0.0, 1.0), "init_lora": "", "ema_decay": 0.0, "mask_min_weight": 0.0,
                   "lora_dora": False, "lokr_factor": -1, "lokr_decompose_both": False}


def run_identity(model: ModelParams, train: TrainParams, encoded_path: Path, text_max_length: int,
                 world: int) -> dict:
    """What defines a run; its hash names the run's checkpoint directory. How often checkpoints are written and
    how many are kept do not change what is trained, so they are left out: changing them continues the run (as do
    samples, the LoRAs written along the way, whether swapped blocks are copied ahead, and `attention`, which has
    one value left and is kept out so that runs from when it had two continue)."""
    cadence = ("checkpoint_every_steps", "checkpoint_every_minutes", "keep_checkpoints", "samples",
               "save_lora_every_steps", "swap_prefetch", "attention")
    # the optimizer, loss and schedule options, init_lora and EMA at their defaults: today's training, which every
    # run from before they existed had, and whose identity lacks the keys
    default_recipe = tuple(k for k, v in RECIPE_DEFAULTS.items() if getattr(train, k) == v)
    train_dict = {k: v for k, v in to_dict(train).items() if k not in cadence + default_recipe}
    # the start LoRA's content, not only its path, defines the run (a missing file fails before training)
    start = Path(train.init_lora)
    init_lora = {"init_lora": hash_file(start)} if train.init_lora and start.is_file() else {}
    return {"model": to_dict(model), "train": train_dict, "encoded": hash_file(encoded_path), **init_lora,
            "text_max_length": text_max_length, "layout": {"processes": world,
                                                           "pipeline_stages": train.pipeline_stages}}


def check_resumable(source: Path, identity: dict, force: bool) -> None:
    """Refuse to continue the run in `source` when its data, model or parallel layout differ from this run's
    (a UserError naming each difference), unless `force`; train params may differ (that is the point)."""
    if not step_dirs(source):
        raise DataError(f"--resume-from {source}: no checkpoint there (no step<N> directory); give a directory "
                        "under runs/checkpoints/")
    theirs = json.loads((source / "identity.json").read_text()) if (source / "identity.json").is_file() else {}
    changes = [f"{name} ({theirs.get(key)!r} -> {identity[key]!r})" if key != "encoded" else
               f"{name} (hash {theirs.get(key)} -> {identity[key]})"
               for key, name in (("encoded", "the encoded table"), ("model", "the model"),
                                 ("layout", "the parallel layout"))
               if theirs.get(key) != identity[key]]
    if changes and not force:
        raise DataError(f"--resume-from {source}: refusing to resume, since " + "; ".join(changes)
                        + " changed; pass --force to resume anyway")


def train_lora(model: ModelParams, train: TrainParams, encode: EncodeParams, encoded_path: Path, out_dir: Path,
               report_path: Path, loss_plot_path: Path, runs_root: Path, store: Store,
               lineage_params: Params | None = None, resume_from: Path | None = None,
               force: bool = False, samples_dir: Path | None = None, lora_formats: tuple[str, ...] = ()) -> dict:
    """Train a LoRA on the encoded table (with train.adapter: full, every weight of the denoiser); write
    `out_dir/lora.safetensors` (for a full fine-tune, the whole denoiser under its own names), with
    `train.ema_decay` its moving average `out_dir/lora.ema.safetensors` (train/ema.py), the report and the loss plot.
    With `lineage_params` (the whole params file), the LoRA and the final checkpoint carry a lineage record.
    An interrupted run of the same identity resumes by itself; `resume_from` continues another run's
    checkpoints, refused when its encoded table, model or parallel layout differ unless `force`.
    `train.samples` renders under `runs_root/samples/<run id>/`; every sample step's grid goes to `samples_dir`
    at the end (train/samples.py). `train.save_lora_every_steps` writes the LoRA in `lora_formats` (diffusers when
    empty) under `runs_root/loras/<run id>/` (train/step_loras.py)."""
    import deepspeed

    dist = init_distributed(train.device)
    check_dtype_supported(model.dtype)
    check_optimizer_available(train, dist.device)
    adapter = load_adapter(model)
    train_rows, eval_rows = read_rows(encoded_path, "train"), read_rows(encoded_path, "eval")
    check_entries(train_rows + eval_rows, store, adapter, encode.text_max_length)
    caption_dropout = CaptionDropout.create(train.caption_dropout, train.seed, adapter, model, encode.text_max_length,
                                            store, train_rows)

    torch.manual_seed(train.seed)
    if dist.world % train.pipeline_stages:
        raise ConfigError(f"train.pipeline_stages: {train.pipeline_stages} does not divide the {dist.world} "
                          "processes launched; launch a multiple of pipeline_stages processes")
    dp_world = dist.world // train.pipeline_stages
    if train.epochs:  # from here on, `steps` is what the epochs come to
        train = dataclasses.replace(train, steps=steps_for_epochs(train_rows, train, dp_world))
    if train.init_lora and train.adapter == "full":
        raise ConfigError("train.init_lora starts LoRA adapters, and train.adapter is full (no adapters); remove "
                          "one of them")
    stage = pipeline_stage(dist.rank, train.pipeline_stages, dp_world)
    local = build_local_model(adapter, train.pipeline_stages, stage,
                              targets=train.lora_targets or adapter.default_lora_targets, rank=train.lora_rank,
                              alpha=train.lora_alpha, dropout=train.lora_dropout, seed=train.seed,
                              base_dtype=model.base_dtype, full=train.adapter == "full",
                              init_lora=Path(train.init_lora) if train.init_lora else None,
                              kind=AdapterKind.of(train))
    denoiser, targets = local.denoiser, local.lora_targets

    scaler = LossScaler(enabled=model.dtype == "float16")
    objective_loss = TrainingLoss(train.loss, train.huber_c)  # MSE while evaluating

    def loss_fn(prediction: torch.Tensor, labels: tuple[torch.Tensor, ...]) -> torch.Tensor:
        weights = labels[1] if len(labels) > 1 else None  # min-SNR weighting
        element_weights = labels[2] if len(labels) > 2 else None  # loss masks (data.py: MicroBatches._mask_weights)
        loss = objective_loss(adapter.prediction_to_latents(prediction, labels[0]), labels[0], weights,
                              element_weights)
        return loss * scaler.scale if scaler.enabled else loss

    if dist.device.type == "cuda" and train.max_gpu_memory_gb:
        total = torch.cuda.get_device_properties(dist.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, train.max_gpu_memory_gb * 2**30 / total), dist.device)
    layers = apply_block_swap(local.layers, (local.start, local.stop), train.blocks_to_swap, dist.device,
                              prefetch=train.swap_prefetch)
    module = build_pipeline_module(layers, train.pipeline_stages, loss_fn, train.activation_checkpointing,
                                   train.seed, (local.start, local.stop), compile_layers=train.compile,
                                   checkpointing_share=train.activation_checkpointing_share,
                                   checkpointing_keep=train.activation_checkpointing_keep)
    trainable = [p for p in module.parameters() if p.requires_grad]
    optimizer = build_optimizer(trainable, train, dist.device, scaler)
    ema = Ema(train.ema_decay, optimizer)  # train.ema_decay > 0: updated after every optimizer step
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(train))
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(train, dp_world))
    trim_engine_step(engine, trainable, optimizer, dp_world)
    if train.pipeline_stages > 1:  # the gradient norm spans every stage of this process's pipeline
        optimizer.norm_group = engine.grid.get_pipe_parallel_group()
    dp_rank = engine.grid.get_data_parallel_rank()
    seed_lora_dropout(train.seed, dp_rank)  # a resumed run restores the states instead (Checkpoints.load)
    is_reporter = dist.rank == 0

    identity = run_identity(model, train, encoded_path, encode.text_max_length, dist.world)
    run_id = hash_json(identity)[:16]
    checkpoint_dir = runs_root / "checkpoints" / run_id
    state = {"step": 0, "position": 0, "losses": [], "grad_norms": [], "evals": []}
    checkpoints = Checkpoints(checkpoint_dir, engine, optimizer, scheduler, dist, ema)
    found = choose_checkpoint(checkpoint_dir, announce=is_reporter)  # the newest intact one
    if found.path is None and resume_from is not None:
        check_resumable(resume_from, identity, force)
        found = choose_checkpoint(resume_from, announce=is_reporter, required=True)
    agree_on_step(found.step, dist)
    resumed_from = found.step
    if found.path is not None:
        state = checkpoints.load(found.path)
    if dist.rank == 0:
        write_json_atomic(checkpoint_dir / "identity.json", identity)

    loader = Prefetcher(MicroBatches(
        train_rows, store, adapter, micro_batch_size=train.micro_batch_size, seed=train.seed, dp_rank=dp_rank,
        dp_world=dp_world, timestep_sampling=train.timestep_sampling, flow_shift=train.flow_shift,
        guidance=train.guidance, noise_offset=train.noise_offset, min_snr_gamma=train.min_snr_gamma,
        caption_dropout=caption_dropout, timestep_range=train.timestep_range, mask_min_weight=train.mask_min_weight),
        dist.device, position=state["position"])

    def evaluate(step: int) -> None:
        if not eval_rows or any(e["step"] == step for e in state["evals"]):
            return
        per_t = {}
        with tqdm(total=len(train.eval_timesteps) * len(eval_rows), desc=f"eval at step {step}", unit="sample",
                  file=sys.stderr, disable=not is_reporter, leave=False) as progress:
            with optimizer.eval_weights(), objective_loss.evaluating():
                for t in train.eval_timesteps:
                    batches = eval_batches(eval_rows, store, adapter, train, t)
                    per_t[f"{t:g}"] = _mean_eval_loss(engine, batches, progress) / scaler.scale
        state["evals"].append({"step": step, "loss": sum(per_t.values()) / len(per_t), "by_timestep": per_t})
        if writer:
            writer.add_scalar("eval/loss", state["evals"][-1]["loss"], step)

    last_save = time.monotonic()

    def save_checkpoint() -> None:
        nonlocal last_save
        checkpoints.save(state, keep=train.keep_checkpoints)
        last_save = time.monotonic()

    def after_step(finite: bool) -> tuple[bool, int | None, bool]:
        """(save a checkpoint now, the stop signal to exit with, the step diverged): the same answer on every
        rank, which must save together. Rank 0's clock decides the minutes; any rank's signal, or non-finite
        step, stops them all."""
        by_steps = bool(train.checkpoint_every_steps) and state["step"] % train.checkpoint_every_steps == 0
        by_time = (bool(train.checkpoint_every_minutes) and dist.rank == 0
                   and time.monotonic() - last_save >= 60 * train.checkpoint_every_minutes)
        if dist.world == 1:
            return by_steps or by_time or stops.signal is not None, stops.signal, not finite
        flags = torch.tensor([int(by_time), stops.signal or 0, int(not finite)], dtype=torch.int32,
                             device=dist.device)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        by_time, signum, bad = (int(x) for x in flags.tolist())
        return by_steps or bool(by_time) or bool(signum), signum or None, bool(bad)

    writer = None
    if is_reporter:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(runs_root / "tensorboard" / run_id))
        print(f"train: run {run_id}, {len(train_rows)} train / {len(eval_rows)} eval samples, "
              + (f"{len(targets)} {AdapterKind.of(train).label} modules, " if targets else "full fine-tune, ")
              + f"{sum(p.numel() for p in trainable)} trainable parameters on "
              f"stage 0, {train.pipeline_stages} stage(s) x {dp_world} data-parallel on {dist.device}"
              + (f"; resuming at step {resumed_from}" if resumed_from is not None else ""), file=sys.stderr)

    for warning in schedule_warnings(train) if is_reporter else ():
        print(f"train: warning: {warning}", file=sys.stderr)
    samples = TrainingSamples.create(train.samples, train.steps, model, encode.text_max_length, adapter, store,
                                     denoiser, module, dist, train.pipeline_stages, dp_world,
                                     runs_root / "samples" / run_id, samples_dir, writer, optimizer.eval_weights)
    step_loras = StepLoras(train.save_lora_every_steps, train.steps, lora_formats, adapter, denoiser, module,
                           dist.rank, train.lora_rank, train.lora_alpha, runs_root / "loras" / run_id, identity, run_id)
    samples_per_step = train.micro_batch_size * train.gradient_accumulation_steps * dp_world
    evaluate(0)
    samples.render(state["step"])
    started, first_step = time.perf_counter(), state["step"]
    bar = tqdm(total=train.steps, initial=state["step"], desc="train", unit="step", file=sys.stderr,
               disable=not is_reporter)
    step_seconds: list[float] = []
    profiler = _Profiler(os.environ.get("DIFFUSION_PIPE_PROFILE"), first_step=state["step"], engine=engine)
    stops = _StopSignals(announce=is_reporter)
    try:
        while state["step"] < train.steps:
            step_started = time.perf_counter()
            with profiler.step(state["step"]):
                scale = scaler.scale  # the step's loss was scaled by this; its optimizer step may change it
                loss = float(engine.train_batch(loader)) / scale
            step_seconds.append(time.perf_counter() - step_started)
            state["step"] += 1
            state["position"] = loader.position
            state["losses"].append(loss)
            grad_norm = engine.get_global_grad_norm()
            state["grad_norms"].append(None if grad_norm is None else float(grad_norm))
            rate = samples_per_step * (state["step"] - first_step) / (time.perf_counter() - started)
            bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:.1f}")
            bar.update(1)
            if writer:
                writer.add_scalar("train/loss", loss, state["step"])
                writer.add_scalar("train/lr", scheduler.get_last_lr()[0], state["step"])
                writer.add_scalar("train/samples_per_s", rate, state["step"])
                if state["grad_norms"][-1] is not None:
                    writer.add_scalar("train/grad_norm", state["grad_norms"][-1], state["step"])
                if dist.device.type == "cuda":
                    writer.add_scalar("train/max_memory_gb", torch.cuda.max_memory_allocated() / 2**30,
                                      state["step"])
            if train.eval_every_steps and state["step"] % train.eval_every_steps == 0:
                evaluate(state["step"])
            samples.render(state["step"])
            save_now, signum, diverging = after_step(step_is_finite(loss, state["grad_norms"][-1], scaler.enabled))
            if diverging:  # before any save: the last checkpoint stays the last good one
                raise diverged(state["step"], loss, state["grad_norms"][-1], train, checkpoints.last_step,
                               checkpoint_dir)
            with optimizer.eval_weights(step_loras.due(state["step"])):
                step_loras.save(state["step"])
            if save_now and (state["step"] < train.steps or signum is not None):  # the last step's: after the LoRA
                save_checkpoint()
            if signum is not None:
                if is_reporter:
                    print(f"train: stopped by {signal.Signals(signum).name}; checkpoint saved at step "
                          f"{state['step']} in {checkpoint_dir}. Run `dvc repro` (or this same command) again "
                          "to resume from it; DVC reporting that 'train' failed to reproduce is expected after a "
                          "stop", file=sys.stderr)
                if signum == signal.SIGINT:
                    raise KeyboardInterrupt
                raise SystemExit(128 + signum)
    finally:
        stops.close()
        bar.close()
        loader.close()
        profiler.close()
    evaluate(state["step"])
    samples.render(state["step"], final=True)

    with optimizer.eval_weights():  # the weights to export (a schedule-free optimizer's average)
        lora = gather_lora(denoiser, module, full=train.adapter == "full")
    ema_lora = ema.gather(lambda: gather_lora(denoiser, module))  # None when train.ema_decay is 0
    report = {
        "run_id": run_id, "steps": state["step"], "resumed_from": resumed_from,
        "train_loss_first": state["losses"][0], "train_loss_last": state["losses"][-1],
        "train_loss_last10": sum(state["losses"][-10:]) / len(state["losses"][-10:]),
        "eval": state["evals"], "eval_loss_start": state["evals"][0]["loss"] if state["evals"] else None,
        "eval_loss_end": state["evals"][-1]["loss"] if state["evals"] else None,
        "samples": len(train_rows), "adapter": train.adapter, "lora_modules": len(targets),
        "lora_rank": train.lora_rank,
        # median of this process's steps after the first two (warm-up, compilation)
        "step_seconds": statistics.median(step_seconds[2:] or step_seconds) if step_seconds else None,
        "max_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if dist.device.type == "cuda" else None,
        "sample_seconds": round(samples.seconds, 3),
        "lora_dtype": str(next(p.dtype for p in module.parameters() if p.requires_grad)).removeprefix("torch."),
    }
    if report["eval_loss_start"] is not None:
        report["eval_loss_improved"] = report["eval_loss_end"] < report["eval_loss_start"]
    # the LoRA (small) before the final checkpoint (large): a disk that fills at the end keeps the run's product
    _written_by_rank0(dist, lambda: _write_outputs(
        out_dir / "lora.safetensors", report_path, loss_plot_path, checkpoint_dir, lora, report, state, model, train,
        targets, lineage_params, encoded_path, ema_lora))
    if checkpoints.last_step != state["step"]:
        _save_final_checkpoint(save_checkpoint, out_dir / "lora.safetensors")
    if writer:
        writer.close()
        print(f"train: done, loss {report['train_loss_first']:.4f} -> {report['train_loss_last10']:.4f} "
              f"(last 10); eval {report['eval_loss_start']} -> {report['eval_loss_end']}", file=sys.stderr)
    return report


def _write_outputs(lora_path: Path, report_path: Path, loss_plot_path: Path, checkpoint_dir: Path,
                   lora: dict[str, torch.Tensor], report: dict, state: dict, model: ModelParams, train: TrainParams,
                   targets: list[str], lineage_params: Params | None, encoded_path: Path,
                   ema_lora: dict[str, torch.Tensor] | None = None) -> None:
    """Rank 0's outputs of a finished run, the LoRA first (and with `ema_lora`, the EMA LoRA beside it): with
    `lineage_params`, its lineage record (in the LoRA's metadata and the run's checkpoint directory), then the
    report and the loss plot. A file that cannot be written (a full disk) is a WriteError naming it."""
    lineage = None
    if lineage_params is not None:
        from diffusion_pipe.lineage.record import checkpoint_lineage, encoded_store_keys

        # only the deterministic part of the report: the LoRA's bytes must not depend on timings
        stable = {k: report[k] for k in ("run_id", "steps", "train_loss_last10", "eval_loss_start", "eval_loss_end")}
        lineage = checkpoint_lineage(lineage_params, Path.cwd(), encoded_path, encoded_store_keys(encoded_path), stable)
    with naming_write_errors(lora_path):
        _write_lora(lora_path, lora, model, train, targets, report["run_id"], lineage)
    if ema_lora is not None:
        with naming_write_errors(ema_lora_path(lora_path)):
            _write_lora(ema_lora_path(lora_path), ema_lora, model, train, targets, report["run_id"], lineage,
                        {"diffusion_pipe.ema_decay": repr(train.ema_decay)})
    else:  # an earlier run's EMA (outside DVC, which deletes outputs first) is not left beside this run's LoRA
        ema_lora_path(lora_path).unlink(missing_ok=True)
    if lineage is not None:
        with naming_write_errors(checkpoint_dir / "lineage.json"):
            write_json_atomic(checkpoint_dir / "lineage.json", lineage)
    with naming_write_errors(report_path):
        write_json_atomic(report_path, report)
    with naming_write_errors(loss_plot_path), atomic_writer(loss_plot_path, "w") as fh:
        fh.write("step,loss,grad_norm\n")
        fh.writelines(f"{i + 1},{loss:.6f},{'' if norm is None else f'{norm:.6f}'}\n"
                      for i, (loss, norm) in enumerate(zip(state["losses"], state["grad_norms"])))


def _written_by_rank0(dist: Dist, write: Callable[[], None]) -> None:
    """Run `write` on rank 0 and let every rank know whether it failed before any goes on to the next collective
    step (the final checkpoint), where the others would wait for a rank 0 that is gone. Rank 0 raises its error;
    the others stop with one naming it as rank 0's."""
    error = None
    if dist.rank == 0:
        try:
            write()
        except Exception as exc:  # re-raised below, once the other ranks know
            error = exc
    if dist.world > 1:
        failed = torch.tensor([int(error is not None)], dtype=torch.int32, device=dist.device)
        torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
        if failed.item() and error is None:
            raise WriteError("train: rank 0 could not write the run's outputs (its error says why); nothing else "
                             "was saved")
    if error is not None:
        raise error


def _save_final_checkpoint(save: Callable[[], None], lora_path: Path) -> None:
    """The final checkpoint, after the outputs: if it cannot be written (a full disk), the error says that the
    LoRA was, and what a rerun does."""
    try:
        save()
    except WriteError as exc:
        raise WriteError(f"{exc}. The run finished and its LoRA was written to {lora_path} before this final "
                         "checkpoint; a rerun resumes from the last checkpoint saved") from exc


class _Profiler:
    """With DIFFUSION_PIPE_PROFILE=<file>, torch.profiler records steps 4-6 of the run (after warm-up), writes
    the operator table to <file> and a Chrome trace to <file>.trace.json (`python bench/trace_gaps.py` finds
    where the device waited on the host in it), with each pipeline-engine instruction annotated: a profile, not
    a guess, when a step is slower than it should be."""

    def __init__(self, path: str | None, first_step: int, engine) -> None:
        self.path, self.start, self.prof = path, first_step + 3, None
        if path:
            engine._INSTRUCTION_MAP = {kind: _annotated(f"pipe.{kind.__name__}", fn)
                                       for kind, fn in engine._INSTRUCTION_MAP.items()}

    @contextlib.contextmanager
    def step(self, step: int):
        if not self.path or not self.start <= step < self.start + 3:
            yield
            return
        from torch.profiler import ProfilerActivity, profile

        if self.prof is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=activities).__enter__()
        with torch.profiler.record_function(f"train.step{step + 1}"):  # numbered as the reports number steps
            yield
        if step == self.start + 2:
            self.close()

    def close(self) -> None:
        """Stop recording and write the table and the trace (also when the run had fewer steps than planned)."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None  # steps after the window never record again
        prof.__exit__(None, None, None)
        write_profile(prof, Path(self.path))


def write_profile(prof, path: Path) -> None:
    """A finished torch.profiler run: operator tables (by device time, then by host time) to `path`, the Chrome
    trace to `<path>.trace.json`. The train stage and bench/bench_train.py's plain loop write the same files."""
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    path.write_text("\n\n".join(prof.key_averages().table(sort_by=key, row_limit=45)
                                 for key in (sort, "self_cpu_time_total")))
    prof.export_chrome_trace(f"{path}.trace.json")


def _annotated(name: str, fn):
    def run(self, *args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(self, *args, **kwargs)
    return run


class _StopSignals:
    """Ctrl-C (SIGINT) or SIGTERM (a scheduler's preemption) during training are noted and acted on between steps,
    so a checkpoint never holds half a step: RNG draws made, or an optimizer update applied to some tensors and
    not others. Signals within `same_request_s` of the first are that same request: one Ctrl-C reaches a worker
    twice under a launcher, from the terminal and passed on by torchrun (SIGINT) or the DeepSpeed launcher
    (SIGTERM). A signal after that stops at once, without a checkpoint."""

    def __init__(self, announce: bool, same_request_s: float = 2.0) -> None:
        self.signal: int | None = None
        self.announce, self.same_request_s = announce, same_request_s
        self._first = 0.0
        self._previous: dict[int, object] = {}
        try:
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._note)
        except ValueError:  # not the main thread: signals stay as they were
            self.close()

    def _note(self, signum: int, frame) -> None:
        if self.signal is None:
            self.signal, self._first = signum, time.monotonic()
            if self.announce:
                print(f"\ntrain: {signal.Signals(signum).name}: stopping after this step with a checkpoint "
                      "(again: stop now, without one)", file=sys.stderr)
        elif time.monotonic() - self._first >= self.same_request_s:
            self.close()
            raise KeyboardInterrupt

    def close(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}


def _mean_eval_loss(engine, batches: list, progress: tqdm, chunk: int = 8) -> float:
    """The mean loss of `batches` through the engine, `chunk` micro-batches per call so that `progress` moves
    while a long evaluation runs (the engine averages each call's micro-batches; the chunks are weighted back)."""
    total = 0.0
    for start in range(0, len(batches), chunk):
        part = batches[start:start + chunk]
        total += float(engine.eval_batch(iter(part), num_micro_batches=len(part))) * len(part)
        progress.update(len(part))
    return total / len(batches)


def _write_lora(path: Path, lora: dict[str, torch.Tensor], model: ModelParams, train: TrainParams,
                targets: list[str], run_id: str, lineage: dict | None, extra: dict[str, str] | None = None) -> None:
    metadata = {**(extra or {}),
        "format": "pt", "diffusion_pipe.family": model.family, "diffusion_pipe.run_id": run_id,
        "diffusion_pipe.adapter": train.adapter,
        "lora_rank": str(train.lora_rank), "lora_alpha": str(train.lora_alpha),
        "lora_targets": json.dumps(targets),
    }
    if lineage is not None:
        from diffusion_pipe.lineage.record import lineage_metadata

        metadata |= lineage_metadata(lineage)
    # a LoRA in float32; a full fine-tune's weights in the dtype they trained in (a bf16 model stays its size)
    tensors = {k: (v if train.adapter == "full" else v.float()).contiguous() for k, v in sorted(lora.items())}
    write_bytes_atomic(path, save_deterministic(tensors, metadata))
