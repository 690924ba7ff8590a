"""Train-stage speed: our full train stage (DeepSpeed pipeline engine, data from the store) against a plain
diffusers + peft loop on the same model and shapes, measured in the same run.

    python bench/bench_train.py --shape dev --steps 20            # H200: Flux-dev-shaped, 1024x1024, LoRA r32
    python bench/bench_train.py --shape tiny --steps 6 --device cpu   # smoke test anywhere
    python bench/bench_train.py --shape dev --base-dtype float8 --variants eager,cap24 --no-plain  # fp8 base
    python bench/bench_train.py --shape dev --steps 12 --variants samples   # share of wall time spent sampling
    python bench/bench_train.py --shape dev --steps 20 --no-plain \
        --variants eager,opt-adamw8bit,opt-prodigy,opt-schedulefree_adamw,opt-adafactor,opt-muon   # optimizers
    python bench/bench_train.py --shape dev --steps 20 --no-plain --variants eager,lokr,loha,dora   # adapter types

The model is random-init (no weights can be downloaded), written in diffusers format and loaded back through
the same `from_pretrained`/safetensors path a real checkpoint takes. Model FLOPs per step are counted by
torch's FlopCounterMode on one forward + backward of the plain loop (every matmul and attention, the LoRA's
own included; recomputation not counted), and utilisation is against a bf16 matmul peak measured in the run.

The `samples` variant runs ours eager with `train.samples` (the README's two prompts, 1024x1024 at dev shape,
--sample-steps steps, rendered at step 0, halfway and at the end, decoded by a full random-init VAE of Flux's
shape; their text entries are in the store under the keys encode gives them) and reports the seconds the train
report records for sampling, their share of the run's wall time, and the share they would take in a 2000-step
run rendering every 0 (step 0 and the end), 250 or 500 steps. The first render includes one-time warm-up, so the
projection errs high.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# dev: FLUX.1-dev's transformer (family_shapes.REAL["flux"]) at 1024x1024; tiny: the family's tiny model
SHAPES = {
    "dev": {"family_shape": "real", "latent_channels": 16, "vae_blocks": 4, "t5_dim": 4096, "clip_dim": 768,
            "text_len": 512, "resolution": 1024},
    "tiny": {"family_shape": "tiny", "latent_channels": 4, "vae_blocks": 3, "t5_dim": 32, "clip_dim": 32,
             "text_len": 32, "resolution": 64},
}
# FLUX.1-dev's VAE (black-forest-labs/FLUX.1-dev vae/config.json), written in full: samples decode with it
FLUX_DEV_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                    layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611,
                    shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
# train.samples of the `samples` variant: the README's two prompts at 1024x1024, SampleParams' default 20 steps
SAMPLE_PROMPTS = ({"prompt": "a photo of sks dog on a beach", "seed": 1},
                  {"prompt": "a photo of a dog on a beach", "seed": 1, "negative_prompt": "blurry"})


def samples_section(shape: dict, every_steps: int, steps: int) -> dict:
    """The `train.samples` params section of the samples variant."""
    return {"every_steps": every_steps, "width": shape["resolution"], "height": shape["resolution"], "steps": steps,
            "prompts": [dict(p) for p in SAMPLE_PROMPTS]}


def sample_params(section: dict):
    """A `train.samples` section as the params loader builds it."""
    from diffusion_pipe.params import SampleParams, SamplePrompt

    return SampleParams(**{**section, "prompts": tuple(SamplePrompt(**p) for p in section["prompts"])})


def make_model_dir(root: Path, shape: dict, device: str) -> Path:
    """A diffusers-format Flux directory (family_shapes.write_model_dir): at dev shape a full random-init
    transformer and VAE of FLUX.1-dev's shape, tiny text encoders and tokenizers (training reads only their
    configs; their weights give sample prompts' text keys something to hash)."""
    from family_shapes import write_model_dir

    dev = shape["family_shape"] == "real"
    write_model_dir("flux", root, shape["family_shape"], device, vae=FLUX_DEV_VAE if dev else None)
    if dev:  # FLUX.1-dev's scheduler (dynamic shifting), which samples render with
        path = root / "scheduler" / "scheduler_config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | {
            "base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
            "shift": 3.0, "use_dynamic_shifting": True}))
    return root


def make_data(store_root: Path, encoded: Path, model_dir: Path, shape: dict, n: int) -> None:
    """`n` latent and text entries in a store and the encoded table that lists them, plus the text entries of
    the samples variant's prompts under the keys encode gives them."""
    from family_shapes import fill_store

    from diffusion_pipe.models.flux import FluxAdapter
    from diffusion_pipe.params import ModelParams
    from diffusion_pipe.sample.render import prompt_texts

    adapter = FluxAdapter(model_dir, torch.bfloat16)
    texts = tuple(t.text for t in prompt_texts(adapter, sample_params(samples_section(shape, 0, 1)).resolved()))
    fill_store(store_root, encoded, adapter, (shape["resolution"], shape["resolution"], 1), shape["text_len"], n,
               ModelParams(family="flux", path=str(model_dir), dtype="bfloat16"), texts)


# name -> train params of our run; "plain": whether the plain loop runs the same variant
VARIANTS = {
    "eager": {"plain": True, "max_gpu_memory_gb": 80},
    "compile": {"plain": True, "compile": True, "max_gpu_memory_gb": 80},
    "cap48": {"plain": False, "activation_checkpointing": True, "max_gpu_memory_gb": 48},
    "cap24": {"plain": False, "activation_checkpointing": True, "blocks_to_swap": 20, "max_gpu_memory_gb": 24},
    # with --base-dtype float8 the frozen weights take half the memory: these caps need fewer or no swapped blocks
    "cap24-noswap": {"plain": False, "activation_checkpointing": True, "max_gpu_memory_gb": 24},
    # swapped blocks copied when needed (train.swap_prefetch: false) against copied ahead, overlapping the compute
    "cap24-noprefetch": {"plain": False, "activation_checkpointing": True, "blocks_to_swap": 20,
                         "swap_prefetch": False, "max_gpu_memory_gb": 24},
    "cap24-compile": {"plain": False, "activation_checkpointing": True, "blocks_to_swap": 20, "compile": True,
                      "max_gpu_memory_gb": 24},
    **{f"cap24-swap{n}-keep-attention-compile": {
        "plain": False, "activation_checkpointing": True, "activation_checkpointing_keep": "attention",
        "blocks_to_swap": n, "compile": True, "max_gpu_memory_gb": 24} for n in (20, 14, 10)},
    # the swapped-block counts of the video families' 24 GB example params (bench_family.py --runs)
    **{f"cap24-swap{n}": {"plain": False, "activation_checkpointing": True, "blocks_to_swap": n,
                          "max_gpu_memory_gb": 24} for n in (10, 24, 44)},
    "cap16": {"plain": False, "activation_checkpointing": True, "blocks_to_swap": 8, "max_gpu_memory_gb": 16},
    # only a share of the layers recompute (train.activation_checkpointing_share): the rest keep their activations
    **{f"cap24-noswap-share{round(share * 100)}": {
        "plain": False, "activation_checkpointing": True, "activation_checkpointing_share": share,
        "max_gpu_memory_gb": 24} for share in (0.5, 0.6, 0.7, 0.8)},
    "cap16-compile": {"plain": False, "activation_checkpointing": True, "blocks_to_swap": 8, "compile": True,
                      "max_gpu_memory_gb": 16},
    "cap24-noswap-compile": {"plain": False, "activation_checkpointing": True, "compile": True,
                             "max_gpu_memory_gb": 24},
    "cap24-noswap-share80-compile": {"plain": False, "activation_checkpointing": True, "compile": True,
                                     "activation_checkpointing_share": 0.8, "max_gpu_memory_gb": 24},
    # activation checkpointing without a cap, recomputing everything or keeping what
    # train.activation_checkpointing_keep names (selective checkpointing), against "eager" / "compile"
    "ckpt": {"plain": False, "activation_checkpointing": True},
    **{f"ckpt-keep-{keep}": {"plain": False, "activation_checkpointing": True,
                             "activation_checkpointing_keep": keep} for keep in ("attention", "narrow")},
    "compile-ckpt": {"plain": False, "activation_checkpointing": True, "compile": True},
    **{f"compile-ckpt-keep-{keep}": {"plain": False, "activation_checkpointing": True, "compile": True,
                                     "activation_checkpointing_keep": keep} for keep in ("narrow", "attention")},
    "compile-ckpt-share80-keep-attention": {"plain": False, "activation_checkpointing": True, "compile": True,
                                            "activation_checkpointing_share": 0.8,
                                            "activation_checkpointing_keep": "attention"},
    **{f"cap24-noswap-keep-{keep}{suffix}": {"plain": False, "activation_checkpointing": True,
                                             "activation_checkpointing_keep": keep, "max_gpu_memory_gb": 24,
                                             "compile": suffix == "-compile"}
       for keep in ("narrow", "attention") for suffix in ("", "-compile")},
    # full fine-tuning (train.adapter: full): every weight trains, fp32 masters and AdamW state for each
    "full": {"plain": False, "adapter": "full"},
    # each train.optimizer other than adamw, against "eager" (its step's time and memory; the bench's learning rate
    # stays 1.0e-4, which times prodigy as well as its usual 1.0), and on a full fine-tune, against "full", where the
    # optimizer's state is most of the memory (muon takes 2-D weights only: no full fine-tune)
    **{f"opt-{name}": {"plain": False, "optimizer": name, "max_gpu_memory_gb": 80}
       for name in ("adamw8bit", "prodigy", "schedulefree_adamw", "adafactor", "muon")},
    **{f"full-{name}": {"plain": False, "adapter": "full", "optimizer": name}
       for name in ("adamw8bit", "prodigy", "schedulefree_adamw", "adafactor")},
    # each adapter type beside LoRA (train.adapter: lokr | loha, train.lora_dora), at the bench's rank, against "eager"
    "lokr": {"plain": False, "adapter": "lokr", "max_gpu_memory_gb": 80},
    "loha": {"plain": False, "adapter": "loha", "max_gpu_memory_gb": 80},
    "dora": {"plain": False, "lora_dora": True, "max_gpu_memory_gb": 80},
    # several samples a step: 4 micro-batches of 1 (gradient accumulation), 2 of 2, one of 2, eager and compiled;
    # the table's s/sample against "eager" / "compile" shows what each micro-batch costs beyond its compute
    **{f"{name}{suffix}": {"plain": False, "gradient_accumulation_steps": ga, "micro_batch_size": mb,
                           "compile": suffix == "-compile", "max_gpu_memory_gb": 80}
       for name, ga, mb in (("ga4", 4, 1), ("ga2-mb2", 2, 2), ("mb2", 1, 2)) for suffix in ("", "-compile")},
    # micro-batch 2 under the checkpointing that met issue 17's 25% (a Flux-dev micro-batch of 2 does not fit 80 GB
    # uncheckpointed), against "compile-ckpt-share80-keep-attention"
    "mb2-compile-ckpt-share80-keep-attention": {"plain": False, "micro_batch_size": 2, "compile": True,
                                                "activation_checkpointing": True,
                                                "activation_checkpointing_share": 0.8,
                                                "activation_checkpointing_keep": "attention"},
    # eager plus train.samples (samples_section: renders at step 0, halfway and at the end), added by main()
    "samples": {"plain": False, "max_gpu_memory_gb": 80},
}


def samples_per_step(variant: dict) -> int:
    """Samples one optimizer step of `variant` trains (micro-batches x their size); FLOPs and speed per sample
    divide by it."""
    return variant.get("gradient_accumulation_steps", 1) * variant.get("micro_batch_size", 1)


def write_params(path: Path, model_dir: Path, shape: dict, steps: int, device: str, variant: dict,
                 base_dtype: str = "", family: str = "flux", guidance: float | None = 3.5) -> None:
    """params.yaml of one run of ours: `variant`'s train params over the bench's fixed ones (nested values as
    JSON, which YAML reads); `guidance` None leaves train.guidance at its default."""
    path.write_text(f"""
model: {{family: {family}, path: {model_dir}, dtype: bfloat16, base_dtype: "{base_dtype}"}}
scan: {{datasets: [{{path: .}}]}}
encode: {{text_max_length: {shape['text_len']}}}
export: {{formats: [comfyui]}}
train:
  steps: {steps}
  micro_batch_size: {variant.get("micro_batch_size", 1)}
  learning_rate: 1.0e-4
  lora_rank: 32
  lora_alpha: 32.0
  device: {'cuda' if device == 'cuda' else 'cpu'}
""" + (f"  guidance: {guidance}\n" if guidance is not None else "")
        + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in variant.items()
                  if k not in ("plain", "micro_batch_size") and (device == "cuda" or k != "max_gpu_memory_gb")))


def run_ours(work: Path, params: Path, encoded: Path, store: Path, tag: str, profile: Path | None) -> dict:
    """Our train stage as users run it (a fresh process, a fresh run: an earlier bench's checkpoints of the same
    variant are removed, else the stage would find that run finished and train no step); returns its report plus
    the process's wall time."""
    runs = work / f"runs-{tag}"
    shutil.rmtree(runs, ignore_errors=True)
    env = dict(os.environ, DIFFUSION_PIPE_STORE=str(store), PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}")
    if profile:
        env["DIFFUSION_PIPE_PROFILE"] = str(profile)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "stages.train", "--params", str(params), "--encoded", str(encoded),
                           "--out", str(runs / "out"), "--report", str(runs / "report.json"),
                           "--loss-plot", str(runs / "loss.csv"), "--runs", str(runs),
                           "--samples", str(runs / "samples")],
                          cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"train stage failed:\n{proc.stderr[-4000:]}")
    report = json.loads((runs / "report.json").read_text())
    report["process_seconds"] = time.perf_counter() - started
    return report


# The plain loops, each what a user writes without a framework, in bf16 autocast as diffusers' training scripts run
# (accelerate's mixed precision): without it parts of diffusers' Flux forward run in float32 (issue 35: 0.557
# against 0.475 s/step compiled, H100). "plain": the LoRA's weights in bf16, stepped by AdamW directly.
# "plain-diffusers": diffusers' own recipe (train_dreambooth_lora_flux.py): fp32 LoRA weights (cast_training_params)
# under autocast, torch's fused AdamW.
PLAIN_RUNNERS = {"plain": {"lora_fp32": False, "fused": False}, "plain-diffusers": {"lora_fp32": True, "fused": True}}
# A compiled plain loop that gains less than this over its eager twin is a broken baseline (issue 35: the bench's
# gained 1.00x while an independent one gained 1.5x): no ratio against it is printed.
MIN_COMPILE_GAIN = 1.2


def plain_loop(model_dir: Path, shape: dict, steps: int, device: str, compile_layers: bool,
               count_flops: bool, profile: Path | None = None, runner: str = "plain") -> dict:
    """A baseline (`runner`, one of PLAIN_RUNNERS): diffusers' transformer + peft LoRA (same targets and rank),
    AdamW, bf16 autocast, no framework."""
    from diffusers import FluxTransformer2DModel
    from family_shapes import add_plain_lora, train_plain

    from diffusion_pipe.models.flux import FluxAdapter, image_ids, pack_latents

    recipe = PLAIN_RUNNERS[runner]
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # as the train stage does (see train/pipeline.py)
    model = FluxTransformer2DModel.from_pretrained(model_dir / "transformer", torch_dtype=torch.bfloat16).to(dev)
    params = add_plain_lora(model, FluxAdapter(model_dir, torch.bfloat16))
    if recipe["lora_fp32"]:
        for p in params:
            p.data = p.data.float()
    if compile_layers:
        for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
            block.compile()
    res, scale = shape["resolution"], 2 ** (shape["vae_blocks"] - 1)
    h = w = res // scale
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, shape["latent_channels"], h, w, generator=g)
    noise = torch.randn(latents.shape, generator=g)
    t = torch.tensor([0.5])
    x = pack_latents(0.5 * latents + 0.5 * noise).to(dev, torch.bfloat16)
    target = pack_latents(noise - latents).to(dev, torch.bfloat16)
    kwargs = dict(hidden_states=x, timestep=t.to(dev, torch.bfloat16),
                  encoder_hidden_states=torch.randn(1, shape["text_len"], shape["t5_dim"], generator=g).to(
                      dev, torch.bfloat16),
                  pooled_projections=torch.randn(1, shape["clip_dim"], generator=g).to(dev, torch.bfloat16),
                  img_ids=image_ids(h, w).to(dev), txt_ids=torch.zeros(shape["text_len"], 3, device=dev),
                  guidance=torch.full((1,), 3.5, device=dev, dtype=torch.bfloat16), return_dict=False)

    def loss() -> torch.Tensor:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            prediction = model(**kwargs)[0]
        return torch.nn.functional.mse_loss(prediction.float(), target.float())

    out = train_plain(loss, params, steps, dev, count_flops, profile, fused=recipe["fused"])
    # our run goes next, in its own process: this one must hand back the model's memory. On an H100 it still held
    # 23 GB after the compiled loop (2026-12-06; not reproduced on the CPU), so dynamo's caches go too
    del model, params, kwargs
    if compile_layers:
        torch._dynamo.reset()
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def sample_share(report: dict, section: dict, steps: int, every_steps: tuple[int, ...]) -> dict:
    """What sampling cost in a samples run (`report`: its train report plus process_seconds; `section`: its
    train.samples), and the share of wall time sampling would take in a run of `steps` steps rendering every
    `every_steps` (0: at step 0 and the end), at this run's s/step and mean seconds per render."""
    from diffusion_pipe.train.samples import sample_steps

    renders = len(sample_steps(sample_params(section), report["steps"]))
    per_render = report["sample_seconds"] / renders
    out = {"renders": renders, "sample_seconds": report["sample_seconds"], "seconds_per_render": round(per_render, 3),
           "share_of_this_run": round(report["sample_seconds"] / report["process_seconds"], 4)}
    for every in every_steps:
        rendering = len(sample_steps(sample_params({**section, "every_steps": every}), steps)) * per_render
        out[f"share_at_{steps}_steps_every_{every}"] = round(rendering / (rendering + steps * report["step_seconds"]), 4)
    return out


def source_commit() -> str | None:
    """The commit of the code being measured: git's HEAD (with "+dirty" for uncommitted changes), else
    $DIFFUSION_PIPE_COMMIT (a copy without .git, as on a lent GPU machine), else None."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("DIFFUSION_PIPE_COMMIT")


def matmul_peak(device: str) -> float | None:
    """bf16 matmul FLOP/s on 8192^3 in this run (the utilisation denominator)."""
    if device != "cuda":
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    started, n = time.perf_counter(), 20
    for _ in range(n):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * n / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="dev")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variants", default=",".join(v for v in VARIANTS if v != "samples"),
                        help=f"comma list of: {', '.join(VARIANTS)} (default: all but samples)")
    parser.add_argument("--work", type=Path, default=None, help="working directory (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--no-plain", action="store_true", help="run ours only")
    parser.add_argument("--base-dtype", choices=["", "float8", "float8_matmul"], default="",
                        help="model.base_dtype of our runs: the blocks' frozen weights in fp8, computed by "
                             "dequantising (float8) or in fp8 matmuls (float8_matmul); the plain loop stays bf16")
    parser.add_argument("--profile", type=Path, default=None,
                        help="write torch.profiler tables, Chrome traces and their GPU-idle breakdown "
                             "(bench/trace_gaps.py) of both runners into this directory")
    parser.add_argument("--sample-steps", type=int, default=20,
                        help="samples variant: inference steps per sample (SampleParams' default 20)")
    args = parser.parse_args()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-train-"))
    model_dir, store, encoded = work / "model", work / "store", work / "encoded.parquet"
    started = time.perf_counter()
    if not (model_dir / "transformer").is_dir():
        make_model_dir(model_dir, shape, args.device)
        make_data(store, encoded, model_dir, shape, n=8)
    print(f"model and data written in {time.perf_counter() - started:.0f} s to {work}", flush=True)
    results: dict = {"shape": args.shape, "steps": args.steps, "device": args.device,
                     "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
                     "torch": torch.__version__, "cuda": torch.version.cuda, "peak_flops": matmul_peak(args.device),
                     "base_dtype": args.base_dtype, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "command": "python bench/bench_train.py " + " ".join(sys.argv[1:]), "commit": source_commit()}
    for variant in args.variants.split(","):
        spec = VARIANTS[variant]
        if variant == "samples":
            spec = {**spec, "samples": samples_section(shape, max(1, args.steps // 2), args.sample_steps)}
        params = work / f"params-{variant}.yaml"
        write_params(params, model_dir, shape, args.steps, args.device, spec, args.base_dtype)
        prof = (lambda name: args.profile / f"{variant}-{name}.txt") if args.profile else (lambda name: None)
        results[variant] = {"params": {k: v for k, v in spec.items() if k != "plain"}}
        for runner in PLAIN_RUNNERS if spec["plain"] and not args.no_plain else ():
            plain = plain_loop(model_dir, shape, args.steps, args.device, spec.get("compile", False),
                               count_flops=results.get("flops_per_step") is None, profile=prof(runner),
                               runner=runner)
            flops = plain.pop("flops_per_step")
            results["flops_per_step"] = results.get("flops_per_step") or flops
            results[variant][runner] = plain
            print(json.dumps({variant: {runner: plain}}), flush=True)
        if args.device == "cuda":
            print(f"{variant}: this process holds {torch.cuda.memory_reserved() / 2**30:.1f} GB while ours runs",
                  flush=True)
        ours = run_ours(work, params, encoded, store, variant, prof("ours"))
        # the losses too: fp8 base weights must not change what is learned (same seed, data and steps as bf16)
        results[variant]["ours"] = {k: ours.get(k) for k in ("step_seconds", "max_memory_gb", "process_seconds",
                                                             "lora_dtype", "train_loss_first", "train_loss_last10")}
        if variant == "samples":
            # the flux-dev examples' 2000 steps; every_steps 0 (SampleParams' default), 250 (the examples'
            # checkpoint and eval cadence), 500 (the README's samples example)
            results[variant]["samples"] = sample_share(ours, spec["samples"], 2000, (0, 250, 500))
        print(json.dumps({variant: results[variant]}), flush=True)
    if args.profile:  # where each runner's GPU sat idle, next to the operator tables
        for trace in sorted(args.profile.glob("*.trace.json")):
            gaps = subprocess.run([sys.executable, str(REPO / "bench/trace_gaps.py"), str(trace)],
                                  capture_output=True, text=True)
            trace.with_name(trace.name.removesuffix(".trace.json") + ".gaps.txt").write_text(gaps.stdout + gaps.stderr)
            print(f"{trace.name}: {gaps.stdout.splitlines()[0] if gaps.stdout else gaps.stderr[-300:]}")
    eager = results.get("eager", {}).get("plain", {}).get("step_seconds")
    print(f"\n{args.shape} on {results['gpu'] or 'cpu'}; model FLOPs/step {results.get('flops_per_step') or 0:.3e}"
          + (f"; bf16 matmul peak {results['peak_flops'] / 1e12:.0f} TFLOP/s" if results["peak_flops"] else ""))
    print(f"{'variant':<14} {'runner':<15} {'s/step':>8} {'s/sample':>8} {'x eager plain':>14} {'MFU':>6} "
          f"{'peak GB':>8}")
    for variant in args.variants.split(","):
        per_step = samples_per_step(VARIANTS[variant])
        for runner in (*PLAIN_RUNNERS, "ours"):
            if runner not in results[variant]:
                continue
            r = results[variant][runner]
            mfu = (results["flops_per_step"] * per_step / r["step_seconds"] / results["peak_flops"]
                   if results["peak_flops"] and results.get("flops_per_step") else None)
            print(f"{variant:<14} {runner:<15} {r['step_seconds']:>8.3f} {r['step_seconds'] / per_step:>8.3f} "
                  f"{(eager * per_step / r['step_seconds']) if eager else float('nan'):>14.2f} "
                  f"{(f'{mfu:.0%}' if mfu else '-'):>6} {r['max_memory_gb'] or '-':>8}")
    if "samples" in results:
        r = results["samples"]["samples"]
        print(f"\nsamples: {r['renders']} renders of {len(SAMPLE_PROMPTS)} prompts x {args.sample_steps} steps at "
              f"{shape['resolution']}x{shape['resolution']}: {r['seconds_per_render']:.2f} s each, "
              f"{r['share_of_this_run']:.1%} of this {args.steps}-step run's wall time")
        for key, share in r.items():
            if key.startswith("share_at_"):
                print(f"  {key}: {share:.1%}")
    results["baseline_check"] = check_baselines(results, args.device)
    for line in results["baseline_check"]["lines"]:
        print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    if not results["baseline_check"]["ok"]:
        raise SystemExit(1)


def check_baselines(results: dict, device: str) -> dict:
    """Each plain loop's compile gain (its eager s/step over its compiled s/step, where both variants ran) and,
    only where every gain is at least MIN_COMPILE_GAIN, ours compiled against each compiled plain loop. On a GPU a
    smaller gain refuses the ratios (`ok` false: the bench exits 1); on the CPU compilation is not expected to pay,
    so the gains are printed and nothing is compared. Pure."""
    eager, compiled = results.get("eager", {}), results.get("compile", {})
    gains = {r: eager[r]["step_seconds"] / compiled[r]["step_seconds"]
             for r in PLAIN_RUNNERS if r in eager and r in compiled}
    lines = [f"compile gain of {r}: {g:.2f}x (eager {eager[r]['step_seconds']:.3f} s/step, compiled "
             f"{compiled[r]['step_seconds']:.3f})" for r, g in gains.items()]
    low = {r: g for r, g in gains.items() if g < MIN_COMPILE_GAIN}
    if device != "cuda":
        return {"gains": gains, "ok": True, "ratios": {},
                "lines": lines + ["no ratio on the CPU: compile gains are checked on a GPU"] if gains else lines}
    if low:
        return {"gains": gains, "ok": False, "ratios": {}, "lines": lines + [
            f"REFUSED: {', '.join(low)} gained less than {MIN_COMPILE_GAIN}x from compiling: that baseline is "
            "broken, so no ratio against it is printed"]}
    ours = compiled.get("ours", {}).get("step_seconds")
    ratios = {r: compiled[r]["step_seconds"] / ours for r in gains if ours}
    return {"gains": gains, "ok": True, "ratios": ratios, "lines": lines + [
        f"ours compiled against compiled {r}: {x:.2f}x ({compiled[r]['step_seconds']:.3f} / {ours:.3f} s/step)"
        for r, x in ratios.items()]}


if __name__ == "__main__":
    main()
