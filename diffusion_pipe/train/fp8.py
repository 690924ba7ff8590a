"""fp8 base weights (`model.base_dtype`): the frozen Linear weights of the denoiser's blocks kept in
float8_e4m3fn with one scale per output row, so the base model takes half the memory of bf16 (and a swapped
block half the transfer), while every product is computed in the model's dtype.

`Fp8Linear` replaces a frozen `nn.Linear` (or the base layer peft's LoRA wraps): LoRA keeps its own bf16 weights
with fp32 masters, untouched. Its forward dequantises the weight for the product and saves only the fp8 weight
for backward (a plain `F.linear` on the dequantised weight would keep a bf16 copy of every layer alive from
forward to backward: the whole bf16 model again). With `matmul=True`, where `torch._scaled_mm` runs, the forward
product is itself fp8 (inputs quantised per row); gradients are always computed on the dequantised weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantise_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale of shape (rows, 1)) with weight ~= fp8 * scale; each row's largest magnitude
    maps to fp8's largest value."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantise(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 `weight` times its row `scale`, in `dtype` (every e4m3 value is exact in bf16: one rounding)."""
    return weight.to(dtype) * scale.to(dtype)


def _scaled_mm_supported(device: torch.device) -> bool:
    """Whether fp8 matrix products run on `device`: CUDA needs compute capability 8.9 (Ada, Hopper) or newer."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"


class _Fp8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with W = fp8 * scale, frozen: saves the fp8 weight, not a dequantised copy."""

    @staticmethod
    def forward(ctx, x, weight, scale, bias, matmul):
        ctx.save_for_backward(weight, scale)
        if matmul:
            rows = x.reshape(-1, x.shape[-1])
            x8, x_scale = quantise_rows(rows)
            out = torch._scaled_mm(x8, weight.t(), scale_a=x_scale, scale_b=scale.t().contiguous(),
                                   bias=bias, out_dtype=x.dtype)
            return out.reshape(*x.shape[:-1], weight.shape[0])
        return F.linear(x, dequantise(weight, scale, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_out):
        weight, scale = ctx.saved_tensors
        return grad_out @ dequantise(weight, scale, grad_out.dtype), None, None, None, None


class Fp8Linear(nn.Linear):
    """A frozen Linear whose weight is stored in fp8 with a float32 scale per output row. A `nn.Linear`
    subclass, so code that looks for Linear modules (LoRA targets) still finds it."""

    def __init__(self, linear: nn.Linear, matmul: bool = False) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a full-precision weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = quantise_rows(linear.weight)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        # fp8 products need both sides' inner dimensions and the output width in multiples of 16
        self.matmul = matmul and self.in_features % 16 == 0 and self.out_features % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        matmul = self.matmul and _scaled_mm_supported(x.device) and x.dtype == torch.bfloat16
        return _Fp8LinearFunction.apply(x, self.weight, self.weight_scale, self.bias, matmul)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8, matmul={self.matmul}"


def quantise_frozen_linears(modules: list[nn.Module], matmul: bool = False) -> int:
    """Replace every frozen, materialised `nn.Linear` inside `modules` (peft's base layers included, its LoRA
    matrices not) by an `Fp8Linear`, in place. Returns how many were replaced."""
    count = 0
    for root in modules:
        for parent in list(root.modules()):
            for name, child in list(parent.named_children()):
                if (type(child) is nn.Linear and not child.weight.requires_grad
                        and child.weight.device.type != "meta" and not isinstance(parent, nn.ModuleDict)):
                    setattr(parent, name, Fp8Linear(child, matmul=matmul))
                    count += 1
    return count
