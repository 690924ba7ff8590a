"""Qwen-Image 2.1 (single-stream DiT over one [text, image] sequence under a block-causal mask, with one modulation
shared by every block, 3-axis complex rotary embeddings, flow matching; the last decoder layer of a Qwen3-VL text model,
before its final norm, under a system prompt; a 64-channel, 16x VAE that reads RGBA), through diffusers components.

Text goes through QwenImage21Pipeline's own prompt encoding, one caption at a time as the pipeline encodes a prompt
(its processor left-pads a batch, which moves a caption's positions in the VL encoder): its text-to-image template and
system prompt (both part of the text key), the system message's tokens dropped. An entry is zero-padded to
`encode.text_max_length` with the mask of its tokens; the pipeline never cuts a prompt, and encode refuses a longer
caption rather than cut it.

Unlike Qwen-Image's, padding is not free here: the image's rotary frame position is the text's length, padding
included. So `model_inputs` trims a micro-batch's entries to its longest caption, as the pipeline pads a batch of
prompts to its longest: a micro-batch of one is exactly the pipeline's call for its prompt, and in a larger one a
shorter caption's image sits where the pipeline puts it in a batch. Latents are the VAE's mode (pixels with an opaque
alpha channel, as the pipeline converts its images to RGBA), per-channel normalised at load time, and go to the
transformer unpatched (one token per latent pixel, the pipeline's `_pack_latents`); timesteps are t in [0, 1], as the
pipeline passes them.

Text-to-image only: the pipeline's condition images (edit / reference images, placed in the VL encoder's vision slots
and as latent blocks of their own) and its prefix KV cache (an inference shortcut over those step-independent text and
condition tokens) are left out of training; samples render through the pipeline, cache included.

transformers builds Qwen3VLProcessor with a video processor, and that only with torchvision: the processor here is
Qwen3VLProcessor without one, over the PIL image processor (`common.image_only_qwen_vl_processor`; text-to-image
never calls it).
"""

from __future__ import annotations

import functools
import json
import types
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import (PipelineTextEncoder, bare_pipeline, dtype_name,
                                         image_only_qwen_vl_processor, load_component, padded_text_entry,
                                         save_tiny_qwen_tokenizer)
from diffusion_pipe.models.ideogram4 import QWEN3_VL_CHAT_TEMPLATE
from diffusion_pipe.models.qwenimage import QwenImageAdapter

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")


class QwenImage21Embed(nn.Module):
    """First layer: QwenImage21Transformer2DModel.forward up to its blocks, for [text, target image]: the joint
    sequence, its rotary table (as a real view), the shared modulation and the time embedding (with the extra t = 0 row
    the text is modulated by, under `causal_condition`), the prefix's image block ids (all -1: the prefix is the text;
    its length is the prefix's, which the blocks read from the shape), each token's target mark, and the keys
    attention may read (a (B, 1) tensor when no caption is padded: no mask, as the pipeline passes none).
    Returns (joint, rotary, temb, modulation, prefix_ids, target, key_valid)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.img_in = transformer.img_in
        self.txt_in = transformer.txt_in
        self.time_text_embed = transformer.time_text_embed
        self.modulation = transformer.modulation
        self.pos_embed = transformer.pos_embed
        self.build_token_metadata = transformer.build_token_metadata
        self.causal_condition = transformer.config.causal_condition

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        tokens, timesteps, text, text_mask, grid = inputs
        b, n = text.shape[:2]
        shape = tuple(grid[0, -1].tolist())  # (1, h, w): one bucket per micro-batch
        hidden = self.img_in(tokens)
        encoder = self.txt_in(text)
        joint = torch.cat((encoder, hidden), dim=1)
        image_pad_mask = torch.cat((torch.zeros(n, dtype=torch.bool), torch.ones(tokens.shape[1], dtype=torch.bool)))
        image_pad_mask = image_pad_mask.to(tokens.device)
        rotary = self.pos_embed([shape], image_pad_mask, device=tokens.device)
        image_ids, target = self.build_token_metadata(image_pad_mask, [shape])
        timesteps = timesteps.to(hidden.dtype)
        if self.causal_condition:
            timesteps = torch.cat([timesteps, timesteps.new_zeros(1)], dim=0)
        temb = self.time_text_embed(timesteps, hidden)
        modulation = self.modulation(temb)
        if text_mask.shape[1] == 1:
            key_valid = text_mask.new_ones(b, 1)
        else:
            key_valid = torch.cat((text_mask, text_mask.new_ones(b, tokens.shape[1])), dim=1)
        return (joint, torch.view_as_real(rotary).contiguous(), temb, modulation, image_ids[:n].contiguous(),
                target.to(torch.int32), key_valid.to(torch.int32))


class QwenImage21Block(nn.Module):
    """One single-stream block under the block-causal mask (text causal, the image bidirectional and reading all the
    text), through the default attention processor's segments. For text-to-image the prefix is the text alone, one
    causal run: what diffusers' `_qwenimage21_prefix_segments` derives from the block ids, here from the prefix's
    length, a shape, so that no block waits on the device (that function and the prefix's length each read a tensor
    back to the host; the transformer does it once per forward, a pipeline layer would per block). Takes and returns
    (joint, rotary, temb, modulation, prefix_ids, target, key_valid)."""

    def __init__(self, block: nn.Module, causal_condition: bool) -> None:
        super().__init__()
        self.block = block
        self.causal_condition = causal_condition

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        joint, rotary, temb, modulation, prefix_ids, target, key_valid = inputs
        joint = self.block(
            hidden_states=joint, modulation=modulation, rotary_emb=torch.view_as_complex(rotary),
            attention_mask=None, target_token_mask=target.bool() if self.causal_condition else None,
            segments=[(0, prefix_ids.shape[0], True)],
            key_valid=None if key_valid.shape[1] == 1 else key_valid.bool())
        return joint, rotary, temb, modulation, prefix_ids, target, key_valid


class QwenImage21Out(nn.Module):
    """Last layer: the final scale-only adaptive norm (text tokens under t = 0's row) and the projection of every
    token; `prediction_to_latents` keeps the image's."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.norm_out = transformer.norm_out
        self.proj_out = transformer.proj_out
        self.causal_condition = transformer.config.causal_condition

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        joint, _rotary, temb, _modulation, _ids, target, _key_valid = inputs
        return self.proj_out(self.norm_out(joint, temb, target.bool() if self.causal_condition else None))


def longest_caption(mask: torch.Tensor) -> int:
    """How many tokens of a batch of stored entries (B, L) the longest caption spans: the pipeline pads a batch of
    prompts to that (on the right)."""
    valid = (mask != 0).long()
    return max(1, int((valid * torch.arange(1, mask.shape[1] + 1, device=mask.device)).amax()))


def sampling_pipeline_class() -> type:
    """QwenImage21Pipeline fed stored entries (padded to `encode.text_max_length`, with their masks): it trims each
    batch of them to its longest caption and drops a mask that masks nothing, which is what its own `encode_prompt`
    gives for those prompts; the rest of the call (schedule, true CFG, KV cache, decoding) is the pipeline's. It builds
    without a processor (nothing is tokenized), and an RGBA VAE's alpha channel is dropped from "np" output, as samples
    are RGB. With blocks on other pipeline stages (training's samples, where rank 0 stands in for them), it renders
    without the prefix KV cache, which those blocks would fill on their own ranks."""
    from diffusers import QwenImage21Pipeline

    def trimmed(embeds: torch.Tensor | None, mask: torch.Tensor | None) -> tuple:
        if embeds is None:
            return None, None
        n = longest_caption(mask)
        mask = mask[:, :n].bool()
        return embeds[:, :n], None if bool(mask.all()) else mask

    class NoTokenizer:
        """What the pipeline's __init__ reads of a processor (the system message's token count, the image slot's id),
        where prompts arrive as stored entries and nothing is tokenized."""

        class tokenizer:  # noqa: N801 - the processor's attribute
            @staticmethod
            def encode(_text: str) -> list[int]:
                return [-1]

        @staticmethod
        def apply_chat_template(*_args, **_kwargs) -> list[list[int]]:
            return [[]]

    class QwenImage21SamplingPipeline(QwenImage21Pipeline):
        def __init__(self, scheduler, vae, text_encoder, processor, transformer, sample_sigmas=None) -> None:
            super().__init__(scheduler, vae, text_encoder, processor or NoTokenizer(), transformer, sample_sigmas)
            if processor is None:
                self.register_modules(processor=None)

        def __call__(self, *args, prompt_embeds: torch.Tensor, prompt_embeds_mask: torch.Tensor,
                     negative_prompt_embeds: torch.Tensor | None = None,
                     negative_prompt_embeds_mask: torch.Tensor | None = None, **kwargs):
            remote = [b for b in self.transformer.transformer_blocks if not hasattr(b, "attn")]
            if remote:  # training's samples with several stages: rank 0 stands in for the others' blocks
                from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor

                for block in remote:  # the forward reads each block's processor to lay out the mask
                    block.attn = types.SimpleNamespace(processor=QwenImage21AttnProcessor())
                kwargs["use_kv_cache"] = False  # a stand-in block would fill its cache on its own rank
            prompt_embeds, prompt_embeds_mask = trimmed(prompt_embeds, prompt_embeds_mask)
            negative_prompt_embeds, negative_prompt_embeds_mask = trimmed(negative_prompt_embeds,
                                                                          negative_prompt_embeds_mask)
            result = super().__call__(*args, prompt_embeds=prompt_embeds, prompt_embeds_mask=prompt_embeds_mask,
                                      negative_prompt_embeds=negative_prompt_embeds,
                                      negative_prompt_embeds_mask=negative_prompt_embeds_mask, **kwargs)
            if kwargs.get("output_type") == "np" and result.images.shape[-1] == 4:
                result.images = result.images[..., :3]
            return result

    return QwenImage21SamplingPipeline


class QwenImage21Adapter(QwenImageAdapter):
    """Qwen-Image 2.1 (text-to-image) in diffusers format (transformer, vae, text_encoder, processor, scheduler)."""

    name: ClassVar[str] = "qwenimage21"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image",), tasks=("t2i",), objective="flow", export_formats=("diffusers", "comfyui"),
    )

    @functools.cached_property
    def _bare(self) -> object:
        """QwenImage21Pipeline over the model's processor only (its __init__ reads the chat template to count the
        system tokens it drops): its templates, scale factor and packing, built once."""
        from diffusers import QwenImage21Pipeline

        processor = image_only_qwen_vl_processor(self.model_dir / "processor", "Qwen3VLProcessor")
        return bare_pipeline(QwenImage21Pipeline, processor=processor)

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def vae_scale(self) -> int:
        return self._bare.vae_scale_factor

    @property
    def pixel_multiple(self) -> int:
        """The pipeline's own rounding of sizes (its VAE factor x 2: the target's slots in the VL sequence stand for
        2x2 latent tokens)."""
        return self._bare.vae_scale_factor * 2

    def vae_class(self) -> type[nn.Module]:
        from diffusers import AutoencoderKLQwenImage21

        return AutoencoderKLQwenImage21

    def text_component_dirs(self) -> tuple[dict[str, Path], dict[str, Path]]:
        """The VL encoder, and the processor's files (tokenizer, chat template, image preprocessing settings)."""
        return {"text_encoder": self.model_dir / "text_encoder"}, {"processor": self.model_dir / "processor"}

    def text_template(self) -> str:
        """QwenImage21Pipeline's text-to-image template (its system prompt in it) and how many tokens it drops, read
        from diffusers."""
        pipe = self._bare
        return json.dumps({"template": pipe.prompt_template_t2i, "system_prompt": pipe.sys_prompt,
                           "drop_tokens": pipe._drop_idx, "hidden_states": "last decoder layer, unnormed"})

    def load_text_encoders(self, device: torch.device) -> PipelineTextEncoder:
        from diffusers import QwenImage21Pipeline
        from transformers import Qwen3VLForConditionalGeneration

        encoder = load_component(Qwen3VLForConditionalGeneration, self.model_dir / "text_encoder", self.dtype, device)
        processor = image_only_qwen_vl_processor(self.model_dir / "processor", "Qwen3VLProcessor")
        return PipelineTextEncoder(bare_pipeline(QwenImage21Pipeline, text_encoder=encoder, processor=processor))

    @torch.no_grad()
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        """The distribution's mode, unnormalised, its frame axis of one dropped. An RGBA VAE reads the pixels with
        an opaque alpha channel (1 in [-1, 1]), as the pipeline's `convert("RGBA")` gives an opaque image."""
        if pixels_BCFHW.shape[2] != 1:
            raise ValueError(f"family '{self.name}' trains on images only; got {pixels_BCFHW.shape[2]} frames")
        pixels = pixels_BCFHW.to(vae.device, vae.dtype)
        if vae.config.in_channels == 4 and pixels.shape[1] == 3:
            pixels = torch.cat((pixels, torch.ones_like(pixels[:, :1])), dim=1)
        latents = vae.encode(pixels).latent_dist.mode()[:, :, 0]
        return [{"latents": x.contiguous().cpu()} for x in latents]

    @torch.no_grad()
    def encode_text(self, encoders: PipelineTextEncoder, captions: list[str], max_length: int) -> list[TensorDict]:
        """QwenImage21Pipeline.encode_prompt of each caption alone, zero-padded to `max_length` with the mask of its
        tokens; a caption longer than that is refused, naming it and the param."""
        from diffusion_pipe.config import ConfigError

        pipe = encoders.pipeline
        out = []
        for caption in captions:
            states, _, image_slots = pipe.encode_prompt([caption], device=pipe.text_encoder.device)
            assert not image_slots.any(), "a text-to-image prompt has no image slots"
            length = states.shape[1]
            if length > max_length:
                raise ConfigError(f"encode.text_max_length: {max_length} tokens cannot hold the caption "
                                  f"{caption[:80]!r} ({length} tokens in Qwen-Image 2.1's template); "
                                  "QwenImage21Pipeline never cuts a prompt: raise encode.text_max_length or shorten "
                                  "the caption")
            out.append(padded_text_entry(states[0], max_length))
        return out

    def text_spec(self, max_length: int) -> Spec:
        return {"prompt_embeds": ((max_length, self.component_config("transformer")["context_in_dim"]),
                                  dtype_name(self.dtype)),
                "prompt_mask": ((max_length,), "int64")}

    # ---- train side --------------------------------------------------------------------------------
    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import QwenImage21Transformer2DModel

        return QwenImage21Transformer2DModel

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        return ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.proj", "img_mlp.gate_layer",
                "img_mlp.out")

    def lora_exclude(self) -> str | None:
        """Nothing: text and image share every block's weights, and the image reads the text's keys and values."""
        return None

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        causal = denoiser.config.causal_condition
        return [QwenImage21Embed(denoiser), *(QwenImage21Block(b, causal) for b in denoiser.transformer_blocks),
                QwenImage21Out(denoiser)]

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """As QwenImage21Pipeline calls its transformer: the latents flattened to tokens (its `_pack_latents`), t, the
        text trimmed to the micro-batch's longest caption with its mask ((B, 1) when none is padded), and the
        target's (1, h, w). Qwen-Image 2.1 has no guidance embedding."""
        b, c, h, w = noisy_latents.shape
        length = longest_caption(text["prompt_mask"])
        mask = (text["prompt_mask"][:, :length] != 0).long()
        if bool(mask.all()):
            mask = mask[:, :1]
        tokens = self._bare._pack_latents(noisy_latents, b, c, h, w)
        grid = torch.tensor([[[1, h, w]]] * b)
        return (tokens.to(self.dtype), timesteps.to(self.dtype), text["prompt_embeds"][:, :length].to(self.dtype),
                mask, grid)

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The image's tokens (the last h * w) back to (B, C, h, w), as the pipeline slices and unpacks them."""
        b, c, h, w = like.shape
        return prediction[:, -h * w:].transpose(1, 2).reshape(b, c, h, w)

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        return sampling_pipeline_class()

    def pipeline_config(self) -> dict:
        """The model's own sampling sigmas, when its `model_index.json` sets them."""
        sigmas = self.model_json("model_index.json").get("sample_sigmas")
        return {} if sigmas is None else {"sample_sigmas": sigmas}

    def sample_inputs(self, text: TensorDict, negative: TensorDict | None, guidance: float, cfg_scale: float) -> dict:
        """The stored entries with their masks (the sampling pipeline trims them); `cfg_scale` above 1 is the
        pipeline's `true_cfg_scale` over the negative prompt (Qwen-Image 2.1 is meant to sample without guidance, at
        1); it has no guidance embedding."""
        kwargs = {"prompt_embeds": text["prompt_embeds"][None].to(self.dtype),
                  "prompt_embeds_mask": text["prompt_mask"][None], "true_cfg_scale": cfg_scale}
        if cfg_scale > 1:
            kwargs |= {"negative_prompt_embeds": negative["prompt_embeds"][None].to(self.dtype),
                       "negative_prompt_embeds_mask": negative["prompt_mask"][None]}
        return kwargs

    # ---- export side -------------------------------------------------------------------------------
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        if fmt == "diffusers":
            return {f"transformer.{k}": v for k, v in lora.items()}
        if fmt == "comfyui":
            return comfyui_lora(lora, self.component_config("transformer"))
        raise self.unknown_format(fmt)

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """Qwen-Image 2.1's layout at toy width: a 2-block transformer, a 5-level RGBA VAE (x16) with 8 latent
        channels, a 2-layer Qwen3-VL with a one-block vision tower, and a processor (a tokenizer that learnt the
        pipeline's template and carries the vision tokens and Qwen3-VL's chat template, and a PIL image processor)."""
        from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline, \
            QwenImage21Transformer2DModel
        from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

        out_dir = Path(out_dir)
        processor_dir = out_dir / "processor"
        Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, min_pixels=64 * 64, max_pixels=64 * 64,
                                 image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(processor_dir)
        tokenizer = None
        for _ in range(2):  # the template is the pipeline's, which needs a processor to build: a first one without it
            template = "" if tokenizer is None else bare_pipeline(QwenImage21Pipeline, processor=(
                image_only_qwen_vl_processor(processor_dir, "Qwen3VLProcessor"))).prompt_template_t2i
            tokenizer = save_tiny_qwen_tokenizer(processor_dir, template=template,
                                                 chat_template=QWEN3_VL_CHAT_TEMPLATE, special_tokens=VISION_TOKENS)
        torch.manual_seed(seed)
        start, image, end, video = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
        width = 32
        Qwen3VLForConditionalGeneration(Qwen3VLConfig(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
                             rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                              "mrope_section": [4, 2, 2]},
                             pad_token_id=tokenizer.pad_token_id),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=16,
                               out_hidden_size=width, num_position_embeddings=16, deepstack_visual_indexes=[]),
            image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
        )).save_pretrained(out_dir / "text_encoder")
        AutoencoderKLQwenImage21(
            base_dim=8, decoder_base_dim=8, z_dim=8, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False, True, True, True],
            latents_mean=[0.1, -0.2, 0.3, 0.0, 0.2, -0.1, 0.4, -0.3],
            latents_std=[1.5, 0.8, 1.2, 2.0, 0.9, 1.1, 1.3, 0.7],
        ).save_pretrained(out_dir / "vae")
        QwenImage21Transformer2DModel(
            in_channels=8, out_channels=8, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            context_in_dim=width, axes_dims_rope=(4, 6, 6),
        ).save_pretrained(out_dir / "transformer")
        FlowMatchEulerDiscreteScheduler(shift=1.0).save_pretrained(out_dir / "scheduler")
        (out_dir / "model_index.json").write_text(MODEL_INDEX)


MODEL_INDEX = """{
  "_class_name": "QwenImage21Pipeline",
  "_diffusers_version": "0.42.1",
  "processor": ["transformers", "Qwen3VLProcessor"],
  "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
  "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
  "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
  "vae": ["diffusers", "AutoencoderKLQwenImage21"]
}
"""


def comfyui_lora(lora: TensorDict, config: dict) -> TensorDict:
    """The LoRA under ComfyUI's Qwen-Image 2.1 names, `diffusion_model.`-prefixed, as `lora_down`/`lora_up` with
    `.alpha` = rank (lora_B is pre-scaled): diffusers' names, but for each block's SwiGLU, whose gate and up
    projections ComfyUI's checkpoint fuses into one `img_mlp.gate_up` (gate rows first, the layout diffusers'
    `convert_qwen_image21_transformer_checkpoint_to_diffusers` splits), which gets one exactly fused LoRA."""
    from diffusion_pipe.lora_keys import down_up_alpha, fuse_loras, lora_modules

    hidden = config["num_attention_heads"] * config["attention_head_dim"] * config["mlp_ratio"]
    groups: dict[str, dict[int | None, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, pair in lora_modules(lora).items():
        head, _, proj = module.rpartition(".img_mlp.")
        if head and proj in ("gate_layer", "proj"):
            groups.setdefault(f"{head}.img_mlp.gate_up", {})[0 if proj == "gate_layer" else 1] = pair
        else:
            groups.setdefault(module, {})[None] = pair
    out: TensorDict = {}
    for name, parts in sorted(groups.items()):
        a, b = fuse_loras([parts.get(0), parts.get(1)], [hidden, hidden]) if None not in parts else parts[None]
        out.update(down_up_alpha(f"diffusion_model.{name}", a, b))
    return out
