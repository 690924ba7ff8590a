"""Flux.1 Kontext (image editing): Flux's transformer, VAE and text encoders, trained on (control, target) pairs.

FluxKontextPipeline conditions on a reference image by appending its packed latent tokens to the noisy target's
and giving them the target's position ids with the first axis set to 1 (`prepare_latents`); the prediction for
those tokens is thrown away (`noise_pred[:, :latents.size(1)]`). Training does the same with diffusers' own
packing and ids: the control tokens enter the first pipeline layer with the target's, travel through every block
(and so every pipeline stage) in the same hidden tensor, and `prediction_to_latents` drops them before the loss.
Control latents are never noised. Everything else (text, blocks, LoRA targets, both export formats: ComfyUI's
Kontext model is its Flux model) is Flux's, inherited.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch

from diffusion_pipe.models.base import Capabilities, TensorDict
from diffusion_pipe.models.flux import MODEL_INDEX, FluxAdapter, unpack_latents


class FluxKontextAdapter(FluxAdapter):
    """FLUX.1 Kontext-shaped models in diffusers format (the same components as Flux's)."""

    name: ClassVar[str] = "flux_kontext"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image",), tasks=("edit",), objective="flow", export_formats=("diffusers", "comfyui"),
        conditioning_latents=1,
    )

    def conditioned_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                           guidance: float, conditioning: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Flux's inputs with the control image's tokens after the target's, and their position ids after the
        target's, as FluxKontextPipeline builds both."""
        from diffusers import FluxKontextPipeline

        self.check_conditioning_count(conditioning)
        hidden, timestep, t5, pooled, img_ids, txt_ids, guidance_t = self.model_inputs(noisy_latents, timesteps,
                                                                                        text, guidance)
        control = conditioning[0]
        b, c, h, w = control.shape
        control_tokens = FluxKontextPipeline._pack_latents(control, b, c, h, w).to(hidden.dtype)
        control_ids = FluxKontextPipeline._prepare_latent_image_ids(b, h // 2, w // 2, img_ids.device, img_ids.dtype)
        control_ids[..., 0] = 1  # prepare_latents: the reference's ids are the latent ids with axis 0 set to 1
        control_ids = control_ids.unsqueeze(0).expand(b, -1, -1)
        return (torch.cat((hidden, control_tokens), dim=1), timestep, t5, pooled,
                torch.cat((img_ids, control_ids), dim=1).contiguous(), txt_ids, guidance_t)

    def pipeline_class(self) -> type:
        from diffusers import FluxKontextPipeline

        return FluxKontextPipeline

    def sample_control_inputs(self, image: object) -> dict:
        """The control image as FluxKontextPipeline takes it, at the sample's own size (the pipeline would otherwise
        resize it and the output to its preferred Kontext resolutions)."""
        width, height = image.size
        return {"image": image, "max_area": width * height, "_auto_resize": False}

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The target's tokens only (the first H/2 * W/2, as the pipeline keeps them), unpacked."""
        height, width = like.shape[-2], like.shape[-1]
        return unpack_latents(prediction[:, :(height // 2) * (width // 2)], height, width)

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """Flux's tiny components (Kontext adds none), as a FluxKontextPipeline directory."""
        FluxAdapter.build_tiny(out_dir, seed=seed)
        (Path(out_dir) / "model_index.json").write_text(
            MODEL_INDEX.replace('"FluxPipeline"', '"FluxKontextPipeline"'))
