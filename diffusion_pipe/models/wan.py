"""Wan 2.1 text-to-video (DiT with 3D rotary attention, flow matching; UMT5 text encoder, Wan 3D causal VAE),
through diffusers components. Images are one-frame videos, so images and videos share one dataset and one path.

Wan 2.2 A14B ships two experts in one pipeline (`transformer` for high noise, `transformer_2` for low noise,
split at `boundary_ratio` of the schedule). `WanAdapter(..., expert="high" | "low")` trains one of them on its
own timestep range; see `timestep_range`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Adapter, Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import dtype_name, load_component, save_tiny_t5_encoder, save_tiny_tokenizers


@dataclass
class WanTextEncoder:
    """UMT5 encoder and its tokenizer."""

    t5: nn.Module
    tokenizer: object


class WanEmbed(nn.Module):
    """First layer: patch embedding, timestep and text embeddings, rotary tables. Takes (latents, timesteps, text)
    and, for a transformer with `image_dim` (Wan 2.1 I2V), the CLIP image states after them.
    Returns (tokens, text, timestep_proj, temb, cos, sin); `text` is then the embedded image states followed by
    the text's, as WanTransformer3DModel.forward concatenates them for cross-attention."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.rope = transformer.rope
        self.patch_embedding = transformer.patch_embedding
        self.condition_embedder = transformer.condition_embedder

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        latents, timesteps, text, *image = inputs
        image = image[0] if image else None
        cos, sin = self.rope(latents)
        hidden = self.patch_embedding(latents).flatten(2).transpose(1, 2).contiguous()
        if timesteps.ndim == 2:  # one timestep per token (Wan 2.2 TI2V), as WanTransformer3DModel.forward
            temb, timestep_proj, text, image = self.condition_embedder(timesteps.flatten() * 1000, text, image,
                                                                       timestep_seq_len=timesteps.shape[1])
            timestep_proj = timestep_proj.unflatten(2, (6, -1))
        else:
            temb, timestep_proj, text, image = self.condition_embedder(timesteps * 1000, text, image)
            timestep_proj = timestep_proj.unflatten(1, (6, -1))
        if image is not None:
            text = torch.cat((image, text), dim=1)
        return hidden, text, timestep_proj, temb, cos, sin


class WanBlock(nn.Module):
    """One transformer block: self-attention, cross-attention to the text, feed-forward."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, text, timestep_proj, temb, cos, sin = inputs
        hidden = self.block(hidden, text, timestep_proj, (cos, sin))
        return hidden, text, timestep_proj, temb, cos, sin


class TopLevelParameters(nn.Module):
    """The transformer's own top-level parameters (`scale_shift_table`), through its very `_parameters` dict.
    Training loads weights by replacing Parameter objects inside the denoiser's modules after the layers are
    built on the meta device; a plain reference would keep the stale meta Parameter, this one sees the new."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self._parameters = transformer._parameters


class WanOut(nn.Module):
    """Last layer: adaptive output norm and projection to patch tokens (unpatchified by the adapter)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.norm_out = transformer.norm_out
        self.proj_out = transformer.proj_out
        self.top = TopLevelParameters(transformer)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        hidden, _text, _proj, temb, _cos, _sin = inputs
        if temb.ndim == 3:  # one timestep per token (Wan 2.2 TI2V)
            shift, scale = (self.top.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
            shift, scale = shift.squeeze(2), scale.squeeze(2)
        else:
            shift, scale = (self.top.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        hidden = (self.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
        return self.proj_out(hidden)


def unpatchify(tokens_BLD: torch.Tensor, like_BCFHW: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """Patch tokens (B, F'H'W', C*pt*ph*pw) back to (B, C, F, H, W), as WanTransformer3DModel.forward does."""
    b, _, f, h, w = like_BCFHW.shape
    pt, ph, pw = patch
    x = tokens_BLD.reshape(b, f // pt, h // ph, w // pw, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)


EXPERTS = {"high": "transformer", "low": "transformer_2"}


def keep_first_frame_clean(noisy_latents: torch.Tensor, target: torch.Tensor,
                           latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`Adapter.keep_clean` of a family whose clip is conditioned on its own first latent frame (Wan 2.2 TI2V,
    Cosmos-Predict2 Video2World): that frame enters clean and leaves the target; an image (one latent frame) has
    nothing to generate from it and trains whole."""
    if latents.shape[2] == 1:
        return noisy_latents, target
    noisy = torch.cat((latents[:, :, :1].to(noisy_latents.dtype), noisy_latents[:, :, 1:]), dim=2)
    return noisy, target[:, :, 1:]


class WanAdapter(Adapter):
    """Wan 2.1 T2V (and one expert of Wan 2.2 A14B) in diffusers format (transformer, vae, text_encoder,
    tokenizer, scheduler)."""

    name: ClassVar[str] = "wan"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image", "video"), tasks=("t2v",), objective="flow", export_formats=("diffusers", "comfyui"),
    )

    experts: ClassVar[tuple[str, ...]] = tuple(EXPERTS)

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def vae_scale(self) -> int:
        return self.component_config("vae").get("scale_factor_spatial") or 8

    @property
    def vae_scale_temporal(self) -> int:
        return self.component_config("vae").get("scale_factor_temporal") or 4

    @property
    def pixel_multiple(self) -> int:
        return self.vae_scale * self.component_config(self._transformer_component())["patch_size"][1]

    def vae_class(self) -> type[nn.Module]:
        from diffusers import AutoencoderKLWan

        return AutoencoderKLWan

    def text_encoder_class(self) -> type[nn.Module]:
        """The transformers class of `text_encoder/`: UMT5's encoder (Cosmos-Predict2, which shares this encoding,
        reads T5's)."""
        from transformers import UMT5EncoderModel

        return UMT5EncoderModel

    def load_text_encoders(self, device: torch.device) -> WanTextEncoder:
        from transformers import AutoTokenizer

        return WanTextEncoder(
            t5=load_component(self.text_encoder_class(), self.model_dir / "text_encoder", self.dtype, device),
            tokenizer=AutoTokenizer.from_pretrained(self.model_dir / "tokenizer"),
        )

    def clean_caption(self, caption: str) -> str:
        """A caption as the pipeline tokenizes it: WanPipeline's `prompt_clean` (HTML unescaped, whitespace
        collapsed)."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        return prompt_clean(caption)

    @torch.no_grad()
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        frames = pixels_BCFHW.shape[2]
        if (frames - 1) % self.vae_scale_temporal:
            raise ValueError(f"family '{self.name}': {frames} frames; the Wan VAE needs 4k+1 frames (1, 5, 9, .., "
                             "81): set scan.datasets[].frames to such counts")
        latents = vae.encode(pixels_BCFHW.to(vae.device, vae.dtype)).latent_dist.mode()
        return [{"latents": x.contiguous().cpu()} for x in latents]

    @torch.no_grad()
    def encode_text(self, encoders: WanTextEncoder, captions: list[str], max_length: int) -> list[TensorDict]:
        """As WanPipeline._get_t5_prompt_embeds: UMT5 states of the real tokens, zeros past them (the
        transformer was trained on zero padding, not on the encoder's states of pad tokens)."""
        enc = encoders
        tokens = enc.tokenizer([self.clean_caption(c) for c in captions], padding="max_length", max_length=max_length,
                               truncation=True, add_special_tokens=True, return_attention_mask=True,
                               return_tensors="pt")
        mask = tokens.attention_mask
        states = enc.t5(tokens.input_ids.to(enc.t5.device), mask.to(enc.t5.device)).last_hidden_state.cpu()
        states = states * mask.unsqueeze(-1).to(states.dtype)
        return [{"t5": states[i].contiguous()} for i in range(len(captions))]

    def latent_spec(self, width: int, height: int, frames: int) -> Spec:
        s, st = self.vae_scale, self.vae_scale_temporal
        return {"latents": ((self.component_config("vae")["z_dim"], (frames - 1) // st + 1, height // s, width // s),
                            dtype_name(self.dtype))}

    def text_spec(self, max_length: int) -> Spec:
        return {"t5": ((max_length, self.component_config("text_encoder")["d_model"]), dtype_name(self.dtype))}

    # ---- train side --------------------------------------------------------------------------------
    def normalise_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Per-channel (x - mean) / std, the inverse of what WanPipeline applies before decoding."""
        config = self.component_config("vae")
        shape = (-1, 1, 1, 1)
        mean = torch.tensor(config["latents_mean"], dtype=latents.dtype).view(shape)
        std = torch.tensor(config["latents_std"], dtype=latents.dtype).view(shape)
        return (latents - mean) / std

    def _transformer_component(self) -> str:
        return EXPERTS[self.expert] if self.expert else "transformer"

    def boundary_ratio(self) -> float | None:
        """Wan 2.2's expert split (fraction of the schedule), from model_index.json; None for Wan 2.1."""
        index = self.model_dir / "model_index.json"
        return json.loads(index.read_text()).get("boundary_ratio") if index.is_file() else None

    def timestep_range(self) -> tuple[float, float]:
        """Wan 2.2: the high-noise expert denoises t >= boundary_ratio, the low-noise one t < boundary_ratio
        (WanPipeline switches at boundary_ratio * num_train_timesteps). Otherwise the whole schedule."""
        if self.expert is None:
            return (0.0, 1.0)
        boundary = self.boundary_ratio()
        if boundary is None:
            raise ValueError(f"{self.model_dir}: expert {self.expert!r} asked for, but model_index.json has no "
                             "boundary_ratio (a Wan 2.1 model has one transformer; drop the expert)")
        return (boundary, 1.0) if self.expert == "high" else (0.0, boundary)

    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import WanTransformer3DModel

        return WanTransformer3DModel

    def denoiser_dir(self) -> Path:
        return self.model_dir / self._transformer_component()

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        return ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        return [WanEmbed(denoiser), *(WanBlock(b) for b in denoiser.blocks), WanOut(denoiser)]

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """(latents (B, C, F, H, W), t in [0, 1], UMT5 states); Wan is not guidance-distilled."""
        return noisy_latents.to(self.dtype), timesteps.to(self.dtype), text["t5"].to(self.dtype)

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        patch = tuple(self.component_config(self._transformer_component())["patch_size"])
        return unpatchify(prediction, like, patch)

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        from diffusers import WanPipeline

        return WanPipeline

    def sample_inputs(self, text: TensorDict, negative: TensorDict, guidance: float, cfg_scale: float) -> dict:
        """`guidance` is Wan's classifier-free guidance scale, over the negative prompt's embeddings."""
        return {"prompt_embeds": text["t5"][None].to(self.dtype),
                "negative_prompt_embeds": negative["t5"][None].to(self.dtype), "guidance_scale": guidance}

    # ---- export side -------------------------------------------------------------------------------
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        return self.transformer_export(lora, fmt, comfyui_lora)

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """Wan 2.1's layout at toy width: a 2-block transformer, a 3-level 3D VAE (x8 spatial, x4 temporal),
        a 2-layer UMT5."""
        import tempfile

        from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
        from transformers import UMT5Config, UMT5EncoderModel

        out_dir = Path(out_dir)
        with tempfile.TemporaryDirectory() as tmp:
            _, t5_tok = save_tiny_tokenizers(Path(tmp))
        t5_tok.save_pretrained(out_dir / "tokenizer")
        torch.manual_seed(seed)
        save_tiny_t5_encoder(out_dir / "text_encoder", t5_tok, UMT5EncoderModel, UMT5Config)
        AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                         temperal_downsample=[False, True, True]).save_pretrained(out_dir / "vae")
        WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
            text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
        ).save_pretrained(out_dir / "transformer")
        UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
                                flow_shift=3.0).save_pretrained(out_dir / "scheduler")
        (out_dir / "model_index.json").write_text(MODEL_INDEX)


MODEL_INDEX = """{
  "_class_name": "WanPipeline",
  "_diffusers_version": "0.42.1",
  "scheduler": ["diffusers", "UniPCMultistepScheduler"],
  "text_encoder": ["transformers", "UMT5EncoderModel"],
  "tokenizer": ["transformers", "T5TokenizerFast"],
  "transformer": ["diffusers", "WanTransformer3DModel"],
  "vae": ["diffusers", "AutoencoderKLWan"]
}
"""

# diffusers module name (inside a block) -> the original Wan name ComfyUI loads.
_BLOCK_NAMES = {
    "attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o", "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k",
    "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o", "attn2.add_k_proj": "cross_attn.k_img",
    "attn2.add_v_proj": "cross_attn.v_img", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2",
}
_TOP_LEVEL = {
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "proj_out": "head.head",
}


def wan_original_name(name: str) -> str:
    """The original Wan module name (`blocks.0.self_attn.q`) of a diffusers WanTransformer3DModel module name
    (`blocks.0.attn1.to_q`); ValueError for one without a counterpart."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blocks" and parts[2] in _BLOCK_NAMES:
        return f"blocks.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
    raise ValueError(f"{name}: no original Wan (ComfyUI) name for this module; drop it from train.lora_targets "
                     "or export the 'diffusers' format")


def comfyui_lora(lora: TensorDict) -> TensorDict:
    """ComfyUI loads Wan LoRAs only under the original Wan names: `diffusion_model.blocks.0.self_attn.q.lora_A
    .weight`, with `.alpha` = rank written explicitly (ComfyUI scales by alpha/rank only when it exists)."""
    out: TensorDict = {}
    for key, value in lora.items():
        module, _, suffix = key.rpartition(".lora_")
        if suffix not in ("A.weight", "B.weight"):
            raise ValueError(f"{key}: not a PEFT LoRA weight (expected .lora_A.weight or .lora_B.weight)")
        base = f"diffusion_model.{wan_original_name(module)}"
        out[f"{base}.lora_{suffix}"] = value
        if suffix == "A.weight":
            out[f"{base}.alpha"] = torch.tensor(float(value.shape[0]))
    return out

