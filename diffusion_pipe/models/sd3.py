"""Stable Diffusion 3 / 3.5 (MMDiT, flow matching; CLIP-L and CLIP-G pooled + sequence, T5 sequence), through
diffusers components. SD3.5's dual-attention blocks (attn2) and qk norms are handled by the same code.

Text goes through StableDiffusion3Pipeline's own `encode_prompt` (both CLIPs' penultimate states concatenated,
padded to T5's width and joined with T5's states; the two pooled projections concatenated).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Adapter, Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import dtype_name, load_component, save_tiny_tokenizers


@dataclass
class SD3TextEncoders:
    """StableDiffusion3Pipeline over its three text encoders and tokenizers only: its own `encode_prompt`."""

    pipeline: object


class SD3Embed(nn.Module):
    """First layer: patch embedding with positions, timestep + pooled text embedding, text projection.
    Returns (hidden, encoder, temb)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.pos_embed = transformer.pos_embed
        self.time_text_embed = transformer.time_text_embed
        self.context_embedder = transformer.context_embedder

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        latents, timesteps, prompt_embeds, pooled = inputs
        hidden = self.pos_embed(latents).contiguous()
        # the transformer takes the scheduler's timesteps (t * 1000), as StableDiffusion3Pipeline passes them
        temb = self.time_text_embed(timesteps.to(hidden.dtype) * 1000, pooled)
        return hidden, self.context_embedder(prompt_embeds), temb


class SD3Block(nn.Module):
    """One joint block. The last one (context_pre_only) updates only the image stream and returns
    (hidden, temb): nothing reads the text stream after it."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, encoder, temb = inputs
        encoder, hidden = self.block(hidden_states=hidden, encoder_hidden_states=encoder, temb=temb)
        return (hidden, temb) if self.block.context_pre_only else (hidden, encoder, temb)


class SD3Out(nn.Module):
    """Last layer: final adaptive norm and projection to patch tokens (unpatchified by the adapter)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.norm_out = transformer.norm_out
        self.proj_out = transformer.proj_out

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        hidden, temb = inputs
        return self.proj_out(self.norm_out(hidden, temb))


class SD3Adapter(Adapter):
    """SD3 Medium and SD3.5 Medium/Large in diffusers format (transformer, vae, text_encoder(_2, _3),
    tokenizer(_2, _3), scheduler)."""

    name: ClassVar[str] = "sd3"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image",), tasks=("t2i",), objective="flow", export_formats=("diffusers", "comfyui"),
    )

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def pixel_multiple(self) -> int:
        return self.vae_scale * self.component_config("transformer")["patch_size"]

    def text_component_dirs(self) -> tuple[dict[str, Path], dict[str, Path]]:
        d = self.model_dir
        return ({"text_encoder": d / "text_encoder", "text_encoder_2": d / "text_encoder_2",
                 "text_encoder_3": d / "text_encoder_3"},
                {"tokenizer": d / "tokenizer", "tokenizer_2": d / "tokenizer_2", "tokenizer_3": d / "tokenizer_3"})

    def load_text_encoders(self, device: torch.device) -> SD3TextEncoders:
        from diffusers import StableDiffusion3Pipeline
        from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

        d = self.model_dir
        return SD3TextEncoders(StableDiffusion3Pipeline(
            scheduler=None, vae=None, transformer=None,
            text_encoder=load_component(CLIPTextModelWithProjection, d / "text_encoder", self.dtype, device),
            text_encoder_2=load_component(CLIPTextModelWithProjection, d / "text_encoder_2", self.dtype, device),
            text_encoder_3=load_component(T5EncoderModel, d / "text_encoder_3", self.dtype, device),
            tokenizer=AutoTokenizer.from_pretrained(d / "tokenizer"),
            tokenizer_2=AutoTokenizer.from_pretrained(d / "tokenizer_2"),
            tokenizer_3=AutoTokenizer.from_pretrained(d / "tokenizer_3"),
        ))

    @torch.no_grad()
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        if pixels_BCFHW.shape[2] != 1:
            raise ValueError(f"family 'sd3' trains on images only; got {pixels_BCFHW.shape[2]} frames")
        # The distribution's mode, unscaled: normalisation happens at load time, so a scaling change is free.
        latents = vae.encode(pixels_BCFHW[:, :, 0].to(vae.device, vae.dtype)).latent_dist.mode()
        return [{"latents": x.contiguous().cpu()} for x in latents]

    @torch.no_grad()
    def encode_text(self, encoders: SD3TextEncoders, captions: list[str], max_length: int) -> list[TensorDict]:
        """StableDiffusion3Pipeline.encode_prompt, the caption fed to all three encoders."""
        pipe = encoders.pipeline
        embeds, _, pooled, _ = pipe.encode_prompt(captions, None, None, device=pipe.text_encoder.device,
                                                  do_classifier_free_guidance=False, max_sequence_length=max_length)
        return [{"prompt_embeds": embeds[i].contiguous().cpu(), "pooled": pooled[i].contiguous().cpu()}
                for i in range(len(captions))]

    def latent_spec(self, width: int, height: int, frames: int) -> Spec:
        s = self.vae_scale
        return {"latents": ((self.component_config("vae")["latent_channels"], height // s, width // s), dtype_name(self.dtype))}

    def text_spec(self, max_length: int) -> Spec:
        """CLIP's fixed 77 tokens followed by T5's `max_length`, at the transformer's joint width."""
        clip_length = self.model_json("tokenizer/tokenizer_config.json")["model_max_length"]
        config = self.component_config("transformer")
        dt = dtype_name(self.dtype)
        return {"prompt_embeds": ((clip_length + max_length, config["joint_attention_dim"]), dt),
                "pooled": ((config["pooled_projection_dim"],), dt)}

    # ---- train side --------------------------------------------------------------------------------
    def normalise_latents(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.component_config("vae")
        return (latents - (config.get("shift_factor") or 0.0)) * config["scaling_factor"]

    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import SD3Transformer2DModel

        return SD3Transformer2DModel

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        return ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")

    def lora_exclude(self) -> str:
        """The last block's text query projection: that block keeps only the image stream, so the text
        queries' outputs are discarded and a LoRA there would never train."""
        last = self.component_config("transformer")["num_layers"] - 1
        return rf"^transformer_blocks\.{last}\.attn\.add_q_proj$"

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        return [SD3Embed(denoiser), *(SD3Block(b) for b in denoiser.transformer_blocks), SD3Out(denoiser)]

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """As StableDiffusion3Pipeline calls the transformer; SD3 has no guidance embedding."""
        return (noisy_latents.to(self.dtype), timesteps.to(self.dtype), text["prompt_embeds"].to(self.dtype),
                text["pooled"].to(self.dtype))

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Patch tokens back to (B, C, H, W), as SD3Transformer2DModel.forward unpatchifies them."""
        b, c, h, w = like.shape
        p = self.component_config("transformer")["patch_size"]
        x = prediction.reshape(b, h // p, w // p, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(b, c, h, w)

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline

    def sample_inputs(self, text: TensorDict, negative: TensorDict, guidance: float, cfg_scale: float) -> dict:
        """`guidance` is SD3's classifier-free guidance scale, over the negative prompt's embeddings."""
        return {"prompt_embeds": text["prompt_embeds"][None].to(self.dtype),
                "pooled_prompt_embeds": text["pooled"][None].to(self.dtype),
                "negative_prompt_embeds": negative["prompt_embeds"][None].to(self.dtype),
                "negative_pooled_prompt_embeds": negative["pooled"][None].to(self.dtype),
                "guidance_scale": guidance}

    # ---- export side -------------------------------------------------------------------------------
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        if fmt == "diffusers":
            return {f"transformer.{k}": v for k, v in lora.items()}
        if fmt == "comfyui":
            config = self.component_config("transformer")
            return comfyui_lora(lora, config["num_attention_heads"] * config["attention_head_dim"],
                                config["num_layers"])
        raise self.unknown_format(fmt)

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """SD3.5's layout at toy width: a 2-block MMDiT whose first block has dual attention, qk norms, two
        CLIPs with projections and a T5 (CLIP widths 16 + 16 = T5's 32), a 3-level VAE."""
        import tempfile

        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
        from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

        out_dir = Path(out_dir)
        with tempfile.TemporaryDirectory() as tmp:
            clip_tok, t5_tok = save_tiny_tokenizers(Path(tmp))
        for name in ("tokenizer", "tokenizer_2"):
            clip_tok.save_pretrained(out_dir / name)
        t5_tok.save_pretrained(out_dir / "tokenizer_3")
        torch.manual_seed(seed)
        for name in ("text_encoder", "text_encoder_2"):
            CLIPTextModelWithProjection(CLIPTextConfig(
                vocab_size=len(clip_tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=77, projection_dim=16,
                bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id,
                pad_token_id=clip_tok.pad_token_id,
            )).save_pretrained(out_dir / name)
        T5EncoderModel(T5Config(
            vocab_size=len(t5_tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, pad_token_id=t5_tok.pad_token_id,
            eos_token_id=t5_tok.eos_token_id, decoder_start_token_id=t5_tok.pad_token_id,
        )).save_pretrained(out_dir / "text_encoder_3")
        AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 16),
            down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
            layers_per_block=1, norm_num_groups=4, sample_size=64, scaling_factor=1.5, shift_factor=0.06,
            use_quant_conv=False, use_post_quant_conv=False,
        ).save_pretrained(out_dir / "vae")
        SD3Transformer2DModel(
            sample_size=32, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
            joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32, out_channels=4,
            pos_embed_max_size=32, dual_attention_layers=(0,), qk_norm="rms_norm",
        ).save_pretrained(out_dir / "transformer")
        FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(out_dir / "scheduler")
        (out_dir / "model_index.json").write_text(MODEL_INDEX)


MODEL_INDEX = """{
  "_class_name": "StableDiffusion3Pipeline",
  "_diffusers_version": "0.42.1",
  "feature_extractor": [null, null],
  "image_encoder": [null, null],
  "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
  "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
  "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
  "text_encoder_3": ["transformers", "T5EncoderModel"],
  "tokenizer": ["transformers", "CLIPTokenizer"],
  "tokenizer_2": ["transformers", "CLIPTokenizer"],
  "tokenizer_3": ["transformers", "T5TokenizerFast"],
  "transformer": ["diffusers", "SD3Transformer2DModel"],
  "vae": ["diffusers", "AutoencoderKL"]
}
"""


# diffusers module inside transformer block N -> (original MMDiT name inside joint_blocks.N, part of the fused
# projection or None): the block map of ComfyUI's comfy/utils.py `mmdit_to_diffusers` (MMDIT_MAP_BLOCK and its
# qkv slices), plus SD3.5's second attention (`x_block.attn2`, which that map leaves out).
_BLOCK_NAMES: dict[str, tuple[str, int | None]] = {
    "attn.to_q": ("x_block.attn.qkv", 0), "attn.to_k": ("x_block.attn.qkv", 1), "attn.to_v": ("x_block.attn.qkv", 2),
    "attn.to_out.0": ("x_block.attn.proj", None),
    "attn.add_q_proj": ("context_block.attn.qkv", 0), "attn.add_k_proj": ("context_block.attn.qkv", 1),
    "attn.add_v_proj": ("context_block.attn.qkv", 2), "attn.to_add_out": ("context_block.attn.proj", None),
    "attn2.to_q": ("x_block.attn2.qkv", 0), "attn2.to_k": ("x_block.attn2.qkv", 1),
    "attn2.to_v": ("x_block.attn2.qkv", 2), "attn2.to_out.0": ("x_block.attn2.proj", None),
    "ff.net.0.proj": ("x_block.mlp.fc1", None), "ff.net.2": ("x_block.mlp.fc2", None),
    "ff_context.net.0.proj": ("context_block.mlp.fc1", None), "ff_context.net.2": ("context_block.mlp.fc2", None),
    "norm1.linear": ("x_block.adaLN_modulation.1", None),
    "norm1_context.linear": ("context_block.adaLN_modulation.1", None),
}
# MMDIT_MAP_BASIC's Linear layers
_TOP_LEVEL_NAMES: dict[str, str] = {
    "context_embedder": "context_embedder",
    "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
    "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
    "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
    "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
    "proj_out": "final_layer.linear", "norm_out.linear": "final_layer.adaLN_modulation.1",
}


def sd3_original_module(module: str) -> tuple[str, int | None]:
    """A diffusers SD3 module name -> (its name in the original MMDiT, which ComfyUI loads, and its part index in
    a fused qkv or None). 'transformer_blocks.3.attn.to_k' -> ('joint_blocks.3.x_block.attn.qkv', 1)."""
    match = re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)", module)
    if match and match.group(2) in _BLOCK_NAMES:
        name, part = _BLOCK_NAMES[match.group(2)]
        return f"joint_blocks.{match.group(1)}.{name}", part
    if module in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[module], None
    raise ValueError(f"export.formats: comfyui has no ComfyUI SD3 name for LoRA module {module!r}; drop it from "
                     "train.lora_targets or export the 'diffusers' format only")


def swaps_scale_shift(original: str, num_layers: int) -> bool:
    """Whether the original orders this modulation's output (shift, scale) where diffusers has (scale, shift):
    the final layer's and the last block's context modulation (swap_scale_shift in ComfyUI's map)."""
    return original in ("final_layer.adaLN_modulation.1",
                        f"joint_blocks.{num_layers - 1}.context_block.adaLN_modulation.1")


def comfyui_lora(lora: TensorDict, inner_dim: int, num_layers: int) -> TensorDict:
    """The LoRA under the original MMDiT names, `diffusion_model.`-prefixed (the generic keys of ComfyUI's
    comfy/lora.py `model_lora_keys_unet`), as `lora_down`/`lora_up` with `.alpha` = rank (lora_B is pre-scaled).
    q/k/v go into one exact fused LoRA per qkv projection (zero rows for parts without one)."""
    from diffusion_pipe.lora_keys import down_up_alpha, fuse_loras, lora_modules

    groups: dict[str, dict[int | None, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, pair in lora_modules(lora).items():
        original, part = sd3_original_module(module)
        groups.setdefault(original, {})[part] = pair
    out: TensorDict = {}
    for original, parts in sorted(groups.items()):
        if original.endswith(".qkv"):
            a, b = fuse_loras([parts.get(i) for i in range(3)], [inner_dim] * 3)
        else:
            a, b = parts[None]
        if swaps_scale_shift(original, num_layers):
            first, second = b.chunk(2, dim=0)
            b = torch.cat([second, first], dim=0)
        out.update(down_up_alpha(f"diffusion_model.{original}", a, b))
    return out
