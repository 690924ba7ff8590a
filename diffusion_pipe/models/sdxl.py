"""Stable Diffusion XL (UNet, DDPM epsilon or v-prediction; two CLIP text encoders, pooled embedding and
size/crop conditioning), through diffusers components.

Size/crop conditioning (`add_time_ids`): the encode stage gives adapters pixels already resized to their bucket,
not the original sizes, so training conditions on original size = target size = the bucket's pixel size and a
(0, 0) crop. That is what SDXL's inference defaults use for an uncropped image of the output size, so a LoRA trained
this way matches how it is sampled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Adapter, Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import dtype_name, load_component, save_tiny_tokenizers


@dataclass
class SDXLTextEncoders:
    """CLIP ViT-L (penultimate hidden states) and OpenCLIP bigG (penultimate states + projected pooled)."""

    clip_l: nn.Module
    tokenizer: object
    clip_g: nn.Module
    tokenizer_2: object


def _broadcast(timesteps: torch.Tensor, batch: int) -> torch.Tensor:
    return timesteps.reshape(-1).expand(batch) if timesteps.numel() == 1 else timesteps.reshape(batch)


class UNetEmbed(nn.Module):
    """First layer: timestep and text/size embedding (`emb`), and conv_in. Returns (sample, emb, context,
    residual_0): the down blocks append their residuals to the tuple, the up blocks consume them."""

    def __init__(self, unet: nn.Module) -> None:
        super().__init__()
        self.time_proj, self.time_embedding = unet.time_proj, unet.time_embedding
        self.add_time_proj, self.add_embedding = unet.add_time_proj, unet.add_embedding
        self.time_embed_act = unet.time_embed_act
        self.conv_in = unet.conv_in

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        sample, timesteps, context, pooled, time_ids = inputs
        # As UNet2DConditionModel.forward: get_time_embed, time_embedding, get_aug_embed ("text_time").
        t_emb = self.time_proj(_broadcast(timesteps, sample.shape[0])).to(sample.dtype)
        emb = self.time_embedding(t_emb)
        time_embeds = self.add_time_proj(time_ids.flatten()).reshape(pooled.shape[0], -1)
        emb = emb + self.add_embedding(torch.cat([pooled, time_embeds], dim=-1).to(emb.dtype))
        if self.time_embed_act is not None:
            emb = self.time_embed_act(emb)
        sample = self.conv_in(sample)
        return sample, emb, context, sample


class _UNetBlock(nn.Module):
    """A UNet block as a pipeline layer; `run` passes the text context only to blocks with cross-attention."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def run(self, sample: torch.Tensor, emb: torch.Tensor, context: torch.Tensor, **kwargs):
        if getattr(self.block, "has_cross_attention", False):
            kwargs["encoder_hidden_states"] = context
        return self.block(hidden_states=sample, temb=emb, **kwargs)


class UNetDown(_UNetBlock):
    """One down block: consumes (sample, emb, context, *residuals), appends its own residuals."""

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        sample, emb, context, *residuals = inputs
        sample, res = self.run(sample, emb, context)
        return (sample, emb, context, *residuals, *res)


class UNetMid(_UNetBlock):
    """The mid block; residuals pass through untouched."""

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        sample, emb, context, *residuals = inputs
        return (self.run(sample, emb, context), emb, context, *residuals)


class UNetUp(_UNetBlock):
    """One up block: consumes as many residuals (from the end) as it has resnets."""

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        sample, emb, context, *residuals = inputs
        n = len(self.block.resnets)
        res, residuals = tuple(residuals[-n:]), residuals[:-n]
        # Bucket sides are multiples of the UNet's total downsampling (pixel_multiple), so diffusers'
        # `upsample_size` is never needed.
        sample = self.run(sample, emb, context, res_hidden_states_tuple=res)
        return (sample, emb, context, *residuals)


class UNetOut(nn.Module):
    """Last layer: output norm, activation and conv_out."""

    def __init__(self, unet: nn.Module) -> None:
        super().__init__()
        self.conv_norm_out, self.conv_act, self.conv_out = unet.conv_norm_out, unet.conv_act, unet.conv_out

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        sample = inputs[0]
        if self.conv_norm_out is not None:
            sample = self.conv_act(self.conv_norm_out(sample))
        return self.conv_out(sample)


class SDXLAdapter(Adapter):
    """SDXL-shaped models in diffusers format (unet, vae, text_encoder(_2), tokenizer(_2), scheduler)."""

    name: ClassVar[str] = "sdxl"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image",), tasks=("t2i",), objective="epsilon", export_formats=("diffusers", "kohya"),
        objectives=("epsilon", "v"),
    )

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def pixel_multiple(self) -> int:
        # The UNet halves the latent once per down block but the last: sides must survive that exactly.
        return self.vae_scale * 2 ** (len(self.component_config("unet")["down_block_types"]) - 1)

    def text_component_dirs(self) -> tuple[dict[str, Path], dict[str, Path]]:
        d = self.model_dir
        return ({"text_encoder": d / "text_encoder", "text_encoder_2": d / "text_encoder_2"},
                {"tokenizer": d / "tokenizer", "tokenizer_2": d / "tokenizer_2"})

    def load_text_encoders(self, device: torch.device) -> SDXLTextEncoders:
        from transformers import AutoTokenizer, CLIPTextModel, CLIPTextModelWithProjection

        d = self.model_dir
        return SDXLTextEncoders(
            clip_l=load_component(CLIPTextModel, d / "text_encoder", self.dtype, device),
            tokenizer=AutoTokenizer.from_pretrained(d / "tokenizer"),
            clip_g=load_component(CLIPTextModelWithProjection, d / "text_encoder_2", self.dtype, device),
            tokenizer_2=AutoTokenizer.from_pretrained(d / "tokenizer_2"),
        )

    @torch.no_grad()
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        if pixels_BCFHW.shape[2] != 1:
            raise ValueError(f"family 'sdxl' trains on images only; got {pixels_BCFHW.shape[2]} frames "
                             "(set scan.datasets[].frames to [1] or use a video family)")
        latents = vae.encode(pixels_BCFHW[:, :, 0].to(vae.device, vae.dtype)).latent_dist.mode()
        return [{"latents": x.contiguous().cpu()} for x in latents]

    @torch.no_grad()
    def encode_text(self, encoders: SDXLTextEncoders, captions: list[str], max_length: int) -> list[TensorDict]:
        """As StableDiffusionXLPipeline.encode_prompt: both encoders' penultimate hidden states concatenated,
        and the second encoder's projected pooled output. CLIP's sequence length is its tokenizer's
        `model_max_length` (77); `encode.text_max_length` does not apply."""
        hidden, pooled = [], None
        for tokenizer, encoder in ((encoders.tokenizer, encoders.clip_l), (encoders.tokenizer_2, encoders.clip_g)):
            ids = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length,
                            truncation=True, return_tensors="pt").input_ids
            out = encoder(ids.to(encoder.device), output_hidden_states=True)
            hidden.append(out.hidden_states[-2])
            pooled = out[0]  # the last encoder's: text_embeds of CLIPTextModelWithProjection
        context = torch.cat(hidden, dim=-1)
        return [{"prompt_embeds": context[i].contiguous().cpu(), "pooled": pooled[i].contiguous().cpu()}
                for i in range(len(captions))]

    def latent_spec(self, width: int, height: int, frames: int) -> Spec:
        s = self.vae_scale
        return {"latents": ((self.component_config("vae")["latent_channels"], height // s, width // s),
                            dtype_name(self.dtype))}

    def text_spec(self, max_length: int) -> Spec:
        length = self.model_json("tokenizer/tokenizer_config.json")["model_max_length"]
        width = self.component_config("text_encoder")["hidden_size"] + self.component_config("text_encoder_2")["hidden_size"]
        dt = dtype_name(self.dtype)
        return {"prompt_embeds": ((length, width), dt),
                "pooled": ((self.component_config("text_encoder_2")["projection_dim"],), dt)}

    # ---- train side --------------------------------------------------------------------------------
    def normalise_latents(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.component_config("vae")
        return (latents - (config.get("shift_factor") or 0.0)) * config["scaling_factor"]

    def objective(self) -> str:
        """epsilon or v, from the scheduler's `prediction_type` (SDXL base is epsilon; v-prediction
        fine-tunes say so there, as diffusers' samplers read it)."""
        prediction = self.noise_schedule().get("prediction_type", "epsilon")
        objectives = {"epsilon": "epsilon", "v_prediction": "v"}
        if prediction not in objectives:
            raise ValueError(f"{self.model_dir / 'scheduler'}: prediction_type {prediction!r} is not trainable "
                             f"(supported: {', '.join(objectives)})")
        return objectives[prediction]

    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import UNet2DConditionModel

        return UNet2DConditionModel

    def denoiser_dir(self) -> Path:
        return self.model_dir / "unet"

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        # Every linear of the transformer blocks, as kohya's sd-scripts and diffusers' SDXL LoRA scripts do.
        return ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2")

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        return [UNetEmbed(denoiser), *(UNetDown(b) for b in denoiser.down_blocks), UNetMid(denoiser.mid_block),
                *(UNetUp(b) for b in denoiser.up_blocks), UNetOut(denoiser)]

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """(latents, discrete timesteps, prompt_embeds, pooled, add_time_ids); `guidance` does not apply.
        add_time_ids = (orig_h, orig_w, crop_top, crop_left, target_h, target_w) = (H, W, 0, 0, H, W) in pixels
        of the bucket: see the module docstring."""
        b, _, h, w = noisy_latents.shape
        s = self.vae_scale
        time_ids = torch.tensor([h * s, w * s, 0, 0, h * s, w * s], dtype=self.dtype).expand(b, -1).contiguous()
        return (noisy_latents.to(self.dtype), timesteps.float(), text["prompt_embeds"].to(self.dtype),
                text["pooled"].to(self.dtype), time_ids)

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return prediction

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        from diffusers import StableDiffusionXLPipeline

        return StableDiffusionXLPipeline

    def sample_inputs(self, text: TensorDict, negative: TensorDict, guidance: float, cfg_scale: float) -> dict:
        """`guidance` is SDXL's classifier-free guidance scale, over the negative prompt's embeddings."""
        return {"prompt_embeds": text["prompt_embeds"][None].to(self.dtype),
                "pooled_prompt_embeds": text["pooled"][None].to(self.dtype),
                "negative_prompt_embeds": negative["prompt_embeds"][None].to(self.dtype),
                "negative_pooled_prompt_embeds": negative["pooled"][None].to(self.dtype),
                "guidance_scale": guidance}

    # ---- export side -------------------------------------------------------------------------------
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        if fmt == "diffusers":
            return {f"unet.{k}": v for k, v in lora.items()}
        if fmt == "kohya":
            return kohya_lora(lora, self.component_config("unet")["layers_per_block"])
        raise self.unknown_format(fmt)

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """SDXL's layout at toy width: three UNet levels (plain, cross-attention, cross-attention) with
        layers_per_block 2, so the original SGM block numbering of a real SDXL applies unchanged."""
        import shutil

        from diffusers import AutoencoderKL, EulerDiscreteScheduler, UNet2DConditionModel
        from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

        out_dir = Path(out_dir)
        clip_tok, _ = save_tiny_tokenizers(out_dir)
        shutil.rmtree(out_dir / "tokenizer_2")  # a T5 tokenizer: SDXL's second tokenizer is CLIP-style too
        clip_tok.save_pretrained(out_dir / "tokenizer_2")
        torch.manual_seed(seed)
        text_config = dict(
            vocab_size=len(clip_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=77, projection_dim=32, hidden_act="gelu",
            bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id,
            pad_token_id=clip_tok.pad_token_id,
        )
        CLIPTextModel(CLIPTextConfig(**text_config)).save_pretrained(out_dir / "text_encoder")
        CLIPTextModelWithProjection(CLIPTextConfig(**text_config)).save_pretrained(out_dir / "text_encoder_2")
        AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 16),
            down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
            layers_per_block=1, norm_num_groups=4, sample_size=64, scaling_factor=0.13025,
        ).save_pretrained(out_dir / "vae")
        UNet2DConditionModel(
            sample_size=16, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(16, 32, 32),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=(2, 4, 4), transformer_layers_per_block=(1, 1, 2), use_linear_projection=True,
            cross_attention_dim=64, addition_embed_type="text_time", addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=6 * 8 + 32, norm_num_groups=8,
        ).save_pretrained(out_dir / "unet")
        EulerDiscreteScheduler(
            num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
            prediction_type="epsilon", timestep_spacing="leading", steps_offset=1,
        ).save_pretrained(out_dir / "scheduler")
        (out_dir / "model_index.json").write_text(MODEL_INDEX)


MODEL_INDEX = """{
  "_class_name": "StableDiffusionXLPipeline",
  "_diffusers_version": "0.42.1",
  "force_zeros_for_empty_prompt": true,
  "feature_extractor": [null, null],
  "image_encoder": [null, null],
  "scheduler": ["diffusers", "EulerDiscreteScheduler"],
  "text_encoder": ["transformers", "CLIPTextModel"],
  "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
  "tokenizer": ["transformers", "CLIPTokenizer"],
  "tokenizer_2": ["transformers", "CLIPTokenizer"],
  "unet": ["diffusers", "UNet2DConditionModel"],
  "vae": ["diffusers", "AutoencoderKL"]
}
"""

# Inside a block, diffusers and the original (SGM) UNet name linears differently only in resnets and the
# top-level embeddings; transformer blocks keep the same names.
_RESNET_LINEARS = {"time_emb_proj": "emb_layers.1"}
_TOP_LEVEL = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
              "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2"}
_BLOCK = re.compile(r"^(down_blocks|up_blocks)\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)\.?(.*)$")
_MID = re.compile(r"^mid_block\.(resnets|attentions)\.(\d+)\.?(.*)$")


def sgm_module_name(name: str, layers_per_block: int) -> str:
    """The original SGM/LDM UNet name (`input_blocks.4.1.transformer_blocks.0.attn1.to_q`) of a diffusers
    UNet2DConditionModel module name (`down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`).

    Down level i holds `layers_per_block` (resnet, attention) pairs then its downsampler, each an input block
    after conv_in (input block 0); up level i holds `layers_per_block + 1` pairs, the last followed by the
    upsampler. Raises ValueError for a module with no SGM counterpart."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    stride = layers_per_block + 1
    m = _BLOCK.match(name)
    if m:
        kind, level, part, j, rest = m.group(1), int(m.group(2)), m.group(3), int(m.group(4)), m.group(5)
        if kind == "down_blocks":
            index = 1 + level * stride + (layers_per_block if part == "downsamplers" else j)
            prefix = f"input_blocks.{index}"
        else:
            index = level * stride + (layers_per_block if part == "upsamplers" else j)
            prefix = f"output_blocks.{index}"
        if part == "resnets":
            return f"{prefix}.0.{_resnet_inner(rest, name)}"
        if part == "attentions":
            return f"{prefix}.1.{rest}"
        raise ValueError(f"{name}: up/down samplers hold no linear layer a LoRA could target")
    m = _MID.match(name)
    if m:
        part, j, rest = m.group(1), int(m.group(2)), m.group(3)
        if part == "attentions":
            return f"middle_block.1.{rest}"
        return f"middle_block.{2 * j}.{_resnet_inner(rest, name)}"
    raise ValueError(f"{name}: no SGM (kohya/ComfyUI) name for this UNet module; drop it from train.lora_targets "
                     "or export the 'diffusers' format")


def _resnet_inner(rest: str, name: str) -> str:
    if rest not in _RESNET_LINEARS:
        raise ValueError(f"{name}: no SGM name for resnet module {rest!r}")
    return _RESNET_LINEARS[rest]


def kohya_lora(lora: TensorDict, layers_per_block: int) -> TensorDict:
    """kohya-ss / ComfyUI SDXL keys: `lora_unet_<SGM name with _>.lora_down.weight` / `.lora_up.weight` and
    `.alpha` = rank (scale already folded into lora_up, so alpha/rank = 1 in every loader)."""
    out: TensorDict = {}
    for key, value in lora.items():
        module, _, suffix = key.rpartition(".lora_")
        base = "lora_unet_" + sgm_module_name(module, layers_per_block).replace(".", "_")
        if suffix == "A.weight":
            out[f"{base}.lora_down.weight"] = value
            out[f"{base}.alpha"] = torch.tensor(float(value.shape[0]))
        elif suffix == "B.weight":
            out[f"{base}.lora_up.weight"] = value
        else:
            raise ValueError(f"{key}: not a PEFT LoRA weight (expected .lora_A.weight or .lora_B.weight)")
    return out
