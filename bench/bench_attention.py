"""Attention kernels torch offers on this device, at a family's attention shape: forward + backward time of each
SDPA backend, and how far its outputs and gradients are from the flash kernel's (the train stage's default).

    python bench/bench_attention.py                       # Flux-dev at 1024x1024: 24 heads x 128, 4096 + 512 tokens
    python bench/bench_attention.py --tokens 4608 --heads 24 --head-dim 128 --iters 50

Each backend runs alone (torch.nn.attention.sdpa_kernel), `--iters` timed forward + backward passes after three
warm-up ones, on the same bf16 inputs; a backend torch refuses for these inputs is reported as such. The many
iterations are also the check for the crash once seen in a cuDNN attention backward (NOTES.md).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}


def run(backend: SDPBackend, q, k, v, grad, iters: int) -> tuple[float, tuple[torch.Tensor, ...]]:
    """Seconds per forward + backward (median of `iters`), and the output and input gradients of the last."""
    times = []
    for i in range(iters + 3):
        q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q_, k_, v_)
        out.backward(grad)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2], (out.detach(), q_.grad, k_.grad, v_.grad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4608)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA GPU")
    gen = torch.Generator("cuda").manual_seed(0)
    shape = (args.batch, args.heads, args.tokens, args.head_dim)
    q, k, v, grad = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    flops = 4 * args.batch * args.heads * args.tokens ** 2 * args.head_dim * 3.5  # fwd 2 products, bwd 5
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; "
          f"{shape} bf16, {args.iters} iterations")
    impls = getattr(torch.nn.attention, "list_flash_attention_impls", None)
    print(f"flash attention implementations registered: {impls() if impls else 'none (this torch has no registry)'}")
    results, reference = {}, None
    for name, backend in BACKENDS.items():
        try:
            seconds, tensors = run(backend, q, k, v, grad, args.iters)
        except RuntimeError as error:  # torch refuses the backend for these inputs
            results[name] = {"error": str(error).splitlines()[0][:200]}
            print(f"{name:10s} refused: {results[name]['error']}")
            continue
        reference = reference or tensors
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(tensors, reference))
        results[name] = {"seconds": seconds, "tflops": flops / seconds / 1e12, "max_abs_diff_vs_flash": diff}
        print(f"{name:10s} {seconds * 1000:8.3f} ms fwd+bwd  {flops / seconds / 1e12:6.0f} TFLOP/s  "
              f"max |diff| vs flash {diff:.3g}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
