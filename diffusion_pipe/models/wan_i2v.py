"""Wan 2.2 I2V-A14B trained for image-to-video: the denoiser generates a clip from its first frame.

WanImageToVideoPipeline (without `expand_timesteps`) conditions the transformer on channels beside the noisy
latents: a 4-channel mask marking the first frame (one channel per frame the VAE folds into a latent frame) and
the latent of the first frame followed by black frames to the clip's length, which the pipeline encodes with the
VAE. The denoiser takes 16 + 4 + 16 = 36 channels and predicts the 16 of the video. Training feeds exactly that:
the condition latent is a store entry of its own (`capabilities.conditioning_rule`, so its key names the rule,
the frame count and the window it starts from), encoded from the clip's own first frame, or from the dataset's
control image where it declares one (`scan.datasets[].control`). The loss covers the whole clip, as the pipeline
denoises the whole clip.

A14B ships two experts (high and low noise, `model.expert`), as Wan 2.2 T2V does. Wan 2.1 I2V (14B-480P/720P)
also feeds a CLIP image embedding to the transformer (`image_dim`): family `wan21_i2v` (wan21_i2v.py) trains it,
and this one refuses such a checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch

from diffusion_pipe.models.base import Capabilities, TensorDict
from diffusion_pipe.models.wan import MODEL_INDEX, WanAdapter

# The rule by which a first frame becomes the condition latent (WanImageToVideoPipeline.prepare_latents without
# expand_timesteps or a last image): it is in the condition latents' keys, so changing it re-encodes them.
CONDITION_RULE = "wan-i2v/first-frame+black-frames"


class WanI2VAdapter(WanAdapter):
    """Wan 2.2 I2V-A14B (diffusers format: transformer, transformer_2, vae, text_encoder, tokenizer, scheduler)."""

    name: ClassVar[str] = "wan_i2v"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("video",), tasks=("i2v",), objective="flow", export_formats=("diffusers", "comfyui"),
        conditioning_latents=1, conditioning_rule=CONDITION_RULE,
    )

    def __init__(self, model_dir: Path, dtype: torch.dtype, expert: str | None = None) -> None:
        super().__init__(model_dir, dtype, expert)
        config = self.model_dir / self._transformer_component() / "config.json"
        if config.is_file():
            self.check_transformer(self.component_config(self._transformer_component()))

    def check_transformer(self, config: dict) -> None:
        """A ConfigError unless the transformer is this family's: Wan 2.2 I2V-A14B's takes no CLIP image
        embedding (`image_dim`), which Wan 2.1 I2V's does (family 'wan21_i2v')."""
        if config.get("image_dim"):
            from diffusion_pipe.config import ConfigError

            raise ConfigError(f"model.path: {self.model_dir} is a Wan 2.1 I2V checkpoint (its transformer takes a "
                              "CLIP image embedding, image_dim); family 'wan_i2v' trains Wan 2.2 I2V-A14B "
                              "(Wan-AI/Wan2.2-I2V-A14B-Diffusers): set model.family to 'wan21_i2v'")

    # ---- encode side -------------------------------------------------------------------------------
    def conditioning_pixels(self, first_frame_BC1HW: torch.Tensor, frames: int) -> torch.Tensor:
        """The first frame followed by black (zero) frames to the clip's length, as the pipeline builds
        `video_condition`."""
        b, c, _, h, w = first_frame_BC1HW.shape
        return torch.cat((first_frame_BC1HW, first_frame_BC1HW.new_zeros(b, c, frames - 1, h, w)), dim=2)

    # ---- train side --------------------------------------------------------------------------------
    def conditioned_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                           guidance: float, conditioning: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Wan's inputs over [noisy latents, first-frame mask, condition latent] along channels, as the pipeline
        concatenates them: the mask is 1 on the first latent frame (the first pixel frame, repeated for each
        frame the VAE folds into it) and 0 after."""
        self.check_conditioning_count(conditioning)
        (condition,) = conditioning
        b, _, frames, h, w = noisy_latents.shape
        mask = noisy_latents.new_zeros(b, self.vae_scale_temporal, frames, h, w)
        mask[:, :, 0] = 1
        x = torch.cat((noisy_latents, mask, condition.to(noisy_latents.dtype)), dim=1)
        return self.model_inputs(x, timesteps, text, guidance)

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        from diffusers import WanImageToVideoPipeline

        return WanImageToVideoPipeline

    def sample_control_inputs(self, image: object) -> dict:
        """The prompt's first frame, which the pipeline turns into its condition as training's rule does."""
        return {"image": image}

    # ---- model -------------------------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """Wan 2.2 I2V-A14B's layout at toy width: Wan's tiny model with a 36-channel-in transformer (noisy
        latents, mask, condition) and no CLIP image embedding, in a WanImageToVideoPipeline model index."""
        from diffusers import WanTransformer3DModel

        out_dir = Path(out_dir)
        WanAdapter.build_tiny(out_dir, seed)
        torch.manual_seed(seed + 1)
        WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16 + 4 + 16,
            out_channels=16, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
        ).save_pretrained(out_dir / "transformer")
        (out_dir / "model_index.json").write_text(MODEL_INDEX.replace('"WanPipeline"', '"WanImageToVideoPipeline"'))
