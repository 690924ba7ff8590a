"""Chroma (Flux-shaped MMDiT, flow matching; T5 only, no CLIP, no guidance embedding), through diffusers.

Chroma keeps Flux's VAE, latent packing, block layout and module names, so `ChromaAdapter` is a `FluxAdapter`
that changes only what Chroma changes: one T5 encoder (with its padding mask), and the modulations, which one
"distilled guidance" approximator computes for every block at once from the timestep instead of each block's
own adaptive norm. Its ComfyUI export is Flux's: ComfyUI's Chroma model class subclasses its Flux one and keeps
BFL's module names (see `diffusion_pipe.models.flux.comfyui_lora`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Adapter, Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import PipelineTextEncoder, bare_pipeline, dtype_name, load_component, \
    save_tiny_tokenizers
from diffusion_pipe.models.flux import FluxAdapter, image_ids, pack_latents
from diffusion_pipe.params import SamplePrompt


class ChromaEmbed(nn.Module):
    """First layer: embeds latent tokens and text, computes every block's modulations and the rotary tables.
    Returns (hidden, encoder, modulations, cos, sin, attention_mask)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.x_embedder = transformer.x_embedder
        self.context_embedder = transformer.context_embedder
        self.time_text_embed = transformer.time_text_embed
        self.distilled_guidance_layer = transformer.distilled_guidance_layer
        self.pos_embed = transformer.pos_embed

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, timesteps, t5, mask, img_ids, txt_ids = inputs
        hidden = self.x_embedder(hidden)
        modulations = self.distilled_guidance_layer(self.time_text_embed(timesteps.to(hidden.dtype) * 1000))
        encoder = self.context_embedder(t5)
        # ids are the same for every item of a micro-batch (one bucket): take the first row.
        cos, sin = self.pos_embed(torch.cat((txt_ids[0], img_ids[0]), dim=0))
        return hidden, encoder, modulations, cos.to(hidden.dtype), sin.to(hidden.dtype), mask


class ChromaDoubleBlock(nn.Module):
    """Double-stream block `index`, fed its image and text slices of the modulations (as the transformer's
    forward slices them: single blocks' first, then all double blocks' image rows, then their text rows)."""

    def __init__(self, block: nn.Module, index: int, num_double: int, num_single: int) -> None:
        super().__init__()
        self.block = block
        self.img = 3 * num_single + 6 * index
        self.txt = 3 * num_single + 6 * num_double + 6 * index

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, encoder, modulations, cos, sin, mask = inputs
        temb = torch.cat((modulations[:, self.img:self.img + 6], modulations[:, self.txt:self.txt + 6]), dim=1)
        encoder, hidden = self.block(hidden_states=hidden, encoder_hidden_states=encoder, temb=temb,
                                     image_rotary_emb=(cos, sin), attention_mask=mask)
        return hidden, encoder, modulations, cos, sin, mask


class ChromaSingleBlock(nn.Module):
    """Single-stream block `index` over the joint [text, image] sequence; split again on the way out so every
    layer takes and returns the same tuple (diffusers' Flux single blocks concatenate and split the same way)."""

    def __init__(self, block: nn.Module, index: int) -> None:
        super().__init__()
        self.block = block
        self.index = index

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, encoder, modulations, cos, sin, mask = inputs
        joint = self.block(hidden_states=torch.cat((encoder, hidden), dim=1),
                           temb=modulations[:, 3 * self.index:3 * self.index + 3],
                           image_rotary_emb=(cos, sin), attention_mask=mask)
        # contiguous: a stage boundary sends these tensors as they are
        encoder, hidden = (t.contiguous() for t in joint.split((encoder.shape[1], hidden.shape[1]), dim=1))
        return hidden, encoder, modulations, cos, sin, mask


class ChromaOut(nn.Module):
    """Last layer: the final adaptive norm (its modulations are the last two rows) and the projection."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.norm_out = transformer.norm_out
        self.proj_out = transformer.proj_out

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        hidden, _encoder, modulations, _cos, _sin, _mask = inputs
        return self.proj_out(self.norm_out(hidden, modulations[:, -2:]))


class ChromaAdapter(FluxAdapter):
    """Chroma1 (HD, Base) in diffusers format (transformer, vae, text_encoder, tokenizer, scheduler)."""

    name: ClassVar[str] = "chroma"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image",), tasks=("t2i",), objective="flow", export_formats=("diffusers", "comfyui"),
    )
    comfyui_reads_diffusers_names: ClassVar[bool] = False  # not checked for Chroma

    # ---- encode side -------------------------------------------------------------------------------
    def text_component_dirs(self) -> tuple[dict[str, Path], dict[str, Path]]:
        """T5 alone (Flux's CLIP is not part of Chroma): the one-encoder layout, not Flux's two."""
        return Adapter.text_component_dirs(self)

    def load_text_encoders(self, device: torch.device) -> PipelineTextEncoder:
        from diffusers import ChromaPipeline
        from transformers import AutoTokenizer, T5EncoderModel

        t5 = load_component(T5EncoderModel, self.model_dir / "text_encoder", self.dtype, device)
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir / "tokenizer")
        return PipelineTextEncoder(bare_pipeline(ChromaPipeline, text_encoder=t5, tokenizer=tokenizer))

    @torch.no_grad()
    def encode_text(self, encoders: PipelineTextEncoder, captions: list[str], max_length: int) -> list[TensorDict]:
        """ChromaPipeline.encode_prompt: T5 states under the padding mask, and the mask the transformer attends
        with (the caption's tokens plus the first padding token)."""
        pipe = encoders.pipeline
        t5, _text_ids, mask, *_ = pipe.encode_prompt(captions, device=pipe.text_encoder.device,
                                                     do_classifier_free_guidance=False, max_sequence_length=max_length)
        return [{"t5": t5[i].contiguous().cpu(), "t5_mask": mask[i].contiguous().cpu()} for i in range(len(captions))]

    def text_spec(self, max_length: int) -> Spec:
        dt = dtype_name(self.dtype)
        return {"t5": ((max_length, self.component_config("text_encoder")["d_model"]), dt), "t5_mask": ((max_length,), dt)}

    # ---- train side --------------------------------------------------------------------------------
    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import ChromaTransformer2DModel

        return ChromaTransformer2DModel

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        double, single = denoiser.transformer_blocks, denoiser.single_transformer_blocks
        return [ChromaEmbed(denoiser),
                *(ChromaDoubleBlock(b, i, len(double), len(single)) for i, b in enumerate(double)),
                *(ChromaSingleBlock(b, i) for i, b in enumerate(single)),
                ChromaOut(denoiser)]

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """As ChromaPipeline calls the transformer: the text mask extended by the image tokens (kept as the
        pipeline's float mask, which diffusers 0.42.1 hands to attention as is; diffusers issue #12116), and
        no guidance: Chroma has no guidance embedding."""
        b, _, h, w = noisy_latents.shape
        t5 = text["t5"].to(self.dtype)
        mask = text["t5_mask"].to(self.dtype)
        image_tokens = (h // 2) * (w // 2)
        return (
            pack_latents(noisy_latents).to(self.dtype),
            timesteps.to(self.dtype),
            t5,
            torch.cat((mask, torch.ones(b, image_tokens, dtype=self.dtype)), dim=1),
            image_ids(h, w).unsqueeze(0).expand(b, -1, -1).contiguous(),
            torch.zeros(b, t5.shape[1], 3),
        )

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        from diffusers import ChromaPipeline

        return ChromaPipeline

    def sample_texts(self, prompt: SamplePrompt) -> tuple[str, ...]:
        """Always the negative prompt too: Chroma's guidance is classifier-free (not Flux's distilled kind)."""
        return (prompt.prompt, prompt.negative_prompt)

    def sample_inputs(self, text: TensorDict, negative: TensorDict, guidance: float, cfg_scale: float) -> dict:
        """`guidance` is Chroma's classifier-free guidance scale (it has no distilled guidance), over the negative
        prompt's embeddings; each embedding comes with its attention mask, as ChromaPipeline requires."""
        return {"prompt_embeds": text["t5"][None].to(self.dtype),
                "prompt_attention_mask": text["t5_mask"][None].to(self.dtype),
                "negative_prompt_embeds": negative["t5"][None].to(self.dtype),
                "negative_prompt_attention_mask": negative["t5_mask"][None].to(self.dtype), "guidance_scale": guidance}

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        from diffusers import AutoencoderKL, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
        from transformers import T5Config, T5EncoderModel

        out_dir = Path(out_dir)
        with tempfile.TemporaryDirectory() as tmp:
            _clip, t5_tok = save_tiny_tokenizers(Path(tmp))
        t5_tok.save_pretrained(out_dir / "tokenizer")
        torch.manual_seed(seed)
        T5EncoderModel(T5Config(
            vocab_size=len(t5_tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, pad_token_id=t5_tok.pad_token_id,
            eos_token_id=t5_tok.eos_token_id, decoder_start_token_id=t5_tok.pad_token_id,
        )).save_pretrained(out_dir / "text_encoder")
        AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 16),
            down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
            layers_per_block=1, norm_num_groups=4, sample_size=64, scaling_factor=0.8, shift_factor=0.1,
            use_quant_conv=False, use_post_quant_conv=False,
        ).save_pretrained(out_dir / "vae")
        ChromaTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
            approximator_num_channels=16, approximator_hidden_dim=32, approximator_layers=2,
        ).save_pretrained(out_dir / "transformer")
        FlowMatchEulerDiscreteScheduler(shift=1.0).save_pretrained(out_dir / "scheduler")
        (out_dir / "model_index.json").write_text(MODEL_INDEX)


MODEL_INDEX = """{
  "_class_name": "ChromaPipeline",
  "_diffusers_version": "0.42.1",
  "feature_extractor": [null, null],
  "image_encoder": [null, null],
  "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
  "text_encoder": ["transformers", "T5EncoderModel"],
  "tokenizer": ["transformers", "T5TokenizerFast"],
  "transformer": ["diffusers", "ChromaTransformer2DModel"],
  "vae": ["diffusers", "AutoencoderKL"]
}
"""
