"""Kandinsky 5.0 Video text-to-video (Lite 2B, Pro 19B: a cross-attention DiT whose text tokens are refined by its own
encoder blocks, flow matching; Qwen2.5-VL states of the templated caption and CLIP's pooled embedding; the
HunyuanVideo causal VAE, x8 spatial, x4 temporal), through diffusers components. Images are one-frame videos.
Kandinsky 5.0 Image is family `kandinsky5_image`: the same transformer class and text encoders over Flux's VAE
and Kandinsky5T2IPipeline (kandinsky5_image.py overrides what differs).

Prompt encoding is the pipeline's own `encode_prompt` (its template, the template's tokens dropped, CLIP's pooled
output), one caption at a time as the pipeline encodes a prompt. The transformer takes no text mask: the pipeline
feeds it a prompt's own tokens, no padding, so its text blocks and cross-attention never see any. Text entries
are padded to `encode.text_max_length` with a mask; the first layer cuts a micro-batch's text to its longest
caption, and every block runs each group of captions of one length on their own tokens (one call when all have
the same length, as at micro batch 1), which is the transformer's forward on each caption alone.

diffusers keeps the time embedding and the modulations in float32 (`_keep_in_fp32_modules`); training holds every
weight in `model.dtype`, so the time embedding's float32 sinusoids are cast to its weights' dtype (a hook on its
first layer, which the transformer's own forward, run by samples during training, passes through too).
NABLA sparse attention (`attention_type: nabla`, the 10-second models) is refused.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffusion_pipe.models.base import Adapter, Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import (PipelineTextEncoder, bare_pipeline, dtype_name, image_only_qwen_vl_processor,
                                          load_component, save_tiny_qwen_tokenizer, save_tiny_tokenizers)

MAX_TEXT_TOKENS = 1024  # the text rotary table's length (Kandinsky5RoPE1D's max_pos), which the pipelines check too


def _input_in_weight_dtype(module: nn.Module, args: tuple) -> tuple:
    return (args[0].to(module.weight.dtype), *args[1:])


def cast_time_features(transformer: nn.Module) -> None:
    """Feed the time embedding's first layer its sinusoids in its weights' dtype (they come in float32, which
    diffusers keeps that layer in; training holds it in model.dtype). Registered once."""
    layer = transformer.time_embeddings.in_layer
    if _input_in_weight_dtype not in layer._forward_pre_hooks.values():
        layer.register_forward_pre_hook(_input_in_weight_dtype)


def caption_groups(text_mask: torch.Tensor, text_len: int) -> list[tuple[int, slice | torch.Tensor]]:
    """A micro-batch's items by caption length: (length, items) per length, shortest first. A (B, 1) mask stands
    for "every caption is `text_len` tokens" (the first layer cut them to it): one group, read without a host sync."""
    if text_mask.shape[1] == 1:
        return [(text_len, slice(None))]
    lengths = text_mask.sum(1).tolist()
    return [(n, torch.tensor([i for i, m in enumerate(lengths) if m == n], device=text_mask.device))
            for n in sorted(set(lengths))]


def by_caption_length(fn: Callable[[slice | torch.Tensor, int], torch.Tensor],
                      groups: list[tuple[int, slice | torch.Tensor]]) -> torch.Tensor:
    """`fn(items, length)` of each group, the results put back in the micro-batch's order."""
    outs = [fn(items, n) for n, items in groups]
    if len(outs) == 1:
        return outs[0]
    order = torch.cat([items for _, items in groups])
    return torch.cat(outs)[torch.argsort(order)]


def video_rope_scale(height: int, width: int) -> tuple[float, float, float]:
    """The rotary scale Kandinsky5T2VPipeline gives its transformer for `height` x `width` pixels (its own rule)."""
    from diffusers import Kandinsky5T2VPipeline

    return tuple(Kandinsky5T2VPipeline._get_scale_factor(None, height, width))


class Kandinsky5Embed(nn.Module):
    """First layer: the text cut to the micro-batch's longest caption and embedded, the time embedding plus CLIP's
    pooled one, the patch embedding and both rotary tables. The visual tokens keep their (F, H, W) grid, which the
    rotary table's shape (1, F, H, W, ...) carries. Returns (visual, text, text_mask, temb, visual_rope, text_rope);
    `text_mask` is (B, 1) when every caption has the text's length."""

    def __init__(self, transformer: nn.Module, pixels_per_cell: int,
                 rope_scale: Callable[[int, int], tuple[float, float, float]]) -> None:
        super().__init__()
        cast_time_features(transformer)
        self.text_embeddings = transformer.text_embeddings
        self.time_embeddings = transformer.time_embeddings
        self.pooled_text_embeddings = transformer.pooled_text_embeddings
        self.visual_embeddings = transformer.visual_embeddings
        self.text_rope_embeddings = transformer.text_rope_embeddings
        self.visual_rope_embeddings = transformer.visual_rope_embeddings
        self.pixels_per_cell = pixels_per_cell
        self.rope_scale = rope_scale

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        latents, timesteps, qwen, qwen_mask, pooled = inputs
        lengths = qwen_mask.bool().sum(1)
        listed = lengths.tolist()
        longest = max(listed)
        if min(listed) == longest:
            text_mask = torch.ones_like(qwen_mask[:, :1])
        else:
            text_mask = (torch.arange(longest, device=lengths.device) < lengths[:, None]).to(qwen_mask.dtype)
        text = self.text_embeddings(qwen[:, :longest])
        temb = self.time_embeddings(timesteps) + self.pooled_text_embeddings(pooled)
        text_rope = self.text_rope_embeddings(torch.arange(longest, device=qwen.device)).unsqueeze(0)
        visual = self.visual_embeddings(latents)
        _, f, h, w, _ = visual.shape
        cell = self.pixels_per_cell * self.visual_embeddings.patch_size[1]
        positions = [torch.arange(n, device=latents.device) for n in (f, h, w)]
        visual_rope = self.visual_rope_embeddings((1, f, h, w), positions, self.rope_scale(h * cell, w * cell))
        return visual, text, text_mask, temb, visual_rope, text_rope


class Kandinsky5TextBlock(nn.Module):
    """One text (encoder) block: self-attention over each caption's own tokens."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        visual, text, text_mask, temb, visual_rope, text_rope = inputs
        width = text.shape[1]

        def run(items: slice | torch.Tensor, n: int) -> torch.Tensor:
            out = self.block(text[items, :n], temb[items], text_rope[:, :n])
            return out if n == width else F.pad(out, (0, 0, 0, width - n))

        text = by_caption_length(run, caption_groups(text_mask, width))
        return visual, text, text_mask, temb, visual_rope, text_rope


class Kandinsky5VisualBlock(nn.Module):
    """One visual (decoder) block: self-attention over the video tokens, cross-attention to each caption's own
    tokens, feed-forward."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        from diffusers.models.transformers.transformer_kandinsky import fractal_flatten, fractal_unflatten

        visual, text, text_mask, temb, visual_rope, text_rope = inputs

        def run(items: slice | torch.Tensor, n: int) -> torch.Tensor:
            x = visual[items]
            shape = x.shape[:-1]
            tokens, rope = fractal_flatten(x, visual_rope, (1, *shape[1:]), block_mask=False)
            out = self.block(tokens, text[items, :n], temb[items], rope, None)
            return fractal_unflatten(out, shape, block_mask=False)

        visual = by_caption_length(run, caption_groups(text_mask, text.shape[1]))
        return visual, text, text_mask, temb, visual_rope, text_rope


class Kandinsky5Out(nn.Module):
    """Last layer: adaptive output norm and projection, unpatchified to (B, F, H, W, C) as the transformer's own."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.out_layer = transformer.out_layer

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        visual, text, _mask, temb, _visual_rope, _text_rope = inputs
        return self.out_layer(visual, text, temb)


@functools.cache
def sampling_pipeline_cls(base_name: str, output: Callable[[object], object]) -> type:
    """diffusers' pipeline `base_name` rendering a batch of prompts one prompt at a time, each from its own tokens
    (`prompt_embeds_qwen` padded, with `prompt_embeds_qwen_mask`) and the noise of its own generator, as it
    renders a prompt alone: its batched path pads the text without a mask, which its transformer would attend.
    It renders the size asked for: Kandinsky5T2IPipeline replaces a size outside its list of `resolutions` by the
    listed one of the nearest aspect ratio, so the list is, per call, that size. `output` wraps the joined pixels as
    the pipeline's output."""
    import diffusers
    import numpy as np

    class Kandinsky5SamplingPipeline(getattr(diffusers, base_name)):
        def __call__(self, *, prompt_embeds_qwen: torch.Tensor, prompt_embeds_qwen_mask: torch.Tensor,
                     prompt_embeds_clip: torch.Tensor, negative_prompt_embeds_qwen: torch.Tensor,
                     negative_prompt_embeds_qwen_mask: torch.Tensor, negative_prompt_embeds_clip: torch.Tensor,
                     generator: torch.Generator | list[torch.Generator] | None = None, **kwargs) -> object:
            if hasattr(self, "resolutions"):
                self.resolutions = [(kwargs["width"], kwargs["height"])]
            outs = []
            for i in range(len(prompt_embeds_qwen)):
                prompt = {}
                for prefix, qwen, mask, clip in (
                        ("", prompt_embeds_qwen, prompt_embeds_qwen_mask, prompt_embeds_clip),
                        ("negative_", negative_prompt_embeds_qwen, negative_prompt_embeds_qwen_mask,
                         negative_prompt_embeds_clip)):
                    n = int(mask[i].sum())
                    prompt |= {f"{prefix}prompt_embeds_qwen": qwen[i:i + 1, :n],
                               f"{prefix}prompt_embeds_clip": clip[i:i + 1],
                               f"{prefix}prompt_cu_seqlens": torch.tensor([0, n], dtype=torch.int32,
                                                                          device=qwen.device)}
                seeded = generator[i] if isinstance(generator, list) else generator
                outs.append(super().__call__(**prompt, generator=seeded, return_dict=False, **kwargs)[0])
            if isinstance(outs[0], np.ndarray):
                return output(np.concatenate(outs))
            if isinstance(outs[0], torch.Tensor):
                return output(torch.cat(outs))
            return output([item for out in outs for item in out])

    return Kandinsky5SamplingPipeline


def _video_output(frames: object) -> object:
    from diffusers.pipelines.kandinsky5.pipeline_output import KandinskyPipelineOutput

    return KandinskyPipelineOutput(frames=frames)


class Kandinsky5Adapter(Adapter):
    """Kandinsky 5.0 Video text-to-video in diffusers format (transformer, vae, text_encoder + tokenizer: Qwen2.5-VL
    and its processor, text_encoder_2 + tokenizer_2: CLIP, scheduler)."""

    name: ClassVar[str] = "kandinsky5"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image", "video"), tasks=("t2v",), objective="flow", export_formats=("diffusers", "comfyui"),
    )
    pipeline_name: ClassVar[str] = "Kandinsky5T2VPipeline"

    def _pipeline_cls(self) -> type:
        """The family's diffusers pipeline class; a ConfigError when `model_index.json` names another (the image
        model given to the video family, an image-to-video model)."""
        import diffusers

        from diffusion_pipe.config import ConfigError

        index = self.model_dir / "model_index.json"
        name = json.loads(index.read_text()).get("_class_name", "") if index.is_file() else ""
        if name != self.pipeline_name:
            raise ConfigError(f"model.path: {self.model_dir} is a {name or 'unknown'} model; family '{self.name}' "
                              f"trains {self.pipeline_name} models: set model.family to the model's own family "
                              "(`diffusion-pipe models`)")
        return getattr(diffusers, self.pipeline_name)

    def _patch(self) -> tuple[int, int, int]:
        return tuple(self.component_config("transformer")["patch_size"])

    def rope_scale(self, height: int, width: int) -> tuple[float, float, float]:
        """The rotary scale the pipeline gives its transformer at `height` x `width` pixels."""
        return video_rope_scale(height, width)

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def vae_scale(self) -> int:
        return self.component_config("vae")["spatial_compression_ratio"]

    @property
    def pixel_multiple(self) -> int:
        return self.vae_scale * self._patch()[1]

    def vae_class(self) -> type[nn.Module]:
        from diffusers import AutoencoderKLHunyuanVideo

        return AutoencoderKLHunyuanVideo

    def text_component_dirs(self) -> tuple[dict[str, Path], dict[str, Path]]:
        d = self.model_dir
        return ({"text_encoder": d / "text_encoder", "text_encoder_2": d / "text_encoder_2"},
                {"tokenizer": d / "tokenizer", "tokenizer_2": d / "tokenizer_2"})

    def text_template(self) -> str:
        """The pipeline's prompt template and how many of its tokens it drops: both change the embedding."""
        pipe = bare_pipeline(self._pipeline_cls())
        return json.dumps({"pipeline": self.pipeline_name, "template": pipe.prompt_template,
                           "drop_tokens": pipe.prompt_template_encode_start_idx})

    def load_text_encoders(self, device: torch.device) -> PipelineTextEncoder:
        from transformers import AutoTokenizer, CLIPTextModel, Qwen2_5_VLForConditionalGeneration

        d = self.model_dir
        return PipelineTextEncoder(bare_pipeline(
            self._pipeline_cls(),
            text_encoder=load_component(Qwen2_5_VLForConditionalGeneration, d / "text_encoder", self.dtype, device),
            tokenizer=image_only_qwen_vl_processor(d / "tokenizer"),
            text_encoder_2=load_component(CLIPTextModel, d / "text_encoder_2", self.dtype, device),
            tokenizer_2=AutoTokenizer.from_pretrained(d / "tokenizer_2")))

    @torch.no_grad()
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        frames = pixels_BCFHW.shape[2]
        temporal = self.component_config("vae")["temporal_compression_ratio"]
        if (frames - 1) % temporal:
            raise ValueError(f"family '{self.name}': {frames} frames; its VAE needs {temporal}k+1 frames "
                             f"(1, {temporal + 1}, {2 * temporal + 1}, ..): set scan.datasets[].frames to such counts")
        latents = vae.encode(pixels_BCFHW.to(vae.device, vae.dtype)).latent_dist.mode()
        return [{"latents": x.contiguous().cpu()} for x in latents]

    @torch.no_grad()
    def encode_text(self, encoders: PipelineTextEncoder, captions: list[str], max_length: int) -> list[TensorDict]:
        """The pipeline's `encode_prompt` of each caption alone, as it encodes a prompt (its batched path pads
        without passing the mask to Qwen and trims a long caption by the batch's padding): the Qwen states of the
        caption's tokens, zero-padded to `max_length` with their mask, and CLIP's pooled embedding."""
        check_text_length(max_length)
        pipe = encoders.pipeline
        out = []
        for caption in captions:
            qwen, pooled, _ = pipe.encode_prompt([caption], max_sequence_length=max_length,
                                                 device=pipe.text_encoder.device, dtype=self.dtype)
            n = qwen.shape[1]
            padded = qwen.new_zeros(max_length, qwen.shape[2])
            padded[:n] = qwen[0]
            mask = torch.zeros(max_length, dtype=torch.long)
            mask[:n] = 1
            out.append({"qwen": padded.cpu(), "qwen_mask": mask, "clip_pooled": pooled[0].cpu()})
        return out

    def latent_spec(self, width: int, height: int, frames: int) -> Spec:
        c = self.component_config("vae")
        s, st = self.vae_scale, c["temporal_compression_ratio"]
        return {"latents": ((c["latent_channels"], (frames - 1) // st + 1, height // s, width // s),
                            dtype_name(self.dtype))}

    def text_spec(self, max_length: int) -> Spec:
        check_text_length(max_length)
        c, dt = self.component_config("transformer"), dtype_name(self.dtype)
        return {"qwen": ((max_length, c["in_text_dim"]), dt), "qwen_mask": ((max_length,), "int64"),
                "clip_pooled": ((c["in_text_dim2"],), dt)}

    # ---- train side --------------------------------------------------------------------------------
    def normalise_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """x scaling_factor (no shift), the inverse of what the pipeline applies before decoding."""
        return latents * self.component_config("vae")["scaling_factor"]

    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import Kandinsky5Transformer3DModel

        return Kandinsky5Transformer3DModel

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        """Attention and feed-forward of the text and visual blocks (the modules the reference trainer targets)."""
        return ("self_attention.to_query", "self_attention.to_key", "self_attention.to_value",
                "self_attention.out_layer", "cross_attention.to_query", "cross_attention.to_key",
                "cross_attention.to_value", "cross_attention.out_layer", "feed_forward.in_layer",
                "feed_forward.out_layer")

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        from diffusion_pipe.config import ConfigError

        self._pipeline_cls()
        if denoiser.config.attention_type != "regular":
            raise ConfigError(f"model.path: {self.denoiser_dir()} has attention_type "
                              f"'{denoiser.config.attention_type}' (NABLA sparse attention: the 10-second models); "
                              f"family '{self.name}' trains models with regular attention (the 5-second ones)")
        return [Kandinsky5Embed(denoiser, self.vae_scale, self.rope_scale),
                *(Kandinsky5TextBlock(b) for b in denoiser.text_transformer_blocks),
                *(Kandinsky5VisualBlock(b) for b in denoiser.visual_transformer_blocks), Kandinsky5Out(denoiser)]

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """(latents channels-last (B, F, H, W, C), with the pipeline's all-zero visual condition and its mask
        channel when the transformer has `visual_cond`; t x 1000 in model.dtype, as the pipeline passes its
        scheduler's timesteps; Qwen states and mask; CLIP pooled). Not guidance-distilled."""
        x = noisy_latents.to(self.dtype).permute(0, 2, 3, 4, 1)
        if self.component_config("transformer")["visual_cond"]:
            x = torch.cat([x, torch.zeros_like(x), x.new_zeros(*x.shape[:-1], 1)], dim=-1)
        return (x.contiguous(), (timesteps * 1000).to(self.dtype), text["qwen"].to(self.dtype),
                text["qwen_mask"].long(), text["clip_pooled"].to(self.dtype))

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """(B, F, H, W, C) -> (B, C, F, H, W)."""
        return prediction.permute(0, 4, 1, 2, 3)

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        self._pipeline_cls()
        return sampling_pipeline_cls(self.pipeline_name, _video_output)

    def sample_inputs(self, text: TensorDict, negative: TensorDict | None, guidance: float,
                      cfg_scale: float) -> dict:
        """Both prompts' stored entries (the sampling pipeline cuts each to its tokens); `guidance` is the
        pipeline's classifier-free guidance scale."""
        out = {"guidance_scale": guidance}
        for prefix, entry in (("", text), ("negative_", negative)):
            out |= {f"{prefix}prompt_embeds_qwen": entry["qwen"][None].to(self.dtype),
                    f"{prefix}prompt_embeds_qwen_mask": entry["qwen_mask"][None],
                    f"{prefix}prompt_embeds_clip": entry["clip_pooled"][None].to(self.dtype)}
        return out

    # ---- export side -------------------------------------------------------------------------------
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        return self.transformer_export(lora, fmt, comfyui_lora)

    # ---- model -------------------------------------------------------------------------------------
    @classmethod
    def save_tiny_vae(cls, out_dir: Path) -> None:
        """A 4-level HunyuanVideo VAE (x8 spatial, as the pipeline's latent sizes need; x4 temporal)."""
        from diffusers import AutoencoderKLHunyuanVideo

        AutoencoderKLHunyuanVideo(latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                                  norm_num_groups=4).save_pretrained(out_dir)

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """Kandinsky 5's layout at toy width: a 2-text-block, 2-visual-block transformer (its modulations, which
        diffusers initialises to zero, random so that every block takes part), the tiny VAE, a 2-layer Qwen2.5-VL
        with a one-block vision tower whose tokenizer (in a processor directory, as the real one) reads the
        pipeline's template in as many tokens as the pipeline drops, and a 2-layer CLIP."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        out_dir = Path(out_dir)
        save_tiny_text_components(out_dir, cls.pipeline_name, seed, cls.tiny_template_tokens, cls.tiny_unlearnt_words)
        torch.manual_seed(seed)
        cls.save_tiny_vae(out_dir / "vae")
        save_tiny_transformer(out_dir / "transformer", visual_cond=cls.tiny_visual_cond)
        FlowMatchEulerDiscreteScheduler(shift=cls.tiny_shift).save_pretrained(out_dir / "scheduler")
        vae = json.loads((out_dir / "vae" / "config.json").read_text())["_class_name"]
        (out_dir / "model_index.json").write_text(MODEL_INDEX.replace("PIPELINE", cls.pipeline_name)
                                                  .replace("VAE", vae))

    # What makes the tiny tokenizer read the template in as many tokens as the pipeline drops (128): '.\n' is one
    # token (as in Qwen's vocabulary; the tiny BPE would split it) and the template's misspelt 'scren' is not in
    # its vocabulary (it takes 4 tokens).
    tiny_template_tokens: ClassVar[tuple[str, ...]] = (".\n",)
    tiny_unlearnt_words: ClassVar[tuple[str, ...]] = (" scren",)
    tiny_visual_cond: ClassVar[bool] = True  # the T2V models' transformers take the (all-zero) visual condition
    tiny_shift: ClassVar[float] = 5.0


def check_text_length(max_length: int) -> None:
    """A ConfigError when `encode.text_max_length` exceeds the transformer's text rotary table."""
    from diffusion_pipe.config import ConfigError

    if max_length > MAX_TEXT_TOKENS:
        raise ConfigError(f"encode.text_max_length: {max_length} is longer than Kandinsky 5's text positions "
                          f"({MAX_TEXT_TOKENS}); set it to at most {MAX_TEXT_TOKENS}")


def comfyui_lora(lora: TensorDict) -> TensorDict:
    """The LoRA under ComfyUI's Kandinsky 5 names, which are diffusers' own (comfy/ldm/kandinsky5/model.py names
    its modules as the original model and diffusers do), `diffusion_model.`-prefixed, as `lora_down`/`lora_up` with
    `.alpha` = rank (lora_B is pre-scaled, so scale 1): the generic keys of comfy/lora.py `model_lora_keys_unet`."""
    from diffusion_pipe.lora_keys import down_up_alpha, lora_modules

    out: TensorDict = {}
    for module, (a, b) in lora_modules(lora).items():
        out.update(down_up_alpha(f"diffusion_model.{module}", a, b))
    return out


def save_tiny_text_components(out_dir: Path, pipeline_name: str, seed: int, template_tokens: tuple[str, ...] = (),
                              unlearnt_words: tuple[str, ...] = ()) -> None:
    """The tiny Qwen2.5-VL (`text_encoder`), its processor directory (`tokenizer`: a tokenizer that learnt the
    pipeline's template but `unlearnt_words`, with `template_tokens` as tokens of their own, reading the template's
    prefix in exactly the tokens the pipeline drops; a PIL image processor's settings) and a tiny CLIP
    (`text_encoder_2`, `tokenizer_2`)."""
    import tempfile

    import diffusers
    from transformers import (CLIPTextConfig, CLIPTextModel, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLImageProcessorPil)

    pipe = bare_pipeline(getattr(diffusers, pipeline_name))
    prefix = pipe.prompt_template.split("{}")[0]
    learnt = prefix
    for word in unlearnt_words:
        learnt = learnt.replace(word, "")
    tokenizer = save_tiny_qwen_tokenizer(out_dir / "tokenizer", template=learnt, special_tokens=template_tokens)
    assert len(tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx, "tiny template length drifted"
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56).save_pretrained(out_dir / "tokenizer")
    with tempfile.TemporaryDirectory() as tmp:
        clip_tok, _ = save_tiny_tokenizers(Path(tmp))
    clip_tok.save_pretrained(out_dir / "tokenizer_2")
    torch.manual_seed(seed)
    vocab = len(tokenizer)
    Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={"vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 2048,
                     "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
                       "fullatt_block_indexes": [0]},
        image_token_id=vocab, video_token_id=vocab + 1, vision_start_token_id=vocab + 2, vision_end_token_id=vocab + 3,
    )).save_pretrained(out_dir / "text_encoder")
    CLIPTextModel(CLIPTextConfig(
        vocab_size=len(clip_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=77, projection_dim=32, bos_token_id=clip_tok.bos_token_id,
        eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id,
    )).save_pretrained(out_dir / "text_encoder_2")


def save_tiny_transformer(out_dir: Path, visual_cond: bool) -> None:
    """A Kandinsky5Transformer3DModel at toy width (32 wide, 2 heads of 16, 2 text and 2 visual blocks) reading the
    tiny encoders' 32-wide states and the tiny VAE's 4 channels, its zero-initialised modulations made random."""
    from diffusers import Kandinsky5Transformer3DModel
    from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Modulation

    transformer = Kandinsky5Transformer3DModel(
        in_visual_dim=4, out_visual_dim=4, in_text_dim=32, in_text_dim2=32, time_dim=16, patch_size=(1, 2, 2),
        model_dim=32, ff_dim=64, num_text_blocks=2, num_visual_blocks=2, axes_dims=(4, 6, 6), visual_cond=visual_cond)
    for module in transformer.modules():
        if isinstance(module, Kandinsky5Modulation):
            module.out_layer.reset_parameters()
    transformer.save_pretrained(out_dir)


MODEL_INDEX = """{
  "_class_name": "PIPELINE",
  "_diffusers_version": "0.42.1",
  "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
  "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
  "text_encoder_2": ["transformers", "CLIPTextModel"],
  "tokenizer": ["transformers", "Qwen2VLProcessor"],
  "tokenizer_2": ["transformers", "CLIPTokenizer"],
  "transformer": ["diffusers", "Kandinsky5Transformer3DModel"],
  "vae": ["diffusers", "VAE"]
}
"""
