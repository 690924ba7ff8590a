"""Block swapping changes where frozen weights wait, not what is computed."""

import torch

from diffusion_pipe.models.flux import FluxAdapter
from diffusion_pipe.train.build import build_local_model
from diffusion_pipe.train.swap import SwappedLayer, apply_block_swap


def test_swapped_layers_give_same_outputs_and_grads(tiny_flux_dir):
    adapter = FluxAdapter(tiny_flux_dir, torch.float32)
    local = build_local_model(adapter, 1, 0, targets=adapter.default_lora_targets, rank=4, alpha=4.0,
                              dropout=0.0, seed=0)
    for name, p in local.denoiser.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    latents = torch.randn(1, 4, 8, 8)
    inputs = adapter.model_inputs(latents, torch.tensor([0.4]), {"t5": torch.randn(1, 6, 32),
                                                                "clip_pooled": torch.randn(1, 32)}, 1.0)

    def run(layers):
        x = inputs
        for layer in layers:
            x = layer(x)
        x.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in local.denoiser.named_parameters() if p.grad is not None}
        local.denoiser.zero_grad(set_to_none=True)
        return x.detach(), grads

    plain_out, plain_grads = run(local.layers)
    swapped = apply_block_swap(local.layers, (local.start, local.stop), 3, torch.device("cpu"))
    assert sum(isinstance(layer, SwappedLayer) for layer in swapped) == 3
    assert not isinstance(swapped[0], SwappedLayer) and not isinstance(swapped[-1], SwappedLayer)
    # between uses, a swapped layer's frozen weights are placeholders
    assert all(p.numel() == 0 for p in swapped[1].layer.parameters() if not p.requires_grad)
    out, grads = run(swapped)
    assert torch.allclose(out, plain_out, atol=1e-6)
    assert grads.keys() == plain_grads.keys() and len(grads) > 0
    for name in grads:
        assert torch.allclose(grads[name], plain_grads[name], atol=1e-6), name
