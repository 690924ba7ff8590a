"""Kandinsky 5.0 Image text-to-image (Lite 6B): family `kandinsky5`'s transformer class and text encoders (the same
layers, prompt encoding through the pipeline's own `encode_prompt`, exports) over Flux's VAE and
Kandinsky5T2IPipeline, whose template, rotary scale (1, 1, 1) and latents (no visual condition; scaled, not
shifted) are its own. Latents keep a frame axis of one, as the pipeline's transformer takes them.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Adapter, Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import dtype_name
from diffusion_pipe.models.kandinsky5 import Kandinsky5Adapter, sampling_pipeline_cls


def _image_output(images: object) -> object:
    from diffusers.pipelines.pipeline_utils import ImagePipelineOutput

    return ImagePipelineOutput(images=images)


class Kandinsky5ImageAdapter(Kandinsky5Adapter):
    """Kandinsky 5.0 Image text-to-image in diffusers format (Kandinsky 5's components, Flux's VAE)."""

    name: ClassVar[str] = "kandinsky5_image"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image",), tasks=("t2i",), objective="flow", export_formats=("diffusers", "comfyui"),
    )
    pipeline_name: ClassVar[str] = "Kandinsky5T2IPipeline"
    tiny_template_tokens: ClassVar[tuple[str, ...]] = ()  # the tiny BPE reads the image template in 40 as it is
    tiny_unlearnt_words: ClassVar[tuple[str, ...]] = ()
    tiny_visual_cond: ClassVar[bool] = False
    tiny_shift: ClassVar[float] = 3.0

    def rope_scale(self, height: int, width: int) -> tuple[float, float, float]:
        """(1, 1, 1) at every size, as Kandinsky5T2IPipeline calls its transformer."""
        return (1.0, 1.0, 1.0)

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def vae_scale(self) -> int:
        return Adapter.vae_scale.fget(self)

    def vae_class(self) -> type[nn.Module]:
        from diffusers import AutoencoderKL

        return AutoencoderKL

    @torch.no_grad()
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        if pixels_BCFHW.shape[2] != 1:
            raise ValueError(f"family '{self.name}' trains on images only; got {pixels_BCFHW.shape[2]} frames")
        latents = vae.encode(pixels_BCFHW[:, :, 0].to(vae.device, vae.dtype)).latent_dist.mode()
        return [{"latents": x[:, None].contiguous().cpu()} for x in latents]

    def latent_spec(self, width: int, height: int, frames: int) -> Spec:
        s = self.vae_scale
        return {"latents": ((self.component_config("vae")["latent_channels"], 1, height // s, width // s),
                            dtype_name(self.dtype))}

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        self._pipeline_cls()
        return sampling_pipeline_cls(self.pipeline_name, _image_output)

    # ---- model -------------------------------------------------------------------------------------
    @classmethod
    def save_tiny_vae(cls, out_dir) -> None:
        """A 4-level AutoencoderKL (x8, which Kandinsky5T2IPipeline assumes) with a shift the pipeline ignores."""
        from diffusers import AutoencoderKL

        AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 16, 16),
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=1, norm_num_groups=4, sample_size=64, scaling_factor=0.8, shift_factor=0.1,
            use_quant_conv=False, use_post_quant_conv=False,
        ).save_pretrained(out_dir)
