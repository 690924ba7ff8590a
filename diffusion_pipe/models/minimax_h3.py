"""MiniMax H3 (MiniMax's audio-video DiT: one packed sequence of text, audio and video rows under full self-attention,
each row modulated by a per-(timestep, modality) AdaLN table; Qwen3-VL hidden states after decoder layer 50 as the
text; a causal 3D CNN VAE, x16 spatial and 17 frames to 5 latent frames), trained for text-to-video on video only,
through diffusers components and the helpers of its modular pipeline (`diffusers.modular_pipelines.minimax_h3`).

Layout. The first layer's inputs are the rows MiniMaxH3ModularPipeline's `t2va` workflow feeds its transformer for one
step: `[text | audio | video]` with the position ids, modality tags and row indices its layout step builds
(`MiniMaxH3PrepareLayoutStep.build_packed_sequence`, imported, not copied), video latents patchified by the
pipeline's `patchify_video_latents`, and the per-row timesteps of its `MiniMaxH3SetTimestepsStep.build_row_timesteps`
(text rows inherit the video timestep). The transformer takes one layout for a whole batch, so each sample keeps its
own (its caption's length moves every media row's rotary time): the layers run diffusers' own modules one sample at a
time, on that sample's rows only (no padding row is ever attended to), with the sample's own timestep embedding.

Audio ("no audio"). MiniMax H3 always generates a soundtrack with its video: every `t2va` layout holds audio rows
(40 latents a second, two stereo channels of the transformer's `audio_in_channels`), and the model never saw a
sequence without them. Our datasets carry no audio latents, so this family trains the video rows alone and keeps the
audio rows as the pipeline's first step holds them: pure Gaussian noise at H3 timestep 0.0 (H3's `t` is 1 - sigma and
t = 1 is clean, so pure noise is t = 0, where MiniMaxH3Scheduler starts both schedules). That is the honest state of
an unknown soundtrack: rows the model reads as carrying no information, in the layout, positions and lengths the
pipeline uses, so the LoRA adapts the sequence it will be sampled in. An empty audio index set also runs through the
transformer, but that is a sequence MiniMax H3 never sees. The audio rows get no loss and their output head is not
run. Their noise is drawn per micro-batch from a generator seeded by the micro-batch's timesteps, so a micro-batch
(and a resumed run) is reproducible.

Objective. MiniMaxH3Scheduler steps `x0 = x_t + sigma * v` with `t = 1 - sigma`: the transformer predicts the
data-ward velocity x0 - noise, the negative of the `flow` objective's target (noise - x0, at sigma). So the first
layer feeds t = 1 - sigma and `prediction_to_latents` negates the prediction. Timesteps go in unscaled, in [0, 1].

Text. MiniMaxH3TextEncoderStep: the caption tokenized verbatim (no template, no special tokens) and read by the
pipeline's own `get_qwen3vl_prompt_embeds` (hidden state 50 of Qwen3-VL's language model); an entry is zero-padded
to `encode.text_max_length` with the mask of its tokens, and only the caption's own rows enter the sequence. The
model is guidance-distilled (no negative prompt, no unconditional branch), so an empty caption is refused.

Latents. AutoencoderKLMiniMaxH3 reads ImageNet-normalised RGB in [0, 1] (the pipeline's `pixel_mean`/`pixel_std`);
the store keeps its posterior's mode, normalised with the VAE's `latents_mean`/`latents_std` at load time. Clips must
have 17n + 5 frames (5n + 2 latent frames, the pipeline's `align_num_frames`); images are refused: the pipeline
generates clips only (a single frame is a keyframe condition, never a target).

No fp8 base weights (`model.base_dtype`): diffusers' AdaLN modulation casts its input to its Linear's parameter dtype,
which an fp8-stored Linear makes float8; a block layer finding one says so (use `train.blocks_to_swap` for memory).

Samples render through MiniMaxH3ModularPipeline's own `t2va` blocks (its core denoise step: layout, noise, the two
schedules, the denoising loop; then its video decode step) over the stored embeddings, the trained transformer and the
VAE: the audio is generated beside the video, as the model always does, and not decoded. The pipeline generates 5 to
15 seconds at 24 fps (120 to 360 frames, rounded up to 17n + 5), so sample prompts ask for such lengths (124 is its
default); it takes no negative prompt and no guidance scale (guidance-distilled). The `sample` stage loads the
exported LoRA with that pipeline's `load_lora_weights` (MiniMaxH3LoraLoaderMixin).

Exports. `diffusers`: `transformer.`-prefixed PEFT names, which `MiniMaxH3LoraLoaderMixin.load_lora_weights` and the
transformer's `load_lora_adapter(file, prefix="transformer")` load. `comfyui`: the original checkpoint's module names
that ComfyUI's own MiniMax H3 model keeps (comfy/ldm/minimax/model.py: `blocks.N.attn.qkv_proj`, `attn.out_proj`,
`mlp.fc1`, `mlp.fc2`, `token_refiner.blocks.N`, `final_layer.video_out`, ...), `diffusion_model.`-prefixed, as
`lora_down`/`lora_up` with `.alpha` = rank. Its fused projections take fused LoRAs: q, k and v stacked as the fused
weight is (`[q; k; v]`, a block-diagonal up over the three downs, exact), and the feed-forward input with its two
halves swapped (the original computes silu(gate) * value from `[gate; value]`, diffusers' SwiGLU from `[value; gate]`).
Checked by converting the file back with diffusers' own converter of such LoRAs.
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Adapter, Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import (dtype_name, image_only_qwen_vl_processor, load_component,
                                         padded_text_entry, save_tiny_qwen_tokenizer)
from diffusion_pipe.params import SamplePrompt

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
NOISE_T = 0.0  # H3's timestep of pure noise (t = 1 - sigma): the untrained audio rows


def pipeline_fact(name: str) -> object:
    """A constant MiniMaxH3ModularPipeline states as a property (`text_encoder_layer`, `pixel_mean`, `fps`, ...):
    read from diffusers, so the family follows the pipeline it mirrors."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline

    return getattr(MiniMaxH3ModularPipeline, name).fget(None)


def noise_generator(timesteps: torch.Tensor) -> torch.Generator:
    """A CPU generator seeded by a micro-batch's timesteps (drawn from the run's seeded generator): the audio rows'
    noise differs between micro-batches and is the same whenever the micro-batch is."""
    digest = hashlib.blake2b(timesteps.detach().float().cpu().numpy().tobytes(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def sample_layout(num_text: int, latent_shape: tuple[int, int, int], num_audio_latents: int,
                  patch_size: tuple[int, int, int], sigma: float) -> dict[str, torch.Tensor]:
    """One sample's `t2va` layout as the pipeline builds it (text rows tagged text, no keyframes), with its row
    timesteps: the video rows (and text) at t = 1 - sigma, the audio rows at pure noise. The distinct timesteps are
    padded to two entries (a repeated value where video is pure noise too), so every sample's table has one shape."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (MiniMaxH3PrepareLayoutStep,
                                                                      MiniMaxH3SetTimestepsStep)

    frames, height, width = latent_shape
    position_ids, token_tags, video_indices, audio_indices, text_indices, _, _ = (
        MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            torch.full((num_text,), pipeline_fact("text_tag"), dtype=torch.long), frames, height, width,
            num_audio_latents, patch_size, pipeline_fact("audio_channels"), pipeline_fact("audio_tag"),
            pipeline_fact("video_tag")))
    timesteps, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video_indices, audio_indices, 0, 0, num_text, 1.0 - sigma, NOISE_T, pipeline_fact("keyframe_noise_aug"), 1.0)
    timesteps = torch.cat((timesteps, timesteps[-1:].expand(2 - len(timesteps))))
    return {"position_ids": position_ids, "token_tags": token_tags, "video_indices": video_indices,
            "audio_indices": audio_indices, "text_indices": text_indices, "timestep": timesteps,
            "timestep_indices": timestep_indices}


def _pad_rows(x: torch.Tensor, length: int) -> torch.Tensor:
    """`x` (1, S, ...) zero-padded along S to `length`."""
    return torch.cat((x, x.new_zeros(x.shape[0], length - x.shape[1], *x.shape[2:])), dim=1)


class MiniMaxH3Embed(nn.Module):
    """First layer: MiniMaxH3Transformer3DModel.forward up to its blocks, per sample: the rotary tables of the
    sample's position ids, the three input projections (the text through the token refiner) scattered into the
    packed sequence, the timestep embedding of its distinct timesteps and each row's AdaLN table row. Returns
    (sequence, temb, adaln_indices, cos, sin, timestep_indices, seq_lengths, video_indices), padded to the longest
    sample's sequence."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.rope = transformer.rope
        self.proj_in = transformer.proj_in
        self.audio_proj_in = transformer.audio_proj_in
        self.context_embedder = transformer.context_embedder
        self.token_refiner = transformer.token_refiner
        self.time_proj = transformer.time_proj
        self.time_embedder = transformer.time_embedder

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        from diffusers.models.modeling_utils import get_parameter_dtype
        from diffusers.models.transformers.transformer_minimax_h3 import MINIMAX_H3_MODALITY_NUM

        (video, audio, text, text_lengths, timesteps, timestep_indices, token_tags, position_ids, video_indices,
         audio_indices, seq_lengths) = inputs
        longest = position_ids.shape[1]
        rows, tembs, coss, sins = [], [], [], []
        for b, (num_text, length) in enumerate(zip(text_lengths.tolist(), seq_lengths.tolist())):
            cos, sin = self.rope(position_ids[b, :length])
            video_embeds = self.proj_in(video[b:b + 1].to(get_parameter_dtype(self.proj_in)))
            audio_embeds = self.audio_proj_in(audio[b:b + 1].to(get_parameter_dtype(self.audio_proj_in)))
            text_embeds = self.context_embedder(text[b:b + 1, :num_text].to(get_parameter_dtype(
                self.context_embedder)))
            text_embeds = self.token_refiner(text_embeds)
            sequence = text_embeds.new_zeros((1, length, text_embeds.shape[-1]))
            sequence = sequence.index_copy(1, torch.arange(num_text, device=sequence.device), text_embeds)
            sequence = sequence.index_copy(1, video_indices[b], video_embeds.to(text_embeds.dtype))
            sequence = sequence.index_copy(1, audio_indices[b], audio_embeds.to(text_embeds.dtype))
            rows.append(_pad_rows(sequence, longest))
            coss.append(_pad_rows(cos[None], longest))
            sins.append(_pad_rows(sin[None], longest))
            temb = self.time_proj(timesteps[b])
            tembs.append(self.time_embedder(temb.to(get_parameter_dtype(self.time_embedder))))
        adaln_indices = timestep_indices * MINIMAX_H3_MODALITY_NUM + token_tags
        return (torch.cat(rows), torch.stack(tembs), adaln_indices, torch.cat(coss), torch.cat(sins),
                timestep_indices, seq_lengths, video_indices)


class MiniMaxH3Block(nn.Module):
    """One MiniMaxH3TransformerBlock, diffusers' own, run per sample on its rows with its timestep embedding."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        sequence, temb, adaln_indices, cos, sin, timestep_indices, seq_lengths, video_indices = inputs
        if self.block.adaln_proj.linear.weight.dtype.itemsize == 1:  # an fp8 base (model.base_dtype)
            from diffusion_pipe.config import ConfigError

            raise ConfigError("model.base_dtype: family 'minimax_h3' cannot keep its block weights in float8: "
                              "diffusers' AdaLN modulation casts its input to its Linear's weight dtype; leave "
                              "base_dtype empty (bf16 base weights) and use train.blocks_to_swap for memory")
        longest = sequence.shape[1]
        out = [_pad_rows(self.block(sequence[b:b + 1, :n], temb[b], adaln_indices[b, :n], (cos[b, :n], sin[b, :n])),
                         longest) for b, n in enumerate(seq_lengths.tolist())]
        return torch.cat(out), temb, adaln_indices, cos, sin, timestep_indices, seq_lengths, video_indices


class MiniMaxH3Out(nn.Module):
    """Last layer: the per-row modulated output norm and the video head on the video rows (the audio head is not
    run: its rows get no loss). Returns (B, video rows, patch channels) in the order of `video_indices`."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.norm_out = transformer.norm_out
        # The two heads sit in a plain container, not as children of their own: the samples' whole-transformer
        # forward (the pipeline's) reads their parameters' dtype directly and runs the audio head too, so training
        # must load the audio head (it is not run here: its rows get no loss) and, over several pipeline stages,
        # rank 0 must borrow the heads' weights (train/samples.py) rather than stand in for them.
        self.heads = nn.ModuleDict({"video": transformer.proj_out, "audio": transformer.audio_proj_out})

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        from diffusers.models.modeling_utils import get_parameter_dtype

        sequence, temb, _adaln, _cos, _sin, timestep_indices, seq_lengths, video_indices = inputs
        out = []
        for b, n in enumerate(seq_lengths.tolist()):
            normed = self.norm_out(sequence[b:b + 1, :n], temb[b], timestep_indices[b, :n])
            head = self.heads["video"]
            out.append(head(normed.to(get_parameter_dtype(head)).index_select(1, video_indices[b])))
        return torch.cat(out)


class MiniMaxH3Adapter(Adapter):
    """MiniMax H3's `t2va` checkpoint (`transformer/`, `vae/`, `text_encoder/`, `tokenizer/`, `processor/`), trained
    text-to-video on its video rows."""

    name: ClassVar[str] = "minimax_h3"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("video",), tasks=("t2v",), objective="flow", export_formats=("diffusers", "comfyui"),
        untrained_media=("audio",),
    )

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def vae_scale(self) -> int:
        import math

        return math.prod(self.component_config("vae")["spatial_downsample_factors"])

    @property
    def patch_size(self) -> tuple[int, int, int]:
        return tuple(self.component_config("transformer")["patch_size"])

    @property
    def pixel_multiple(self) -> int:
        """The pipeline's `canvas_multiple`: the VAE's spatial factor x the patch."""
        return self.vae_scale * self.patch_size[2]

    def vae_class(self) -> type[nn.Module]:
        from diffusers import AutoencoderKLMiniMaxH3

        return AutoencoderKLMiniMaxH3

    def text_component_dirs(self) -> tuple[dict[str, Path], dict[str, Path]]:
        return ({"text_encoder": self.model_dir / "text_encoder"},
                {"tokenizer": self.model_dir / "tokenizer", "processor": self.model_dir / "processor"})

    def caption_token_limits(self, tokenizers: dict[str, object], max_length: int) -> dict[str, int]:
        """None: the pipeline never cuts a prompt, and `encode_text` refuses a caption longer than
        `encode.text_max_length`."""
        return {}

    def text_template(self) -> str:
        """No template: the caption verbatim, without special tokens, read at the pipeline's hidden state."""
        return f"verbatim, no special tokens, hidden_states[{pipeline_fact('text_encoder_layer')}]"

    def load_text_encoders(self, device: torch.device) -> dict:
        from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

        return {"text_encoder": load_component(Qwen3VLForConditionalGeneration, self.model_dir / "text_encoder",
                                               self.dtype, device),
                "tokenizer": AutoTokenizer.from_pretrained(self.model_dir / "tokenizer"),
                "processor": image_only_qwen_vl_processor(self.model_dir / "processor", "Qwen3VLProcessor")}

    def vae_frames(self) -> tuple[int, int]:
        """(pixel frames per encoder chunk, latent frames per chunk): the pipeline's `vae_frames_per_chunk` and
        `vae_latents_per_chunk`, from the VAE's config."""
        import math

        config = self.component_config("vae")
        ratio = math.prod(config["temporal_downsample_factors"])
        return config["clip_length"], math.ceil(config["clip_length"] / ratio)

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a clip of `frames` frames; a ValueError naming the rule unless the VAE takes it."""
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import video_latent_num_frames

        per_chunk, latents_per_chunk = self.vae_frames()
        if frames == 1:
            raise ValueError(f"family '{self.name}' trains on clips only (MiniMax H3 generates video; a single "
                             "frame is a keyframe condition, never a target); leave images out of its datasets")
        if frames % per_chunk != latents_per_chunk:
            raise ValueError(f"scan.datasets[].frames: {frames} frames; family '{self.name}' needs "
                             f"{per_chunk}n + {latents_per_chunk} frames (5, 22, 39, ..., 124), as its VAE encodes")
        return video_latent_num_frames(frames, per_chunk, latents_per_chunk)

    def pixel_frames(self, latent_frames: int) -> int:
        """The clip length (17n + 5) whose latents have `latent_frames` frames."""
        per_chunk, latents_per_chunk = self.vae_frames()
        frames = (latent_frames - 2) // latents_per_chunk * per_chunk + latents_per_chunk
        if self.latent_frames(frames) != latent_frames:
            raise ValueError(f"{latent_frames} latent frames are not a clip of family '{self.name}' (5n + 2)")
        return frames

    @torch.no_grad()
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        """The posterior's mode of the ImageNet-normalised [0, 1] pixels the VAE reads (the pipeline's
        `pixel_mean`/`pixel_std`), unnormalised; clips of 17n + 5 frames only."""
        self.latent_frames(pixels_BCFHW.shape[2])
        mean = torch.tensor(pipeline_fact("pixel_mean"), device=vae.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(pipeline_fact("pixel_std"), device=vae.device).view(1, -1, 1, 1, 1)
        pixels = ((pixels_BCFHW.to(vae.device, torch.float32) + 1) / 2 - mean) / std
        latents = vae.encode(pixels).latent_dist.mode()
        return [{"latents": x.to(self.dtype).contiguous().cpu()} for x in latents]

    @torch.no_grad()
    def encode_text(self, encoders: dict, captions: list[str], max_length: int) -> list[TensorDict]:
        """MiniMaxH3TextEncoderStep of each caption: its tokens (no special tokens) through the pipeline's
        `get_qwen3vl_prompt_embeds`, zero-padded to `max_length` with the mask of its tokens."""
        from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds

        from diffusion_pipe.config import ConfigError

        encoder, tokenizer = encoders["text_encoder"], encoders["tokenizer"]
        out = []
        for caption in captions:
            token_ids = tokenizer(caption, add_special_tokens=False)["input_ids"]
            if not token_ids:
                raise ConfigError(f"family '{self.name}': an empty caption has no text rows, and MiniMax H3 is "
                                  "guidance-distilled (no unconditional branch); give every item a caption and "
                                  "set train.caption_dropout to 0")
            if len(token_ids) > max_length:
                raise ConfigError(f"encode.text_max_length: {max_length} tokens cannot hold the caption "
                                  f"{caption[:80]!r} ({len(token_ids)} tokens); the pipeline never cuts a prompt: "
                                  "raise encode.text_max_length or shorten the caption")
            states = get_qwen3vl_prompt_embeds(encoder, encoders["processor"], token_ids, {},
                                               text_encoder_layer=pipeline_fact("text_encoder_layer"),
                                               device=encoder.device, dtype=self.dtype)[0]
            out.append(padded_text_entry(states, max_length))
        return out

    def latent_spec(self, width: int, height: int, frames: int) -> Spec:
        s = self.vae_scale
        return {"latents": ((self.component_config("vae")["latent_channels"], self.latent_frames(frames),
                             height // s, width // s), dtype_name(self.dtype))}

    def text_spec(self, max_length: int) -> Spec:
        return {"prompt_embeds": ((max_length, self.component_config("transformer")["text_dim"]),
                                  dtype_name(self.dtype)),
                "prompt_mask": ((max_length,), "int64")}

    # ---- train side --------------------------------------------------------------------------------
    def normalise_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """(x - latents_mean) / latents_std per channel, as the pipeline normalises what its VAE encodes."""
        config = self.component_config("vae")
        mean = torch.tensor(config["latents_mean"], dtype=latents.dtype).view(-1, 1, 1, 1)
        std = torch.tensor(config["latents_std"], dtype=latents.dtype).view(-1, 1, 1, 1)
        return (latents - mean) / std

    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import MiniMaxH3Transformer3DModel

        return MiniMaxH3Transformer3DModel

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        return ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        return [MiniMaxH3Embed(denoiser), *(MiniMaxH3Block(b) for b in denoiser.transformer_blocks),
                MiniMaxH3Out(denoiser)]

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """(video rows, audio rows, text, text lengths, distinct timesteps (B, 2), then per row, padded to the longest
        sample: timestep indices, modality tags, position ids; video and audio row indices, sequence lengths): each
        sample's layout as the pipeline builds it for one step, its video at t = 1 - sigma and its audio rows pure
        noise at t = 0. MiniMax H3 is guidance-distilled; `guidance` is not an input."""
        import math

        from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import audio_latent_num_frames

        b, _, frames, height, width = noisy_latents.shape
        config = self.component_config("transformer")
        num_audio = audio_latent_num_frames(self.pixel_frames(frames), pipeline_fact("fps"))
        audio_rows = num_audio * pipeline_fact("audio_channels")
        audio = torch.randn((b, audio_rows, config["audio_in_channels"]), generator=noise_generator(timesteps))
        video = patchify_video_latents(noisy_latents.float(), self.patch_size).view(b, -1, math.prod(
            (config["in_channels"], *self.patch_size)))
        mask = text["prompt_mask"]  # a caption's tokens lead its entry: its length is where its mask ends
        text_lengths = ((mask != 0).long() * torch.arange(1, mask.shape[1] + 1)).amax(dim=1).clamp(min=1)
        layouts = [sample_layout(int(n), (frames, height, width), num_audio, self.patch_size, float(sigma))
                   for n, sigma in zip(text_lengths, timesteps.float())]
        longest = max(len(layout["token_tags"]) for layout in layouts)

        def padded(key: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.stack([_pad_rows(layout[key][None].to(dtype), longest)[0] for layout in layouts])

        return (video.to(self.dtype), audio.to(self.dtype), text["prompt_embeds"].to(self.dtype), text_lengths,
                torch.stack([layout["timestep"] for layout in layouts]).float(),
                padded("timestep_indices", torch.long), padded("token_tags", torch.long),
                padded("position_ids", torch.float32),
                torch.stack([layout["video_indices"] for layout in layouts]),
                torch.stack([layout["audio_indices"] for layout in layouts]),
                torch.tensor([len(layout["token_tags"]) for layout in layouts]))

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Video rows back to (B, C, F, H, W), the inverse of `patchify_video_latents`, negated: H3 predicts the
        data-ward velocity x0 - noise, the objective's target is noise - x0."""
        b, c, frames, height, width = like.shape
        pt, ph, pw = self.patch_size
        x = prediction.reshape(b, frames // pt, height // ph, width // pw, c, pt, ph, pw)
        x = x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, c, frames, height, width)
        return -x

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        return MiniMaxH3VideoPipeline

    def sample_pipeline(self, denoiser: nn.Module, vae: nn.Module) -> object:
        """The pipeline's blocks over `denoiser` (as it is being trained), `vae` and the model's two schedulers."""
        pipe = MiniMaxH3VideoPipeline(denoiser, vae, self.load_scheduler(), self.load_scheduler("audio_scheduler"))
        pipe.set_progress_bar_config(desc="samples", unit="step", leave=False, file=sys.stderr)
        return pipe

    def load_pipeline(self, skip: tuple[str, ...] = ()) -> object:
        """The sample stage's pipeline: its denoiser and VAE through the checked loaders (the folder has no
        model_index.json to list them: the modular pipeline's components are fixed)."""
        cpu = torch.device("cpu")
        return self.sample_pipeline(self.load_denoiser(cpu), self.load_vae(cpu))

    def sample_texts(self, prompt: SamplePrompt) -> tuple[str, ...]:
        """The prompt alone: the model is guidance-distilled, its pipeline takes no negative prompt."""
        return (prompt.prompt,)

    def sample_inputs(self, text: TensorDict, negative: TensorDict | None, guidance: float,
                      cfg_scale: float) -> dict:
        """The prompt's embeddings, its caption's rows only (as the pipeline's text step makes them); no guidance
        (guidance-distilled)."""
        n = int((text["prompt_mask"] != 0).sum())
        return {"prompt_embeds": [text["prompt_embeds"][:n][None].to(self.dtype)]}

    # ---- export side -------------------------------------------------------------------------------
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        return self.transformer_export(lora, fmt, comfyui_lora)

    # ---- model -------------------------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """MiniMax H3's layout at toy width: a 2-block transformer (32 wide, 2 heads of 16, one refiner block; its
        audio rows keep the real 32 channels, which the pipeline draws noise at without an audio VAE), the VAE's
        real geometry (x16 spatial, 17 frames to 5 latents) at 8 channels with a 1-layer ViT decoder, a 51-layer,
        16-wide Qwen3-VL (the pipeline reads hidden state 50) with a one-block vision tower, its tokenizer (carrying
        the vision tokens) and a processor, and the two schedulers."""
        from diffusers import AutoencoderKLMiniMaxH3, MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel
        from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

        out_dir = Path(out_dir)
        tokenizer = save_tiny_qwen_tokenizer(out_dir / "tokenizer", special_tokens=VISION_TOKENS)
        tokenizer.save_pretrained(out_dir / "processor")
        Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, min_pixels=64 * 64, max_pixels=64 * 64,
                                 image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(out_dir / "processor")
        torch.manual_seed(seed)
        start, image, end, video = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
        width = 16
        Qwen3VLForConditionalGeneration(Qwen3VLConfig(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=16,
                             num_hidden_layers=pipeline_fact("text_encoder_layer") + 1, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=8, max_position_embeddings=2048,
                             rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                              "mrope_section": [2, 1, 1]},
                             pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, patch_size=16,
                               out_hidden_size=width, num_position_embeddings=16, deepstack_visual_indexes=[]),
            image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
            tie_word_embeddings=True,
        )).save_pretrained(out_dir / "text_encoder")
        AutoencoderKLMiniMaxH3(
            latent_channels=8, block_out_channels=(8, 8, 8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
            decoder_num_layers=1, decoder_num_attention_heads=2, decoder_attention_head_dim=8,
            decoder_num_register_tokens=1, decoder_ffn_mult=1,
            latents_mean=(0.1, -0.2, 0.3, 0.0, 0.2, -0.1, 0.4, -0.3),
            latents_std=(1.5, 0.8, 1.2, 2.0, 0.9, 1.1, 1.3, 0.7),
        ).save_pretrained(out_dir / "vae")
        MiniMaxH3Transformer3DModel(
            num_attention_heads=2, attention_head_dim=16, hidden_size=32, num_layers=2, num_refiner_layers=1,
            ffn_dim=64, in_channels=8, audio_in_channels=32, patch_size=(1, 2, 2), text_dim=width, freq_dim=32,
            time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2,
        ).save_pretrained(out_dir / "transformer")
        MiniMaxH3Scheduler(shift=12.0).save_pretrained(out_dir / "scheduler")
        MiniMaxH3Scheduler(shift=3.0).save_pretrained(out_dir / "audio_scheduler")


class MiniMaxH3VideoPipeline:
    """MiniMaxH3ModularPipeline's `t2va` generation from prompt embeddings: its core denoise blocks and its video
    decode block (no text encoder, no audio decode), with the calling convention of the diffusers pipelines the
    sample code drives: one call renders a batch of prompts, each from its own generator; `frames` in [0, 1]."""

    def __init__(self, transformer: nn.Module, vae: nn.Module, scheduler: object, audio_scheduler: object) -> None:
        from diffusers.modular_pipelines import SequentialPipelineBlocks
        from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3VideoDecodeStep
        from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3CoreDenoiseStep

        blocks = dict(MiniMaxH3CoreDenoiseStep().sub_blocks)  # flat, so the loop's progress bar is reachable
        blocks["decode_video"] = MiniMaxH3VideoDecodeStep()
        self.modular = SequentialPipelineBlocks.from_blocks_dict(blocks).init_pipeline()
        self.modular.update_components(transformer=transformer, vae=vae, scheduler=scheduler,
                                       audio_scheduler=audio_scheduler)

    @classmethod
    def from_pretrained(cls, model_dir: Path, torch_dtype: torch.dtype = torch.float32,
                        **_components: object) -> MiniMaxH3VideoPipeline:
        """The model directory's transformer, VAE and schedulers (text components are never loaded: prompts arrive
        as embeddings)."""
        from diffusers import AutoencoderKLMiniMaxH3, MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel

        model_dir = Path(model_dir)
        return cls(MiniMaxH3Transformer3DModel.from_pretrained(model_dir / "transformer", torch_dtype=torch_dtype),
                   AutoencoderKLMiniMaxH3.from_pretrained(model_dir / "vae", torch_dtype=torch_dtype),
                   MiniMaxH3Scheduler.from_pretrained(model_dir / "scheduler"),
                   MiniMaxH3Scheduler.from_pretrained(model_dir / "audio_scheduler"))

    def set_progress_bar_config(self, **kwargs: object) -> None:
        self.modular.set_progress_bar_config(**kwargs)

    def to(self, device: torch.device) -> MiniMaxH3VideoPipeline:
        for name in ("transformer", "vae"):
            getattr(self.modular, name).to(device)
        return self

    def load_lora_weights(self, path: str, **kwargs: object) -> None:
        """MiniMaxH3ModularPipeline's own LoRA loader (MiniMaxH3LoraLoaderMixin)."""
        self.modular.load_lora_weights(path, **kwargs)

    @torch.no_grad()
    def __call__(self, prompt_embeds: list[torch.Tensor], height: int, width: int, num_frames: int,
                 num_inference_steps: int, generator: list[torch.Generator], output_type: str = "np") -> object:
        import numpy as np

        videos = []
        for embeds, g in zip(prompt_embeds, generator, strict=True):
            tags = torch.full((embeds.shape[1],), pipeline_fact("text_tag"), dtype=torch.long)
            videos.append(self.modular(prompt_embeds=embeds, text_token_tags=tags, height=height, width=width,
                                       num_frames=num_frames, num_inference_steps=num_inference_steps, generator=g,
                                       output_type=output_type, output="videos"))
        return SimpleNamespace(frames=np.concatenate(videos))


# Block prefixes (diffusers pattern, original / ComfyUI prefix) and the modules inside a block, then the modules outside
# the blocks: the inverse of the naming of diffusers' `_convert_non_diffusers_minimax_h3_lora_to_diffusers`.
_BLOCKS = ((r"transformer_blocks\.(\d+)\.", "blocks"),
           (r"token_refiner\.refiner_blocks\.(\d+)\.", "token_refiner.blocks"))
_BLOCK_MODULES = {"attn.to_out.0": "attn.out_proj", "ff.net.0.proj": "mlp.fc1", "ff.net.2": "mlp.fc2",
                  "adaln_proj.linear": "adaln_proj.linear"}
_STANDALONE = {"proj_in": "video_patch_proj", "audio_proj_in": "audio_patch_proj", "context_embedder": "condition_proj",
               "time_embedder.linear_1": "time_embedder.proj_in", "time_embedder.linear_2": "time_embedder.proj_out",
               "norm_out.linear": "final_layer.adaln_proj.linear", "proj_out": "final_layer.video_out",
               "audio_proj_out": "final_layer.audio_out"}
_QKV = ("attn.to_q", "attn.to_k", "attn.to_v")


def minimax_original_name(name: str) -> str:
    """The original MiniMax H3 (ComfyUI) module of a diffusers MiniMaxH3Transformer3DModel module:
    `transformer_blocks.0.attn.to_q` -> `blocks.0.attn.qkv_proj` (fused), `proj_out` -> `final_layer.video_out`;
    ValueError for one without a counterpart."""
    if name in _STANDALONE:
        return _STANDALONE[name]
    for pattern, original in _BLOCKS:
        match = re.match(pattern, name)
        if match:
            inner = name[match.end():]
            inner = "attn.qkv_proj" if inner in _QKV else _BLOCK_MODULES.get(inner)
            if inner is not None:
                return f"{original}.{match.group(1)}.{inner}"
    raise ValueError(f"{name}: no original MiniMax H3 (ComfyUI) name for this module; drop it from "
                     "train.lora_targets or export the 'diffusers' format")


def comfyui_lora(lora: TensorDict) -> TensorDict:
    """The LoRA under ComfyUI's MiniMax H3 names, `diffusion_model.`-prefixed, as `lora_down`/`lora_up` with `.alpha`
    = rank (lora_B is pre-scaled, so scale 1). A block's q/k/v LoRAs become one LoRA of its fused `qkv_proj`: the
    downs stacked, the ups block-diagonal in `[q; k; v]` order (a projection without a LoRA gets zero rows); the
    feed-forward input's up has its halves swapped to the original `[gate; value]` order."""
    from diffusion_pipe.lora_keys import down_up_alpha, lora_modules

    modules = lora_modules(lora)
    out: TensorDict = {}
    fused: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, (a, b) in modules.items():
        original = minimax_original_name(module)
        suffix = next((q for q in _QKV if module.endswith("." + q)), None)
        if suffix:
            fused.setdefault(original, {})[suffix] = (a, b)
            continue
        if module.endswith(".ff.net.0.proj"):
            value, gate = b.chunk(2, dim=0)
            b = torch.cat((gate, value))
        out.update(down_up_alpha(f"diffusion_model.{original}", a, b))
    for original, parts in fused.items():
        rows = next(iter(parts.values()))[1].shape[0]
        downs = [parts[q][0] for q in _QKV if q in parts]
        up = downs[0].new_zeros(3 * rows, sum(d.shape[0] for d in downs))
        column = 0
        for i, q in enumerate(_QKV):
            if q in parts:
                a, b = parts[q]
                up[i * rows:(i + 1) * rows, column:column + a.shape[0]] = b
                column += a.shape[0]
        out.update(down_up_alpha(f"diffusion_model.{original}", torch.cat(downs), up))
    return out
