"""Train-stage speed: our full train stage (DeepSpeed pipeline engine, data from the store) against a plain
diffusers + peft loop on the same model and shapes, measured in the same run.

    python bench/bench_train.py --shape dev --steps 20            # H200: Flux-dev-shaped, 1024x1024, LoRA r32
    python bench/bench_train.py --shape tiny --steps 6 --device cpu   # smoke test anywhere
    python bench/bench_train.py --shape dev --base-dtype float8 --variants eager,cap24 --no-plain  # fp8 base

The model is random-init (no weights can be downloaded), written in diffusers format and loaded back through
the same `from_pretrained`/safetensors path a real checkpoint takes. Model FLOPs per step are counted by
torch's FlopCounterMode on one forward + backward of the plain loop (every matmul and attention, the LoRA's
own included; recomputation not counted), and utilisation is against a bf16 matmul peak measured in the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {
    "dev": {"transformer": dict(num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
                                joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                                in_channels=64, axes_dims_rope=(16, 56, 56)),
            "latent_channels": 16, "vae_blocks": 4, "t5_dim": 4096, "clip_dim": 768, "text_len": 512,
            "resolution": 1024},
    "tiny": {"transformer": dict(num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                                 joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
                                 in_channels=16, axes_dims_rope=(4, 6, 6)),
             "latent_channels": 4, "vae_blocks": 3, "t5_dim": 32, "clip_dim": 32, "text_len": 32,
             "resolution": 64},
}


def make_model_dir(root: Path, shape: dict, device: str) -> Path:
    """A diffusers-format Flux directory: a full random-init transformer, and the configs of the other
    components (training reads only their shapes)."""
    from diffusers import FluxTransformer2DModel

    with torch.device(device):
        model = FluxTransformer2DModel(**shape["transformer"]).to(torch.bfloat16)
    model.save_pretrained(root / "transformer", max_shard_size="10GB")
    del model
    vae = {"_class_name": "AutoencoderKL", "block_out_channels": [128] * shape["vae_blocks"],
           "latent_channels": shape["latent_channels"], "scaling_factor": 0.3611, "shift_factor": 0.1159}
    for name, config in (("vae", vae), ("text_encoder", {"hidden_size": shape["clip_dim"]}),
                         ("text_encoder_2", {"d_model": shape["t5_dim"]})):
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.json").write_text(json.dumps(config))
    return root


def make_data(store_root: Path, encoded: Path, shape: dict, n: int) -> None:
    """`n` latent and text entries in a store, and the encoded table that lists them."""
    from diffusion_pipe.bucket_labels import bucket_label
    from diffusion_pipe.encode.encode import Sample, write_encoded_table
    from diffusion_pipe.hashing import hash_json
    from diffusion_pipe.store import Store

    store = Store(store_root)
    res, scale = shape["resolution"], 2 ** (shape["vae_blocks"] - 1)
    bucket = bucket_label(res, res, 1)
    samples = []
    with store.writer("latent") as lw, store.writer("text") as tw:
        for i in range(n):
            lkey, tkey = hash_json(["bench-latent", i]), hash_json(["bench-text", i])
            lw.add(lkey, {"latents": torch.randn(shape["latent_channels"], res // scale, res // scale,
                                                 dtype=torch.bfloat16)})
            tw.add(tkey, {"t5": torch.randn(shape["text_len"], shape["t5_dim"], dtype=torch.bfloat16),
                          "clip_pooled": torch.randn(shape["clip_dim"], dtype=torch.bfloat16)})
            samples.append(Sample("bench", f"{i}.png", bucket, "train", 1, "", "", lkey, tkey))
    write_encoded_table(samples, encoded)


# name -> train params of our run; "plain": whether the plain loop runs the same variant
VARIANTS = {
    "eager": {"plain": True, "max_gpu_memory_gb": 80},
    "compile": {"plain": True, "compile": True, "max_gpu_memory_gb": 80},
    "cap48": {"plain": False, "activation_checkpointing": True, "max_gpu_memory_gb": 48},
    "cap24": {"plain": False, "activation_checkpointing": True, "blocks_to_swap": 20, "max_gpu_memory_gb": 24},
    # with --base-dtype float8 the frozen weights take half the memory: these caps need fewer or no swapped blocks
    "cap24-noswap": {"plain": False, "activation_checkpointing": True, "max_gpu_memory_gb": 24},
    "cap16": {"plain": False, "activation_checkpointing": True, "blocks_to_swap": 8, "max_gpu_memory_gb": 16},
}


def write_params(path: Path, model_dir: Path, shape: dict, steps: int, device: str, variant: dict,
                 base_dtype: str = "") -> None:
    path.write_text(f"""
model: {{family: flux, path: {model_dir}, dtype: bfloat16, base_dtype: "{base_dtype}"}}
scan: {{datasets: [{{path: .}}]}}
encode: {{text_max_length: {shape['text_len']}}}
train:
  steps: {steps}
  micro_batch_size: 1
  learning_rate: 1.0e-4
  lora_rank: 32
  lora_alpha: 32.0
  device: {'cuda' if device == 'cuda' else 'cpu'}
  guidance: 3.5
""" + "".join(f"  {k}: {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in variant.items()
              if k != "plain" and (device == "cuda" or k != "max_gpu_memory_gb")))


def run_ours(work: Path, params: Path, encoded: Path, store: Path, tag: str, profile: Path | None) -> dict:
    """Our train stage as users run it (a fresh process); returns its report plus the process's wall time."""
    runs = work / f"runs-{tag}"
    env = dict(os.environ, DIFFUSION_PIPE_STORE=str(store), PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}")
    if profile:
        env["DIFFUSION_PIPE_PROFILE"] = str(profile)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "stages.train", "--params", str(params), "--encoded", str(encoded),
                           "--out", str(runs / "out"), "--report", str(runs / "report.json"),
                           "--loss-plot", str(runs / "loss.csv"), "--runs", str(runs)],
                          cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"train stage failed:\n{proc.stderr[-4000:]}")
    report = json.loads((runs / "report.json").read_text())
    report["process_seconds"] = time.perf_counter() - started
    return report


def plain_loop(model_dir: Path, shape: dict, steps: int, device: str, compile_layers: bool,
               count_flops: bool, profile: Path | None = None) -> dict:
    """The baseline: diffusers' transformer + peft LoRA (same targets and rank), AdamW, bf16, no framework."""
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    from diffusion_pipe.models.flux import FluxAdapter, image_ids, pack_latents
    from diffusion_pipe.train.lora import target_module_names

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # as the train stage does (see train/pipeline.py)
    model = FluxTransformer2DModel.from_pretrained(model_dir / "transformer", torch_dtype=torch.bfloat16).to(dev)
    model.requires_grad_(False)
    adapter = FluxAdapter(model_dir, torch.bfloat16)
    targets = target_module_names(model, adapter.default_lora_targets, adapter.lora_exclude())
    model.add_adapter(LoraConfig(r=32, lora_alpha=32, target_modules=targets, init_lora_weights=True))
    if compile_layers:
        for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
            block.compile()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
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

    def step() -> None:
        pred = model(**kwargs)[0]
        loss = torch.nn.functional.mse_loss(pred.float(), target.float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    flops = None
    if count_flops:
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
        with counter:
            step()
        flops = counter.get_total_flops()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps):
        started = time.perf_counter()
        if profile and i == 3:
            from torch.profiler import ProfilerActivity, profile as torch_profile

            from diffusion_pipe.train.loop import write_profile

            cuda = dev.type == "cuda"
            with torch_profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
                with torch.profiler.record_function(f"train.step{i}"):
                    step()
                    if cuda:
                        torch.cuda.synchronize()
            write_profile(prof, profile)
        else:
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    out = {"step_seconds": statistics.median(times[2:] or times), "flops_per_step": flops,
           "max_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.type == "cuda" else None}
    del model, opt, params
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


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
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of: {', '.join(VARIANTS)}")
    parser.add_argument("--work", type=Path, default=None, help="working directory (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--no-plain", action="store_true", help="run ours only")
    parser.add_argument("--base-dtype", choices=["", "float8", "float8_matmul"], default="",
                        help="model.base_dtype of our runs: the blocks' frozen weights in fp8, computed by "
                             "dequantising (float8) or in fp8 matmuls (float8_matmul); the plain loop stays bf16")
    parser.add_argument("--profile", type=Path, default=None,
                        help="write torch.profiler tables, Chrome traces and their GPU-idle breakdown "
                             "(bench/trace_gaps.py) of both runners into this directory")
    args = parser.parse_args()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-train-"))
    model_dir, store, encoded = work / "model", work / "store", work / "encoded.parquet"
    started = time.perf_counter()
    if not (model_dir / "transformer").is_dir():
        make_model_dir(model_dir, shape, args.device)
        make_data(store, encoded, shape, n=8)
    print(f"model and data written in {time.perf_counter() - started:.0f} s to {work}", flush=True)
    results: dict = {"shape": args.shape, "steps": args.steps, "device": args.device,
                     "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
                     "torch": torch.__version__, "peak_flops": matmul_peak(args.device), "base_dtype": args.base_dtype}
    for variant in args.variants.split(","):
        spec = VARIANTS[variant]
        params = work / f"params-{variant}.yaml"
        write_params(params, model_dir, shape, args.steps, args.device, spec, args.base_dtype)
        prof = (lambda name: args.profile / f"{variant}-{name}.txt") if args.profile else (lambda name: None)
        results[variant] = {"params": {k: v for k, v in spec.items() if k != "plain"}}
        if spec["plain"] and not args.no_plain:
            plain = plain_loop(model_dir, shape, args.steps, args.device, spec.get("compile", False),
                               count_flops=results.get("flops_per_step") is None, profile=prof("plain"))
            flops = plain.pop("flops_per_step")
            results["flops_per_step"] = results.get("flops_per_step") or flops
            results[variant]["plain"] = plain
        ours = run_ours(work, params, encoded, store, variant, prof("ours"))
        # the losses too: fp8 base weights must not change what is learned (same seed, data and steps as bf16)
        results[variant]["ours"] = {k: ours.get(k) for k in ("step_seconds", "max_memory_gb", "process_seconds",
                                                             "lora_dtype", "train_loss_first", "train_loss_last10")}
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
    print(f"{'variant':<14} {'runner':<6} {'s/step':>8} {'x eager plain':>14} {'MFU':>6} {'peak GB':>8}")
    for variant in args.variants.split(","):
        for runner in ("plain", "ours"):
            if runner not in results[variant]:
                continue
            r = results[variant][runner]
            mfu = (results["flops_per_step"] / r["step_seconds"] / results["peak_flops"]
                   if results["peak_flops"] and results.get("flops_per_step") else None)
            print(f"{variant:<14} {runner:<6} {r['step_seconds']:>8.3f} "
                  f"{(eager / r['step_seconds']) if eager else float('nan'):>14.2f} "
                  f"{(f'{mfu:.0%}' if mfu else '-'):>6} {r['max_memory_gb'] or '-':>8}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
