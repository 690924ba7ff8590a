"""Cosmos-Predict2 Text2Image (2B, 14B): family `cosmos2`'s transformer class, layers, T5 entries and exports,
trained text-to-image as Cosmos2TextToImagePipeline generates: one latent frame, no condition mask, one timestep
t = sigma / (sigma + 1) for the whole image, the noisy latent scaled to the rectified-flow interpolation and the
prediction read as the flow velocity (the module docstring of cosmos2.py says why). Images only.
"""

from __future__ import annotations

from typing import ClassVar

from diffusion_pipe.models.base import Capabilities
from diffusion_pipe.models.cosmos2 import Cosmos2Adapter


class Cosmos2ImageAdapter(Cosmos2Adapter):
    """Cosmos-Predict2 Text2Image in diffusers format (transformer, vae, text_encoder, tokenizer, scheduler), as
    nvidia/Cosmos-Predict2-2B-Text2Image and -14B-Text2Image ship it."""

    name: ClassVar[str] = "cosmos2_image"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image",), tasks=("t2i",), objective="flow", export_formats=("diffusers", "comfyui"),
    )
    conditioned: ClassVar[bool] = False
    checkpoints: ClassVar[str] = ("Cosmos-Predict2 Text2Image (nvidia/Cosmos-Predict2-2B-Text2Image or "
                                  "-14B-Text2Image)")
    pipeline_name: ClassVar[str] = "Cosmos2TextToImagePipeline"
