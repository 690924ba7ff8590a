"""HunyuanVideo 1.5 text-to-video (a dual-stream DiT, flow matching; a Qwen2.5-VL language model prompted with a
system message and a ByT5 encoder of the caption's quoted text; a causal 3D VAE, x16 spatial, x4 temporal),
through diffusers components. Images are one-frame videos.

Prompt encoding is HunyuanVideo15Pipeline's own (`_get_mllm_prompt_embeds`, `_get_byt5_prompt_embeds`, with
its system message and template crop); this file splits the transformer's forward into pipeline layers.

Text-to-video only: the image-conditioning tokens of the image-to-video model (SigLIP embeddings) are all masked
out in text-to-video, and a masked token never reaches an unmasked one, so the first layer leaves them out.
"""

from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Adapter, Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import dtype_name, load_component, save_tiny_qwen_tokenizer


def _pipeline_cls() -> type:
    from diffusers import HunyuanVideo15Pipeline

    return HunyuanVideo15Pipeline


@functools.cache
def sampling_pipeline_cls() -> type:
    """HunyuanVideo15Pipeline plus what diffusers 0.42.1 leaves out of it and sampling needs: `load_lora_weights`
    (through its transformer's own PEFT loader, `load_lora_adapter`) and a per-call `guidance_scale` (the pipeline
    reads its classifier-free guidance scale from its guider component). Its VAE decodes one item at a time: in
    0.42.1 the VAE's mid-block attention builds a (B, L, L) causal mask that does not broadcast against its
    (B, 1, L, C) queries when B > 1 (a RuntimeError), in encode and decode alike."""
    from diffusers import HunyuanVideo15Pipeline

    class HunyuanVideo15SamplingPipeline(HunyuanVideo15Pipeline):
        def load_lora_weights(self, path_or_state_dict: str | Path | TensorDict, **kwargs) -> None:
            from safetensors.torch import load_file

            state = path_or_state_dict
            if not isinstance(state, dict):
                state = load_file(str(state))
            self.transformer.load_lora_adapter(state, prefix="transformer", **kwargs)

        def __call__(self, *args, guidance_scale: float | None = None, **kwargs):
            if guidance_scale is not None:
                self.guider = self.guider.new(guidance_scale=guidance_scale)
            self.vae.enable_slicing()
            return super().__call__(*args, **kwargs)

    return HunyuanVideo15SamplingPipeline


def _prompt_defaults() -> dict:
    """The pipeline's prompt settings: the system message, the template tokens cropped off (`crop_start`), the
    hidden layer read, and the ByT5 length. They are the defaults of its encoding methods (equal to what
    HunyuanVideo15Pipeline.__init__ sets), read from there so they follow diffusers."""
    cls = _pipeline_cls()
    mllm = inspect.signature(cls._get_mllm_prompt_embeds).parameters
    byt5 = inspect.signature(cls._get_byt5_prompt_embeds).parameters
    return {"system_message": mllm["system_message"].default, "crop_start": mllm["crop_start"].default,
            "num_hidden_layers_to_skip": mllm["num_hidden_layers_to_skip"].default,
            "byt5_max_length": byt5["tokenizer_max_length"].default}


# Qwen2.5-VL's chat template for messages whose content is a string (the only kind the pipeline sends).
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


def valid_tokens_first(states: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per item, the unmasked tokens first (in order) and the masked ones after them, zeroed: the layout
    HunyuanVideo15Transformer3DModel.forward gives its joined text tokens."""
    keep = mask.bool()
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
    states = (states * keep.unsqueeze(-1).to(states.dtype)).gather(1, order.unsqueeze(-1).expand_as(states))
    return states, mask.gather(1, order)


class HunyuanVideo15Embed(nn.Module):
    """First layer: rotary tables, timestep embedding, patch embedding, the refined Qwen tokens and projected
    ByT5 tokens (each with its condition-type embedding), joined valid-first.
    Returns (tokens, text, text_mask, temb, cos, sin)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.rope = transformer.rope
        self.time_embed = transformer.time_embed
        self.x_embedder = transformer.x_embedder
        self.context_embedder = transformer.context_embedder
        self.context_embedder_2 = transformer.context_embedder_2
        self.cond_type_embed = transformer.cond_type_embed
        # Unused here (text-to-video masks the image tokens out), but held so that training loads its weights:
        # samples rendered during training run the transformer's whole forward, which computes it.
        self.image_embedder = transformer.image_embedder

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        latents, timesteps, qwen, qwen_mask, byt5, byt5_mask = inputs
        t = timesteps * 1000
        cos, sin = self.rope(latents)
        temb = self.time_embed(t)
        hidden = self.x_embedder(latents)
        qwen = self.context_embedder(qwen, t, qwen_mask)
        qwen = qwen + self.cond_type_embed(torch.zeros_like(qwen[:, :, 0], dtype=torch.long))
        byt5 = self.context_embedder_2(byt5)
        byt5 = byt5 + self.cond_type_embed(torch.ones_like(byt5[:, :, 0], dtype=torch.long))
        text, mask = valid_tokens_first(torch.cat([byt5, qwen], dim=1), torch.cat([byt5_mask, qwen_mask], dim=1))
        return hidden, text, mask, temb, cos, sin


class HunyuanVideo15Block(nn.Module):
    """One dual-stream block: joint attention over video and text tokens (masked text), two feed-forwards."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, text, mask, temb, cos, sin = inputs
        hidden, text = self.block(hidden, text, temb, mask, (cos, sin))
        return hidden, text, mask, temb, cos, sin


class HunyuanVideo15Out(nn.Module):
    """Last layer: adaptive output norm and projection to patch tokens (unpatchified by the adapter)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.norm_out = transformer.norm_out
        self.proj_out = transformer.proj_out

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        hidden, _text, _mask, temb, _cos, _sin = inputs
        return self.proj_out(self.norm_out(hidden, temb))


def unpatchify(tokens_BLD: torch.Tensor, like_BCFHW: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """Patch tokens (B, F'H'W', C*pt*ph*pw) back to (B, C, F, H, W), as HunyuanVideo15Transformer3DModel's
    forward ends."""
    b, _, f, h, w = like_BCFHW.shape
    pt, ph, pw = patch
    x = tokens_BLD.reshape(b, f // pt, h // ph, w // pw, -1, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)


class HunyuanVideo15Adapter(Adapter):
    """HunyuanVideo 1.5 text-to-video in diffusers format (transformer, vae, text_encoder + tokenizer: Qwen2.5-VL,
    text_encoder_2 + tokenizer_2: ByT5, scheduler, guider)."""

    name: ClassVar[str] = "hunyuan_video15"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image", "video"), tasks=("t2v",), objective="flow", export_formats=("diffusers", "comfyui"),
    )

    def _patch(self) -> tuple[int, int, int]:
        c = self.component_config("transformer")
        return (c["patch_size_t"], c["patch_size"], c["patch_size"])

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def pixel_multiple(self) -> int:
        return self.component_config("vae")["spatial_compression_ratio"] * self._patch()[1]

    def vae_class(self) -> type[nn.Module]:
        from diffusers import AutoencoderKLHunyuanVideo15

        return AutoencoderKLHunyuanVideo15

    def load_vae(self, device: torch.device) -> nn.Module:
        """The VAE, slicing batches into single items (see `sampling_pipeline_cls`)."""
        vae = super().load_vae(device)
        vae.enable_slicing()
        return vae

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
        """The pipeline's system message, template crop and hidden layer: each changes the embedding."""
        return json.dumps(_prompt_defaults(), sort_keys=True)

    def load_text_encoders(self, device: torch.device) -> dict:
        from transformers import AutoTokenizer, Qwen2_5_VLTextModel, T5EncoderModel

        d = self.model_dir
        return {"text_encoder": load_component(Qwen2_5_VLTextModel, d / "text_encoder", self.dtype, device),
                "tokenizer": AutoTokenizer.from_pretrained(d / "tokenizer"),
                "text_encoder_2": load_component(T5EncoderModel, d / "text_encoder_2", self.dtype, device),
                "tokenizer_2": AutoTokenizer.from_pretrained(d / "tokenizer_2")}

    @torch.no_grad()
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        frames = pixels_BCFHW.shape[2]
        temporal = self.component_config("vae")["temporal_compression_ratio"]
        if (frames - 1) % temporal:
            raise ValueError(f"family 'hunyuan_video15': {frames} frames; its VAE needs {temporal}k+1 frames "
                             f"(1, {temporal + 1}, {2 * temporal + 1}, ..): set scan.datasets[].frames to such counts")
        latents = vae.encode(pixels_BCFHW.to(vae.device, vae.dtype)).latent_dist.mode()
        return [{"latents": x.contiguous().cpu()} for x in latents]

    @torch.no_grad()
    def encode_text(self, encoders: dict, captions: list[str], max_length: int) -> list[TensorDict]:
        """HunyuanVideo15Pipeline's two encodings: the Qwen2.5-VL states (of the chat-templated caption, the
        system prompt cropped off) with their mask, and the ByT5 states of the caption's quoted text with theirs
        (zeros and an empty mask when it quotes nothing)."""
        cls, p = _pipeline_cls(), _prompt_defaults()
        device = encoders["text_encoder"].device
        qwen, qwen_mask = cls._get_mllm_prompt_embeds(
            encoders["text_encoder"], encoders["tokenizer"], captions, device, tokenizer_max_length=max_length,
            num_hidden_layers_to_skip=p["num_hidden_layers_to_skip"], system_message=p["system_message"],
            crop_start=p["crop_start"])
        byt5, byt5_mask = cls._get_byt5_prompt_embeds(encoders["tokenizer_2"], encoders["text_encoder_2"], captions,
                                                      device, tokenizer_max_length=p["byt5_max_length"])
        dt = self.dtype
        return [{"qwen": qwen[i].to(dt).cpu(), "qwen_mask": qwen_mask[i].to(dt).cpu(),
                 "byt5": byt5[i].to(dt).cpu(), "byt5_mask": byt5_mask[i].to(dt).cpu()} for i in range(len(captions))]

    def latent_spec(self, width: int, height: int, frames: int) -> Spec:
        c = self.component_config("vae")
        s, st = c["spatial_compression_ratio"], c["temporal_compression_ratio"]
        return {"latents": ((c["latent_channels"], (frames - 1) // st + 1, height // s, width // s),
                            dtype_name(self.dtype))}

    def text_spec(self, max_length: int) -> Spec:
        dt, byt5_len = dtype_name(self.dtype), _prompt_defaults()["byt5_max_length"]
        return {"qwen": ((max_length, self.component_config("text_encoder")["hidden_size"]), dt),
                "qwen_mask": ((max_length,), dt),
                "byt5": ((byt5_len, self.component_config("text_encoder_2")["d_model"]), dt), "byt5_mask": ((byt5_len,), dt)}

    # ---- train side --------------------------------------------------------------------------------
    def normalise_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """x scaling_factor, the inverse of what HunyuanVideo15Pipeline applies before decoding."""
        return latents * self.component_config("vae")["scaling_factor"]

    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import HunyuanVideo15Transformer3DModel

        return HunyuanVideo15Transformer3DModel

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        return ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                "ff_context.net.2")

    def lora_exclude(self) -> str:
        """Frozen despite matching target names: the text refiner's blocks (attn.to_q, ff.net.0.proj), and the
        last block's text-stream output (attn.to_add_out, ff_context): no block reads that text after it, so a
        LoRA there would never get a gradient."""
        last = self.component_config("transformer")["num_layers"] - 1
        return rf"^context_embedder\.|^transformer_blocks\.{last}\.(attn\.to_add_out|ff_context\.)"

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        return [HunyuanVideo15Embed(denoiser), *(HunyuanVideo15Block(b) for b in denoiser.transformer_blocks),
                HunyuanVideo15Out(denoiser)]

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """(latents with the empty first-frame condition and its mask channel, as HunyuanVideo15Pipeline's
        prepare_cond_latents_and_mask makes them for text-to-video; t in [0, 1]; Qwen states and mask; ByT5
        states and mask). Not guidance-distilled."""
        b, _, f, h, w = noisy_latents.shape
        x = noisy_latents.to(self.dtype)
        latents = torch.cat([x, torch.zeros_like(x), x.new_zeros(b, 1, f, h, w)], dim=1)
        return (latents, timesteps.to(self.dtype), text["qwen"].to(self.dtype), text["qwen_mask"].to(self.dtype),
                text["byt5"].to(self.dtype), text["byt5_mask"].to(self.dtype))

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return unpatchify(prediction, like, self._patch())

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        return sampling_pipeline_cls()

    def sample_pipeline(self, denoiser: nn.Module, vae: nn.Module) -> object:
        """The family's pipeline with the model's own guider (its classifier-free guidance)."""
        from diffusers import ClassifierFreeGuidance

        pipe = super().sample_pipeline(denoiser, vae)
        pipe.register_modules(guider=ClassifierFreeGuidance.from_pretrained(self.model_dir / "guider"))
        return pipe

    def sample_inputs(self, text: TensorDict, negative: TensorDict | None, guidance: float,
                      cfg_scale: float) -> dict:
        """Both encodings with their masks, for the prompt and the negative prompt; `guidance` is the
        classifier-free guidance scale."""
        out = {"guidance_scale": guidance}
        for prefix, entry in (("", text), ("negative_", negative)):
            out |= {f"{prefix}prompt_embeds": entry["qwen"][None].to(self.dtype),
                    f"{prefix}prompt_embeds_mask": entry["qwen_mask"][None].to(self.dtype),
                    f"{prefix}prompt_embeds_2": entry["byt5"][None].to(self.dtype),
                    f"{prefix}prompt_embeds_mask_2": entry["byt5_mask"][None].to(self.dtype)}
        return out

    # ---- export side -------------------------------------------------------------------------------
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        if fmt == "diffusers":
            return {f"transformer.{k}": v for k, v in lora.items()}
        if fmt == "comfyui":
            from diffusion_pipe.models.flux import comfyui_lora

            # ComfyUI's HunyuanVideo model (comfy/ldm/hunyuan_video/model.py) builds its double blocks from
            # Flux's DoubleStreamBlock, so a block's LoRA takes Flux's original names there (fused img/txt qkv).
            c = self.component_config("transformer")
            inner = c["num_attention_heads"] * c["attention_head_dim"]
            return comfyui_lora(lora, inner_dim=inner, mlp_dim=int(inner * c["mlp_ratio"]))
        raise self.unknown_format(fmt)

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """HunyuanVideo 1.5's layout at toy width: a 2-block transformer (its ByT5 projection is 2048 wide in
        diffusers whatever the config: its middle weight is zeroed so the files compress), a 3-level VAE (x4
        spatial and temporal), a 3-layer Qwen2.5-VL text model whose tokenizer splits the system prompt into as
        many tokens as the real one (the pipeline crops a fixed count), and a 2-layer ByT5."""
        from diffusers import (AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler,
                               HunyuanVideo15Transformer3DModel)
        from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

        out_dir = Path(out_dir)
        p = _prompt_defaults()
        prefix = CHAT_TEMPLATE_PREFIX.format(system=p["system_message"])
        tokenizer = save_tiny_qwen_tokenizer(out_dir / "tokenizer", template=prefix, chat_template=CHAT_TEMPLATE)
        assert len(tokenizer(prefix).input_ids) == p["crop_start"], "tiny tokenizer: template length drifted"
        byt5_tok = ByT5Tokenizer()
        byt5_tok.save_pretrained(out_dir / "tokenizer_2")
        torch.manual_seed(seed)
        Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048, bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
        )).save_pretrained(out_dir / "text_encoder")
        T5EncoderModel(T5Config(
            vocab_size=len(byt5_tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, pad_token_id=byt5_tok.pad_token_id,
            eos_token_id=byt5_tok.eos_token_id, decoder_start_token_id=byt5_tok.pad_token_id,
        )).save_pretrained(out_dir / "text_encoder_2")
        AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 8, 8), layers_per_block=1,
                                    spatial_compression_ratio=4, temporal_compression_ratio=4,
                                    ).save_pretrained(out_dir / "vae")
        transformer = HunyuanVideo15Transformer3DModel(
            in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
            num_refiner_layers=1, text_embed_dim=32, text_embed_2_dim=32, image_embed_dim=16,
            rope_axes_dim=(4, 6, 6), task_type="t2v",
        )
        with torch.no_grad():
            transformer.context_embedder_2.linear_2.weight.zero_()
        transformer.save_pretrained(out_dir / "transformer")
        FlowMatchEulerDiscreteScheduler(shift=7.0).save_pretrained(out_dir / "scheduler")
        ClassifierFreeGuidance(guidance_scale=6.0).save_pretrained(out_dir / "guider")
        (out_dir / "model_index.json").write_text(MODEL_INDEX)


# What CHAT_TEMPLATE renders before the caption: the tokens the pipeline crops off (`crop_start` of them).
CHAT_TEMPLATE_PREFIX = "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"

MODEL_INDEX = """{
  "_class_name": "HunyuanVideo15Pipeline",
  "_diffusers_version": "0.42.1",
  "guider": ["diffusers", "ClassifierFreeGuidance"],
  "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
  "text_encoder": ["transformers", "Qwen2_5_VLTextModel"],
  "text_encoder_2": ["transformers", "T5EncoderModel"],
  "tokenizer": ["transformers", "Qwen2Tokenizer"],
  "tokenizer_2": ["transformers", "ByT5Tokenizer"],
  "transformer": ["diffusers", "HunyuanVideo15Transformer3DModel"],
  "vae": ["diffusers", "AutoencoderKLHunyuanVideo15"]
}
"""
