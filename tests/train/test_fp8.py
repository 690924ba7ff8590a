"""fp8 base weights (model.base_dtype): storage halves, numerics stay close to bf16, LoRA still trains in bf16."""

import pytest
import torch
from torch import nn

from diffusion_pipe.models.flux import FluxAdapter
from diffusion_pipe.train.build import build_local_model
from diffusion_pipe.train.fp8 import Fp8Linear, dequantise, quantise_frozen_linears, quantise_rows
from diffusion_pipe.train.swap import SwapQueue, SwappedLayer


def test_row_quantisation_error_is_bounded():
    """e4m3 keeps 3 mantissa bits: every element within 1/16 of its row's largest magnitude (rows scaled
    apart by 1000x each keep their own precision)."""
    w = torch.randn(64, 48) * torch.logspace(-3, 0, 64)[:, None]
    q, scale = quantise_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    err = (dequantise(q, scale, torch.float32) - w).abs()
    assert (err <= w.abs().amax(dim=1, keepdim=True) / 16).all()


@pytest.mark.parametrize("matmul", [False, True])
def test_fp8_linear_matches_bf16_and_saves_no_bf16_weight(matmul):
    """Outputs within 4% (relative norm) of the bf16 Linear; gradients to the input equal the dequantised
    weight's; the frozen weight gets no gradient."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 32).bfloat16().requires_grad_(False)
    fp8 = Fp8Linear(linear, matmul=matmul)
    assert fp8.matmul is matmul and fp8.weight.dtype == torch.float8_e4m3fn
    x = torch.randn(4, 7, 64, dtype=torch.bfloat16, requires_grad=True)
    y = fp8(x)
    ref = linear(x.detach())
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    assert (y.float() - ref.float()).norm() / ref.float().norm() < 0.04
    grad_out = torch.randn_like(y)  # a loss linear in y: the same output gradient on both paths
    (y * grad_out).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    (nn.functional.linear(x2, dequantise(fp8.weight, fp8.weight_scale, torch.bfloat16), fp8.bias)
     * grad_out).sum().backward()
    assert torch.equal(x.grad, x2.grad)
    assert fp8.weight.grad is None


def build(model_dir, base_dtype, stages=1, stage=0):
    adapter = FluxAdapter(model_dir, torch.bfloat16)
    return adapter, build_local_model(adapter, stages, stage, targets=adapter.default_lora_targets, rank=4,
                                      alpha=4.0, dropout=0.0, seed=0, base_dtype=base_dtype)


def base_bytes(layers) -> int:
    return sum(p.numel() * p.element_size() for layer in layers for n, p in layer.named_parameters()
               if "lora_" not in n and p.device.type != "meta")


def test_build_keeps_block_weights_in_fp8(tiny_flux_dir):
    """The blocks' frozen Linears become Fp8Linear under peft's LoRA, whose weights stay bf16 and trainable;
    the blocks' base weights take half the bytes plus 4 bytes per row for the scales."""
    _, ref = build(tiny_flux_dir, "")
    _, local = build(tiny_flux_dir, "float8")
    blocks, ref_blocks = local.layers[1:-1], ref.layers[1:-1]
    fp8 = [m for layer in blocks for m in layer.modules() if isinstance(m, Fp8Linear)]
    assert fp8 and not any(type(m) is nn.Linear and not m.weight.requires_grad
                           for layer in blocks for m in layer.modules())
    assert any(type(m).__name__ == "Linear" and hasattr(m, "base_layer") and isinstance(m.base_layer, Fp8Linear)
               for layer in blocks for m in layer.modules())
    lora = [p for n, p in local.denoiser.named_parameters() if "lora_" in n]
    assert lora and all(p.dtype == torch.bfloat16 and p.requires_grad for p in lora)
    rows = sum(m.out_features for m in fp8)
    linear_bf16 = sum(m.weight.numel() * 2 for m in fp8)
    assert base_bytes(blocks) == base_bytes(ref_blocks) - linear_bf16 // 2 + 4 * rows
    # first and last layers stay in bf16
    assert not any(isinstance(m, Fp8Linear) for m in [*local.layers[0].modules(), *local.layers[-1].modules()])


def forward(adapter, layers, latents, text):
    timesteps = torch.full((latents.shape[0],), 0.5)
    x = adapter.model_inputs(latents, timesteps, text, guidance=1.0)
    for layer in layers:
        x = layer(x)
    return adapter.prediction_to_latents(x, latents)


def test_fp8_base_trains_close_to_bf16(tiny_flux_dir):
    """Same inputs: the fp8 model's loss is within 5% of the bf16 model's; 6 AdamW steps on the LoRA
    lower it, and the LoRA gradients are bf16."""
    torch.manual_seed(0)
    latents = torch.randn(2, 4, 8, 8, dtype=torch.bfloat16)
    target = torch.randn_like(latents)
    text = {"t5": torch.randn(2, 16, 32), "clip_pooled": torch.randn(2, 32)}
    adapter, ref = build(tiny_flux_dir, "")
    _, local = build(tiny_flux_dir, "float8")
    with torch.no_grad():
        loss_ref = (forward(adapter, ref.layers, latents, text).float() - target.float()).square().mean()
    lora = [p for n, p in local.denoiser.named_parameters() if "lora_" in n]
    opt = torch.optim.AdamW(lora, lr=3e-2)
    losses = []
    for _ in range(6):
        loss = (forward(adapter, local.layers, latents, text).float() - target.float()).square().mean()
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in lora)
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - loss_ref.item()) / loss_ref.item() < 0.05
    assert losses[-1] < losses[0] * 0.9


def test_swapped_block_moves_fp8(tiny_flux_dir):
    """Block swap keeps and moves the fp8 storage (half the bytes of bf16), and the block still computes."""
    _, local = build(tiny_flux_dir, "float8")
    block = local.layers[1]
    swapped = SwappedLayer(block, SwapQueue(torch.device("cpu")))
    fp8_masters = [m for _, _, m in swapped.slots if m.dtype == torch.float8_e4m3fn]
    assert fp8_masters and len(fp8_masters) == sum(isinstance(m, Fp8Linear) for m in block.modules())


def test_quantise_skips_trainable_and_meta():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    model[0].requires_grad_(False)
    assert quantise_frozen_linears([model]) == 1
    assert isinstance(model[0], Fp8Linear) and type(model[1]) is nn.Linear
