"""Wan 2.2 TI2V-5B trained for image-to-video: a clip's first latent frame is the condition, the rest is generated.

TI2V-5B is Wan's transformer over its 2.2 VAE (48 latent channels, x16 spatial, x4 temporal) with one timestep
per token (`expand_timesteps`). WanImageToVideoPipeline conditions it on an image by putting the image's clean
latent in frame 0 with timestep 0 and denoising the other frames. Training does the same with the clip's own
first frame: the VAE is causal, so a clip's first latent frame is exactly the latent of its first frame alone,
already in the store with the clip (no second key, and an edited clip re-encodes both at once). The loss covers
the frames the model generates. An image (one latent frame) has nothing to generate from a condition and trains as
text-to-image, as TI2V-5B does. Samples are image-to-video: each prompt names its first frame (`control:`). For a
text-to-video LoRA of the same checkpoint use family `wan`.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch

from diffusion_pipe.models.base import Capabilities, TensorDict
from diffusion_pipe.models.wan import MODEL_INDEX, WanAdapter, keep_first_frame_clean


class WanTI2VAdapter(WanAdapter):
    """Wan 2.2 TI2V-5B (diffusers format: transformer, vae, text_encoder, tokenizer, scheduler), image-to-video."""

    name: ClassVar[str] = "wan_ti2v"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image", "video"), tasks=("i2v",), objective="flow", export_formats=("diffusers", "comfyui"),
    )
    experts: ClassVar[tuple[str, ...]] = ()

    # ---- train side --------------------------------------------------------------------------------
    def keep_clean(self, noisy_latents: torch.Tensor, target: torch.Tensor,
                   latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A clip's first latent frame stays clean (the condition) and is left out of the target."""
        return keep_first_frame_clean(noisy_latents, target, latents)

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """Wan's inputs with one timestep per token, 0 on a clip's first latent frame, as WanImageToVideoPipeline
        computes them with `expand_timesteps` (the mask taken at the patch grid)."""
        b, _, frames, height, width = noisy_latents.shape
        _, ph, pw = self.component_config("transformer")["patch_size"]
        per_frame = (height // ph) * (width // pw)
        mask = torch.ones(frames, per_frame, dtype=timesteps.dtype)
        if frames > 1:
            mask[0] = 0
        per_token = timesteps.reshape(b, 1) * mask.flatten().to(timesteps.device)
        return noisy_latents.to(self.dtype), per_token.to(self.dtype), text["t5"].to(self.dtype)

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The prediction in the target's layout: a clip's first frame (the condition) dropped when `like` is the
        target of the frames after it."""
        b, c, frames, height, width = like.shape
        pt, ph, pw = self.component_config("transformer")["patch_size"]
        predicted = prediction.shape[1] * pt // ((height // ph) * (width // pw))
        full = super().prediction_to_latents(prediction, torch.empty(b, c, predicted, height, width, device="meta"))
        return full[:, :, predicted - frames:]

    # ---- sample side -------------------------------------------------------------------------------
    samples_need_control: ClassVar[bool] = True  # each sample prompt names its first frame (`control:`)

    def pipeline_class(self) -> type:
        from diffusers import WanImageToVideoPipeline

        return WanImageToVideoPipeline

    def sample_pipeline(self, denoiser: torch.nn.Module, vae: torch.nn.Module) -> object:
        """WanImageToVideoPipeline as TI2V-5B runs it: one timestep per token, no CLIP image encoder."""
        pipe = super().sample_pipeline(denoiser, vae)
        pipe.register_to_config(expand_timesteps=True)
        return pipe

    def sample_control_inputs(self, image: object) -> dict:
        """The prompt's first frame, which the pipeline encodes and keeps clean as training keeps a clip's."""
        return {"image": image}

    # ---- model -------------------------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """Wan 2.2 TI2V-5B's layout at toy width: Wan's tiny transformer and UMT5 over a residual 2.2-style VAE
        (patchified pixels, x16 spatial, x4 temporal, 8 latent channels)."""
        from diffusers import AutoencoderKLWan, WanTransformer3DModel

        out_dir = Path(out_dir)
        WanAdapter.build_tiny(out_dir, seed)
        torch.manual_seed(seed + 1)
        z = 8
        AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                         temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                         patch_size=2, scale_factor_spatial=16, latents_mean=[0.0] * z,
                         latents_std=[1.0] * z).save_pretrained(out_dir / "vae")
        WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=z, out_channels=z,
            text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
        ).save_pretrained(out_dir / "transformer")
        (out_dir / "model_index.json").write_text(MODEL_INDEX.replace(
            '"_diffusers_version": "0.42.1",', '"_diffusers_version": "0.42.1",\n  "expand_timesteps": true,'))
