"""LTX-Video 0.9.x text-to-video (a DiT over 1x1 patch tokens with 3D rotary attention, flow matching; T5
text encoder, LTX's causal video VAE: x32 spatial, x8 temporal), through diffusers components. Images are
one-frame videos, so images and videos share one dataset and one path.

Prompt encoding is LTXPipeline's own (`_get_t5_prompt_embeds`), token packing its `_pack_latents` and
`_unpack_latents`; this file only splits the transformer's forward into pipeline layers.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Adapter, Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import dtype_name, load_component, save_tiny_tokenizers, vae_latent_stats
from diffusion_pipe.models.wan import TopLevelParameters

# LTXPipeline's default `frame_rate`: the temporal rotary scale is vae_temporal_ratio / frame_rate, so the
# model is trained at the rate it is sampled at by default.
FRAME_RATE = 25.0


def _pipeline_cls() -> type:
    from diffusers import LTXPipeline

    return LTXPipeline


class LTXEmbed(nn.Module):
    """First layer: packs the latents into tokens, embeds them, the timestep and the text, turns the text mask
    into an attention bias and computes the rotary tables, as LTXVideoTransformer3DModel.forward does.
    Returns (tokens, text, temb, embedded_timestep, text_bias, cos, sin)."""

    def __init__(self, transformer: nn.Module, rope_scale: tuple[float, float, float]) -> None:
        super().__init__()
        self.proj_in = transformer.proj_in
        self.time_embed = transformer.time_embed
        self.caption_projection = transformer.caption_projection
        self.rope = transformer.rope
        self.patch = (transformer.config.patch_size, transformer.config.patch_size_t)
        self.rope_scale = rope_scale

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        latents, timesteps, text, mask = inputs
        b, _, f, h, w = latents.shape
        hidden = _pipeline_cls()._pack_latents(latents, *self.patch)
        cos, sin = self.rope(hidden, f, h, w, self.rope_scale)
        bias = ((1 - mask.to(hidden.dtype)) * -10000.0).unsqueeze(1)
        hidden = self.proj_in(hidden)
        temb, embedded = self.time_embed((timesteps * 1000).flatten(), batch_size=b, hidden_dtype=hidden.dtype)
        text = self.caption_projection(text).view(b, -1, hidden.size(-1))
        return (hidden, text, temb.view(b, -1, temb.size(-1)), embedded.view(b, -1, embedded.size(-1)), bias,
                cos, sin)


class LTXBlock(nn.Module):
    """One transformer block: self-attention with rotary embeddings, masked cross-attention, feed-forward."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, text, temb, embedded, bias, cos, sin = inputs
        hidden = self.block(hidden, text, temb, (cos, sin), bias)
        return hidden, text, temb, embedded, bias, cos, sin


class LTXOut(nn.Module):
    """Last layer: output norm modulated by the embedded timestep and projection to patch tokens."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.norm_out = transformer.norm_out
        self.proj_out = transformer.proj_out
        self.top = TopLevelParameters(transformer)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        hidden, _text, _temb, embedded, _bias, _cos, _sin = inputs
        values = self.top.scale_shift_table[None, None] + embedded[:, :, None]
        shift, scale = values[:, :, 0], values[:, :, 1]
        return self.proj_out(self.norm_out(hidden) * (1 + scale) + shift)


class LTXAdapter(Adapter):
    """LTX-Video 0.9.x in diffusers format (transformer, vae, text_encoder, tokenizer, scheduler)."""

    name: ClassVar[str] = "ltx"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image", "video"), tasks=("t2v",), objective="flow", export_formats=("diffusers", "comfyui"),
    )

    def _vae_ratios(self) -> tuple[int, int]:
        """(spatial, temporal) compression of the VAE, as AutoencoderKLLTXVideo.__init__ derives them: the
        config's explicit ratios (0.9.5 and later), else patch size x 2 ** (number of scaling blocks)."""
        c = self.component_config("vae")
        scalings = 2 ** sum(c["spatio_temporal_scaling"])
        return (c.get("spatial_compression_ratio") or c["patch_size"] * scalings,
                c.get("temporal_compression_ratio") or c["patch_size_t"] * scalings)

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def pixel_multiple(self) -> int:
        return self._vae_ratios()[0] * self.component_config("transformer")["patch_size"]

    def sample_size_multiple(self) -> int:
        return max(32, self.pixel_multiple)  # LTXPipeline refuses sizes that are not multiples of 32

    def vae_class(self) -> type[nn.Module]:
        from diffusers import AutoencoderKLLTXVideo

        return AutoencoderKLLTXVideo

    def load_text_encoders(self, device: torch.device) -> nn.Module:
        """An LTXPipeline holding only the T5 encoder and tokenizer: its own prompt encoding runs on them."""
        from transformers import AutoTokenizer, T5EncoderModel

        return _pipeline_cls()(
            scheduler=None, vae=None, transformer=None,
            text_encoder=load_component(T5EncoderModel, self.model_dir / "text_encoder", self.dtype, device),
            tokenizer=AutoTokenizer.from_pretrained(self.model_dir / "tokenizer"),
        )

    @torch.no_grad()
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        frames = pixels_BCFHW.shape[2]
        temporal = self._vae_ratios()[1]
        if (frames - 1) % temporal:
            raise ValueError(f"family 'ltx': {frames} frames; the LTX VAE needs {temporal}k+1 frames "
                             f"(1, {temporal + 1}, {2 * temporal + 1}, ..): set scan.datasets[].frames to such counts")
        latents = vae.encode(pixels_BCFHW.to(vae.device, vae.dtype)).latent_dist.mode()
        return [{"latents": x.contiguous().cpu()} for x in latents]

    @torch.no_grad()
    def encode_text(self, encoders: nn.Module, captions: list[str], max_length: int) -> list[TensorDict]:
        """LTXPipeline's T5 states (of every position: the pipeline runs T5 without a mask) and the token mask,
        which the transformer's cross-attention applies."""
        states, mask = encoders._get_t5_prompt_embeds(captions, max_sequence_length=max_length,
                                                      device=encoders.text_encoder.device, dtype=self.dtype)
        return [{"t5": states[i].contiguous().cpu(), "t5_mask": mask[i].to(self.dtype).cpu()}
                for i in range(len(captions))]

    def latent_spec(self, width: int, height: int, frames: int) -> Spec:
        s, st = self._vae_ratios()
        return {"latents": ((self.component_config("vae")["latent_channels"], (frames - 1) // st + 1, height // s, width // s),
                            dtype_name(self.dtype))}

    def text_spec(self, max_length: int) -> Spec:
        dt = dtype_name(self.dtype)
        return {"t5": ((max_length, self.component_config("text_encoder")["d_model"]), dt), "t5_mask": ((max_length,), dt)}

    # ---- train side --------------------------------------------------------------------------------
    @cached_property
    def _latent_stats(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """The VAE's `latents_mean` / `latents_std` buffers (stored with its weights, not in its config) and
        its `scaling_factor`."""
        return vae_latent_stats(self.model_dir, "LTX-Video")

    def normalise_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """LTXPipeline._normalize_latents, which its image-to-video path applies to encoded frames, per item."""
        mean, std, scaling = self._latent_stats
        return _pipeline_cls()._normalize_latents(latents, mean, std, scaling)

    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import LTXVideoTransformer3DModel

        return LTXVideoTransformer3DModel

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        return ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ff.net.0.proj", "ff.net.2")

    def rope_scale(self) -> tuple[float, float, float]:
        """LTXPipeline's `rope_interpolation_scale` at its default frame rate."""
        spatial, temporal = self._vae_ratios()
        return (temporal / FRAME_RATE, spatial, spatial)

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        return [LTXEmbed(denoiser, self.rope_scale()), *(LTXBlock(b) for b in denoiser.transformer_blocks),
                LTXOut(denoiser)]

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """(latents (B, C, F, H, W), t in [0, 1], T5 states, T5 mask); LTX-Video is not guidance-distilled."""
        return (noisy_latents.to(self.dtype), timesteps.to(self.dtype), text["t5"].to(self.dtype),
                text["t5_mask"].to(self.dtype))

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        c = self.component_config("transformer")
        _, _, f, h, w = like.shape
        p, pt = c["patch_size"], c["patch_size_t"]
        return _pipeline_cls()._unpack_latents(prediction, f // pt, h // p, w // p, p, pt)

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        return _pipeline_cls()

    def sample_inputs(self, text: TensorDict, negative: TensorDict, guidance: float, cfg_scale: float) -> dict:
        """`guidance` is LTX's classifier-free guidance scale, over the negative prompt's embeddings; the masks
        travel with the embeddings as LTXPipeline takes them."""
        return {"prompt_embeds": text["t5"][None].to(self.dtype),
                "prompt_attention_mask": text["t5_mask"][None].to(self.dtype),
                "negative_prompt_embeds": negative["t5"][None].to(self.dtype),
                "negative_prompt_attention_mask": negative["t5_mask"][None].to(self.dtype),
                "guidance_scale": guidance}

    # ---- export side -------------------------------------------------------------------------------
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        return self.transformer_export(lora, fmt, comfyui_lora)

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """LTX-Video's layout at toy width: a 2-block transformer, a VAE with 3 scaling blocks and no patching
        (x8 spatial, x8 temporal: the real model's 8k+1 frame rule), a 2-layer T5."""
        import tempfile

        from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXVideoTransformer3DModel
        from transformers import T5Config, T5EncoderModel

        out_dir = Path(out_dir)
        with tempfile.TemporaryDirectory() as tmp:
            _, t5_tok = save_tiny_tokenizers(Path(tmp))
        t5_tok.save_pretrained(out_dir / "tokenizer")
        torch.manual_seed(seed)
        T5EncoderModel(T5Config(
            vocab_size=len(t5_tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, pad_token_id=t5_tok.pad_token_id, eos_token_id=t5_tok.eos_token_id,
            decoder_start_token_id=t5_tok.pad_token_id,
        )).save_pretrained(out_dir / "text_encoder")
        vae = AutoencoderKLLTXVideo(
            latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
            layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1), patch_size=1,
            patch_size_t=1,
        )
        # Non-trivial latent statistics, so normalisation is exercised (the real VAE's are not 0 and 1).
        vae.latents_mean.copy_(torch.linspace(-0.5, 0.5, 8))
        vae.latents_std.copy_(torch.linspace(0.5, 1.5, 8))
        vae.save_pretrained(out_dir / "vae")
        LTXVideoTransformer3DModel(
            in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=12, cross_attention_dim=24,
            num_layers=2, caption_channels=32,
        ).save_pretrained(out_dir / "transformer")
        FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
            max_image_seq_len=4096, shift_terminal=0.1,
        ).save_pretrained(out_dir / "scheduler")
        (out_dir / "model_index.json").write_text(MODEL_INDEX)


MODEL_INDEX = """{
  "_class_name": "LTXPipeline",
  "_diffusers_version": "0.42.1",
  "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
  "text_encoder": ["transformers", "T5EncoderModel"],
  "tokenizer": ["transformers", "T5TokenizerFast"],
  "transformer": ["diffusers", "LTXVideoTransformer3DModel"],
  "vae": ["diffusers", "AutoencoderKLLTXVideo"]
}
"""

# diffusers module name -> the name in ComfyUI's LTXV model (comfy/ldm/lightricks/model.py: LTXVModel), where it
# differs; inside the blocks (attn1, attn2, ff) the names are the same. The inverse of diffusers' single-file
# converter for LTX (`patchify_proj` -> `proj_in`, `adaln_single` -> `time_embed`).
_TOP_LEVEL_RENAMES = {"proj_in": "patchify_proj", "time_embed": "adaln_single"}


def comfyui_module_name(name: str) -> str:
    """ComfyUI's LTXV module name of a diffusers LTXVideoTransformer3DModel module name."""
    head, dot, rest = name.partition(".")
    return _TOP_LEVEL_RENAMES.get(head, head) + dot + rest


def comfyui_lora(lora: TensorDict) -> TensorDict:
    """The LoRA as ComfyUI's loader consumes it for LTXV: `diffusion_model.<LTXVModel module>.lora_A/B.weight`
    (the generic `diffusion_model.` keys of comfy/lora.py `model_lora_keys_unet`), with `.alpha` = rank
    written explicitly (ComfyUI scales by alpha/rank only where it exists; lora_B is pre-scaled)."""
    out: TensorDict = {}
    for key, value in lora.items():
        module, _, suffix = key.rpartition(".lora_")
        if suffix not in ("A.weight", "B.weight"):
            raise ValueError(f"{key}: not a PEFT LoRA weight (expected .lora_A.weight or .lora_B.weight)")
        base = f"diffusion_model.{comfyui_module_name(module)}"
        out[f"{base}.lora_{suffix}"] = value
        if suffix == "A.weight":
            out[f"{base}.alpha"] = torch.tensor(float(value.shape[0]))
    return out
