"""Per-family train speed: our train stage against a plain diffusers + peft loop, for any registered family at its
real (published) shape or its tiny test shape, in the same run; one markdown row per family.

    python bench/bench_family.py --family qwenimage --shape real --steps 8           # H200
    python bench/bench_family.py --families qwenimage,flux2_klein,ltx --shape real --steps 8 --deadline-s 480
    python bench/bench_family.py --families all --shape tiny --steps 3 --device cpu  # smoke test anywhere
    python bench/bench_family.py --family wan --no-plain --runs uncapped,cap24,cap24-noswap:float8  # memory savers

Model: the family's tiny model directory with the denoiser replaced by a random-init bf16 one of the published
`transformer/config.json` (family_shapes.REAL, which names the hub repo of each), built on the device and
written with `save_pretrained`, and the published VAE and text-encoder config values that training reads. Data:
a store of random entries of the shapes the adapter's own `latent_spec` / `text_spec` give (images 1024x1024,
videos 480x832 at 33 frames, 17 for Wan 14B and HunyuanVideo 13B; the text length of the family's example
params; masks all ones), batch 1, LoRA r32 (alpha 32) on the family's default targets, bf16, no activation
checkpointing, no memory cap.

- ours: `python -m stages.train` in a fresh process (bench_train.run_ours): the DeepSpeed pipeline engine, one
  stage, data read from the store, a checkpoint at the end; s/step is the train report's median of steps 3..N.
- plain: the same denoiser loaded with `from_pretrained`, peft LoRA on the same targets, AdamW, grad clipping,
  in bf16 autocast (since 2026-12-07: earlier rows ran without it),
  on one fixed micro-batch: the adapter's `model_inputs` (at t = 0.5) fed to the denoiser's own unsplit forward
  as the family's contract test calls it (`unsplit_forward` of tests/models/test_<family>.py, the forward the
  composed pipeline layers are tested equal to). Its input preparation is done once, outside the timed steps.

`--runs` runs ours once per entry, `NAME[:BASE_DTYPE]`: NAME is `uncapped` (the default: no cap, no memory saver)
or a variant of bench/bench_train.py (its train params: `cap24` is activation checkpointing, 20 swapped blocks
and a 24 GB cap), BASE_DTYPE a `model.base_dtype` (`float8`). Every run has the same seed, data and steps, so
their losses show what fp8 base weights change.

Each family's model directory and store are deleted after its row (a 20B model takes 41 GB of disk). A family
that fails (out of memory, say) gets a row saying why, and the loop goes on; with --deadline-s, families not
started by then get a row saying so.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import re
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from torch.utils._pytree import tree_map

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# the order the issues rank them in; sdxl and flux have their own benchmarks (flux: bench_train.py)
PRIORITY = ("qwenimage", "qwenimage21", "flux2_klein", "krea2", "hunyuan_video15", "ltx", "ltx2", "sd3", "chroma",
            "zimage", "wan", "wan_i2v", "wan21_i2v", "wan_ti2v", "skyreels_v2", "hunyuan_video", "lumina2",
            "auraflow", "ernie_image", "hidream", "hunyuan_image", "flux2", "ideogram4", "kandinsky5_image",
            "kandinsky5", "qwenimage_edit", "flux_kontext", "cosmos2", "cosmos2_image",
            "minimax_h3")


class _Clock:
    """Progress lines stamped with the seconds since the run started, for planning a time-limited run."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def __call__(self, message: str) -> None:
        print(f"[{self.elapsed():7.1f} s] {message}", flush=True)


def contract_forward(family: str):
    """The family's contract test class (tests/models/test_<family>.py), whose `unsplit_forward` calls the
    denoiser's own forward on `model_inputs`' tuple: the base one where a variant's class derives from it (LTX-2.3
    from LTX-2, Qwen-Image-Edit-2511 from 2509)."""
    from tests.models.contract import AdapterContract

    module = importlib.import_module(f"tests.models.test_{family}")
    classes = [c for c in vars(module).values()
               if isinstance(c, type) and issubclass(c, AdapterContract) and c is not AdapterContract]
    return min(classes, key=lambda c: len(c.__mro__))()


class _OnDevice:
    """The denoiser as the contract's forward calls it. Tensors that forward builds itself on the CPU
    (HunyuanVideo 1.5's all-zero image embeddings, in the default float32) go to the model's device and dtype;
    the inputs, already there, pass untouched (on a CPU run every CPU tensor counts, which only a smoke test
    sees)."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def _place(self, x):
        if isinstance(x, torch.Tensor) and x.device.type == "cpu":
            return x.to(self.device, torch.bfloat16 if x.is_floating_point() else x.dtype)
        return x

    def __call__(self, *args, **kwargs):
        return self.model(*tree_map(self._place, args), **tree_map(self._place, kwargs))


def plain_family(family: str, adapter, media: tuple[int, int, int], text_len: int, steps: int, device: str,
                 log, profile: Path | None = None) -> dict:
    """The plain diffusers + peft loop on `family`'s denoiser (see the module docstring); `profile`: a
    torch.profiler table and trace of its step 3 there."""
    from family_shapes import add_plain_lora, random_entry, train_plain

    from diffusion_pipe.params import TrainParams
    from diffusion_pipe.train.data import noise_latents

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # as the train stage does (see train/pipeline.py)
    started = time.perf_counter()
    model = adapter.denoiser_class().from_pretrained(adapter.denoiser_dir(), torch_dtype=torch.bfloat16).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{family}: plain: {n_params / 1e9:.2f}B parameters loaded in {time.perf_counter() - started:.1f} s")
    params = add_plain_lora(model, adapter)
    g = torch.Generator().manual_seed(0)
    width, height, frames = media
    latents = adapter.normalise_latents(random_entry(adapter.latent_spec(width, height, frames), g)["latents"]
                                        .float()[None])
    text = {k: v[None] for k, v in random_entry(adapter.text_spec(text_len), g).items()}
    conditioning = tuple(adapter.normalise_latents(random_entry(adapter.latent_spec(width, height, frames), g)[
        "latents"].float()[None]) for _ in range(adapter.capabilities.conditioning_latents))
    noised = noise_latents(adapter, latents, torch.randn(latents.shape, generator=g), torch.tensor([0.5]),
                           "uniform", 1.0, g)
    inputs = tree_map(lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x,
                      adapter.conditioned_inputs(noised.noisy, noised.timesteps, text, TrainParams().guidance,
                                                 conditioning))
    target, like = noised.target.to(dev, inputs[0].dtype), noised.noisy.to(dev, inputs[0].dtype)
    contract, denoiser = contract_forward(family), _OnDevice(model, dev)

    def loss() -> torch.Tensor:
        # in bf16 autocast, as diffusers' training scripts run (accelerate's mixed precision) and as
        # bench_train.py's plain loops run since issue 35 found one without it flattering our ratios
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            prediction = contract.unsplit_forward(adapter, denoiser, inputs, like)
        return torch.nn.functional.mse_loss(prediction.float(), target.float())

    out = train_plain(loss, params, steps, dev, profile=profile, log=lambda m: log(f"{family}: {m}"))
    out["parameters"] = n_params
    return out


def _reason(error: BaseException | str) -> str:
    """A failure in a few words: OOM, or the exception's line (the last line naming an error: a stage's stderr
    may end in warnings printed at its exit), else the last line."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    if "out of memory" in text.lower() or "OutOfMemoryError" in text:
        return "OOM"
    lines = [line for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"\w(Error|Exception): ", line)]
    return ((errors or lines)[-1].removeprefix("[rank0]: ") if lines else text)[:160]


def bench_one(family: str, shape: str, steps: int, device: str, work: Path, log, plain: bool = True,
              runs: tuple[str, ...] = ("uncapped",), profile: Path | None = None) -> dict:
    """One family's row: model and data, the plain loop, then ours once per entry of `runs` (see the module
    docstring); failures are caught and named. `profile`: a directory for profiles of each runner (tables,
    Chrome traces; ours' steps 4-6 and plain's step 3), whose timings they slow."""
    from bench_train import VARIANTS, run_ours, write_params
    from family_shapes import fill_store, media_shape, write_model_dir

    from diffusion_pipe.models import adapter_class
    from diffusion_pipe.params import ModelParams

    media, text_len = media_shape(family, shape)
    row: dict = {"family": family, "shape": f"{media[0]}x{media[1]}x{media[2]}", "text_len": text_len}
    root = work / family
    model_dir, store, encoded = root / "model", root / "store", root / "encoded.parquet"
    try:
        started = time.perf_counter()
        write_model_dir(family, model_dir, shape, device)
        adapter = adapter_class(family)(model_dir, torch.bfloat16)
        fill_store(store, encoded, adapter, media, text_len, 4,
                   ModelParams(family=family, path=str(model_dir), dtype="bfloat16"))
        row["setup_seconds"] = round(time.perf_counter() - started, 1)
        log(f"{family}: model and data written in {row['setup_seconds']} s")
    except Exception as error:  # noqa: BLE001 - a row says why, and the next family runs
        traceback.print_exc()
        row["error"] = f"setup: {_reason(error)}"
        shutil.rmtree(root, ignore_errors=True)
        return row
    if plain:
        started = time.perf_counter()
        try:
            row["plain"] = plain_family(family, adapter, media, text_len, steps, device, log,
                                        profile and profile / f"{family}-plain.txt")
        except Exception as error:  # noqa: BLE001
            traceback.print_exc()
            row["plain"] = {"error": _reason(error)}
        row["plain"]["seconds"] = round(time.perf_counter() - started, 1)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        log(f"{family}: plain done: {row['plain']}")
    for i, spec in enumerate(runs):
        name, _, base_dtype = spec.partition(":")
        variant = {} if name == "uncapped" else VARIANTS[name]
        params = root / f"params-{i}.yaml"
        write_params(params, model_dir, {"text_len": text_len}, steps, device, variant, base_dtype=base_dtype,
                     family=family, guidance=None)
        try:
            report = run_ours(root, params, encoded, store, f"ours-{i}", profile and profile / f"{family}-ours-{i}.txt")
            result = {k: report.get(k) for k in ("step_seconds", "max_memory_gb", "process_seconds",
                                                 "train_loss_first", "train_loss_last10", "lora_modules")}
        except SystemExit as error:  # run_ours exits with the stage's stderr
            print(str(error)[-3000:], flush=True)
            result = {"error": _reason(str(error))}
        log(f"{family}: ours {spec} done: {result}")
        row.setdefault("ours", result)  # the first run is the row's; every run is in "runs"
        row.setdefault("runs", {})[spec] = result
    shutil.rmtree(root, ignore_errors=True)
    return row


def _gb(value) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) else "-"


def markdown_row(row: dict) -> str:
    """| family | shape | ours s/step | plain s/step | plain/ours | peak GB ours/plain | note |"""
    ours, plain = row.get("ours", {}), row.get("plain", {})
    o, p = ours.get("step_seconds"), plain.get("step_seconds")
    notes = [f"{k}: {v['error']}" for k, v in (("ours", ours), ("plain", plain)) if "error" in v]
    notes += [row["error"]] if "error" in row else []
    params = plain.get("parameters")
    size = (f" ({params / 1e9:.1f}B)" if params >= 1e8 else f" ({params / 1e6:.2f}M)") if params else ""
    return (f"| {row['family']} | {row['shape']}{size} | "
            f"{f'{o:.3f}' if o else '-'} | {f'{p:.3f}' if p else '-'} | {f'{p / o:.2f}' if o and p else '-'} | "
            f"{_gb(ours.get('max_memory_gb'))} / {_gb(plain.get('max_memory_gb'))} | {'; '.join(notes)} |")


HEADER = ("| family | shape (params) | ours s/step | plain s/step | plain/ours | peak GB ours / plain | note |\n"
          "|---|---|---|---|---|---|---|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--family", help="one registered family")
    which.add_argument("--families", help=f"comma list run one after the other, or 'all': {','.join(PRIORITY)}")
    parser.add_argument("--shape", choices=["real", "tiny"], default="real")
    parser.add_argument("--steps", type=int, default=8, help="steps of each runner (s/step: median of 3..N)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--work", type=Path, default=None, help="working directory (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here (after every family)")
    parser.add_argument("--no-plain", action="store_true", help="run ours only")
    parser.add_argument("--runs", default="uncapped",
                        help="comma list of runs of ours, NAME[:BASE_DTYPE] (module docstring); the first is the row's")
    parser.add_argument("--profile", type=Path, default=None,
                        help="write torch.profiler tables and Chrome traces of both runners here (slows their "
                             "timings; read the traces with bench/trace_gaps.py)")
    parser.add_argument("--deadline-s", type=float, default=0.0,
                        help="start no family after this many seconds of the run (0: no limit)")
    args = parser.parse_args()
    from diffusion_pipe.models import REGISTRY

    families = [args.family] if args.family else (list(PRIORITY) if args.families == "all"
                                                  else args.families.split(","))
    from bench_train import VARIANTS

    runs = tuple(args.runs.split(","))
    bad = [r for r in runs if r.partition(":")[0] not in {"uncapped", *VARIANTS}
           or r.partition(":")[2] not in ("", "float8", "float8_matmul")]
    if bad:
        parser.error(f"--runs: {bad} not NAME[:BASE_DTYPE] with NAME uncapped or one of {sorted(VARIANTS)}")
    unknown = [f for f in families if f not in REGISTRY]
    if unknown:
        parser.error(f"unknown families {unknown}; registered: {', '.join(sorted(REGISTRY))}")
    if args.shape == "real":
        from family_shapes import REAL

        missing = [f for f in families if f not in REAL]
        if missing:
            parser.error(f"no real shape for {missing} in bench/family_shapes.py REAL")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    log = _Clock()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-family-"))
    results: dict = {"shape": args.shape, "steps": args.steps, "device": args.device, "torch": torch.__version__,
                     "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None, "rows": []}
    log(f"{len(families)} families at {args.shape} shape, {args.steps} steps each, on {results['gpu'] or 'cpu'}; "
        f"work dir {work}")
    for family in families:
        if args.deadline_s and log.elapsed() > args.deadline_s:
            row = {"family": family, "shape": "-", "error": f"not started: past --deadline-s {args.deadline_s:.0f}"}
        else:
            log(f"{family}: start")
            row = bench_one(family, args.shape, args.steps, args.device, work, log, plain=not args.no_plain,
                            runs=runs, profile=args.profile)
            row["seconds"] = round(log.elapsed(), 1)
        results["rows"].append(row)
        print(HEADER + "\n" + markdown_row(row), flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    print(f"\n{args.shape} shape, {args.steps} steps, {results['gpu'] or 'cpu'}, torch {torch.__version__}; "
          f"total {log.elapsed():.0f} s\n{HEADER}")
    for row in results["rows"]:
        print(markdown_row(row))
    if len(runs) > 1:
        print("\n| family | run | s/step | peak GB | loss first | loss last 10 | note |\n|---|---|---|---|---|---|---|")
        for row in results["rows"]:
            for spec, r in row.get("runs", {}).items():
                cells = [f"{r[k]:{f}}" if isinstance(r.get(k), float) else "-"
                         for k, f in (("step_seconds", ".3f"), ("train_loss_first", ".6f"),
                                      ("train_loss_last10", ".6f"))]
                print(f"| {row['family']} | {spec} | {cells[0]} | {_gb(r.get('max_memory_gb'))} | {cells[1]} | "
                      f"{cells[2]} | {r.get('error', '')} |")


if __name__ == "__main__":
    main()
