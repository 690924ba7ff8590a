"""HunyuanImage 2.1 text-to-image (a dual- then single-stream DiT, flow matching; a Qwen2.5-VL language model
prompted with a system message and a ByT5 encoder of the caption's quoted text; a 32x VAE), through diffusers
components. The base model only: its distilled variant (guidance embedding, MeanFlow) and the refiner are refused.

Text goes through HunyuanImagePipeline's own `encode_prompt`: the caption in the pipeline's template, padded to
`encode.text_max_length` tokens after the 34 template tokens it drops, the Qwen2.5-VL hidden states it reads (the
third from the end) with their mask; and the glyph text (what the caption quotes, as the pipeline words it) through
ByT5, zeros with an empty mask when it quotes nothing. Latents are the VAE's, x scaling_factor at load time as the
pipeline un-scales them before decoding. This file splits the transformer's forward into pipeline layers.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from diffusion_pipe.models.base import Adapter, Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import PipelineTextEncoder, bare_pipeline, dtype_name, load_component, \
    save_tiny_qwen_tokenizer
from diffusion_pipe.models.hunyuan_video15 import valid_tokens_first


def _pipeline(**components: object) -> object:
    from diffusers import HunyuanImagePipeline

    return bare_pipeline(HunyuanImagePipeline, **components)


@functools.cache
def sampling_pipeline_cls() -> type:
    """HunyuanImagePipeline plus what diffusers 0.42.1 leaves out of it and sampling needs: `load_lora_weights`
    (through its transformer's own PEFT loader, `load_lora_adapter`) and a per-call `guidance_scale` (the pipeline
    reads its guidance scale from its guider components, the prompt's and the one for quoted text)."""
    from diffusers import HunyuanImagePipeline

    class HunyuanImageSamplingPipeline(HunyuanImagePipeline):
        def load_lora_weights(self, path_or_state_dict: str | Path | TensorDict, **kwargs) -> None:
            from safetensors.torch import load_file

            state = path_or_state_dict
            if not isinstance(state, dict):
                state = load_file(str(state))
            self.transformer.load_lora_adapter(state, prefix="transformer", **kwargs)

        def __call__(self, *args, guidance_scale: float | None = None, **kwargs):
            for name in ("guider", "ocr_guider"):
                guider = getattr(self, name, None)
                if guidance_scale is not None and guider is not None:
                    setattr(self, name, guider.new(guidance_scale=guidance_scale))
            return super().__call__(*args, **kwargs)

    return HunyuanImageSamplingPipeline


class HunyuanImageEmbed(nn.Module):
    """First layer: rotary tables, timestep embedding (t in [0, 1] to the scheduler's x1000 timesteps the model
    takes), patch embedding, the refined Qwen tokens and the projected ByT5 tokens, joined valid-first as
    HunyuanImageTransformer2DModel.forward joins them (padding zeroed there: masked as keys, it reaches no other
    token). Returns (tokens, text, text_mask, temb, cos, sin)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.rope = transformer.rope
        self.time_guidance_embed = transformer.time_guidance_embed
        self.x_embedder = transformer.x_embedder
        self.context_embedder = transformer.context_embedder
        self.context_embedder_2 = transformer.context_embedder_2

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        latents, timesteps, text, text_mask, glyph, glyph_mask = inputs
        t = timesteps * 1000
        cos, sin = self.rope(latents)
        temb = self.time_guidance_embed(t)
        hidden = self.x_embedder(latents)
        text = self.context_embedder(text, t, text_mask.bool())
        text, mask = valid_tokens_first(torch.cat([self.context_embedder_2(glyph), text], dim=1),
                                        torch.cat([glyph_mask, text_mask], dim=1))
        return hidden, text, mask, temb, cos, sin


class HunyuanImageBlock(nn.Module):
    """One dual- or single-stream block over image and text tokens (padding masked as keys); both take and return
    (tokens, text, text_mask, temb, cos, sin)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, text, text_mask, temb, cos, sin = inputs
        mask = F.pad(text_mask.bool(), (hidden.shape[1], 0), value=True)[:, None, None, :]
        hidden, text = self.block(hidden, text, temb, attention_mask=mask, image_rotary_emb=(cos, sin))
        return hidden, text, text_mask, temb, cos, sin


class HunyuanImageOut(nn.Module):
    """Last layer: adaptive output norm and projection to patch tokens (unpatchified by the adapter)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.norm_out = transformer.norm_out
        self.proj_out = transformer.proj_out

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        hidden, _text, _mask, temb, _cos, _sin = inputs
        return self.proj_out(self.norm_out(hidden, temb))


class HunyuanImageAdapter(Adapter):
    """HunyuanImage 2.1 (text-to-image) in diffusers format (transformer, vae, text_encoder + tokenizer: Qwen2.5-VL,
    text_encoder_2 + tokenizer_2: ByT5, scheduler, guider and ocr_guider)."""

    name: ClassVar[str] = "hunyuan_image"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image",), tasks=("t2i",), objective="flow", export_formats=("diffusers", "comfyui"),
    )

    @functools.cached_property
    def _bare(self) -> object:
        """HunyuanImagePipeline without components, for its template and lengths: built once."""
        return _pipeline()

    def _patch(self) -> tuple[int, int]:
        return tuple(self.component_config("transformer")["patch_size"])

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def vae_scale(self) -> int:
        """As HunyuanImagePipeline computes it: the VAE's spatial compression ratio (32)."""
        return self.component_config("vae")["spatial_compression_ratio"]

    @property
    def pixel_multiple(self) -> int:
        return self.vae_scale * math.lcm(*self._patch())

    def vae_class(self) -> type[nn.Module]:
        from diffusers import AutoencoderKLHunyuanImage

        return AutoencoderKLHunyuanImage

    def text_component_dirs(self) -> tuple[dict[str, Path], dict[str, Path]]:
        d = self.model_dir
        return ({"text_encoder": d / "text_encoder", "text_encoder_2": d / "text_encoder_2"},
                {"tokenizer": d / "tokenizer", "tokenizer_2": d / "tokenizer_2"})

    def caption_token_limits(self, tokenizers: dict[str, object], max_length: int) -> dict[str, int]:
        """The Qwen encoder's limit; ByT5 (`tokenizer_2`) reads only the caption's quoted text, at its own
        length, so the caption itself is never cut there."""
        limits = super().caption_token_limits(tokenizers, max_length)
        return {name: n for name, n in limits.items() if name != "tokenizer_2"}

    def text_template(self) -> str:
        """The pipeline's template, the template tokens it drops, the hidden layer it reads and the ByT5 length,
        read from diffusers: each changes the embedding."""
        pipe = self._bare
        qwen = inspect.signature(pipe._get_qwen_prompt_embeds).parameters
        return json.dumps({"template": pipe.prompt_template_encode,
                           "drop_tokens": pipe.prompt_template_encode_start_idx,
                           "hidden_state_skip_layer": qwen["hidden_state_skip_layer"].default,
                           "glyph_max_length": pipe.tokenizer_2_max_length}, sort_keys=True)

    def load_text_encoders(self, device: torch.device) -> PipelineTextEncoder:
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration, T5EncoderModel

        d = self.model_dir
        return PipelineTextEncoder(_pipeline(
            text_encoder=load_component(Qwen2_5_VLForConditionalGeneration, d / "text_encoder", self.dtype, device),
            tokenizer=AutoTokenizer.from_pretrained(d / "tokenizer"),
            text_encoder_2=load_component(T5EncoderModel, d / "text_encoder_2", self.dtype, device),
            tokenizer_2=AutoTokenizer.from_pretrained(d / "tokenizer_2")))

    @torch.no_grad()
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        """The distribution's mode, unscaled (scaling happens at load time)."""
        if pixels_BCFHW.shape[2] != 1:
            raise ValueError(f"family 'hunyuan_image' trains on images only; got {pixels_BCFHW.shape[2]} frames")
        latents = vae.encode(pixels_BCFHW[:, :, 0].to(vae.device, vae.dtype)).latent_dist.mode()
        return [{"latents": x.contiguous().cpu()} for x in latents]

    @torch.no_grad()
    def encode_text(self, encoders: PipelineTextEncoder, captions: list[str], max_length: int) -> list[TensorDict]:
        """HunyuanImagePipeline.encode_prompt with its Qwen length set to `max_length` (it pads every caption to
        that many tokens and cuts longer ones): Qwen2.5-VL states and mask, ByT5 states and mask of the glyph
        text (all zeros for a caption that quotes nothing)."""
        pipe = encoders.pipeline
        pipe.tokenizer_max_length = max_length
        qwen, qwen_mask, glyph, glyph_mask = pipe.encode_prompt(list(captions), device=pipe.text_encoder.device,
                                                             batch_size=len(captions))
        dt = self.dtype
        return [{"prompt_embeds": qwen[i].to(dt).contiguous().cpu(), "prompt_mask": qwen_mask[i].long().cpu(),
                 "glyph_embeds": glyph[i].to(dt).contiguous().cpu(), "glyph_mask": glyph_mask[i].long().cpu()}
                for i in range(len(captions))]

    def latent_spec(self, width: int, height: int, frames: int) -> Spec:
        s = self.vae_scale
        return {"latents": ((self.component_config("vae")["latent_channels"], height // s, width // s),
                            dtype_name(self.dtype))}

    def text_spec(self, max_length: int) -> Spec:
        config, dt = self.component_config("transformer"), dtype_name(self.dtype)
        glyph_length = self._bare.tokenizer_2_max_length
        return {"prompt_embeds": ((max_length, config["text_embed_dim"]), dt), "prompt_mask": ((max_length,), "int64"),
                "glyph_embeds": ((glyph_length, config["text_embed_2_dim"]), dt),
                "glyph_mask": ((glyph_length,), "int64")}

    # ---- train side --------------------------------------------------------------------------------
    def normalise_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """x scaling_factor, the inverse of what HunyuanImagePipeline applies before decoding."""
        return latents * self.component_config("vae")["scaling_factor"]

    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import HunyuanImageTransformer2DModel

        return HunyuanImageTransformer2DModel

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        return ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                "ff_context.net.2", "proj_mlp", "proj_out")

    def lora_exclude(self) -> str:
        """Frozen despite matching target names: the text refiner's blocks and the final projection."""
        return r"^context_embedder\.|^proj_out$"

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        config = denoiser.config
        if config.guidance_embeds or config.use_meanflow or len(config.patch_size) != 2:
            raise ValueError(f"{self.denoiser_dir()}: this is a distilled (guidance_embeds / use_meanflow) or refiner "
                             "HunyuanImage transformer; family 'hunyuan_image' trains the base text-to-image model "
                             "(hunyuanvideo-community/HunyuanImage-2.1-Diffusers)")
        blocks = [*denoiser.transformer_blocks, *denoiser.single_transformer_blocks]
        return [HunyuanImageEmbed(denoiser), *(HunyuanImageBlock(b) for b in blocks), HunyuanImageOut(denoiser)]

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """(latents, t in [0, 1], Qwen states and mask, ByT5 states and mask): what HunyuanImagePipeline gives the
        base transformer, but for the timestep's x1000 (the first layer's); no guidance embedding, no MeanFlow
        timestep."""
        dt = self.dtype
        return (noisy_latents.to(dt), timesteps.to(dt), text["prompt_embeds"].to(dt),
                text["prompt_mask"].long(), text["glyph_embeds"].to(dt), text["glyph_mask"].long())

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Patch tokens (B, H/p * W/p, C*p*p) back to (B, C, H, W), as the transformer's forward ends."""
        b, c, h, w = like.shape
        ph, pw = self._patch()
        return prediction.reshape(b, h // ph, w // pw, c, ph, pw).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        return sampling_pipeline_cls()

    def sample_size_multiple(self) -> int:
        """HunyuanImagePipeline wants sides that are multiples of twice its VAE factor (64)."""
        return 2 * self.vae_scale

    def sample_pipeline(self, denoiser: nn.Module, vae: nn.Module) -> object:
        """The family's pipeline with the model's own guiders (its classifier-free guidance, and the one it uses
        for prompts that quote text)."""
        import diffusers

        pipe = super().sample_pipeline(denoiser, vae)
        for name in ("guider", "ocr_guider"):
            if (self.model_dir / name).is_dir():
                cls = getattr(diffusers, self.model_json(f"{name}/guider_config.json")["_class_name"])
                pipe.register_modules(**{name: cls.from_pretrained(self.model_dir / name)})
        return pipe

    def sample_inputs(self, text: TensorDict, negative: TensorDict | None, guidance: float,
                      cfg_scale: float) -> dict:
        """Both encodings with their masks, for the prompt and the negative prompt; `guidance` is the guiders'
        guidance scale."""
        out = {"guidance_scale": guidance}
        for prefix, entry in (("", text), ("negative_", negative)):
            out |= {f"{prefix}prompt_embeds": entry["prompt_embeds"][None].to(self.dtype),
                    f"{prefix}prompt_embeds_mask": entry["prompt_mask"][None],
                    f"{prefix}prompt_embeds_2": entry["glyph_embeds"][None].to(self.dtype),
                    f"{prefix}prompt_embeds_mask_2": entry["glyph_mask"][None]}
        return out

    # ---- export side -------------------------------------------------------------------------------
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        """`diffusers`: the transformer's PEFT keys under `transformer.`, what its `load_lora_adapter` reads.
        `comfyui`: ComfyUI runs HunyuanImage 2.1 on its HunyuanVideo model (comfy/ldm/hunyuan_video/model.py, built
        from Flux's DoubleStreamBlock and SingleStreamBlock) as model_base.HunyuanImage21, a BaseModel of its own:
        comfy/lora.py's HunyuanVideo-only spellings do not apply, its generic `diffusion_model.<module>` keys do,
        so a LoRA takes Flux's original module names there (q/k/v fused into img_attn.qkv, with the MLP input
        into linear1), with `.alpha`."""
        if fmt == "diffusers":
            return {f"transformer.{k}": v for k, v in lora.items()}
        if fmt == "comfyui":
            from diffusion_pipe.models.flux import comfyui_lora

            c = self.component_config("transformer")
            inner = c["num_attention_heads"] * c["attention_head_dim"]
            return comfyui_lora(lora, inner_dim=inner, mlp_dim=int(inner * c["mlp_ratio"]))
        raise self.unknown_format(fmt)

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """HunyuanImage 2.1's layout at toy width: 2 dual- and 2 single-stream blocks (its ByT5 projection is 2048
        wide in diffusers whatever the config: its middle weight is set to the identity, so the file is mostly
        zeros and glyph states still reach the blocks), a 6-level VAE with the real x32 compression, a 3-layer
        Qwen2.5-VL whose tokenizer spends as many tokens on the template as the real one (the pipeline drops a
        fixed count), a 2-layer ByT5, and the guiders."""
        from diffusers import (AdaptiveProjectedMixGuidance, AutoencoderKLHunyuanImage, FlowMatchEulerDiscreteScheduler,
                               HunyuanImageTransformer2DModel)
        from transformers import ByT5Tokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, T5Config, \
            T5EncoderModel

        out_dir = Path(out_dir)
        tokenizer = save_tiny_qwen_tokenizer(out_dir / "tokenizer", template=_pipeline().prompt_template_encode)
        byt5_tok = ByT5Tokenizer()
        byt5_tok.save_pretrained(out_dir / "tokenizer_2")
        torch.manual_seed(seed)
        vocab = len(tokenizer)
        Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config={"vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
                         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 2048,
                         "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                             "mrope_section": [2, 3, 3]}},
            vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                           "out_hidden_size": 32, "fullatt_block_indexes": [0]},
            # image and video tokens outside the tiny vocabulary: captions never contain them
            image_token_id=vocab, video_token_id=vocab + 1, vision_start_token_id=vocab + 2,
            vision_end_token_id=vocab + 3,
        )).save_pretrained(out_dir / "text_encoder")
        T5EncoderModel(T5Config(
            vocab_size=len(byt5_tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, pad_token_id=byt5_tok.pad_token_id,
            eos_token_id=byt5_tok.eos_token_id, decoder_start_token_id=byt5_tok.pad_token_id,
        )).save_pretrained(out_dir / "text_encoder_2")
        AutoencoderKLHunyuanImage(
            in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(32,) * 6, layers_per_block=1,
            spatial_compression_ratio=32, sample_size=64, scaling_factor=0.75289,
        ).save_pretrained(out_dir / "vae")
        transformer = HunyuanImageTransformer2DModel(
            in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16, num_layers=2,
            num_single_layers=2, num_refiner_layers=1, patch_size=(1, 1), text_embed_dim=32, text_embed_2_dim=32,
            rope_axes_dim=(8, 8),
        )
        with torch.no_grad():
            nn.init.eye_(transformer.context_embedder_2.linear_2.weight)
        transformer.save_pretrained(out_dir / "transformer")
        FlowMatchEulerDiscreteScheduler(shift=5.0).save_pretrained(out_dir / "scheduler")
        for name in ("guider", "ocr_guider"):
            AdaptiveProjectedMixGuidance().save_pretrained(out_dir / name)
        (out_dir / "model_index.json").write_text(MODEL_INDEX)


MODEL_INDEX = """{
  "_class_name": "HunyuanImagePipeline",
  "_diffusers_version": "0.42.1",
  "guider": ["diffusers", "AdaptiveProjectedMixGuidance"],
  "ocr_guider": ["diffusers", "AdaptiveProjectedMixGuidance"],
  "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
  "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
  "text_encoder_2": ["transformers", "T5EncoderModel"],
  "tokenizer": ["transformers", "Qwen2Tokenizer"],
  "tokenizer_2": ["transformers", "ByT5Tokenizer"],
  "transformer": ["diffusers", "HunyuanImageTransformer2DModel"],
  "vae": ["diffusers", "AutoencoderKLHunyuanImage"]
}
"""
