"""SkyReels V2 text-to-video (Skywork's Wan 2.1-derived DiT, flow matching; UMT5 text encoder, Wan's 3D causal
VAE), through diffusers components.

SkyReelsV2Transformer3DModel is Wan's transformer with room for diffusion forcing (one timestep per frame block,
a causal mask between blocks, an fps embedding): SkyReelsV2Pipeline's text-to-video checkpoints use none of it,
so the pipeline layers are Wan's, each block called without a mask as the pipeline calls it. Diffusion-forcing
checkpoints (`num_frame_per_block` > 1 or `inject_sample_info`) are refused: they train with per-block timesteps.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Capabilities
from diffusion_pipe.models.wan import MODEL_INDEX, WanAdapter, WanBlock, WanEmbed, WanOut


class SkyReelsV2Block(WanBlock):
    """One transformer block, without the diffusion-forcing causal mask (None, as SkyReelsV2Pipeline runs it)."""

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, text, timestep_proj, temb, cos, sin = inputs
        hidden = self.block(hidden, text, timestep_proj, (cos, sin), None)
        return hidden, text, timestep_proj, temb, cos, sin


class SkyReelsV2Adapter(WanAdapter):
    """SkyReels V2 T2V in diffusers format (transformer, vae, text_encoder, tokenizer, scheduler)."""

    name: ClassVar[str] = "skyreels_v2"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image", "video"), tasks=("t2v",), objective="flow", export_formats=("diffusers", "comfyui"),
    )
    experts: ClassVar[tuple[str, ...]] = ()

    def __init__(self, model_dir: Path, dtype: torch.dtype, expert: str | None = None) -> None:
        super().__init__(model_dir, dtype, expert)
        if (self.model_dir / "transformer" / "config.json").is_file():
            config = self.component_config("transformer")
            if config.get("num_frame_per_block", 1) > 1 or config.get("inject_sample_info"):
                from diffusion_pipe.config import ConfigError

                raise ConfigError(f"model.path: {self.model_dir} is a SkyReels V2 diffusion-forcing checkpoint "
                                  "(num_frame_per_block > 1 or inject_sample_info), which family 'skyreels_v2' does "
                                  "not train; use a text-to-video one (Skywork/SkyReels-V2-T2V-14B-540P-Diffusers)")

    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import SkyReelsV2Transformer3DModel

        return SkyReelsV2Transformer3DModel

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        return [WanEmbed(denoiser), *(SkyReelsV2Block(b) for b in denoiser.blocks), WanOut(denoiser)]

    def pipeline_class(self) -> type:
        from diffusers import SkyReelsV2Pipeline

        return SkyReelsV2Pipeline

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """SkyReels V2 T2V's layout at toy width: Wan's tiny UMT5, VAE and scheduler, a 2-block transformer."""
        from diffusers import SkyReelsV2Transformer3DModel

        out_dir = Path(out_dir)
        WanAdapter.build_tiny(out_dir, seed)
        torch.manual_seed(seed + 1)
        SkyReelsV2Transformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
            text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
        ).save_pretrained(out_dir / "transformer")
        (out_dir / "model_index.json").write_text(MODEL_INDEX.replace('"WanPipeline"', '"SkyReelsV2Pipeline"')
                                                  .replace('"WanTransformer3DModel"', '"SkyReelsV2Transformer3DModel"'))
