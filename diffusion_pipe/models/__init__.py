"""Model families: a registry of adapters by name, imported lazily (no if/elif over families)."""

from __future__ import annotations

import importlib

from diffusion_pipe.config import ConfigError
from diffusion_pipe.models.base import Adapter

# name -> "module:Class"; the module's file stem equals the name (a registry test checks it).
REGISTRY: dict[str, str] = {
    "flux": "diffusion_pipe.models.flux:FluxAdapter",
    "sdxl": "diffusion_pipe.models.sdxl:SDXLAdapter",
    "wan": "diffusion_pipe.models.wan:WanAdapter",
}


def adapter_class(family: str) -> type[Adapter]:
    """The adapter class registered under `family`; an unknown name lists the known ones."""
    try:
        target = REGISTRY[family]
    except KeyError:
        raise ConfigError(
            f"model.family: unknown family {family!r}; known families: {', '.join(sorted(REGISTRY))}"
        ) from None
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)
