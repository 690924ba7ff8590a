"""FLUX.2 [klein] (Flux.2 MMDiT with shared modulations, flow matching; Qwen3 text encoder, the Flux.2 VAE),
through diffusers components. FLUX.2 [dev] (Mistral 3 text encoder, guidance embedding) is family `flux2`, this
adapter's subclass (it swaps the pipeline class, the text encoder class and the guidance check).

Text goes through Flux2KleinPipeline's own `encode_prompt` (the caption as a chat message, three of Qwen3's
hidden layers stacked); latents through its own `_encode_vae_image` (2x2 patches, then the VAE's batch-norm
statistics), so the stored latents are already in the transformer's space.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Adapter, Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import PipelineTextEncoder, bare_pipeline, dtype_name, load_component, \
    save_tiny_qwen_tokenizer
from diffusion_pipe.models.zimage import QWEN3_CHAT_TEMPLATE


class Flux2Embed(nn.Module):
    """First layer: embeds latent tokens and text, the time embedding and the three shared modulations, and the
    rotary tables of [text, image]. Returns (hidden, encoder, temb, mod_img, mod_txt, mod_single, cos, sin)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.x_embedder = transformer.x_embedder
        self.context_embedder = transformer.context_embedder
        self.time_guidance_embed = transformer.time_guidance_embed
        self.double_stream_modulation_img = transformer.double_stream_modulation_img
        self.double_stream_modulation_txt = transformer.double_stream_modulation_txt
        self.single_stream_modulation = transformer.single_stream_modulation
        self.pos_embed = transformer.pos_embed
        self.guidance_embeds = transformer.config.guidance_embeds

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, timesteps, text, img_ids, txt_ids, guidance = inputs
        guidance = guidance.to(hidden.dtype) * 1000 if self.guidance_embeds else None
        temb = self.time_guidance_embed(timesteps.to(hidden.dtype) * 1000, guidance)
        # ids are the same for every item of a micro-batch (one bucket): take the first row
        text_cos, text_sin = self.pos_embed(txt_ids[0])
        image_cos, image_sin = self.pos_embed(img_ids[0])
        return (self.x_embedder(hidden), self.context_embedder(text), temb,
                self.double_stream_modulation_img(temb), self.double_stream_modulation_txt(temb),
                self.single_stream_modulation(temb), torch.cat((text_cos, image_cos)), torch.cat((text_sin, image_sin)))


class Flux2DoubleBlock(nn.Module):
    """A double-stream block. The last one drops the double-stream modulations from the tuple (nothing after it
    reads them, and a stage boundary must not send a tensor that gets no gradient):
    (hidden, encoder, temb, mod_img, mod_txt, mod_single, cos, sin) -> the same, or
    (hidden, encoder, temb, mod_single, cos, sin) after the last."""

    def __init__(self, block: nn.Module, last: bool) -> None:
        super().__init__()
        self.block = block
        self.last = last

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, encoder, temb, mod_img, mod_txt, mod_single, cos, sin = inputs
        encoder, hidden = self.block(hidden_states=hidden, encoder_hidden_states=encoder, temb_mod_img=mod_img,
                                     temb_mod_txt=mod_txt, image_rotary_emb=(cos, sin))
        if self.last:
            return hidden, encoder, temb, mod_single, cos, sin
        return hidden, encoder, temb, mod_img, mod_txt, mod_single, cos, sin


class Flux2SingleBlock(nn.Module):
    """A single-stream block over [text, image], split again on the way out (as the block itself offers).
    (hidden, encoder, temb, mod_single, cos, sin) -> the same, or (hidden, temb) after the last."""

    def __init__(self, block: nn.Module, last: bool) -> None:
        super().__init__()
        self.block = block
        self.last = last

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, encoder, temb, mod_single, cos, sin = inputs
        encoder, hidden = self.block(hidden_states=hidden, encoder_hidden_states=encoder, temb_mod=mod_single,
                                     image_rotary_emb=(cos, sin), split_hidden_states=True)
        if self.last:
            return hidden.contiguous(), temb
        # contiguous: a stage boundary sends these tensors as they are
        return hidden.contiguous(), encoder.contiguous(), temb, mod_single, cos, sin


class Flux2Out(nn.Module):
    """Last layer: final adaptive norm and projection back to latent tokens."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.norm_out = transformer.norm_out
        self.proj_out = transformer.proj_out

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        hidden, temb = inputs
        return self.proj_out(self.norm_out(hidden, temb))


class Flux2KleinAdapter(Adapter):
    """FLUX.2 [klein] in diffusers format (transformer, vae, text_encoder, tokenizer, scheduler)."""

    name: ClassVar[str] = "flux2_klein"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image",), tasks=("t2i",), objective="flow", export_formats=("diffusers", "comfyui"),
    )
    guidance_embeds: ClassVar[bool] = False  # FLUX.2 [klein] has no guidance embedding, FLUX.2 [dev] has one

    def __init__(self, model_dir: Path, dtype: torch.dtype, expert: str | None = None) -> None:
        super().__init__(model_dir, dtype, expert)
        config = self.model_dir / "transformer" / "config.json"
        # Flux2Transformer2DModel's config defaults guidance_embeds to True
        if config.is_file() and self.component_config("transformer").get("guidance_embeds", True) != \
                self.guidance_embeds:
            from diffusion_pipe.config import ConfigError

            has, family = ("no", "flux2_klein") if self.guidance_embeds else ("a", "flux2")
            raise ConfigError(f"model.family: {self.model_dir}'s transformer has {has} guidance embedding, so it is "
                              f"not a model of family '{self.name}' (FLUX.2 [dev] has one, FLUX.2 [klein] none); "
                              f"set model.family to '{family}'")

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def pixel_multiple(self) -> int:
        return self.vae_scale * 2  # the pipeline's 2x2 latent patches

    def vae_class(self) -> type[nn.Module]:
        from diffusers import AutoencoderKLFlux2

        return AutoencoderKLFlux2

    def text_component_dirs(self) -> tuple[dict[str, Path], dict[str, Path]]:
        """The chat template the pipeline wraps captions in is a tokenizer file: the tokenizer hash keys it."""
        return {"text_encoder": self.model_dir / "text_encoder"}, {"tokenizer": self.model_dir / "tokenizer"}

    def text_encoder_class(self) -> type[nn.Module]:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM

    def load_text_encoders(self, device: torch.device) -> PipelineTextEncoder:
        from transformers import AutoTokenizer

        encoder = load_component(self.text_encoder_class(), self.model_dir / "text_encoder", self.dtype, device)
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir / "tokenizer")
        return PipelineTextEncoder(bare_pipeline(self.pipeline_class(), text_encoder=encoder, tokenizer=tokenizer))

    @torch.no_grad()
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        """The pipeline's `_encode_vae_image`: the distribution's mode, 2x2 patches, batch-norm statistics."""
        if pixels_BCFHW.shape[2] != 1:
            raise ValueError(f"family '{self.name}' trains on images only; got {pixels_BCFHW.shape[2]} frames")
        pixels = pixels_BCFHW[:, :, 0].to(vae.device, vae.dtype)
        latents = bare_pipeline(self.pipeline_class(), vae=vae)._encode_vae_image(pixels, None)
        return [{"latents": x.contiguous().cpu()} for x in latents]

    @torch.no_grad()
    def encode_text(self, encoders: PipelineTextEncoder, captions: list[str], max_length: int) -> list[TensorDict]:
        pipe = encoders.pipeline
        embeds, _ = pipe.encode_prompt(list(captions), device=pipe.text_encoder.device, max_sequence_length=max_length)
        return [{"prompt_embeds": embeds[i].contiguous().cpu()} for i in range(len(captions))]

    def latent_spec(self, width: int, height: int, frames: int) -> Spec:
        s = self.vae_scale * 2
        return {"latents": ((self.component_config("vae")["latent_channels"] * 4, height // s, width // s),
                            dtype_name(self.dtype))}

    def text_spec(self, max_length: int) -> Spec:
        return {"prompt_embeds": ((max_length, self.component_config("transformer")["joint_attention_dim"]),
                                  dtype_name(self.dtype))}

    # ---- train side --------------------------------------------------------------------------------
    def normalise_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Identity: encoding already applied the VAE's batch-norm statistics, as the pipeline does (they are
        weights of the VAE, whose hash keys the stored latents)."""
        return latents

    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import Flux2Transformer2DModel

        return Flux2Transformer2DModel

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        return ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
                "attn.to_qkv_mlp_proj", "attn.to_out")

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        double, single = denoiser.transformer_blocks, denoiser.single_transformer_blocks
        return [Flux2Embed(denoiser),
                *(Flux2DoubleBlock(b, last=i == len(double) - 1) for i, b in enumerate(double)),
                *(Flux2SingleBlock(b, last=i == len(single) - 1) for i, b in enumerate(single)),
                Flux2Out(denoiser)]

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """As the pipeline calls the transformer: packed latent tokens, its position ids for them and for the text;
        `guidance` reaches the transformer only if it has a guidance embedding."""
        pipe = self.pipeline_class()  # its static packing and id helpers: nothing to build
        b = noisy_latents.shape[0]
        prompt_embeds = text["prompt_embeds"].to(self.dtype)
        return (pipe._pack_latents(noisy_latents).to(self.dtype), timesteps.to(self.dtype), prompt_embeds,
                pipe._prepare_latent_ids(noisy_latents).float(), pipe._prepare_text_ids(prompt_embeds).float(),
                torch.full((b,), guidance, dtype=self.dtype))

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Tokens (B, H*W, C) back to (B, C, H, W): the inverse of the pipeline's `_pack_latents`."""
        b, c, h, w = like.shape
        return prediction.permute(0, 2, 1).reshape(b, c, h, w)

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        from diffusers import Flux2KleinPipeline

        return Flux2KleinPipeline

    def sample_inputs(self, text: TensorDict, negative: TensorDict, guidance: float, cfg_scale: float) -> dict:
        """`guidance` is Flux2KleinPipeline's classifier-free guidance scale, over the negative prompt."""
        return {"prompt_embeds": text["prompt_embeds"][None].to(self.dtype),
                "negative_prompt_embeds": negative["prompt_embeds"][None].to(self.dtype), "guidance_scale": guidance}

    # ---- export side -------------------------------------------------------------------------------
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        if fmt == "diffusers":
            return {f"transformer.{k}": v for k, v in lora.items()}
        if fmt == "comfyui":
            config = self.component_config("transformer")
            return comfyui_lora(lora, config["num_attention_heads"] * config["attention_head_dim"])
        raise self.unknown_format(fmt)

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """FLUX.2 [klein]'s layout at toy width: one double and two single blocks, a 27-layer Qwen3 (the pipeline
        reads hidden layers 9, 18 and 27) with a tokenizer carrying the chat template, a 3-level VAE with
        non-trivial batch-norm statistics."""
        from transformers import Qwen3Config, Qwen3ForCausalLM

        out_dir = Path(out_dir)
        tokenizer = save_tiny_qwen_tokenizer(out_dir / "tokenizer", template="<|im_start|>user\n<|im_end|>\n"
                                             "<|im_start|>assistant\n", chat_template=QWEN3_CHAT_TEMPLATE)
        torch.manual_seed(seed)
        Qwen3ForCausalLM(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=27,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=2048,
            tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )).save_pretrained(out_dir / "text_encoder")
        save_tiny_flux2_components(out_dir, guidance_embeds=False, model_index=MODEL_INDEX)


def save_tiny_flux2_components(out_dir: Path, guidance_embeds: bool, model_index: str) -> None:
    """What every tiny FLUX.2 model shares, written after its text encoder (same random stream): a 3-level VAE with
    non-trivial batch-norm statistics, a transformer of one double and two single blocks over 48-wide text (three
    16-wide hidden layers stacked), the scheduler, and `model_index` as model_index.json."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, layers_per_block=1, latent_channels=4, norm_num_groups=4,
        sample_size=64, use_quant_conv=False, use_post_quant_conv=False,
    )
    vae.bn.running_mean.normal_(0.0, 0.5)
    vae.bn.running_var.uniform_(0.5, 2.0)
    vae.save_pretrained(out_dir / "vae")
    Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=32, axes_dims_rope=(2, 2, 2, 2),
        guidance_embeds=guidance_embeds,
    ).save_pretrained(out_dir / "transformer")
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(out_dir / "scheduler")
    (out_dir / "model_index.json").write_text(model_index)


MODEL_INDEX = """{
  "_class_name": "Flux2KleinPipeline",
  "_diffusers_version": "0.42.1",
  "is_distilled": false,
  "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
  "text_encoder": ["transformers", "Qwen3ForCausalLM"],
  "tokenizer": ["transformers", "Qwen2Tokenizer"],
  "transformer": ["diffusers", "Flux2Transformer2DModel"],
  "vae": ["diffusers", "AutoencoderKLFlux2"]
}
"""


# diffusers module -> (BFL's original name, which ComfyUI's Flux.2 model keeps, and the part of a fused qkv or
# None): the inverse of diffusers' convert_flux2_transformer_checkpoint_to_diffusers key maps.
_DOUBLE_BLOCK_NAMES: dict[str, tuple[str, int | None]] = {
    "attn.to_q": ("img_attn.qkv", 0), "attn.to_k": ("img_attn.qkv", 1), "attn.to_v": ("img_attn.qkv", 2),
    "attn.to_out.0": ("img_attn.proj", None), "attn.add_q_proj": ("txt_attn.qkv", 0),
    "attn.add_k_proj": ("txt_attn.qkv", 1), "attn.add_v_proj": ("txt_attn.qkv", 2),
    "attn.to_add_out": ("txt_attn.proj", None), "ff.linear_in": ("img_mlp.0", None),
    "ff.linear_out": ("img_mlp.2", None), "ff_context.linear_in": ("txt_mlp.0", None),
    "ff_context.linear_out": ("txt_mlp.2", None),
}
_SINGLE_BLOCK_NAMES: dict[str, str] = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}
_TOP_LEVEL_NAMES: dict[str, str] = {
    "x_embedder": "img_in", "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "proj_out": "final_layer.linear", "norm_out.linear": "final_layer.adaLN_modulation.1",
}


def flux2_original_module(module: str) -> tuple[str, int | None]:
    """A diffusers Flux.2 module name -> (its name in BFL's original model, its part of a fused qkv or None).
    'transformer_blocks.0.attn.to_k' -> ('double_blocks.0.img_attn.qkv', 1)."""
    match = re.fullmatch(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)", module)
    if match:
        kind, index, inner = match.groups()
        if kind == "transformer_blocks" and inner in _DOUBLE_BLOCK_NAMES:
            name, part = _DOUBLE_BLOCK_NAMES[inner]
            return f"double_blocks.{index}.{name}", part
        if kind == "single_transformer_blocks" and inner in _SINGLE_BLOCK_NAMES:
            return f"single_blocks.{index}.{_SINGLE_BLOCK_NAMES[inner]}", None
    elif module in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[module], None
    raise ValueError(f"export.formats: comfyui has no ComfyUI Flux.2 name for LoRA module {module!r}; drop it from "
                     "train.lora_targets or export the 'diffusers' format only")


def comfyui_lora(lora: TensorDict, inner_dim: int) -> TensorDict:
    """The LoRA under BFL's Flux.2 names, `diffusion_model.`-prefixed (the generic keys of ComfyUI's comfy/lora.py
    `model_lora_keys_unet`), as `lora_down`/`lora_up` with `.alpha` = rank (lora_B is pre-scaled): q/k/v fused
    exactly into one LoRA per qkv, the final modulation's (scale, shift) halves swapped to BFL's (shift, scale)."""
    from diffusion_pipe.lora_keys import down_up_alpha, fuse_loras, lora_modules

    groups: dict[str, dict[int | None, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, pair in lora_modules(lora).items():
        original, part = flux2_original_module(module)
        groups.setdefault(original, {})[part] = pair
    out: TensorDict = {}
    for original, parts in sorted(groups.items()):
        a, b = fuse_loras([parts.get(i) for i in range(3)], [inner_dim] * 3) if original.endswith(".qkv") \
            else parts[None]
        if original == "final_layer.adaLN_modulation.1":
            first, second = b.chunk(2, dim=0)
            b = torch.cat([second, first], dim=0)
        out.update(down_up_alpha(f"diffusion_model.{original}", a, b))
    return out
