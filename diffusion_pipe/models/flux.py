"""Flux (MMDiT, flow matching; CLIP pooled + T5 sequence conditioning), through diffusers components."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Adapter, Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import dtype_name, load_component, save_tiny_tokenizers
from diffusion_pipe.params import SamplePrompt


@dataclass
class FluxTextEncoders:
    """CLIP (pooled) and T5 (sequence) encoders with their tokenizers."""

    clip: nn.Module
    clip_tokenizer: object
    t5: nn.Module
    t5_tokenizer: object


class FluxEmbed(nn.Module):
    """First pipeline layer: embeds latent tokens, text, timestep (and guidance) and computes rotary tables."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.x_embedder = transformer.x_embedder
        self.context_embedder = transformer.context_embedder
        self.time_text_embed = transformer.time_text_embed
        self.pos_embed = transformer.pos_embed
        self.guidance_embeds = transformer.config.guidance_embeds

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, timesteps, t5, pooled, img_ids, txt_ids, guidance = inputs
        hidden = self.x_embedder(hidden)
        t = timesteps.to(hidden.dtype) * 1000
        if self.guidance_embeds:
            temb = self.time_text_embed(t, guidance.to(hidden.dtype) * 1000, pooled)
        else:
            temb = self.time_text_embed(t, pooled)
        encoder = self.context_embedder(t5)
        # ids are the same for every item of a micro-batch (one bucket): take the first row.
        cos, sin = self.pos_embed(torch.cat((txt_ids[0], img_ids[0]), dim=0))
        return hidden, encoder, temb, cos.to(hidden.dtype), sin.to(hidden.dtype)


class FluxBlock(nn.Module):
    """One double-stream or single-stream block; both take and return (hidden, encoder, temb, cos, sin)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, encoder, temb, cos, sin = inputs
        encoder, hidden = self.block(hidden_states=hidden, encoder_hidden_states=encoder, temb=temb,
                                     image_rotary_emb=(cos, sin))
        return hidden, encoder, temb, cos, sin


class FluxOut(nn.Module):
    """Last pipeline layer: final adaptive norm and projection back to packed latent tokens."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.norm_out = transformer.norm_out
        self.proj_out = transformer.proj_out

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        hidden, _encoder, temb, _cos, _sin = inputs
        return self.proj_out(self.norm_out(hidden, temb))


def pack_latents(latents_BCHW: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, C*4): Flux's 2x2 patch tokens."""
    b, c, h, w = latents_BCHW.shape
    x = latents_BCHW.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens_BLD: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of `pack_latents` for latent size (height, width)."""
    b, _, d = tokens_BLD.shape
    x = tokens_BLD.view(b, height // 2, width // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, height, width)


def image_ids(height: int, width: int) -> torch.Tensor:
    """Rotary position ids (H/2 * W/2, 3) of the packed latent tokens."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] = torch.arange(height // 2)[:, None]
    ids[..., 2] = torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3)


class FluxAdapter(Adapter):
    """Flux.1 dev/schnell-shaped models in diffusers format (transformer, vae, text_encoder(_2), tokenizer(_2))."""

    name: ClassVar[str] = "flux"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image",), tasks=("t2i",), objective="flow", export_formats=("diffusers", "comfyui"),
    )
    comfyui_reads_diffusers_names: ClassVar[bool] = True  # comfy/lora.py maps them through utils.flux_to_diffusers

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def pixel_multiple(self) -> int:
        return self.vae_scale * 2

    def text_component_dirs(self) -> tuple[dict[str, Path], dict[str, Path]]:
        d = self.model_dir
        return ({"text_encoder": d / "text_encoder", "text_encoder_2": d / "text_encoder_2"},
                {"tokenizer": d / "tokenizer", "tokenizer_2": d / "tokenizer_2"})

    def load_text_encoders(self, device: torch.device) -> FluxTextEncoders:
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        d = self.model_dir
        return FluxTextEncoders(
            clip=load_component(CLIPTextModel, d / "text_encoder", self.dtype, device),
            clip_tokenizer=AutoTokenizer.from_pretrained(d / "tokenizer"),
            t5=load_component(T5EncoderModel, d / "text_encoder_2", self.dtype, device),
            t5_tokenizer=AutoTokenizer.from_pretrained(d / "tokenizer_2"),
        )

    @torch.no_grad()
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        if pixels_BCFHW.shape[2] != 1:
            raise ValueError(f"family '{self.name}' trains on images only; got {pixels_BCFHW.shape[2]} frames")
        # The distribution's mode, unscaled: normalisation happens at load time, so a scaling change is free.
        latents = vae.encode(pixels_BCFHW[:, :, 0].to(vae.device, vae.dtype)).latent_dist.mode()
        return [{"latents": x.contiguous().cpu()} for x in latents]

    @torch.no_grad()
    def encode_text(self, encoders: FluxTextEncoders, captions: list[str], max_length: int) -> list[TensorDict]:
        enc = encoders
        clip_ids = enc.clip_tokenizer(captions, padding="max_length", truncation=True, return_tensors="pt",
                                      max_length=enc.clip_tokenizer.model_max_length).input_ids
        pooled = enc.clip(clip_ids.to(enc.clip.device), output_hidden_states=False).pooler_output
        t5_ids = enc.t5_tokenizer(captions, padding="max_length", truncation=True, max_length=max_length,
                                  return_tensors="pt").input_ids
        t5 = enc.t5(t5_ids.to(enc.t5.device), output_hidden_states=False)[0]
        return [{"t5": t5[i].contiguous().cpu(), "clip_pooled": pooled[i].contiguous().cpu()}
                for i in range(len(captions))]

    def latent_spec(self, width: int, height: int, frames: int) -> Spec:
        channels = self.component_config("vae")["latent_channels"]
        s = self.vae_scale
        return {"latents": ((channels, height // s, width // s), dtype_name(self.dtype))}

    def text_spec(self, max_length: int) -> Spec:
        t5_dim = self.component_config("text_encoder_2")["d_model"]
        clip_dim = self.component_config("text_encoder")["hidden_size"]
        dt = dtype_name(self.dtype)
        return {"t5": ((max_length, t5_dim), dt), "clip_pooled": ((clip_dim,), dt)}

    # ---- train side --------------------------------------------------------------------------------
    def normalise_latents(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.component_config("vae")
        return (latents - (config.get("shift_factor") or 0.0)) * config["scaling_factor"]

    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import FluxTransformer2DModel

        return FluxTransformer2DModel

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        return ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "proj_mlp", "proj_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")

    def lora_exclude(self) -> str:
        """Top-level modules that share target names but must stay frozen (the final projection)."""
        return r"^proj_out$"

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        blocks = [*denoiser.transformer_blocks, *denoiser.single_transformer_blocks]
        return [FluxEmbed(denoiser), *(FluxBlock(b) for b in blocks), FluxOut(denoiser)]

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        b, _, h, w = noisy_latents.shape
        t5 = text["t5"].to(self.dtype)
        return (
            pack_latents(noisy_latents).to(self.dtype),
            timesteps.to(self.dtype),
            t5,
            text["clip_pooled"].to(self.dtype),
            image_ids(h, w).unsqueeze(0).expand(b, -1, -1).contiguous(),
            torch.zeros(b, t5.shape[1], 3),
            torch.full((b,), guidance, dtype=self.dtype),
        )

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return unpack_latents(prediction, like.shape[-2], like.shape[-1])

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        from diffusers import FluxPipeline

        return FluxPipeline

    def sample_texts(self, prompt: SamplePrompt) -> tuple[str, ...]:
        """The negative prompt only with true CFG (cfg_scale > 1): Flux's distilled guidance needs none."""
        return (prompt.prompt, prompt.negative_prompt) if prompt.cfg_scale > 1 else (prompt.prompt,)

    def sample_inputs(self, text: TensorDict, negative: TensorDict | None, guidance: float,
                      cfg_scale: float) -> dict:
        kwargs = {"prompt_embeds": text["t5"][None].to(self.dtype),
                  "pooled_prompt_embeds": text["clip_pooled"][None].to(self.dtype), "guidance_scale": guidance}
        if cfg_scale > 1:  # true CFG, on top of the distilled guidance
            kwargs |= {"negative_prompt_embeds": negative["t5"][None].to(self.dtype),
                       "negative_pooled_prompt_embeds": negative["clip_pooled"][None].to(self.dtype),
                       "true_cfg_scale": cfg_scale}
        return kwargs

    # ---- export side -------------------------------------------------------------------------------
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        if fmt == "diffusers":
            return {f"transformer.{k}": v for k, v in lora.items()}
        if fmt == "comfyui":
            config = self.component_config("transformer")
            inner_dim = config["num_attention_heads"] * config["attention_head_dim"]
            # diffusers builds every single block with its default mlp_ratio of 4
            return comfyui_lora(lora, inner_dim=inner_dim, mlp_dim=int(inner_dim * 4.0))
        raise self.unknown_format(fmt)

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
        from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

        out_dir = Path(out_dir)
        clip_tok, t5_tok = save_tiny_tokenizers(out_dir)
        torch.manual_seed(seed)
        CLIPTextModel(CLIPTextConfig(
            vocab_size=len(clip_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=77, projection_dim=32,
            bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id,
            pad_token_id=clip_tok.pad_token_id,
        )).save_pretrained(out_dir / "text_encoder")
        T5EncoderModel(T5Config(
            vocab_size=len(t5_tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, pad_token_id=t5_tok.pad_token_id,
            eos_token_id=t5_tok.eos_token_id, decoder_start_token_id=t5_tok.pad_token_id,
        )).save_pretrained(out_dir / "text_encoder_2")
        AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 16),
            down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
            layers_per_block=1, norm_num_groups=4, sample_size=64, scaling_factor=0.8, shift_factor=0.1,
            use_quant_conv=False, use_post_quant_conv=False,
        ).save_pretrained(out_dir / "vae")
        FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        ).save_pretrained(out_dir / "transformer")
        FlowMatchEulerDiscreteScheduler(shift=1.0).save_pretrained(out_dir / "scheduler")
        (out_dir / "model_index.json").write_text(MODEL_INDEX)


MODEL_INDEX = """{
  "_class_name": "FluxPipeline",
  "_diffusers_version": "0.42.1",
  "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
  "text_encoder": ["transformers", "CLIPTextModel"],
  "text_encoder_2": ["transformers", "T5EncoderModel"],
  "tokenizer": ["transformers", "CLIPTokenizer"],
  "tokenizer_2": ["transformers", "T5TokenizerFast"],
  "transformer": ["diffusers", "FluxTransformer2DModel"],
  "vae": ["diffusers", "AutoencoderKL"]
}
"""


def comfyui_lora(lora: TensorDict, inner_dim: int, mlp_dim: int) -> TensorDict:
    """The LoRA under ComfyUI's own Flux module names (those of BFL's original model), `diffusion_model.`-prefixed,
    as `lora_down`/`lora_up` with an explicit `.alpha` = rank (ComfyUI scales by alpha/rank only where `.alpha`
    exists; lora_B is pre-scaled, so scale 1 is right).

    Projections the original model fuses (q/k/v into `img_attn.qkv`, q/k/v/mlp into `linear1`) get one fused
    LoRA each, exactly: A = cat(A_i), B = block_diag(B_i), zero rows for untrained parts. `inner_dim` and
    `mlp_dim` are the widths of those parts (needed when a part has no LoRA).
    """
    from diffusion_pipe.lora_keys import down_up_alpha, fuse_loras, lora_modules

    groups: dict[str, dict[int | None, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, pair in lora_modules(lora).items():
        original, part = flux_original_module(module)
        groups.setdefault(original, {})[part] = pair
    out: TensorDict = {}
    for original, parts in sorted(groups.items()):
        dims = flux_fused_dims(original, inner_dim, mlp_dim)
        if dims is None:
            a, b = parts[None]
        else:
            a, b = fuse_loras([parts.get(i) for i in range(len(dims))], dims)
        if original == "final_layer.adaLN_modulation.1":
            b = _swap_halves(b)  # BFL orders this projection's output (shift, scale); diffusers (scale, shift)
        out.update(down_up_alpha(f"diffusion_model.{original}", a, b))
    return out


# diffusers module name inside a double-stream block -> (BFL/ComfyUI name, part of the fused projection or None)
_DOUBLE_BLOCK_NAMES: dict[str, tuple[str, int | None]] = {
    "attn.to_q": ("img_attn.qkv", 0), "attn.to_k": ("img_attn.qkv", 1), "attn.to_v": ("img_attn.qkv", 2),
    "attn.to_out.0": ("img_attn.proj", None),
    "attn.add_q_proj": ("txt_attn.qkv", 0), "attn.add_k_proj": ("txt_attn.qkv", 1),
    "attn.add_v_proj": ("txt_attn.qkv", 2), "attn.to_add_out": ("txt_attn.proj", None),
    "ff.net.0.proj": ("img_mlp.0", None), "ff.net.2": ("img_mlp.2", None),
    "ff_context.net.0.proj": ("txt_mlp.0", None), "ff_context.net.2": ("txt_mlp.2", None),
    "norm1.linear": ("img_mod.lin", None), "norm1_context.linear": ("txt_mod.lin", None),
}
_SINGLE_BLOCK_NAMES: dict[str, tuple[str, int | None]] = {
    "attn.to_q": ("linear1", 0), "attn.to_k": ("linear1", 1), "attn.to_v": ("linear1", 2),
    "proj_mlp": ("linear1", 3), "proj_out": ("linear2", None), "norm.linear": ("modulation.lin", None),
}
_TOP_LEVEL_NAMES: dict[str, str] = {
    "x_embedder": "img_in", "context_embedder": "txt_in",
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "proj_out": "final_layer.linear", "norm_out.linear": "final_layer.adaLN_modulation.1",
}
# Parameters that are not LoRA targets but complete the original state dict (qk norms).
_DOUBLE_BLOCK_NORMS = {"attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
                       "attn.norm_added_q": "txt_attn.norm.query_norm",
                       "attn.norm_added_k": "txt_attn.norm.key_norm"}
_SINGLE_BLOCK_NORMS = {"attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm"}


def flux_original_module(module: str) -> tuple[str, int | None]:
    """A diffusers Flux module name -> (its name in BFL's and ComfyUI's Flux model, its part index inside a fused
    projection or None). 'transformer_blocks.3.attn.to_k' -> ('double_blocks.3.img_attn.qkv', 1)."""
    import re

    match = re.fullmatch(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)", module)
    if match:
        kind, index, inner = match.groups()
        double = kind == "transformer_blocks"
        table = _DOUBLE_BLOCK_NAMES if double else _SINGLE_BLOCK_NAMES
        if inner in table:
            name, part = table[inner]
            return f"{'double_blocks' if double else 'single_blocks'}.{index}.{name}", part
    elif module in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[module], None
    raise ValueError(f"export.formats: comfyui has no ComfyUI Flux name for LoRA module {module!r}; drop it from "
                     "train.lora_targets or export the 'diffusers' format only")


def flux_fused_dims(original: str, inner_dim: int, mlp_dim: int) -> list[int] | None:
    """Output widths of the parts of a fused original projection, or None if `original` is not fused."""
    if original.endswith((".img_attn.qkv", ".txt_attn.qkv")):
        return [inner_dim] * 3
    if original.startswith("single_blocks.") and original.endswith(".linear1"):
        return [inner_dim] * 3 + [mlp_dim]
    return None


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def original_flux_state_dict(state_dict: TensorDict, inner_dim: int, mlp_dim: int) -> TensorDict:
    """A diffusers FluxTransformer2DModel state dict in BFL's original layout (ComfyUI's `diffusion_model.`
    names without the prefix): the inverse of diffusers' `convert_flux_transformer_checkpoint_to_diffusers`."""
    import re

    fused: dict[str, dict[int, torch.Tensor]] = {}
    out: TensorDict = {}
    for key, value in state_dict.items():
        module, param = key.rsplit(".", 1)
        block = re.fullmatch(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(attn\.norm_.+)", module)
        if block:  # qk norms: RMSNorm weights, called `scale` in BFL's code
            kind, index, inner = block.groups()
            double = kind == "transformer_blocks"
            norm = (_DOUBLE_BLOCK_NORMS if double else _SINGLE_BLOCK_NORMS)[inner]
            out[f"{'double_blocks' if double else 'single_blocks'}.{index}.{norm}.scale"] = value
            continue
        original, part = flux_original_module(module)
        if part is not None:
            fused.setdefault(f"{original}.{param}", {})[part] = value
        elif original == "final_layer.adaLN_modulation.1":
            out[f"{original}.{param}"] = _swap_halves(value)
        else:
            out[f"{original}.{param}"] = value
    for key, parts in fused.items():
        dims = flux_fused_dims(key.rsplit(".", 1)[0], inner_dim, mlp_dim)
        assert dims is not None and sorted(parts) == list(range(len(dims))), key
        out[key] = torch.cat([parts[i] for i in range(len(dims))], dim=0)
    return dict(sorted(out.items()))
