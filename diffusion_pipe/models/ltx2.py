"""LTX-2 (Lightricks' audio-video DiT: a video stream and an audio stream in every block, joined by audio-to-video
and video-to-audio cross-attention; flow matching; a Gemma 3 text encoder whose hidden states of every layer go
through the text "connectors"; LTX-2's causal video VAE, x32 spatial and x8 temporal), trained on video only,
through diffusers components. Images are one-frame videos, so images and videos share one dataset and one path.

Audio. LTX2Pipeline always generates audio with the video: it denoises audio latents beside the video's, both
streams reading each other in every block. Training the audio stream needs audio latents of each clip, made by the
audio VAE from the clip's soundtrack (a mel spectrogram); the scan stage decodes only frames, so that would be new
data plumbing, and this family trains the video stream alone ("no audio"). It trains it as Lightricks' own trainer
(ltx-trainer) trains video-only LoRAs: without an audio modality, so the video stream runs its self-attention,
text cross-attention and feed-forward and no audio-to-video cross-attention. In diffusers that is the transformer's
`isolate_modalities=True`, the forward LTX2Pipeline itself runs for its modality-isolation guidance (video output
independent of any audio input; tested). Feeding noise as the audio instead (what the pipeline feeds at its first
step only) would make every video prediction depend on a random input that tells it nothing. Each block layer calls
diffusers' own LTX2VideoTransformerBlock with an empty audio sequence and cross-modal attention off, so the audio
stream costs nothing; the audio stream's modules outside the blocks are never loaded. LoRA's default targets are
the video stream's attention and feed-forward (the audio modules' names, `audio_attn1.to_q`, do not match them).

Connectors. LTX2Pipeline runs LTX2TextConnectors (`connectors/`, its own component beside the transformer; frozen
here, as LoRA trains the transformer) on `encode_prompt`'s stacked Gemma states once per prompt, before the
denoising loop, and feeds their output to the transformer at every step: they are text encoding, not the
denoiser. So the stored text entry is the connectors' video output and mask (Gemma's stacked states would be about
385 MB a caption at the pipeline's 1024 tokens; the connectors' output is 8 MB), made by the pipeline's own
`encode_prompt` and connectors, and text entries are keyed by the connectors' weights with Gemma's
(`text_component_dirs`). The connectors replace padding with learned registers, so `encode.text_max_length` must be
a multiple of their register count (128).

Latent packing, normalisation and the rotary coordinates are LTX2Pipeline's and its transformer's own
(`_pack_latents`, `_normalize_latents`, `rope.prepare_video_coords` at the pipeline's default 24 fps); this file only
splits the transformer's forward into pipeline layers.

Samples. LTX2Pipeline always denoises audio beside the video and runs the connectors itself on Gemma's states, so
neither stored connector outputs nor a video-only LoRA can drive it as it is. Samples render through
`LTX2VideoPipeline`, LTX2Pipeline with a video-only `__call__` (as ltx-trainer validates video-only LoRAs): the
same noise schedule (sigmas from 1 to 1/steps, shifted by the token count), scheduler, latent statistics, VAE
decode and post-processing, and the video-only forward this family trains (these pipeline layers), with
classifier-free guidance over the negative prompt; the pipeline's extra guidances (spatio-temporal, modality
isolation, rescaling) are left out. The sample stage loads it with `from_pretrained` and `load_lora_weights` as
any LTX2Pipeline.
"""

from __future__ import annotations

import importlib
from functools import cache, cached_property
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Adapter, Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import (PipelineTextEncoder, bare_pipeline, dtype_name, load_component,
                                         vae_latent_stats)
from diffusion_pipe.models.wan import TopLevelParameters

# LTX2Pipeline's default `frame_rate` (with `motion_speed` 1): the video's rotary time coordinates are seconds at
# this rate, so the model is trained at the rate it is sampled at by default.
FRAME_RATE = 24.0


def _pipeline_cls() -> type:
    from diffusers import LTX2Pipeline

    return LTX2Pipeline


class LTX2Embed(nn.Module):
    """First layer: packs the latents into tokens and embeds them, the timestep and the text, turns the text mask
    into an attention bias and computes the video rotary tables, as LTX2VideoTransformer3DModel.forward does for the
    video stream. Returns (tokens, text, temb, [prompt temb,] embedded_timestep, text_bias, cos, sin); the prompt
    temb (LTX-2.3's timestep-modulated text) only for transformers that have one."""

    def __init__(self, transformer: nn.Module, fps: float) -> None:
        super().__init__()
        self.proj_in = transformer.proj_in
        self.time_embed = transformer.time_embed
        self.rope = transformer.rope
        self.caption_projection = getattr(transformer, "caption_projection", None)  # LTX-2.0: text projected here
        self.prompt_adaln = getattr(transformer, "prompt_adaln", None)  # LTX-2.3: text modulated by the timestep
        self.patch = (transformer.config.patch_size, transformer.config.patch_size_t)
        self.fps = fps

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        latents, timesteps, text, mask = inputs
        b, _, f, h, w = latents.shape
        hidden = _pipeline_cls()._pack_latents(latents, *self.patch)
        coords = self.rope.prepare_video_coords(b, f, h, w, hidden.device, fps=self.fps)
        cos, sin = self.rope(coords, device=hidden.device)
        bias = ((1 - mask.to(hidden.dtype)) * -10000.0).unsqueeze(1)
        hidden = self.proj_in(hidden)
        # LTX2Pipeline passes the scheduler's timestep (sigma x 1000) as both `timestep` and `sigma`
        t = (timesteps * 1000).flatten()
        temb, embedded = self.time_embed(t, batch_size=b, hidden_dtype=hidden.dtype)
        temb, embedded = temb.view(b, -1, temb.size(-1)), embedded.view(b, -1, embedded.size(-1))
        if self.caption_projection is not None:
            text = self.caption_projection(text).view(b, -1, hidden.size(-1))
        prompt = ()
        if self.prompt_adaln is not None:
            temb_prompt, _ = self.prompt_adaln(t, batch_size=b, hidden_dtype=hidden.dtype)
            prompt = (temb_prompt.view(b, -1, temb_prompt.size(-1)),)
        return (hidden, text, temb, *prompt, embedded, bias, cos, sin)


class LTX2Block(nn.Module):
    """One LTX2VideoTransformerBlock, video stream only: diffusers' block called with an empty audio sequence and
    cross-modal attention off (its audio half then computes on nothing; scaled_dot_product_attention sends
    zero-length sequences to its math kernel, which every device has)."""

    def __init__(self, block: nn.Module, prompt_modulated: bool) -> None:
        super().__init__()
        self.block = block
        self.prompt_modulated = prompt_modulated

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if self.prompt_modulated:
            hidden, text, temb, temb_prompt, embedded, bias, cos, sin = inputs
        else:
            (hidden, text, temb, embedded, bias, cos, sin), temb_prompt = inputs, None
        table = self.block.audio_scale_shift_table
        no_audio = hidden.new_zeros(hidden.shape[0], 0, table.shape[1])
        # the audio half's modulation: any values of its shape do (they modulate no token)
        hidden, _ = self.block(
            hidden_states=hidden, audio_hidden_states=no_audio, encoder_hidden_states=text,
            audio_encoder_hidden_states=no_audio, temb=temb,
            temb_audio=hidden.new_zeros(hidden.shape[0], 1, table.numel()), temb_ca_scale_shift=None,
            temb_ca_audio_scale_shift=None, temb_ca_gate=None, temb_ca_audio_gate=None, temb_prompt=temb_prompt,
            video_rotary_emb=(cos, sin), encoder_attention_mask=bias, use_a2v_cross_attention=False,
            use_v2a_cross_attention=False, all_perturbed=False,
        )
        return (hidden, *inputs[1:])


class LTX2Out(nn.Module):
    """Last layer: output norm modulated by the embedded timestep and projection to patch tokens."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.norm_out = transformer.norm_out
        self.proj_out = transformer.proj_out
        self.top = TopLevelParameters(transformer)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        hidden, embedded = inputs[0], inputs[-4]  # the embedded timestep, with or without LTX-2.3's prompt temb
        values = self.top.scale_shift_table[None, None] + embedded[:, :, None]
        shift, scale = values[:, :, 0], values[:, :, 1]
        return self.proj_out(self.norm_out(hidden) * (1 + scale) + shift)


def video_layers(transformer: nn.Module) -> list[nn.Module]:
    """The transformer's video-only forward as a sequence of layers (training's pipeline layers, and samples')."""
    prompt_modulated = getattr(transformer, "prompt_adaln", None) is not None
    return [LTX2Embed(transformer, FRAME_RATE),
            *(LTX2Block(b, prompt_modulated) for b in transformer.transformer_blocks), LTX2Out(transformer)]


@cache
def video_pipeline_cls() -> type:
    """`LTX2VideoPipeline`: LTX2Pipeline rendering video alone from stored connector outputs (module docstring).
    Made on first use, so importing this module does not import diffusers' pipelines."""
    import numpy as np
    from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2PipelineOutput, calculate_shift, retrieve_timesteps
    from diffusers.utils.torch_utils import randn_tensor

    class LTX2VideoPipeline(_pipeline_cls()):
        @torch.no_grad()
        def __call__(self, height: int, width: int, num_frames: int, num_inference_steps: int, generator,
                     prompt_embeds: torch.Tensor, prompt_attention_mask: torch.Tensor,
                     negative_prompt_embeds: torch.Tensor | None = None,
                     negative_prompt_attention_mask: torch.Tensor | None = None, guidance_scale: float = 4.0,
                     output_type: str = "np"):
            """Video frames (`output_type` as LTX2Pipeline's) of each prompt from its connector outputs and mask;
            `generator` (one per prompt) draws the starting noise."""
            device, transformer = self._execution_device, self.transformer
            s, st = self.vae_spatial_compression_ratio, self.vae_temporal_compression_ratio
            p, pt = self.transformer_spatial_patch_size, self.transformer_temporal_patch_size
            shape = (prompt_embeds.shape[0], transformer.config.in_channels, (num_frames - 1) // st + 1,
                     height // s, width // s)
            latents = randn_tensor(shape, generator=generator, device=torch.device("cpu"),
                                   dtype=torch.float32).to(device)
            c = self.scheduler.config
            mu = calculate_shift(shape[2] // pt * (shape[3] // p) * (shape[4] // p), c.get("base_image_seq_len", 1024),
                                 c.get("max_image_seq_len", 4096), c.get("base_shift", 0.95), c.get("max_shift", 2.05))
            timesteps, _ = retrieve_timesteps(self.scheduler, num_inference_steps, device, mu=mu,
                                              sigmas=np.linspace(1.0, 1 / num_inference_steps, num_inference_steps))
            self.scheduler.set_begin_index(0)
            guided = guidance_scale > 1 and negative_prompt_embeds is not None
            layers, dtype = video_layers(transformer), transformer.dtype
            text = (torch.cat([negative_prompt_embeds, prompt_embeds]) if guided else prompt_embeds).to(device, dtype)
            mask = (torch.cat([negative_prompt_attention_mask, prompt_attention_mask]) if guided else
                    prompt_attention_mask).to(device, dtype)
            with self.progress_bar(total=len(timesteps)) as bar:
                for t in timesteps:
                    x = torch.cat([latents] * 2) if guided else latents
                    out = (x.to(dtype), (t / 1000).expand(x.shape[0]).to(dtype), text, mask)
                    for layer in layers:
                        out = layer(out)
                    velocity = self._unpack_latents(out, shape[2] // pt, shape[3] // p, shape[4] // p, p, pt).float()
                    if guided:
                        uncond, cond = velocity.chunk(2)
                        velocity = uncond + guidance_scale * (cond - uncond)
                    latents = self.scheduler.step(velocity, t, latents, return_dict=False)[0]
                    bar.update()
            if output_type == "latent":
                return LTX2PipelineOutput(frames=latents, audio=None)
            vae = self.vae
            latents = self._denormalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
            # the pipeline's default decode: timestep 0, no decode noise
            timestep = latents.new_zeros(shape[0]).to(vae.dtype) if vae.config.timestep_conditioning else None
            video = vae.decode(latents.to(vae.dtype), timestep, return_dict=False)[0]
            return LTX2PipelineOutput(frames=self.video_processor.postprocess_video(video, output_type=output_type),
                                      audio=None)

    return LTX2VideoPipeline


class LTX2Adapter(Adapter):
    """LTX-2 in diffusers format (transformer, vae, audio_vae, vocoder, text_encoder, tokenizer, connectors,
    scheduler), trained on video."""

    name: ClassVar[str] = "ltx2"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image", "video"), tasks=("t2v",), objective="flow", export_formats=("diffusers", "comfyui"),
        untrained_media=("audio",),
    )

    @cached_property
    def _vae_ratios(self) -> tuple[int, int]:
        """(spatial, temporal) compression of the video VAE, as AutoencoderKLLTX2Video computes them from its config
        (built on the meta device: no weights read)."""
        from diffusers import AutoencoderKLLTX2Video

        with torch.device("meta"):
            vae = AutoencoderKLLTX2Video.from_config(self.component_config("vae"))
        return vae.spatial_compression_ratio, vae.temporal_compression_ratio

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def pixel_multiple(self) -> int:
        return self._vae_ratios[0] * self.component_config("transformer")["patch_size"]

    def vae_class(self) -> type[nn.Module]:
        from diffusers import AutoencoderKLLTX2Video

        return AutoencoderKLLTX2Video

    def text_component_dirs(self) -> tuple[dict[str, Path], dict[str, Path]]:
        """Gemma and the connectors (their output is the text entry); Gemma's tokenizer."""
        d = self.model_dir
        return {"text_encoder": d / "text_encoder", "connectors": d / "connectors"}, {"tokenizer": d / "tokenizer"}

    def load_text_encoders(self, device: torch.device) -> PipelineTextEncoder:
        """An LTX2Pipeline holding only Gemma (the class `model_index.json` names), its tokenizer and the
        connectors: its own prompt encoding runs on them."""
        from diffusers.pipelines.ltx2 import LTX2TextConnectors
        from transformers import AutoTokenizer

        library, class_name = self.model_json("model_index.json")["text_encoder"]
        encoder_cls = getattr(importlib.import_module(library), class_name)
        return PipelineTextEncoder(bare_pipeline(
            _pipeline_cls(),
            text_encoder=load_component(encoder_cls, self.model_dir / "text_encoder", self.dtype, device),
            tokenizer=AutoTokenizer.from_pretrained(self.model_dir / "tokenizer"),
            connectors=load_component(LTX2TextConnectors, self.model_dir / "connectors", self.dtype, device),
        ))

    @torch.no_grad()
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        frames = pixels_BCFHW.shape[2]
        temporal = self._vae_ratios[1]
        if (frames - 1) % temporal:
            raise ValueError(f"family 'ltx2': {frames} frames; the LTX-2 VAE needs {temporal}k+1 frames "
                             f"(1, {temporal + 1}, {2 * temporal + 1}, ..): set scan.datasets[].frames to such counts")
        latents = vae.encode(pixels_BCFHW.to(vae.device, vae.dtype)).latent_dist.mode()
        return [{"latents": x.contiguous().cpu()} for x in latents]

    def _registers(self) -> int | None:
        return self.component_config("connectors").get("video_connector_num_learnable_registers", 128)

    def _check_text_length(self, max_length: int) -> None:
        registers = self._registers()
        if registers and max_length % registers:
            from diffusion_pipe.config import ConfigError

            raise ConfigError(f"encode.text_max_length: {max_length}; family 'ltx2' needs a multiple of {registers} "
                              f"(the text connectors' learned registers fill the padding in blocks of {registers}): "
                              f"set it to {max(registers, max_length // registers * registers)} or "
                              f"{-(-max_length // registers) * registers} (LTX2Pipeline's default is 1024)")

    @torch.no_grad()
    def encode_text(self, encoders: PipelineTextEncoder, captions: list[str], max_length: int) -> list[TensorDict]:
        """LTX2Pipeline's `encode_prompt` (Gemma's hidden states of every layer, left-padded to `max_length`) through
        the pipeline's connectors, as its __call__ runs them: the video text states and their mask."""
        self._check_text_length(max_length)
        pipe = encoders.pipeline
        device = pipe.text_encoder.device
        states, mask, _, _ = pipe.encode_prompt(list(captions), do_classifier_free_guidance=False,
                                                max_sequence_length=max_length, device=device, dtype=self.dtype)
        video, _audio, video_mask = pipe.connectors(states, mask, padding_side=pipe.tokenizer.padding_side)
        return [{"text": video[i].contiguous().cpu(), "text_mask": video_mask[i].to(self.dtype).cpu()}
                for i in range(len(captions))]

    def latent_spec(self, width: int, height: int, frames: int) -> Spec:
        s, st = self._vae_ratios
        return {"latents": ((self.component_config("vae")["latent_channels"], (frames - 1) // st + 1, height // s,
                             width // s), dtype_name(self.dtype))}

    def text_spec(self, max_length: int) -> Spec:
        self._check_text_length(max_length)
        c = self.component_config("connectors")
        width = c.get("video_connector_num_attention_heads", 30) * c.get("video_connector_attention_head_dim", 128)
        dt = dtype_name(self.dtype)
        return {"text": ((max_length, width), dt), "text_mask": ((max_length,), dt)}

    # ---- train side --------------------------------------------------------------------------------
    @cached_property
    def _latent_stats(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """The video VAE's `latents_mean` / `latents_std` buffers (stored with its weights, not in its config) and
        its `scaling_factor`."""
        return vae_latent_stats(self.model_dir, "LTX-2")

    def normalise_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """LTX2Pipeline._normalize_latents, which it applies to latents it is given, per item."""
        mean, std, scaling = self._latent_stats
        return _pipeline_cls()._normalize_latents(latents, mean, std, scaling)

    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import LTX2VideoTransformer3DModel

        return LTX2VideoTransformer3DModel

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        return ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ff.net.0.proj", "ff.net.2")

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        return video_layers(denoiser)

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """(latents (B, C, F, H, W), t in [0, 1], connector text states, their mask); not guidance-distilled."""
        return (noisy_latents.to(self.dtype), timesteps.to(self.dtype), text["text"].to(self.dtype),
                text["text_mask"].to(self.dtype))

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        c = self.component_config("transformer")
        _, _, f, h, w = like.shape
        p, pt = c["patch_size"], c["patch_size_t"]
        return _pipeline_cls()._unpack_latents(prediction, f // pt, h // p, w // p, p, pt)

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        """LTX2Pipeline rendering video only (`video_pipeline_cls`)."""
        return video_pipeline_cls()

    def sample_inputs(self, text: TensorDict, negative: TensorDict, guidance: float, cfg_scale: float) -> dict:
        """`guidance` is the classifier-free guidance scale over the negative prompt's connector outputs; the masks
        travel with them."""
        return {"prompt_embeds": text["text"][None].to(self.dtype),
                "prompt_attention_mask": text["text_mask"][None].to(self.dtype),
                "negative_prompt_embeds": negative["text"][None].to(self.dtype),
                "negative_prompt_attention_mask": negative["text_mask"][None].to(self.dtype),
                "guidance_scale": guidance}

    # ---- export side -------------------------------------------------------------------------------
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        return self.transformer_export(lora, fmt, comfyui_lora)

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """LTX-2's layout at toy width (Lightricks/LTX-2: LTX-2.0): see `save_tiny_ltx2`."""
        save_tiny_ltx2(Path(out_dir), seed)


def save_tiny_ltx2(out_dir: Path, seed: int = 0, ltx23: bool = False) -> None:
    """A tiny random-init LTX-2 in diffusers format: a 2-block audio-video transformer (split rotary tables as the
    real model's), a 2-layer Gemma 3 with a 1-layer vision tower and a tiny BPE Gemma tokenizer, connectors with 8
    learned registers, a video VAE with x8 spatial and x8 temporal compression (the real model's 8k+1 frame rule),
    a tiny audio VAE and vocoder (LTX2Pipeline loads them). `ltx23`: LTX-2.3's layout (per-modality connector
    projections, gated attention, timestep-modulated text cross-attention, no caption projection)."""
    import tempfile

    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, GemmaTokenizer

    from diffusion_pipe.models.common import TOKENIZER_CORPUS

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.train_from_iterator(TOKENIZER_CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    with tempfile.TemporaryDirectory() as tmp:
        bpe.model.save(tmp)
        merges = [tuple(line.split()) for line in Path(tmp, "merges.txt").read_text().splitlines()
                  if line and not line.startswith("#")]
    tokenizer = GemmaTokenizer(vocab=bpe.get_vocab(), merges=merges, model_max_length=1024)
    tokenizer.save_pretrained(out_dir / "tokenizer")

    width, layers = 32, 2  # Gemma's hidden size (the connectors' caption_channels) and layer count
    torch.manual_seed(seed)
    Gemma3ForConditionalGeneration(Gemma3Config(
        text_config={"vocab_size": len(tokenizer), "hidden_size": width, "intermediate_size": 64,
                     "num_hidden_layers": layers, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                     "max_position_embeddings": 2048, "sliding_window": 8, "pad_token_id": tokenizer.pad_token_id,
                     "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id},
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 28, "patch_size": 14},
        mm_tokens_per_image=4, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )).save_pretrained(out_dir / "text_encoder")

    heads, head_dim, audio_heads, audio_head_dim = 2, 12, 2, 4
    inner, audio_inner = heads * head_dim, audio_heads * audio_head_dim
    torch.manual_seed(seed + 1)
    LTX2TextConnectors(
        caption_channels=width, text_proj_in_factor=layers + 1,
        video_connector_num_attention_heads=4, video_connector_attention_head_dim=inner // 4 if ltx23 else 8,
        video_connector_num_layers=1, video_connector_num_learnable_registers=8, video_gated_attn=ltx23,
        audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=audio_inner // 4 if ltx23 else 8,
        audio_connector_num_layers=1, audio_connector_num_learnable_registers=8, audio_gated_attn=ltx23,
        rope_type="split", per_modality_projections=ltx23, video_hidden_dim=inner, audio_hidden_dim=audio_inner,
    ).save_pretrained(out_dir / "connectors")

    torch.manual_seed(seed + 2)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=heads, attention_head_dim=head_dim,
        cross_attention_dim=inner, vae_scale_factors=(8, 8, 8), audio_in_channels=4, audio_out_channels=4,
        audio_num_attention_heads=audio_heads, audio_attention_head_dim=audio_head_dim,
        audio_cross_attention_dim=audio_inner, num_layers=2, caption_channels=width, rope_type="split",
        gated_attn=ltx23, audio_gated_attn=ltx23, cross_attn_mod=ltx23, audio_cross_attn_mod=ltx23,
        use_prompt_embeddings=not ltx23, perturbed_attn=ltx23,
    )
    transformer.save_pretrained(out_dir / "transformer")

    torch.manual_seed(seed + 3)
    vae = AutoencoderKLLTX2Video(  # "spatial", "temporal", then two "spatiotemporal" downsamplings, as the real VAE
        latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1), decoder_inject_noise=(False,) * 4,
        upsample_factor=(1, 1, 1), upsample_residual=(False,) * 3, patch_size=1, patch_size_t=1,
        spatial_compression_ratio=8, temporal_compression_ratio=8,
    )
    # Non-trivial latent statistics, so normalisation is exercised (the real VAE's are not 0 and 1).
    vae.latents_mean.copy_(torch.linspace(-0.5, 0.5, 8))
    vae.latents_std.copy_(torch.linspace(0.5, 1.5, 8))
    vae.save_pretrained(out_dir / "vae")
    torch.manual_seed(seed + 4)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8,
    )
    audio_vae.save_pretrained(out_dir / "audio_vae")
    LTX2Vocoder(
        in_channels=2 * 8, hidden_channels=8, out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
        resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1,
        output_sampling_rate=16000,
    ).save_pretrained(out_dir / "vocoder")
    FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
        max_image_seq_len=4096, shift_terminal=0.1,
    ).save_pretrained(out_dir / "scheduler")
    (out_dir / "model_index.json").write_text(MODEL_INDEX)


MODEL_INDEX = """{
  "_class_name": "LTX2Pipeline",
  "_diffusers_version": "0.42.1",
  "audio_vae": ["diffusers", "AutoencoderKLLTX2Audio"],
  "connectors": ["ltx2", "LTX2TextConnectors"],
  "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
  "text_encoder": ["transformers", "Gemma3ForConditionalGeneration"],
  "tokenizer": ["transformers", "GemmaTokenizer"],
  "transformer": ["diffusers", "LTX2VideoTransformer3DModel"],
  "vae": ["diffusers", "AutoencoderKLLTX2Video"],
  "vocoder": ["ltx2", "LTX2Vocoder"]
}
"""


# diffusers module name -> the original LTX-2 name, which ComfyUI's LTXAV model (comfy/ldm/lightricks/av_model.py)
# keeps: the inverse of the renames in diffusers' LTX-2 converters (`convert_ltx2_transformer_to_diffusers`,
# `_convert_non_diffusers_ltx2_lora_to_diffusers`). Top-level modules by their first name, names inside by any part.
_TOP_LEVEL_RENAMES = {
    "proj_in": "patchify_proj", "audio_proj_in": "audio_patchify_proj",
    "time_embed": "adaln_single", "audio_time_embed": "audio_adaln_single",
    "av_cross_attn_video_scale_shift": "av_ca_video_scale_shift_adaln_single",
    "av_cross_attn_video_a2v_gate": "av_ca_a2v_gate_adaln_single",
    "av_cross_attn_audio_scale_shift": "av_ca_audio_scale_shift_adaln_single",
    "av_cross_attn_audio_v2a_gate": "av_ca_v2a_gate_adaln_single",
    "prompt_adaln": "prompt_adaln_single", "audio_prompt_adaln": "audio_prompt_adaln_single",
}
_INNER_RENAMES = {
    "norm_q": "q_norm", "norm_k": "k_norm",
    "video_a2v_cross_attn_scale_shift_table": "scale_shift_table_a2v_ca_video",
    "audio_a2v_cross_attn_scale_shift_table": "scale_shift_table_a2v_ca_audio",
}


def comfyui_module_name(name: str) -> str:
    """ComfyUI's LTXAV name (the original LTX-2 name) of a diffusers LTX2VideoTransformer3DModel module or tensor
    name: 'time_embed.linear' -> 'adaln_single.linear'; inside the blocks only the q/k norms differ."""
    head, *rest = name.split(".")
    return ".".join([_TOP_LEVEL_RENAMES.get(head, head), *(_INNER_RENAMES.get(part, part) for part in rest)])


def comfyui_lora(lora: TensorDict) -> TensorDict:
    """The LoRA in LTX-2's own format, as Lightricks' trainer writes it and ComfyUI loads it for LTXAV:
    `diffusion_model.<original module>.lora_A.weight` / `.lora_B.weight` (comfy/lora.py's generic
    `diffusion_model.` keys; it reads lora_A/lora_B as down/up) without `.alpha`, so both ComfyUI and diffusers'
    LTX-2 loader (which refuses `.alpha`) apply it at scale 1, as lora_B is pre-scaled."""
    from diffusion_pipe.lora_keys import lora_modules

    out: TensorDict = {}
    for module, (a, b) in lora_modules(lora).items():
        base = f"diffusion_model.{comfyui_module_name(module)}"
        out[f"{base}.lora_A.weight"], out[f"{base}.lora_B.weight"] = a.contiguous(), b.contiguous()
    return out
