"""Attention kernels torch offers on this device, at a family's attention shape: forward + backward time of each
SDPA backend, in the layouts a diffusers attention processor hands them, eager and compiled, and how far each
one's outputs and gradients are from the flash kernel's (the train stage's default).

    python bench/bench_attention.py                       # Flux-dev at 1024x1024: 24 heads x 128, 4096 + 512 tokens
    python bench/bench_attention.py --tokens 4608 --heads 24 --head-dim 128 --iters 50
    python bench/bench_attention.py --flux-blocks --layouts ''  # Flux blocks only: flash against cuDNN

Layouts: `bhsd`, q/k/v contiguous as [batch, heads, tokens, head dim] (the kernels' own); `bshd`, what diffusers'
`native` backend passes: projections shaped [batch, tokens, heads, head dim] and permuted (strided views), the
output permuted back and flattened to [batch, tokens, width], as the processor's out-projection takes it;
`bshd-contiguous`, the same with q/k/v copied to the kernels' layout first (diffusers' `_native_cudnn` backend),
the copies timed. Each backend runs alone (torch.nn.attention.sdpa_kernel), `--iters` timed forward + backward
passes after three warm-up ones (compiled: after compiling), on the same bf16 inputs; a backend torch refuses for
these inputs is reported as such. The many iterations are also the check for the crash once seen in a cuDNN
attention backward (NOTES.md). `--flux-blocks` also runs a diffusers Flux double + single block at this width under
the train stage's kernel order (flash) and with cuDNN's kernel first (what the removed `train.attention: cudnn`
set), eager and compiled: time, and how far the outputs and every gradient are from flash's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}


def attention_in(layout: str, backend: SDPBackend):
    """The attention as a processor runs it in `layout`: (q, k, v) in the layout's input shape -> output."""

    def bhsd(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v)

    def bshd(q, k, v):
        q, k, v = (x.permute(0, 2, 1, 3) for x in (q, k, v))
        if layout == "bshd-contiguous":
            q, k, v = (x.contiguous() for x in (q, k, v))
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v)
        return out.permute(0, 2, 1, 3).flatten(2, 3)

    return bhsd if layout == "bhsd" else bshd


def run(fn, q, k, v, grad, iters: int) -> tuple[float, tuple[torch.Tensor, ...]]:
    """Seconds per forward + backward (median of `iters`), and the output and input gradients of the last, in
    the kernels' [batch, heads, tokens, head dim] layout whatever the inputs' layout (to compare across them)."""
    times = []
    for i in range(iters + 3):
        q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(q_, k_, v_)
        out.backward(grad)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1000)
    tensors = (out.detach(), q_.grad, k_.grad, v_.grad)
    if out.dim() == 3:  # [batch, tokens, width] from a bshd layout
        tensors = (out.detach().unflatten(-1, q.shape[2:]), q_.grad, k_.grad, v_.grad)
        tensors = tuple(t.transpose(1, 2) for t in tensors)
    return sorted(times)[len(times) // 2], tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4608)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--layouts", default="bhsd,bshd,bshd-contiguous")
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    parser.add_argument("--flux-blocks", action="store_true",
                        help="also: a Flux double and single block at this width, flash against cuDNN as the train "
                             "stage picks them (train.attention), their gradients compared")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA GPU")
    gen = torch.Generator("cuda").manual_seed(0)
    b, h, s, d = args.batch, args.heads, args.tokens, args.head_dim
    flops = 4 * b * h * s ** 2 * d * 3.5  # fwd 2 products, bwd 5
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; "
          f"batch {b}, {h} heads x {d}, {s} tokens, bf16, {args.iters} iterations")
    impls = getattr(torch.nn.attention, "list_flash_attention_impls", None)
    print(f"flash attention implementations registered: {impls() if impls else 'none (this torch has no registry)'}")
    results, reference = {}, None
    bhsd = [torch.randn((b, h, s, d), device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)]
    for layout in filter(None, args.layouts.split(",")):
        q, k, v, grad = bhsd  # the same values in every layout
        if layout != "bhsd":
            q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            grad = grad.transpose(1, 2).flatten(2, 3).contiguous()
        for mode in ["eager"] + ([] if args.no_compile else ["compiled"]):
            for name, backend in BACKENDS.items():
                key = f"{layout} {mode} {name}"
                fn = attention_in(layout, backend)
                if mode == "compiled":
                    torch._dynamo.reset()
                    fn = torch.compile(fn)
                try:
                    seconds, tensors = run(fn, q, k, v, grad, args.iters)
                except Exception as error:  # torch refuses the backend for these inputs
                    results[key] = {"error": str(error).strip().splitlines()[-1][:200]}
                    print(f"{key:32s} refused: {results[key]['error']}")
                    continue
                if layout == "bhsd" and mode == "eager" and name == "flash":
                    reference = tensors
                diffs = [(x.float() - y.float()).abs().max().item() for x, y in zip(tensors, reference)]
                results[key] = {"seconds": seconds, "tflops": flops / seconds / 1e12,
                                "max_abs_diff_vs_flash": dict(zip(("out", "dq", "dk", "dv"), diffs))}
                print(f"{key:32s} {seconds * 1000:8.3f} ms fwd+bwd  {flops / seconds / 1e12:6.0f} TFLOP/s  "
                      f"max |diff| vs eager flash: out {diffs[0]:.3g} dq {diffs[1]:.3g} dk {diffs[2]:.3g} "
                      f"dv {diffs[3]:.3g}")
    if args.flux_blocks:
        results["flux_blocks"] = flux_blocks(b, h, d, s - 512, 512, args.iters, not args.no_compile)
    print(json.dumps(results))


class FluxBlocks(NamedTuple):
    forward: Callable  # (image, text) -> image
    gradients: Callable  # (image, text) -> {name: gradient}
    zero_grad: Callable
    image: torch.Tensor
    text: torch.Tensor
    grad: torch.Tensor  # of the output


def flux_blocks_setup(batch: int, heads: int, dim: int, image_tokens: int, text_tokens: int, device: str = "cuda"):
    """A diffusers Flux double block then a single block at this width (random init, seed 0, bf16) and inputs for
    them. `gradients(image, text)` reads the inputs' and every weight's gradient after a backward; `zero_grad()`
    clears the weights'."""
    from diffusers.models.transformers.transformer_flux import (FluxPosEmbed, FluxSingleTransformerBlock,
                                                                FluxTransformerBlock)

    width, dtype = heads * dim, torch.bfloat16
    torch.manual_seed(0)
    double = FluxTransformerBlock(width, heads, dim).to(device, dtype)
    single = FluxSingleTransformerBlock(width, heads, dim).to(device, dtype)
    gen = torch.Generator(device).manual_seed(2)
    image = torch.randn(batch, image_tokens, width, device=device, dtype=dtype, generator=gen)
    text = torch.randn(batch, text_tokens, width, device=device, dtype=dtype, generator=gen)
    temb = torch.randn(batch, width, device=device, dtype=dtype, generator=gen)
    side = int(image_tokens ** 0.5)
    ids = torch.zeros(text_tokens + image_tokens, 3, device=device)
    ids[text_tokens:, 1] = torch.arange(image_tokens, device=device) // side
    ids[text_tokens:, 2] = torch.arange(image_tokens, device=device) % side
    rotary = FluxPosEmbed(theta=10000, axes_dim=[16, 56, 56] if dim == 128 else [dim // 4, dim // 4, dim // 2])(ids)
    grad = torch.randn(batch, image_tokens, width, device=device, dtype=dtype, generator=gen)

    def forward(x, c):
        c, x = double(x, c, temb, rotary)
        c, x = single(x, c, temb, rotary)
        return x

    def gradients(x, c) -> dict:
        return {"d image": x.grad, "d text": c.grad, **{f"double.{n}": p.grad for n, p in double.named_parameters()},
                **{f"single.{n}": p.grad for n, p in single.named_parameters()}}

    def zero_grad():
        for p in (*double.parameters(), *single.parameters()):
            p.grad = None

    return FluxBlocks(forward, gradients, zero_grad, image, text, grad)


def relative_differences(reference: dict, tensors: dict) -> dict:
    """|a - b| / |b| per tensor (Frobenius norms, b the reference), over the tensors whose reference is not noise:
    a key bias's gradient is near zero (softmax ignores a shift shared by every key), so its bf16 rounding would
    rank first."""
    norms = {n: reference[n].float().norm().item() for n in tensors}
    return {n: (t.float() - reference[n].float()).norm().item() / norms[n] for n, t in tensors.items()
            if norms[n] > 1e-3 * max(norms.values())}


def use_kernel_order(kernel: str) -> None:
    """For the rest of the process: "flash", the SDPA kernel order the train stage sets (`use_attention_kernel`);
    "cudnn", cuDNN's kernel first with flash off (compiled code takes flash whenever it is allowed, whatever the
    order), as the removed `train.attention: cudnn` did, to measure whether cuDNN's gradients are right again."""
    from torch.nn.attention import _sdpa_kernel

    from diffusion_pipe.train.pipeline import use_attention_kernel

    if kernel == "flash":
        use_attention_kernel()
    else:
        _sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], set_priority=True)


def flux_blocks(batch: int, heads: int, dim: int, image_tokens: int, text_tokens: int, iters: int,
                compiled: bool, device: str = "cuda") -> dict:
    """The Flux double + single block of `flux_blocks_setup`, forward + backward with the SDPA kernel order the
    train stage sets and with cuDNN's kernel first (`use_kernel_order`): seconds per pass and, against
    flash, the largest `relative_differences` in the outputs and in the gradients of the inputs and of every
    weight. cuDNN's kernel gets the strided q/k/v views diffusers' attention processor makes, and whatever layout
    of the output's gradient autograd (or the compiled graph) hands back: a kernel that mishandled either would
    show here as a large difference."""
    blocks = flux_blocks_setup(batch, heads, dim, image_tokens, text_tokens, device)
    out = {}
    for mode in ["eager"] + (["compiled"] if compiled else []):
        reference = None
        for kernel in ("flash", "cudnn"):
            use_kernel_order(kernel)
            fn = blocks.forward
            if mode == "compiled":
                torch._dynamo.reset()
                fn = torch.compile(blocks.forward)
            times = []
            for i in range(iters + 3):
                blocks.zero_grad()
                x, c = blocks.image.detach().requires_grad_(), blocks.text.detach().requires_grad_()
                start = time.perf_counter()
                y = fn(x, c)
                y.backward(blocks.grad)
                if device == "cuda":
                    torch.cuda.synchronize()
                if i >= 3:
                    times.append(time.perf_counter() - start)
            tensors = {"out": y.detach(), **blocks.gradients(x, c)}
            row = {"seconds": sorted(times)[len(times) // 2]}
            if reference is None:
                reference = tensors
            else:
                rel = relative_differences(reference, tensors)
                worst = max(rel, key=rel.get)
                row.update(worst=worst, worst_relative_diff=rel[worst], out_relative_diff=rel["out"],
                           inputs_relative_diff=max(rel["d image"], rel["d text"]))
            out[f"{mode} {kernel}"] = row
            print(f"flux blocks {mode:8s} {kernel:6s} {row['seconds'] * 1000:8.2f} ms fwd+bwd"
                  + (f"  vs flash, |a - b| / |b|: out {row['out_relative_diff']:.3g}, input gradients "
                     f"{row['inputs_relative_diff']:.3g}, worst gradient {worst} {row['worst_relative_diff']:.3g}"
                     if "worst" in row else ""))
    use_kernel_order("flash")
    return out


if __name__ == "__main__":
    main()
