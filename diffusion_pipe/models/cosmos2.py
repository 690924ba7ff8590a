"""Cosmos-Predict2 Video2World (2B, 14B): NVIDIA's DiT over Wan 2.1's VAE and T5-XXL text states, trained for
image-to-video as Cosmos2VideoToWorldPipeline generates: a clip from its first frame and its caption.

The pipeline keeps the first latent frame clean (the conditioning image's latent, normalised with the VAE's
statistics), marks it in a channel of its own (`condition_mask`, 1 on conditioning frames) and gives it its own
timestep (t = sigma_c / (sigma_c + 1), sigma_c = 1e-4); the other frames are noised. It feeds the transformer
t = sigma / (sigma + 1) and the noisy latents scaled by 1 - t, which is the rectified-flow interpolation
(1 - t) x0 + t noise, and reads the prediction F as x0 = x_t - t F: F is the flow velocity noise - x0, what the
`flow` objective trains. Training does the same with the clip's own first frame: Wan's VAE is causal, so a clip's
first latent frame is the latent of its first frame alone, already in the store (no second key, as for Wan 2.2
TI2V). The loss covers the frames the model generates.

The transformer concatenates a padding mask to its input, which the pipeline passes as zeros (resized with
torchvision, which this first layer does not need: zeros at any size are zeros). Text: T5 states of the caption's
tokens, zeros past them; the transformer cross-attends to every one of the `encode.text_max_length` positions
(512 in the pipeline), so train and render with the same length. Rotary positions along time assume the
pipeline's default 16 fps.

No samples during training yet: Cosmos2VideoToWorldPipeline screens prompts and videos with NVIDIA's Cosmos
Guardrail (the `cosmos_guardrail` package and its own models), which this tool neither installs nor bypasses.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Adapter, Capabilities, TensorDict
from diffusion_pipe.models.common import save_tiny_t5_encoder, save_tiny_tokenizers
from diffusion_pipe.models.wan import WanAdapter, keep_first_frame_clean

FPS = 16  # Cosmos2VideoToWorldPipeline's default frame rate, which scales the rotary positions along time
SIGMA_CONDITIONING = 1e-4  # the pipeline's noise level of the conditioning frames
T_CONDITIONING = SIGMA_CONDITIONING / (SIGMA_CONDITIONING + 1)


class CosmosEmbed(nn.Module):
    """First layer: the zero padding-mask channel, rotary tables, patch embedding and the per-frame timestep
    embeddings spread over each frame's tokens (one per sample for one frame), as CosmosTransformer3DModel.forward
    computes them. Takes (latents with the condition-mask channel, one timestep per latent frame, text); returns
    (tokens, text, embedded timestep, timestep embedding, cos, sin)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.rope = transformer.rope
        self.patch_embed = transformer.patch_embed
        self.time_embed = transformer.time_embed
        self.patch = tuple(transformer.config.patch_size)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        latents, timesteps, text = inputs
        b, _, frames, height, width = latents.shape
        latents = torch.cat((latents, latents.new_zeros(b, 1, frames, height, width)), dim=1)
        cos, sin = self.rope(latents, fps=FPS)
        tokens = self.patch_embed(latents).flatten(1, 3)
        temb, embedded = self.time_embed(tokens, timesteps.flatten())
        pt, ph, pw = self.patch
        if frames // pt > 1:  # a timestep per latent frame: each frame's tokens get theirs
            temb, embedded = (x.view(b, frames // pt, 1, 1, -1).expand(-1, -1, height // ph, width // pw, -1)
                              .flatten(1, 3) for x in (temb, embedded))
        # one latent frame (an image): one embedding per sample, which the blocks' norms broadcast over the tokens
        # as the transformer does for Text2Image. Spread per token, every block's three norms projected each token's
        # copy: at 1024x1024 on an H100 ours took 0.290 s a step against plain's 0.231, and 5.6 GB more
        return tokens, text, embedded, temb, cos, sin


class CosmosBlock(nn.Module):
    """One transformer block: self-attention with rotary positions, cross-attention to the text, feed-forward."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        tokens, text, embedded, temb, cos, sin = inputs
        tokens = self.block(tokens, text, embedded, temb, (cos, sin))
        return tokens, text, embedded, temb, cos, sin


class CosmosOut(nn.Module):
    """Last layer: adaptive output norm and projection to patch tokens (unpatchified by the adapter)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.norm_out = transformer.norm_out
        self.proj_out = transformer.proj_out

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        tokens, _text, embedded, temb, _cos, _sin = inputs
        return self.proj_out(self.norm_out(tokens, embedded, temb))


class Cosmos2Adapter(WanAdapter):
    """Cosmos-Predict2 Video2World in diffusers format (transformer, vae, text_encoder, tokenizer, scheduler), as
    nvidia/Cosmos-Predict2-2B-Video2World and -14B-Video2World ship it."""

    name: ClassVar[str] = "cosmos2"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("video",), tasks=("i2v",), objective="flow", export_formats=("diffusers", "comfyui"),
    )
    experts: ClassVar[tuple[str, ...]] = ()
    # Whether the transformer takes the condition-mask channel and a clip's first frame conditions the rest
    # (Video2World); Text2Image's (family cosmos2_image) takes the latents alone.
    conditioned: ClassVar[bool] = True
    checkpoints: ClassVar[str] = ("Cosmos-Predict2 Video2World (nvidia/Cosmos-Predict2-2B-Video2World or "
                                  "-14B-Video2World)")
    pipeline_name: ClassVar[str] = "Cosmos2VideoToWorldPipeline"

    def __init__(self, model_dir: Path, dtype: torch.dtype, expert: str | None = None) -> None:
        super().__init__(model_dir, dtype, expert)
        if (self.model_dir / "transformer" / "config.json").is_file():
            self.check_transformer(self.component_config("transformer"), self.component_config("vae")["z_dim"])

    def check_transformer(self, config: dict, z_dim: int) -> None:
        """A ConfigError unless the transformer is this family's Predict2 checkpoint: Video2World's input is the
        latents and the condition mask, Text2Image's the latents alone; neither has learnable positions (Cosmos
        1.0) nor a projection of stacked text states (Predict2.5)."""
        from diffusion_pipe.config import ConfigError

        other = {True: ("a Text2Image checkpoint (its transformer takes no condition mask)", "cosmos2_image"),
                 False: ("a Video2World checkpoint (its transformer takes a condition mask)", "cosmos2")}[
            self.conditioned]
        problem = ("a Cosmos 1.0 checkpoint (learnable positional embeddings)" if config.get("extra_pos_embed_type")
                   else "a Cosmos-Predict2.5 checkpoint (Qwen2.5-VL text states)"
                   if config.get("use_crossattn_projection")
                   else f"{other[0]}: set model.family to '{other[1]}'"
                   if config.get("in_channels") != z_dim + self.conditioned else "")
        if problem:
            raise ConfigError(f"model.path: {self.model_dir} is {problem}; family '{self.name}' trains "
                              f"{self.checkpoints}")

    # ---- encode side -------------------------------------------------------------------------------
    # Wan's T5 encoding (its load_text_encoders and encode_text) is Cosmos2VideoToWorldPipeline._get_t5_prompt_embeds
    # too: T5 states of the caption's tokens read under their attention mask, zeros past them; over T5's encoder, of
    # the caption as written.
    def text_encoder_class(self) -> type[nn.Module]:
        from transformers import T5EncoderModel

        return T5EncoderModel

    def clean_caption(self, caption: str) -> str:
        return caption

    # ---- train side --------------------------------------------------------------------------------
    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import CosmosTransformer3DModel

        return CosmosTransformer3DModel

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        return ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ff.net.0.proj", "ff.net.2")

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        return [CosmosEmbed(denoiser), *(CosmosBlock(b) for b in denoiser.transformer_blocks), CosmosOut(denoiser)]

    def keep_clean(self, noisy_latents: torch.Tensor, target: torch.Tensor,
                   latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A clip's first latent frame stays clean (the condition) and is left out of the target; an image
        (Text2Image's only medium) has no frame after it and trains whole."""
        return keep_first_frame_clean(noisy_latents, target, latents)

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """(latents, with the condition mask along channels where the transformer takes it, t per latent frame, T5
        states), as the pipeline calls its transformer: a clip's first frame is marked conditioning (mask 1) at
        the conditioning timestep; Cosmos takes t itself, not t x 1000, and is not guidance-distilled."""
        b, _, frames, height, width = noisy_latents.shape
        per_frame = timesteps.reshape(b, 1).expand(b, frames).clone()
        x = noisy_latents
        if self.conditioned:
            mask = noisy_latents.new_zeros(b, 1, frames, height, width)
            if frames > 1:
                mask[:, :, 0] = 1
                per_frame[:, 0] = T_CONDITIONING
            x = torch.cat((noisy_latents, mask), dim=1)
        return x.to(self.dtype), per_frame.to(self.dtype), text["t5"].to(self.dtype)

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Patch tokens back to (B, C, F, H, W) in CosmosTransformer3DModel's own order (its output unpatchify is
        not the inverse of its patch embedding's), with a clip's first frame (the condition) dropped when `like`
        is the target of the frames after it."""
        b, c, frames, height, width = like.shape
        pt, ph, pw = self.component_config("transformer")["patch_size"]
        grid = (height // ph) * (width // pw)
        predicted = prediction.shape[1] // grid
        x = prediction.unflatten(2, (ph, pw, pt, -1)).unflatten(1, (predicted, height // ph, width // pw))
        x = x.permute(0, 7, 1, 6, 2, 4, 3, 5).flatten(6, 7).flatten(4, 5).flatten(2, 3)
        return x[:, :, x.shape[2] - frames:]

    # ---- sample side -------------------------------------------------------------------------------
    pipeline_class = Adapter.pipeline_class  # no samples yet (the module's docstring says why), not Wan's pipeline

    # ---- export side -------------------------------------------------------------------------------
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        return self.transformer_export(lora, fmt, comfyui_lora)

    # ---- model -------------------------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """Cosmos-Predict2's layout at toy width: a 2-block transformer (24 wide, 2 heads) taking 16 latent
        channels (and the condition mask, for Video2World), Wan's tiny 3D VAE (x8 spatial, x4 temporal), a 2-layer
        T5."""
        import tempfile

        from diffusers import AutoencoderKLWan, CosmosTransformer3DModel, FlowMatchEulerDiscreteScheduler
        from transformers import T5Config, T5EncoderModel

        out_dir = Path(out_dir)
        with tempfile.TemporaryDirectory() as tmp:
            _, t5_tok = save_tiny_tokenizers(Path(tmp))
        t5_tok.save_pretrained(out_dir / "tokenizer")
        torch.manual_seed(seed)
        save_tiny_t5_encoder(out_dir / "text_encoder", t5_tok, T5EncoderModel, T5Config)
        AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                         temperal_downsample=[False, True, True]).save_pretrained(out_dir / "vae")
        CosmosTransformer3DModel(
            in_channels=16 + cls.conditioned, out_channels=16, num_attention_heads=2, attention_head_dim=12,
            num_layers=2, mlp_ratio=2.0, text_embed_dim=32, adaln_lora_dim=8, max_size=(16, 32, 32),
            patch_size=(1, 2, 2), rope_scale=(1.0, 3.0, 3.0), concat_padding_mask=True, extra_pos_embed_type=None,
        ).save_pretrained(out_dir / "transformer")
        FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True, shift=1.0).save_pretrained(out_dir / "scheduler")
        index = MODEL_INDEX.replace("PIPELINE", cls.pipeline_name)
        (out_dir / "model_index.json").write_text(index)


MODEL_INDEX = """{
  "_class_name": "PIPELINE",
  "_diffusers_version": "0.42.1",
  "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
  "text_encoder": ["transformers", "T5EncoderModel"],
  "tokenizer": ["transformers", "T5TokenizerFast"],
  "transformer": ["diffusers", "CosmosTransformer3DModel"],
  "vae": ["diffusers", "AutoencoderKLWan"]
}
"""

# (diffusers name pattern, original Cosmos-Predict2 name): the inverse of diffusers' own converter
# (single_file_utils.convert_cosmos_transformer_checkpoint_to_diffusers, Cosmos 2.0), whose names ComfyUI's
# Predict2 model (comfy/ldm/cosmos/predict2.py) keeps.
_ORIGINAL_NAMES = (
    (r"transformer_blocks\.(\d+)\.attn([12])\.(to_q|to_k|to_v|to_out\.0|norm_q|norm_k)", None),
    (r"transformer_blocks\.(\d+)\.ff\.net\.0\.proj", r"blocks.\1.mlp.layer1"),
    (r"transformer_blocks\.(\d+)\.ff\.net\.2", r"blocks.\1.mlp.layer2"),
    (r"transformer_blocks\.(\d+)\.norm1\.linear_([12])", r"blocks.\1.adaln_modulation_self_attn.\2"),
    (r"transformer_blocks\.(\d+)\.norm2\.linear_([12])", r"blocks.\1.adaln_modulation_cross_attn.\2"),
    (r"transformer_blocks\.(\d+)\.norm3\.linear_([12])", r"blocks.\1.adaln_modulation_mlp.\2"),
    (r"patch_embed\.proj", "x_embedder.proj.1"),
    (r"time_embed\.t_embedder\.(linear_[12])", r"t_embedder.1.\1"),
    (r"time_embed\.norm", "t_embedding_norm"),
    (r"norm_out\.linear_([12])", r"final_layer.adaln_modulation.\1"),
    (r"proj_out", "final_layer.linear"),
)
_ATTENTION = {"1": "self_attn", "2": "cross_attn"}
_PROJECTIONS = {"to_q": "q_proj", "to_k": "k_proj", "to_v": "v_proj", "to_out.0": "output_proj",
                "norm_q": "q_norm", "norm_k": "k_norm"}


def cosmos_original_name(name: str) -> str:
    """The original Cosmos-Predict2 module name (`blocks.0.self_attn.q_proj`) of a diffusers
    CosmosTransformer3DModel module name (`transformer_blocks.0.attn1.to_q`); ValueError for one without a
    counterpart."""
    for pattern, original in _ORIGINAL_NAMES:
        match = re.fullmatch(pattern, name)
        if match and original is None:
            block, attention, projection = match.groups()
            return f"blocks.{block}.{_ATTENTION[attention]}.{_PROJECTIONS[projection]}"
        if match:
            return match.expand(original)
    raise ValueError(f"{name}: no original Cosmos-Predict2 (ComfyUI) name for this module; drop it from "
                     "train.lora_targets or export the 'diffusers' format")


def comfyui_lora(lora: TensorDict) -> TensorDict:
    """The LoRA under ComfyUI's Cosmos-Predict2 names, `diffusion_model.`-prefixed, as `lora_down`/`lora_up` with
    `.alpha` = rank (lora_B is pre-scaled, so scale 1): the generic keys of comfy/lora.py `model_lora_keys_unet`."""
    from diffusion_pipe.lora_keys import down_up_alpha, lora_modules

    out: TensorDict = {}
    for module, (a, b) in lora_modules(lora).items():
        out.update(down_up_alpha(f"diffusion_model.{cosmos_original_name(module)}", a, b))
    return out
