"""Model families: a registry of adapters by name, imported lazily (no if/elif over families)."""

from __future__ import annotations

import importlib

from typing import TYPE_CHECKING

from diffusion_pipe.config import ConfigError
from diffusion_pipe.models.base import Adapter

if TYPE_CHECKING:
    from diffusion_pipe.params import ModelParams

# name -> "module:Class"; the module's file stem equals the name (a registry test checks it).
REGISTRY: dict[str, str] = {
    "auraflow": "diffusion_pipe.models.auraflow:AuraFlowAdapter",
    "chroma": "diffusion_pipe.models.chroma:ChromaAdapter",
    "cosmos2": "diffusion_pipe.models.cosmos2:Cosmos2Adapter",
    "cosmos2_image": "diffusion_pipe.models.cosmos2_image:Cosmos2ImageAdapter",
    "ernie_image": "diffusion_pipe.models.ernie_image:ErnieImageAdapter",
    "flux": "diffusion_pipe.models.flux:FluxAdapter",
    "flux2": "diffusion_pipe.models.flux2:Flux2Adapter",
    "flux2_klein": "diffusion_pipe.models.flux2_klein:Flux2KleinAdapter",
    "flux_kontext": "diffusion_pipe.models.flux_kontext:FluxKontextAdapter",
    "hidream": "diffusion_pipe.models.hidream:HiDreamAdapter",
    "hunyuan_image": "diffusion_pipe.models.hunyuan_image:HunyuanImageAdapter",
    "hunyuan_video": "diffusion_pipe.models.hunyuan_video:HunyuanVideoAdapter",
    "hunyuan_video15": "diffusion_pipe.models.hunyuan_video15:HunyuanVideo15Adapter",
    "ideogram4": "diffusion_pipe.models.ideogram4:Ideogram4Adapter",
    "kandinsky5": "diffusion_pipe.models.kandinsky5:Kandinsky5Adapter",
    "kandinsky5_image": "diffusion_pipe.models.kandinsky5_image:Kandinsky5ImageAdapter",
    "krea2": "diffusion_pipe.models.krea2:Krea2Adapter",
    "ltx": "diffusion_pipe.models.ltx:LTXAdapter",
    "ltx2": "diffusion_pipe.models.ltx2:LTX2Adapter",
    "lumina2": "diffusion_pipe.models.lumina2:Lumina2Adapter",
    "minimax_h3": "diffusion_pipe.models.minimax_h3:MiniMaxH3Adapter",
    "qwenimage": "diffusion_pipe.models.qwenimage:QwenImageAdapter",
    "qwenimage21": "diffusion_pipe.models.qwenimage21:QwenImage21Adapter",
    "qwenimage_edit": "diffusion_pipe.models.qwenimage_edit:QwenImageEditAdapter",
    "sd3": "diffusion_pipe.models.sd3:SD3Adapter",
    "sdxl": "diffusion_pipe.models.sdxl:SDXLAdapter",
    "skyreels_v2": "diffusion_pipe.models.skyreels_v2:SkyReelsV2Adapter",
    "wan": "diffusion_pipe.models.wan:WanAdapter",
    "wan21_i2v": "diffusion_pipe.models.wan21_i2v:Wan21I2VAdapter",
    "wan_i2v": "diffusion_pipe.models.wan_i2v:WanI2VAdapter",
    "wan_ti2v": "diffusion_pipe.models.wan_ti2v:WanTI2VAdapter",
    "zimage": "diffusion_pipe.models.zimage:ZImageAdapter",
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


def load_adapter(model: ModelParams) -> Adapter:
    """The family's adapter over the resolved model directory (a local diffusers folder or a hub id, with the
    components `model.transformer`, `model.vae`, `model.text_encoders` name taken from single files)."""
    from diffusion_pipe.models.checkpoints import resolve_model
    from diffusion_pipe.models.common import DTYPES

    return adapter_class(model.family)(resolve_model(model), DTYPES[model.dtype], expert=model.expert or None)
