"""Block swapping: frozen weights of some layers live in pinned CPU memory and visit the GPU only while their
layer computes, so a model larger than the GPU's memory trains.

A swapped layer runs under non-reentrant activation checkpointing: its forward saves no tensors that reference
the weights, and its recomputation in backward reloads them (checkpoint's recompute context), after which
autograd frees them as that layer's backward completes. Trainable (LoRA) weights stay on the GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class SwappedLayer(nn.Module):
    """`layer` with its frozen parameters held on the CPU between uses."""

    def __init__(self, layer: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.layer = layer
        self.device = device
        pin = device.type == "cuda"
        # (owning module, attribute name, CPU master) of each frozen parameter
        self._slots = [(module, name, p.data.pin_memory() if pin else p.data)
                       for module in layer.modules() for name, p in module.named_parameters(recurse=False)
                       if not p.requires_grad]
        self._unload()  # placeholders, so moving the module to the GPU moves none of these weights

    def _unload(self) -> None:
        for module, name, master in self._slots:
            module._parameters[name] = nn.Parameter(torch.empty(0, dtype=master.dtype, device=self.device),
                                                    requires_grad=False)

    @contextlib.contextmanager
    def _loaded(self) -> Iterator[None]:
        # A new Parameter object per load: autograd saves leaves by reference, so it keeps this one (and its
        # GPU memory) exactly as long as the backward needs it, whatever is loaded next.
        for module, name, master in self._slots:
            module._parameters[name] = nn.Parameter(master.to(self.device, non_blocking=True), requires_grad=False)
        try:
            yield
        finally:
            self._unload()

    def loaded(self) -> contextlib.AbstractContextManager[None]:
        """The frozen weights on the device while the context lasts: samples call the wrapped modules directly."""
        return self._loaded()

    def forward(self, inputs):
        with self._loaded():
            return checkpoint(self.layer, inputs, use_reentrant=False,
                              context_fn=lambda: (contextlib.nullcontext(), self._loaded()))


def apply_block_swap(layers: list[nn.Module], local: tuple[int, int], count: int,
                     device: torch.device) -> list[nn.Module]:
    """Wrap the first `count` of this rank's layers (the model's first and last, small embedding and output
    layers, excepted) in `SwappedLayer`; returns the new layer list."""
    if count <= 0:
        return layers
    start, stop = local
    out = list(layers)
    candidates = [i for i in range(max(start, 1), min(stop, len(layers) - 1))]
    for i in candidates[:count]:
        out[i] = SwappedLayer(out[i], device)
    return out
