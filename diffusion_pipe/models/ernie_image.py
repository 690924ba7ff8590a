"""ERNIE-Image (single-stream DiT over [image, text] tokens with shared adaptive norms, flow matching; Mistral 3
text encoder, the Flux.2 VAE), through diffusers components.

Text goes through ErnieImagePipeline's own `encode_prompt` (the second-to-last hidden states of each caption's
tokens, no template), stored zero-padded to `encode.text_max_length` with the caption's length: the transformer
masks the padding and places the image tokens after the text length, so the padding changes nothing. Latents are
the Flux.2 VAE's, 2x2-patchified and normalised by the VAE's batch-norm statistics as ErnieImagePipeline inverts
them before decoding. The transformer runs its sequence first (S, B, H); the pipeline layers keep that layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Adapter, Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import PipelineTextEncoder, bare_pipeline, dtype_name, load_component, \
    save_tiny_qwen_tokenizer

# ErnieImagePipeline's batch-norm epsilon when it un-normalises latents (a literal there, not the VAE's config).
_BN_EPS = 1e-5


def _pipeline(**components: object) -> object:
    from diffusers import ErnieImagePipeline

    return bare_pipeline(ErnieImagePipeline, **components)


class ErnieImageEmbed(nn.Module):
    """First layer: image and text tokens in one sequence (image first, sequence-first layout), their rotary
    angles, the timestep embedding and its six shared modulations.
    Returns (x, rotary, modulation, c, mask, grid)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.x_embedder = transformer.x_embedder
        self.text_proj = transformer.text_proj
        self.time_proj = transformer.time_proj
        self.time_embedding = transformer.time_embedding
        self.pos_embed = transformer.pos_embed
        self.adaLN_modulation = transformer.adaLN_modulation
        self.patch_size = transformer.config.patch_size

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """As ErnieImageTransformer2DModel.forward, up to its blocks."""
        hidden, timesteps, text, text_lens = inputs
        b, _, h, w = hidden.shape
        hp, wp = h // self.patch_size, w // self.patch_size
        image = self.x_embedder(hidden).transpose(0, 1)
        if self.text_proj is not None:
            text = self.text_proj(text)
        t_max = text.shape[1]
        x = torch.cat((image, text.transpose(0, 1)), dim=0).contiguous()
        text_ids = torch.cat((torch.arange(t_max, device=x.device, dtype=torch.float32).view(1, t_max, 1)
                              .expand(b, -1, -1), torch.zeros((b, t_max, 2), device=x.device)), dim=-1)
        grid_yx = torch.stack(torch.meshgrid(torch.arange(hp, device=x.device, dtype=torch.float32),
                                             torch.arange(wp, device=x.device, dtype=torch.float32), indexing="ij"),
                              dim=-1).reshape(-1, 2)
        image_ids = torch.cat((text_lens.float().view(b, 1, 1).expand(-1, hp * wp, -1),
                               grid_yx.view(1, hp * wp, 2).expand(b, -1, -1)), dim=-1)
        rotary = self.pos_embed(torch.cat((image_ids, text_ids), dim=1))
        valid_text = torch.arange(t_max, device=x.device).view(1, t_max) < text_lens.view(b, 1)
        mask = torch.cat((torch.ones((b, hp * wp), device=x.device, dtype=torch.bool), valid_text), dim=1)
        c = self.time_embedding(self.time_proj(timesteps).to(x.dtype))
        grid = torch.tensor([[hp, wp]] * b, device=x.device)
        return x, rotary, self.adaLN_modulation(c), c, mask.long(), grid


class ErnieImageBlock(nn.Module):
    """One shared-AdaLN block; takes and returns (x, rotary, modulation, c, mask, grid). The six modulations
    broadcast over the sequence (the model expands them to it; the values are the same)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, rotary, modulation, c, mask, grid = inputs
        temb = [m.unsqueeze(0) for m in modulation.chunk(6, dim=-1)]
        x = self.block(x, rotary, temb, mask.bool()[:, None, None, :])
        return x, rotary, modulation, c, mask, grid


class ErnieImageOut(nn.Module):
    """Last layer: the final adaptive norm and projection of the image tokens, batch first."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.final_norm = transformer.final_norm
        self.final_linear = transformer.final_linear

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, _rotary, _modulation, c, _mask, grid = inputs
        n_image = int(grid[0, 0] * grid[0, 1])
        x = self.final_norm(x, c).type_as(x)
        return self.final_linear(x)[:n_image].transpose(0, 1).contiguous()


class ErnieImageAdapter(Adapter):
    """ERNIE-Image (text-to-image) in diffusers format (transformer, vae, text_encoder, tokenizer, scheduler)."""

    name: ClassVar[str] = "ernie_image"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image",), tasks=("t2i",), objective="flow", export_formats=("diffusers", "comfyui"),
    )

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def vae_scale(self) -> int:
        """As ErnieImagePipeline computes it: one halving per VAE level, the last being the 2x2 patchify."""
        return 2 ** len(self.component_config("vae")["block_out_channels"])

    @property
    def pixel_multiple(self) -> int:
        return self.vae_scale * self.component_config("transformer")["patch_size"]

    def vae_class(self) -> type[nn.Module]:
        from diffusers import AutoencoderKLFlux2

        return AutoencoderKLFlux2

    def load_text_encoders(self, device: torch.device) -> PipelineTextEncoder:
        from transformers import AutoTokenizer, Mistral3Model

        encoder = load_component(Mistral3Model, self.model_dir / "text_encoder", self.dtype, device)
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir / "tokenizer")
        return PipelineTextEncoder(_pipeline(text_encoder=encoder, tokenizer=tokenizer))

    @torch.no_grad()
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        """The distribution's mode, 2x2-patchified (the pipeline's `_patchify_latents`) and normalised by the VAE's
        batch-norm statistics, the inverse of what ErnieImagePipeline applies before decoding."""
        from diffusers import ErnieImagePipeline

        if pixels_BCFHW.shape[2] != 1:
            raise ValueError(f"family 'ernie_image' trains on images only; got {pixels_BCFHW.shape[2]} frames")
        latents = vae.encode(pixels_BCFHW[:, :, 0].to(vae.device, vae.dtype)).latent_dist.mode()
        latents = ErnieImagePipeline._patchify_latents(latents)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + _BN_EPS).to(latents)
        return [{"latents": x.contiguous().cpu()} for x in (latents - mean) / std]

    @torch.no_grad()
    def encode_text(self, encoders: PipelineTextEncoder, captions: list[str], max_length: int) -> list[TensorDict]:
        """ErnieImagePipeline.encode_prompt per caption, cut to `max_length` tokens and zero-padded to it, with the
        length the transformer masks the padding by."""
        pipe = encoders.pipeline
        out = []
        for states in pipe.encode_prompt(list(captions), device=pipe.text_encoder.device):
            states = states[:max_length].cpu()
            padded = states.new_zeros(max_length, states.shape[1])
            padded[:len(states)] = states
            out.append({"text": padded.contiguous(), "text_len": torch.tensor(len(states), dtype=torch.int64)})
        return out

    def latent_spec(self, width: int, height: int, frames: int) -> Spec:
        s = self.vae_scale
        return {"latents": ((self.component_config("vae")["latent_channels"] * 4, height // s, width // s),
                            dtype_name(self.dtype))}

    def text_spec(self, max_length: int) -> Spec:
        return {"text": ((max_length, self.component_config("transformer")["text_in_dim"]), dtype_name(self.dtype)),
                "text_len": ((), "int64")}

    # ---- train side --------------------------------------------------------------------------------
    def normalise_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Identity: encoding already applied the VAE's batch-norm statistics (weights of the VAE, whose hash keys
        the stored latents)."""
        return latents

    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import ErnieImageTransformer2DModel

        return ErnieImageTransformer2DModel

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        return ("self_attention.to_q", "self_attention.to_k", "self_attention.to_v", "self_attention.to_out.0",
                "mlp.gate_proj", "mlp.up_proj", "mlp.linear_fc2")

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        return [ErnieImageEmbed(denoiser), *(ErnieImageBlock(b) for b in denoiser.layers), ErnieImageOut(denoiser)]

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """As ErnieImagePipeline calls the transformer: latents, the scheduler's timestep (t x 1000), the padded
        text states and their lengths; ERNIE-Image has no guidance embedding."""
        return (noisy_latents.to(self.dtype), (timesteps * 1000).to(self.dtype), text["text"].to(self.dtype),
                text["text_len"].long().reshape(-1))

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Image tokens (B, H/p * W/p, p*p*C) back to (B, C, H, W), as the transformer's own output reshape."""
        b, c, h, w = like.shape
        p = self.component_config("transformer")["patch_size"]
        return prediction.view(b, h // p, w // p, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        from diffusers import ErnieImagePipeline

        return ErnieImagePipeline

    def sample_inputs(self, text: TensorDict, negative: TensorDict, guidance: float, cfg_scale: float) -> dict:
        """`guidance` is ErnieImagePipeline's classifier-free guidance scale, over the negative prompt; embeddings
        go in as the pipeline's per-prompt lists, each cut to its length."""
        return {"prompt_embeds": [text["text"][:int(text["text_len"])].to(self.dtype)],
                "negative_prompt_embeds": [negative["text"][:int(negative["text_len"])].to(self.dtype)],
                "guidance_scale": guidance, "use_pe": False}

    # ---- export side -------------------------------------------------------------------------------
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        """ERNIE-Image's original names are diffusers' own (diffusers' single-file converter only strips the
        prefix), so `comfyui` is the `diffusion_model.`-prefixed PEFT keys ComfyUI's generic loader reads and
        ErnieImagePipeline's loader converts. No `.alpha`: lora_B is pre-scaled (scale 1, what ComfyUI applies
        without one) and diffusers' loader would hand an alpha key to PEFT as a weight."""
        if fmt == "diffusers":
            return {f"transformer.{k}": v for k, v in lora.items()}
        if fmt == "comfyui":
            return {f"diffusion_model.{k}": v for k, v in lora.items()}
        raise self.unknown_format(fmt)

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """ERNIE-Image's layout at toy width: a 2-block transformer, a 2-layer Mistral 3 with a one-layer vision
        tower, a 3-level Flux.2 VAE with non-trivial batch-norm statistics."""
        from diffusers import AutoencoderKLFlux2, ErnieImageTransformer2DModel, FlowMatchEulerDiscreteScheduler
        from transformers import Mistral3Model

        out_dir = Path(out_dir)
        tokenizer = save_tiny_qwen_tokenizer(out_dir / "tokenizer")
        torch.manual_seed(seed)
        Mistral3Model(tiny_mistral3_config(tokenizer, num_hidden_layers=2)).save_pretrained(out_dir / "text_encoder")
        vae = AutoencoderKLFlux2(
            block_out_channels=(8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 3,
            up_block_types=("UpDecoderBlock2D",) * 3, layers_per_block=1, latent_channels=4, norm_num_groups=4,
            sample_size=64, use_quant_conv=False, use_post_quant_conv=False,
        )
        vae.bn.running_mean.normal_(0.0, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
        vae.save_pretrained(out_dir / "vae")
        transformer = ErnieImageTransformer2DModel(
            hidden_size=32, num_attention_heads=2, num_layers=2, ffn_hidden_size=64, in_channels=16, out_channels=16,
            patch_size=1, text_in_dim=16, rope_axes_dim=(4, 6, 6),
        )
        # the model zero-initialises its modulation and output projection (a trained one has weights there); a
        # tiny model needs them non-zero, or its output and every gradient would be zero
        for module in (transformer.adaLN_modulation[-1], transformer.final_linear):
            nn.init.normal_(module.weight, std=0.05)
            nn.init.normal_(module.bias, std=0.05)
        transformer.save_pretrained(out_dir / "transformer")
        FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(out_dir / "scheduler")
        (out_dir / "model_index.json").write_text(MODEL_INDEX)


def tiny_mistral3_config(tokenizer: object, num_hidden_layers: int) -> object:
    """A Mistral3Config at toy width over `tokenizer`'s vocabulary: a 16-wide text model of `num_hidden_layers`
    layers and a one-layer Pixtral vision tower (text encoding never runs it)."""
    from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig

    vocab = len(tokenizer)
    return Mistral3Config(
        vision_config=PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, head_dim=8, patch_size=4, image_size=32).to_dict(),
        text_config=MistralConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=num_hidden_layers, num_attention_heads=2, num_key_value_heads=1,
                                  head_dim=8, max_position_embeddings=2048,
                                  pad_token_id=tokenizer.pad_token_id).to_dict(),
        image_token_index=vocab, spatial_merge_size=2, vision_feature_layer=-1,
    )


MODEL_INDEX = """{
  "_class_name": "ErnieImagePipeline",
  "_diffusers_version": "0.42.1",
  "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
  "text_encoder": ["transformers", "Mistral3Model"],
  "tokenizer": ["transformers", "Qwen2Tokenizer"],
  "transformer": ["diffusers", "ErnieImageTransformer2DModel"],
  "vae": ["diffusers", "AutoencoderKLFlux2"]
}
"""
