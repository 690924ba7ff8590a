"""Would fusing each LoRA with its base matmul speed up the train step, and what would it cost in what the forward
sees? One of issue 17's candidates for the compiled Flux-dev step.

    python bench/bench_lora_fusion.py                    # GPU: time per step's LoRA linears, and the precision
    python bench/bench_lora_fusion.py --device cpu --precision-only

Three ways to run a LoRA'd linear y = x W^T + s (x A^T) B^T, forward + backward, bf16, `torch.compile`d, with x
requiring its gradient as a pipeline layer's input does and W frozen:
- `base`: x W^T alone (no adapter): the floor;
- `peft`: the base product plus the adapter's two thin products and the sum, as peft's `lora.Linear` runs it
  (the train stage's way);
- `fused`: one product with W + s B A, formed in the weights' dtype in the forward and again in the backward
  (`FusedLora`: the backward also gives A's and B's gradients through thin products, never a full-size weight
  gradient; keeping the merged weight instead would hold a second copy of every adapted weight);
- `addmm`: the adapter's thin products first, then the base product adding them (`torch.addmm`, beta = s): no
  separate sum, and (where the library adds C in its fp32 accumulator, as on the CPU) one rounding to bf16, not two.
Timed at every Flux-dev (1024x1024: 4096 image and 512 text tokens, width 3072) LoRA target shape, each shape's
time times its count in the model's 57 blocks: the step's LoRA'd linears. Two clocks: the device's kernel time
(what a pass costs inside a step whose host runs ahead, as the train stage's does) and a lone synchronized pass's
wall time (launch-bound at the small shapes).

Precision: W is stored in bf16, so W + s B A formed in bf16 rounds the adapter's change to W's grid; an entry
below half a step of that grid is lost, for every token alike. peft's sum has the same flaw one step later: the
base output is rounded to bf16 first, and an adapter output under half a step of that grid is lost. `retained`
is the share of the adapter's effect on the output that survives (the projection of each way's y minus the exact
x W^T on the exact s x A^T B^T), for an adapter whose change to W has an RMS of `ratio` times W's RMS; 1.0 is all
of it.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

# Flux-dev's LoRA targets (the flux adapter's default_lora_targets) as (in, out, tokens): count in the model.
# 19 double blocks (image stream 4096 tokens, text stream 512) and 38 single blocks (4608 tokens).
WIDTH, IMAGE, TEXT = 3072, 4096, 512
FLUX_DEV_SHAPES = {
    (WIDTH, WIDTH, IMAGE): 19 * 4,  # to_q, to_k, to_v, to_out.0
    (WIDTH, WIDTH, TEXT): 19 * 4,  # add_q_proj, add_k_proj, add_v_proj, to_add_out
    (WIDTH, 4 * WIDTH, IMAGE): 19, (4 * WIDTH, WIDTH, IMAGE): 19,  # ff.net.0.proj, ff.net.2
    (WIDTH, 4 * WIDTH, TEXT): 19, (4 * WIDTH, WIDTH, TEXT): 19,  # ff_context.net.0.proj, ff_context.net.2
    (WIDTH, WIDTH, IMAGE + TEXT): 38 * 3,  # single blocks' to_q, to_k, to_v
    (WIDTH, 4 * WIDTH, IMAGE + TEXT): 38,  # proj_mlp
    (5 * WIDTH, WIDTH, IMAGE + TEXT): 38,  # proj_out (attention and MLP outputs concatenated)
}


class FusedLora(torch.autograd.Function):
    """y = x (W + s B A)^T + bias with the merged weight formed in W's dtype; gradients of x, A and B (W and the
    bias are frozen)."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scale):
        ctx.save_for_backward(x, weight, lora_a, lora_b)
        ctx.scale = scale
        return F.linear(x, weight + scale * (lora_b @ lora_a), bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight, lora_a, lora_b = ctx.saved_tensors
        s = ctx.scale
        grad_x = grad @ (weight + s * (lora_b @ lora_a))
        g2, x2 = grad.flatten(0, -2), x.flatten(0, -2)
        grad_a = s * (g2 @ lora_b).t() @ x2
        grad_b = s * g2.t() @ (x2 @ lora_a.t())
        return grad_x, None, None, grad_a, grad_b, None


def ways(scale: float) -> dict:
    """name -> fn(x, weight, bias, lora_a, lora_b) giving y."""

    def addmm(x, w, bias, a, b):
        lora = F.linear(F.linear(x, a), b).flatten(0, -2)
        return torch.addmm(lora, x.flatten(0, -2), w.t(), beta=scale).unflatten(0, x.shape[:-1]) + bias

    return {
        "base": lambda x, w, bias, a, b: F.linear(x, w, bias),
        "peft": lambda x, w, bias, a, b: F.linear(x, w, bias) + F.linear(F.linear(x, a), b) * scale,
        "fused": lambda x, w, bias, a, b: FusedLora.apply(x, w, bias, a, b, scale),
        "addmm": addmm,
    }


def operands(d_in: int, d_out: int, tokens: int, rank: int, device: str, dtype: torch.dtype, ratio: float,
             seed: int = 0) -> tuple[torch.Tensor, ...]:
    """x, W (RMS 0.02, a trained transformer's scale), its bias, A, B with s B A of RMS `ratio` x W's (scale 1)."""
    gen = torch.Generator(device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32)

    x, weight, bias = randn(1, tokens, d_in), 0.02 * randn(d_out, d_in), 0.02 * randn(d_out)
    lora_a, lora_b = randn(rank, d_in) / d_in ** 0.5, randn(d_out, rank) / rank ** 0.5
    lora_b *= ratio * 0.02 / (lora_b @ lora_a).pow(2).mean().sqrt()
    return tuple(t.to(dtype) for t in (x, weight, bias, lora_a, lora_b))


def retained(d_in: int, d_out: int, tokens: int, rank: int, ratio: float, device: str) -> dict[str, float]:
    """Per way, the share of the adapter's exact effect on y that its bf16 computation keeps."""
    tensors = operands(d_in, d_out, tokens, rank, device, torch.bfloat16, ratio)
    x, w, bias, a, b = (t.double() for t in tensors)
    exact_base = F.linear(x, w, bias)
    exact_delta = F.linear(F.linear(x, a), b)
    out = {}
    for name, fn in ways(1.0).items():
        if name != "base":
            with torch.no_grad():
                got = fn(*tensors).double() - exact_base
            out[name] = float((got * exact_delta).sum() / exact_delta.pow(2).sum())
    return out


def time_way(fn, x, w, bias, a, b, iters: int) -> tuple[float, float]:
    """Seconds of a forward + backward of compiled `fn`, after compiling and three warm-up passes: the device's
    kernel time per pass (summed from a profile of `iters` passes: what the pass costs in a step whose host runs
    ahead of the device, as the train stage's does) and the median wall time of a pass synchronized alone (host
    included: launch-bound for the small shapes)."""
    from torch.profiler import ProfilerActivity, profile

    fn = torch.compile(fn)
    grad = torch.randn(*x.shape[:-1], w.shape[0], device=x.device, dtype=x.dtype)

    def one_pass():
        x_, a_, b_ = (t.detach().requires_grad_() for t in (x, a, b))
        fn(x_, w, bias, a_, b_).backward(grad)

    walls = []
    for i in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        one_pass()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            walls.append(start.elapsed_time(end) / 1000)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            one_pass()
        torch.cuda.synchronize()
    device_us = sum(e.self_device_time_total for e in prof.key_averages())
    if device_us <= 0:
        raise RuntimeError("the profile recorded no kernel time")
    return device_us / 1e6 / iters, sorted(walls)[len(walls) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision-only", action="store_true", help="only the retained shares (any device)")
    parser.add_argument("--ratios", default="0.0003,0.001,0.003,0.01,0.03")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    results: dict = {"precision": {}, "timing": {}}
    # one square shape is enough for the precision: the rounding is per weight entry
    for ratio in map(float, args.ratios.split(",")):
        results["precision"][ratio] = retained(WIDTH, WIDTH, 512, args.rank, ratio, args.device)
        print(f"adapter RMS {ratio:g} x W's: retained " + ", ".join(
            f"{k} {v:.3f}" for k, v in results["precision"][ratio].items()), flush=True)
    if not args.precision_only:
        if not torch.cuda.is_available() or args.device != "cuda":
            sys.exit("timing needs a CUDA GPU (--precision-only runs anywhere)")
        # each shape compiled for itself, as the train stage's layers are (no dynamic shapes, no recompile limit)
        torch._dynamo.config.automatic_dynamic_shapes = False
        torch._dynamo.config.cache_size_limit = torch._dynamo.config.recompile_limit = 256
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, rank {args.rank}, bf16, compiled")
        totals = {clock: dict.fromkeys(ways(1.0), 0.0) for clock in ("device", "wall")}
        for (d_in, d_out, tokens), count in FLUX_DEV_SHAPES.items():
            tensors = operands(d_in, d_out, tokens, args.rank, "cuda", torch.bfloat16, 0.01)
            row = {name: time_way(fn, *tensors, args.iters) for name, fn in ways(1.0).items()}
            results["timing"][f"{d_in}x{d_out}x{tokens}"] = {"count": count, **row}
            for name, (device, wall) in row.items():
                totals["device"][name] += count * device
                totals["wall"][name] += count * wall
            print(f"{d_in:>6} -> {d_out:<6} {tokens:>5} tokens x{count:<4} device ms " + "  ".join(
                f"{k} {v[0] * 1e3:.3f}" for k, v in row.items()) + "; wall ms " + "  ".join(
                f"{k} {v[1] * 1e3:.3f}" for k, v in row.items()), flush=True)
        results["step_lora_linears_s"] = totals
        for clock, total in totals.items():
            print(f"per Flux-dev step, its {sum(FLUX_DEV_SHAPES.values())} LoRA'd linears, {clock} time: " + ", ".join(
                f"{k} {v:.4f} s" for k, v in total.items()) + "; over base: " + ", ".join(
                f"{k} {v - total['base']:+.4f} s" for k, v in total.items() if k != "base"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
