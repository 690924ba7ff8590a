"""Block swapping: frozen weights of some layers live in pinned CPU memory and visit the GPU only while their
layer computes, so a model larger than the GPU's memory trains.

A swapped layer saves no tensor that references its weights: it runs under non-reentrant activation
checkpointing (its own, or the pipeline's when the pipeline recomputes that layer anyway: one checkpoint, so the
weights cross twice a step, for the forward and for the recomputation in backward), and the recomputation
reloads them; autograd frees them as that layer's backward completes. Trainable (LoRA) weights stay on the GPU,
and nothing is ever copied back: the frozen weights only travel host to device.

The copies overlap the compute (`SwapQueue`): while one swapped layer computes, the next one's weights copy on
a stream of their own (forward: the layer after it; backward, whose recomputations run the layers in reverse:
the one before it), so at most two swapped layers' weights are on the GPU at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class _Copy(NamedTuple):
    layer: SwappedLayer
    tensors: list[torch.Tensor]
    done: torch.cuda.Event | None  # recorded on the copy stream after the last copy (None on the CPU)


def _in_backward() -> bool:
    """Whether autograd's backward is running on this thread (recomputations in backward run in reverse order)."""
    return torch._C._current_graph_task_id() != -1


class SwapQueue:
    """The swapped layers of one rank in forward order, and the copy of the next one's weights under way.

    The device buffers are allocated on the compute stream and the copy stream waits for the compute stream
    before it writes them, so memory the allocator hands back is never written while a kernel still reads it;
    the compute stream waits for a copy's event before its layer runs (or before an unused copy is dropped), so
    every later reuse of that memory comes after the copy too."""

    def __init__(self, device: torch.device, prefetch: bool = True) -> None:
        self.device = device
        self.prefetch = prefetch
        self.layers: list[SwappedLayer] = []
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ahead: _Copy | None = None  # the copy started for the layer expected next

    def weights(self, layer: SwappedLayer, prefetch: bool = True) -> list[torch.Tensor]:
        """`layer`'s frozen weights on the device, ready for the compute stream (taken from the copy started
        ahead when it was this layer's); then, with `prefetch`, starts copying the layer expected next."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead.layer is not layer:
            self._ready(ahead)  # not this layer's: dropped once the compute stream has waited for it
            ahead = None
        tensors = self._ready(ahead or self._copy(layer))
        following = self.following(layer) if prefetch and self.prefetch else None
        if following is not None:
            self.ahead = self._copy(following)
        return tensors

    def following(self, layer: SwappedLayer) -> SwappedLayer | None:
        """The swapped layer that loads after `layer`: the next one in a forward pass, the previous one while
        backward recomputes; None at either end."""
        i = self.layers.index(layer) + (-1 if _in_backward() else 1)
        return self.layers[i] if 0 <= i < len(self.layers) else None

    def _copy(self, layer: SwappedLayer) -> _Copy:
        masters = [master for _, _, master in layer.slots]
        if self.copy_stream is None:  # the CPU: the masters are the weights
            return _Copy(layer, [m.to(self.device) for m in masters], None)
        tensors = [torch.empty_like(m, device=self.device) for m in masters]  # on the compute stream
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            for tensor, master in zip(tensors, masters):
                tensor.copy_(master, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        return _Copy(layer, tensors, done)

    def _ready(self, copy: _Copy) -> list[torch.Tensor]:
        if copy.done is not None:
            torch.cuda.current_stream(self.device).wait_event(copy.done)
        return copy.tensors


class SwappedLayer(nn.Module):
    """`layer` with its frozen parameters held on the CPU between uses; `queue` brings them to the device."""

    def __init__(self, layer: nn.Module, queue: SwapQueue) -> None:
        super().__init__()
        self.layer = layer
        self.queue = queue
        queue.layers.append(self)
        # The pipeline sets this when it recomputes the layer in backward itself (`recomputed_outside`).
        self.checkpointed_outside = False
        pin = queue.device.type == "cuda"
        # (owning module, attribute name, CPU master) of each frozen parameter
        self.slots = [(module, name, p.data.pin_memory() if pin else p.data)
                      for module in layer.modules() for name, p in module.named_parameters(recurse=False)
                      if not p.requires_grad]
        self._unload()  # placeholders, so moving the module to the GPU moves none of these weights

    def _unload(self) -> None:
        for module, name, master in self.slots:
            module._parameters[name] = nn.Parameter(torch.empty(0, dtype=master.dtype, device=self.queue.device),
                                                    requires_grad=False)

    @contextlib.contextmanager
    def _loaded(self, prefetch: bool = True) -> Iterator[None]:
        # A new Parameter object per load: autograd saves leaves by reference, so it keeps this one (and its
        # GPU memory) exactly as long as the backward needs it, whatever is loaded next.
        for (module, name, _), weight in zip(self.slots, self.queue.weights(self, prefetch)):
            module._parameters[name] = nn.Parameter(weight, requires_grad=False)
        try:
            yield
        finally:
            self._unload()

    def loaded(self) -> contextlib.AbstractContextManager[None]:
        """The frozen weights on the device while the context lasts (no other layer's copied ahead): samples
        call the wrapped modules directly."""
        return self._loaded(prefetch=False)

    def recomputed_outside(self) -> None:
        """The caller checkpoints this layer (it recomputes it in backward, reloading the weights through this
        forward): the layer then adds no checkpoint of its own, which would load them a third time."""
        self.checkpointed_outside = True

    def compile(self, *args, **kwargs) -> None:
        """Compile the wrapped layer; the loading around it stays eager."""
        self.layer.compile(*args, **kwargs)

    def forward(self, inputs):
        with self._loaded():
            if self.checkpointed_outside:
                return self.layer(inputs)
            return checkpoint(self.layer, inputs, use_reentrant=False,
                              context_fn=lambda: (contextlib.nullcontext(), self._loaded()))


def apply_block_swap(layers: list[nn.Module], local: tuple[int, int], count: int, device: torch.device,
                     prefetch: bool = True) -> list[nn.Module]:
    """Wrap the first `count` of this rank's layers (the model's first and last, small embedding and output
    layers, excepted) in `SwappedLayer`, sharing one `SwapQueue` (with `prefetch`, each copy overlaps the layer
    computing before it); returns the new layer list."""
    if count <= 0:
        return layers
    start, stop = local
    out = list(layers)
    queue = SwapQueue(device, prefetch)
    candidates = [i for i in range(max(start, 1), min(stop, len(layers) - 1))]
    for i in candidates[:count]:
        out[i] = SwappedLayer(out[i], queue)
    return out
