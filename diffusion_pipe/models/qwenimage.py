"""Qwen-Image (MMDiT with 3-axis complex rotary embeddings, flow matching; Qwen2.5-VL text encoder under a system
prompt, the Qwen-Image VAE), through diffusers components.

Text goes through QwenImagePipeline's own `encode_prompt` (its template, the template tokens dropped, the last
hidden states of the caption's tokens) and latents are packed into 2x2 patches like Flux's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Adapter, Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import PipelineTextEncoder, dtype_name, load_component, \
    save_tiny_qwen_tokenizer
from diffusion_pipe.models.flux import pack_latents, unpack_latents


def _text_pipeline(text_encoder: nn.Module | None = None, tokenizer: object | None = None) -> object:
    from diffusers import QwenImagePipeline

    return QwenImagePipeline(scheduler=None, vae=None, transformer=None, text_encoder=text_encoder,
                             tokenizer=tokenizer)


class QwenImageEmbed(nn.Module):
    """First layer: embeds latent tokens, text and timestep, computes the rotary tables. The complex rotary
    tables travel as real views (a stage boundary sends real tensors) and the text mask as integers. `grid` holds
    the (frames, height, width) of each image whose tokens `hidden` holds, in order (the target's, then an edit
    model's control images'). With `zero_cond_t` (Qwen-Image-Edit-2511) the timestep embedding is computed for t
    and for 0, and `modulate_index` marks the tokens (the control images') modulated by the second, as the
    transformer's forward does; otherwise it is all zeros and unused.
    Returns (hidden, encoder, text_mask, temb, image_freqs, text_freqs, modulate_index)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.img_in = transformer.img_in
        self.txt_norm = transformer.txt_norm
        self.txt_in = transformer.txt_in
        self.time_text_embed = transformer.time_text_embed
        self.pos_embed = transformer.pos_embed
        self.zero_cond_t = transformer.config.zero_cond_t

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, timesteps, text, text_mask, grid = inputs
        hidden = self.img_in(hidden)
        timesteps = timesteps.to(hidden.dtype)
        # the grids are the same for every item of a micro-batch (one bucket): take the first row
        shapes = [tuple(g) for g in grid[0].tolist()]
        counts = [f * h * w for f, h, w in shapes]
        modulate_index = torch.cat([torch.full((n,), int(i > 0), dtype=torch.int32) for i, n in enumerate(counts)])
        modulate_index = modulate_index.to(hidden.device).expand(hidden.shape[0], -1).contiguous()
        if self.zero_cond_t:
            timesteps = torch.cat((timesteps, timesteps * 0))
        temb = self.time_text_embed(timesteps, hidden)
        encoder = self.txt_in(self.txt_norm(text))
        image_freqs, text_freqs = self.pos_embed([shapes], max_txt_seq_len=text.shape[1], device=hidden.device)
        return (hidden, encoder, text_mask, temb, torch.view_as_real(image_freqs).contiguous(),
                torch.view_as_real(text_freqs).contiguous(), modulate_index)


class QwenImageBlock(nn.Module):
    """One double-stream block; takes and returns (hidden, encoder, text_mask, temb, image_freqs, text_freqs,
    modulate_index)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, encoder, text_mask, temb, image_freqs, text_freqs, modulate_index = inputs
        encoder, hidden = self.block(
            hidden_states=hidden, encoder_hidden_states=encoder, encoder_hidden_states_mask=text_mask.bool(),
            temb=temb, image_rotary_emb=(torch.view_as_complex(image_freqs), torch.view_as_complex(text_freqs)),
            modulate_index=modulate_index if self.block.zero_cond_t else None)
        return hidden, encoder, text_mask, temb, image_freqs, text_freqs, modulate_index


class QwenImageOut(nn.Module):
    """Last layer: final adaptive norm (under t's embedding) and projection back to packed latent tokens."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.norm_out = transformer.norm_out
        self.proj_out = transformer.proj_out
        self.zero_cond_t = transformer.config.zero_cond_t

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        hidden, _encoder, _mask, temb, _image_freqs, _text_freqs, _index = inputs
        if self.zero_cond_t:
            temb = temb.chunk(2, dim=0)[0]
        return self.proj_out(self.norm_out(hidden, temb))


class QwenImageAdapter(Adapter):
    """Qwen-Image (text-to-image) in diffusers format (transformer, vae, text_encoder, tokenizer, scheduler)."""

    name: ClassVar[str] = "qwenimage"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image",), tasks=("t2i",), objective="flow", export_formats=("diffusers", "comfyui"),
    )
    # The tiny model's vision tokens (vision start, image, vision end), in its tokenizer when the VL encoder reads
    # images (edit models); else they lie outside the vocabulary, as captions never contain them.
    tiny_vision_tokens: ClassVar[tuple[str, ...]] = ()

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def vae_scale(self) -> int:
        """As QwenImagePipeline computes it: one halving per temporal-downsample level."""
        return 2 ** len(self.component_config("vae")["temperal_downsample"])

    @property
    def pixel_multiple(self) -> int:
        return self.vae_scale * self.component_config("transformer")["patch_size"]

    def vae_class(self) -> type[nn.Module]:
        from diffusers import AutoencoderKLQwenImage

        return AutoencoderKLQwenImage

    def text_template(self) -> str:
        """QwenImagePipeline's system-prompt template and how many of its tokens it drops, read from diffusers."""
        pipe = _text_pipeline()
        return json.dumps({"template": pipe.prompt_template_encode,
                           "drop_tokens": pipe.prompt_template_encode_start_idx})

    def load_text_encoders(self, device: torch.device) -> PipelineTextEncoder:
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        encoder = load_component(Qwen2_5_VLForConditionalGeneration, self.model_dir / "text_encoder", self.dtype,
                                 device)
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir / "tokenizer")
        return PipelineTextEncoder(_text_pipeline(encoder, tokenizer))

    @torch.no_grad()
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        if pixels_BCFHW.shape[2] != 1:
            raise ValueError(f"family 'qwenimage' trains on images only; got {pixels_BCFHW.shape[2]} frames")
        # The distribution's mode, unnormalised (normalisation happens at load time); the VAE's frame axis of
        # one is dropped, so the latents pack like an image's.
        latents = vae.encode(pixels_BCFHW.to(vae.device, vae.dtype)).latent_dist.mode()[:, :, 0]
        return [{"latents": x.contiguous().cpu()} for x in latents]

    @torch.no_grad()
    def encode_text(self, encoders: PipelineTextEncoder, captions: list[str], max_length: int) -> list[TensorDict]:
        """QwenImagePipeline.encode_prompt, then zero-padded to `max_length` with the mask saying which tokens are
        the caption's (the pipeline pads to the longest caption of its batch; padding is masked out of
        attention and does not move the caption tokens' rotary positions, so its length changes nothing)."""
        pipe = encoders.pipeline
        states, mask = pipe.encode_prompt(captions, device=pipe.text_encoder.device, max_sequence_length=max_length)
        length = states.shape[1]
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(len(captions), length, dtype=torch.long)
        padded = states.new_zeros(len(captions), max_length, states.shape[2])
        padded[:, :length] = states
        padded_mask = torch.zeros(len(captions), max_length, dtype=torch.long)
        padded_mask[:, :length] = mask.cpu()
        return [{"prompt_embeds": padded[i].contiguous().cpu(), "prompt_mask": padded_mask[i].contiguous()}
                for i in range(len(captions))]

    def latent_spec(self, width: int, height: int, frames: int) -> Spec:
        s = self.vae_scale
        return {"latents": ((self.component_config("vae")["z_dim"], height // s, width // s), dtype_name(self.dtype))}

    def text_spec(self, max_length: int) -> Spec:
        return {"prompt_embeds": ((max_length, self.component_config("transformer")["joint_attention_dim"]),
                                  dtype_name(self.dtype)),
                "prompt_mask": ((max_length,), "int64")}

    # ---- train side --------------------------------------------------------------------------------
    def normalise_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Per-channel (x - mean) / std, the inverse of what QwenImagePipeline applies before decoding."""
        config = self.component_config("vae")
        mean = torch.tensor(config["latents_mean"], dtype=latents.dtype).view(-1, 1, 1)
        std = torch.tensor(config["latents_std"], dtype=latents.dtype).view(-1, 1, 1)
        return (latents - mean) / std

    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import QwenImageTransformer2DModel

        return QwenImageTransformer2DModel

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        return ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")

    def lora_exclude(self) -> str:
        """The last block's text-stream outputs: the model's output reads only the image stream after it, so a
        LoRA there would never train."""
        last = self.component_config("transformer")["num_layers"] - 1
        return rf"^transformer_blocks\.{last}\.(attn\.to_add_out|txt_mlp\..+)$"

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        config = denoiser.config
        if config.zero_cond_t or config.use_additional_t_cond or config.use_layer3d_rope:
            raise ValueError(f"{self.denoiser_dir()}: this is a Qwen-Image edit or layered transformer "
                             "(zero_cond_t / use_additional_t_cond / use_layer3d_rope); family 'qwenimage' trains "
                             "the text-to-image model only")
        return [QwenImageEmbed(denoiser), *(QwenImageBlock(b) for b in denoiser.transformer_blocks),
                QwenImageOut(denoiser)]

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """As QwenImagePipeline calls the transformer; Qwen-Image has no guidance embedding."""
        b, _, h, w = noisy_latents.shape
        grid = torch.tensor([[[1, h // 2, w // 2]]] * b)
        return (pack_latents(noisy_latents).to(self.dtype), timesteps.to(self.dtype),
                text["prompt_embeds"].to(self.dtype), text["prompt_mask"].long(), grid)

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return unpack_latents(prediction, like.shape[-2], like.shape[-1])

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        from diffusers import QwenImagePipeline

        return QwenImagePipeline

    def sample_inputs(self, text: TensorDict, negative: TensorDict, guidance: float, cfg_scale: float) -> dict:
        """Qwen-Image's classifier-free guidance is QwenImagePipeline's `true_cfg_scale` (its `guidance_scale`
        feeds guidance-distilled variants only): `cfg_scale` above 1 runs it over the negative prompt."""
        kwargs = {"prompt_embeds": text["prompt_embeds"][None].to(self.dtype),
                  "prompt_embeds_mask": text["prompt_mask"][None], "true_cfg_scale": cfg_scale}
        if cfg_scale > 1:
            kwargs |= {"negative_prompt_embeds": negative["prompt_embeds"][None].to(self.dtype),
                       "negative_prompt_embeds_mask": negative["prompt_mask"][None]}
        return kwargs

    # ---- export side -------------------------------------------------------------------------------
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        return self.transformer_export(lora, fmt, comfyui_lora)

    @classmethod
    def tiny_template(cls) -> str:
        """The template the tiny tokenizer learns its words from: the pipeline's."""
        return _text_pipeline().prompt_template_encode

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """Qwen-Image's layout at toy width: a 2-block transformer, a 4-level VAE (x8), a 2-layer Qwen2.5-VL with a
        one-block vision tower, and a tokenizer in which the pipeline's template is 34 tokens, as in the real one."""
        from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        out_dir = Path(out_dir)
        tokenizer = save_tiny_qwen_tokenizer(out_dir / "tokenizer", template=cls.tiny_template(),
                                             special_tokens=cls.tiny_vision_tokens)
        torch.manual_seed(seed)
        vocab = len(tokenizer)
        start, image, end = (tokenizer.convert_tokens_to_ids(list(cls.tiny_vision_tokens)) if cls.tiny_vision_tokens
                             else (vocab + 2, vocab, vocab + 3))
        Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config={"vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 2048,
                         "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                             "mrope_section": [2, 3, 3]}},
            vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                           "out_hidden_size": 32, "fullatt_block_indexes": [0]},
            image_token_id=image, video_token_id=vocab + 1, vision_start_token_id=start, vision_end_token_id=end,
        )).save_pretrained(out_dir / "text_encoder")
        AutoencoderKLQwenImage(
            base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
            latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 2.0],
        ).save_pretrained(out_dir / "vae")
        QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
        ).save_pretrained(out_dir / "transformer")
        FlowMatchEulerDiscreteScheduler(shift=1.0).save_pretrained(out_dir / "scheduler")
        (out_dir / "model_index.json").write_text(MODEL_INDEX)


MODEL_INDEX = """{
  "_class_name": "QwenImagePipeline",
  "_diffusers_version": "0.42.1",
  "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
  "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
  "tokenizer": ["transformers", "Qwen2Tokenizer"],
  "transformer": ["diffusers", "QwenImageTransformer2DModel"],
  "vae": ["diffusers", "AutoencoderKLQwenImage"]
}
"""


def comfyui_lora(lora: TensorDict) -> TensorDict:
    """The LoRA under ComfyUI's Qwen-Image names, which are diffusers' own (comfy/ldm/qwen_image/model.py keeps
    them), `diffusion_model.`-prefixed, as `lora_down`/`lora_up` with `.alpha` = rank (lora_B is pre-scaled, so
    scale 1): the generic `diffusion_model.<module>` keys of ComfyUI's comfy/lora.py `model_lora_keys_unet`."""
    from diffusion_pipe.lora_keys import down_up_alpha, lora_modules

    out: TensorDict = {}
    for module, (a, b) in lora_modules(lora).items():
        out.update(down_up_alpha(f"diffusion_model.{module}", a, b))
    return out
