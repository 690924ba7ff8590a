"""AuraFlow (MMDiT then single-stream DiT with register tokens, flow matching; UMT5 text encoder), through
diffusers components. Pony Diffusion V7 is an AuraFlow model.

Text goes through AuraFlowPipeline's own `encode_prompt` (UMT5 states zeroed past the caption's tokens; the
transformer takes no mask).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Adapter, Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import PipelineTextEncoder, dtype_name, load_component, save_tiny_tokenizers
from diffusion_pipe.models.wan import TopLevelParameters


class AuraFlowEmbed(nn.Module):
    """First layer: patch embedding with positions, time embedding, text projection with the register tokens in
    front. Returns (hidden, encoder, temb)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.pos_embed = transformer.pos_embed
        self.time_step_embed = transformer.time_step_embed
        self.time_step_proj = transformer.time_step_proj
        self.context_embedder = transformer.context_embedder
        self.top = TopLevelParameters(transformer)  # the register tokens

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        latents, timesteps, text = inputs
        hidden = self.pos_embed(latents)
        temb = self.time_step_proj(self.time_step_embed(timesteps).to(hidden.dtype))
        encoder = self.context_embedder(text)
        registers = self.top.register_tokens.to(encoder.dtype).repeat(encoder.shape[0], 1, 1)
        return hidden, torch.cat((registers, encoder), dim=1), temb


class AuraFlowJointBlock(nn.Module):
    """One MMDiT block: (hidden, encoder, temb) -> the same."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, encoder, temb = inputs
        encoder, hidden = self.block(hidden_states=hidden, encoder_hidden_states=encoder, temb=temb)
        return hidden, encoder, temb


class AuraFlowSingleBlock(nn.Module):
    """One single-stream block over [text, image], split again on the way out; the last returns (hidden, temb):
    nothing reads the text after it."""

    def __init__(self, block: nn.Module, last: bool) -> None:
        super().__init__()
        self.block = block
        self.last = last

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, encoder, temb = inputs
        joint = self.block(hidden_states=torch.cat((encoder, hidden), dim=1), temb=temb)
        # contiguous: a stage boundary sends these tensors as they are
        encoder, hidden = (t.contiguous() for t in joint.split((encoder.shape[1], hidden.shape[1]), dim=1))
        return (hidden, temb) if self.last else (hidden, encoder, temb)


class AuraFlowOut(nn.Module):
    """Last layer: final adaptive norm and projection to patch tokens (unpatchified by the adapter)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.norm_out = transformer.norm_out
        self.proj_out = transformer.proj_out

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        hidden, temb = inputs
        return self.proj_out(self.norm_out(hidden, temb))


class AuraFlowAdapter(Adapter):
    """AuraFlow 0.x and its fine-tunes (Pony V7) in diffusers format (transformer, vae, text_encoder, tokenizer,
    scheduler)."""

    name: ClassVar[str] = "auraflow"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image",), tasks=("t2i",), objective="flow", export_formats=("diffusers", "comfyui"),
    )

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def pixel_multiple(self) -> int:
        return self.vae_scale * self.component_config("transformer")["patch_size"]

    def load_text_encoders(self, device: torch.device) -> PipelineTextEncoder:
        from diffusers import AuraFlowPipeline
        from transformers import AutoTokenizer, UMT5EncoderModel

        encoder = load_component(UMT5EncoderModel, self.model_dir / "text_encoder", self.dtype, device)
        return PipelineTextEncoder(AuraFlowPipeline(
            tokenizer=AutoTokenizer.from_pretrained(self.model_dir / "tokenizer"), text_encoder=encoder, vae=None,
            transformer=None, scheduler=None))

    @torch.no_grad()
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        if pixels_BCFHW.shape[2] != 1:
            raise ValueError(f"family 'auraflow' trains on images only; got {pixels_BCFHW.shape[2]} frames")
        # The distribution's mode, unscaled: normalisation happens at load time, so a scaling change is free.
        latents = vae.encode(pixels_BCFHW[:, :, 0].to(vae.device, vae.dtype)).latent_dist.mode()
        return [{"latents": x.contiguous().cpu()} for x in latents]

    @torch.no_grad()
    def encode_text(self, encoders: PipelineTextEncoder, captions: list[str], max_length: int) -> list[TensorDict]:
        pipe = encoders.pipeline
        states, _mask, _, _ = pipe.encode_prompt(list(captions), do_classifier_free_guidance=False,
                                                 device=pipe.text_encoder.device, max_sequence_length=max_length)
        return [{"prompt_embeds": states[i].contiguous().cpu()} for i in range(len(captions))]

    def latent_spec(self, width: int, height: int, frames: int) -> Spec:
        s = self.vae_scale
        return {"latents": ((self.component_config("vae")["latent_channels"], height // s, width // s), dtype_name(self.dtype))}

    def text_spec(self, max_length: int) -> Spec:
        return {"prompt_embeds": ((max_length, self.component_config("transformer")["joint_attention_dim"]),
                                  dtype_name(self.dtype))}

    # ---- train side --------------------------------------------------------------------------------
    def normalise_latents(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.component_config("vae")
        return (latents - (config.get("shift_factor") or 0.0)) * config["scaling_factor"]

    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import AuraFlowTransformer2DModel

        return AuraFlowTransformer2DModel

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        return ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "ff.linear_1", "ff.linear_2", "ff.out_projection", "ff_context.linear_1", "ff_context.linear_2",
                "ff_context.out_projection")

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        joint, single = denoiser.joint_transformer_blocks, denoiser.single_transformer_blocks
        if not single:
            raise ValueError(f"{self.denoiser_dir()}: an AuraFlow transformer without single-stream layers is not "
                             "supported by family 'auraflow'")
        return [AuraFlowEmbed(denoiser), *(AuraFlowJointBlock(b) for b in joint),
                *(AuraFlowSingleBlock(b, last=i == len(single) - 1) for i, b in enumerate(single)),
                AuraFlowOut(denoiser)]

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """As AuraFlowPipeline calls the transformer: t in [0, 1], 1 the noise (the objective's own convention)."""
        return noisy_latents.to(self.dtype), timesteps.to(self.dtype), text["prompt_embeds"].to(self.dtype)

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Patch tokens back to (B, C, H, W), as AuraFlowTransformer2DModel.forward unpatchifies them."""
        b, c, h, w = like.shape
        p = self.component_config("transformer")["patch_size"]
        x = prediction.reshape(b, h // p, w // p, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(b, c, h, w)

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        from diffusers import AuraFlowPipeline

        return AuraFlowPipeline

    def sample_inputs(self, text: TensorDict, negative: TensorDict, guidance: float, cfg_scale: float) -> dict:
        """`guidance` is AuraFlow's classifier-free guidance scale, over the negative prompt. The pipeline wants
        masks beside embeddings; its transformer never reads them, so all-ones masks of the right shape do."""
        def ones(entry: TensorDict) -> torch.Tensor:
            return torch.ones(entry["prompt_embeds"].shape[:1], dtype=torch.long)[None]

        return {"prompt_embeds": text["prompt_embeds"][None].to(self.dtype), "prompt_attention_mask": ones(text),
                "negative_prompt_embeds": negative["prompt_embeds"][None].to(self.dtype),
                "negative_prompt_attention_mask": ones(negative), "guidance_scale": guidance}

    # ---- export side -------------------------------------------------------------------------------
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        return self.transformer_export(lora, fmt, comfyui_lora)

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """AuraFlow's layout at toy width: one MMDiT and two single layers, a 2-layer UMT5, a 3-level VAE."""
        import tempfile

        from diffusers import AuraFlowTransformer2DModel, AutoencoderKL, FlowMatchEulerDiscreteScheduler
        from transformers import UMT5Config, UMT5EncoderModel

        out_dir = Path(out_dir)
        with tempfile.TemporaryDirectory() as tmp:
            _, t5_tok = save_tiny_tokenizers(Path(tmp))
        t5_tok.save_pretrained(out_dir / "tokenizer")
        torch.manual_seed(seed)
        UMT5EncoderModel(UMT5Config(
            vocab_size=len(t5_tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, pad_token_id=t5_tok.pad_token_id, eos_token_id=t5_tok.eos_token_id,
            decoder_start_token_id=t5_tok.pad_token_id,
        )).save_pretrained(out_dir / "text_encoder")
        AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 16),
            down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
            layers_per_block=1, norm_num_groups=4, sample_size=64, scaling_factor=0.13,
        ).save_pretrained(out_dir / "vae")
        AuraFlowTransformer2DModel(
            sample_size=16, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=2,
            attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16,
            out_channels=4, pos_embed_max_size=256,
        ).save_pretrained(out_dir / "transformer")
        FlowMatchEulerDiscreteScheduler(shift=1.73).save_pretrained(out_dir / "scheduler")
        (out_dir / "model_index.json").write_text(MODEL_INDEX)


MODEL_INDEX = """{
  "_class_name": "AuraFlowPipeline",
  "_diffusers_version": "0.42.1",
  "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
  "text_encoder": ["transformers", "UMT5EncoderModel"],
  "tokenizer": ["transformers", "T5TokenizerFast"],
  "transformer": ["diffusers", "AuraFlowTransformer2DModel"],
  "vae": ["diffusers", "AutoencoderKL"]
}
"""


# diffusers module inside a block -> original AuraFlow name (ComfyUI's own: comfy/utils.py auraflow_to_diffusers,
# the map comfy/lora.py model_lora_keys_unet uses for AuraFlow; diffusers' single-file converter agrees)
_JOINT_NAMES: dict[str, str] = {
    "attn.to_q": "attn.w2q", "attn.to_k": "attn.w2k", "attn.to_v": "attn.w2v", "attn.to_out.0": "attn.w2o",
    "attn.add_q_proj": "attn.w1q", "attn.add_k_proj": "attn.w1k", "attn.add_v_proj": "attn.w1v",
    "attn.to_add_out": "attn.w1o", "ff.linear_1": "mlpX.c_fc1", "ff.linear_2": "mlpX.c_fc2",
    "ff.out_projection": "mlpX.c_proj", "ff_context.linear_1": "mlpC.c_fc1", "ff_context.linear_2": "mlpC.c_fc2",
    "ff_context.out_projection": "mlpC.c_proj", "norm1.linear": "modX.1", "norm1_context.linear": "modC.1",
}
_SINGLE_NAMES: dict[str, str] = {
    "attn.to_q": "attn.w1q", "attn.to_k": "attn.w1k", "attn.to_v": "attn.w1v", "attn.to_out.0": "attn.w1o",
    "norm1.linear": "modCX.1", "ff.linear_1": "mlp.c_fc1", "ff.linear_2": "mlp.c_fc2",
    "ff.out_projection": "mlp.c_proj",
}
_TOP_LEVEL_NAMES: dict[str, str] = {
    "time_step_proj.linear_1": "t_embedder.mlp.0", "time_step_proj.linear_2": "t_embedder.mlp.2",
    "context_embedder": "cond_seq_linear", "pos_embed.proj": "init_x_linear", "proj_out": "final_linear",
    "norm_out.linear": "modF.1",
}


def auraflow_original_module(module: str) -> str:
    """A diffusers AuraFlow module name -> its original name, which ComfyUI loads.
    'joint_transformer_blocks.0.attn.to_k' -> 'double_layers.0.attn.w2k'."""
    match = re.fullmatch(r"(joint_transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)", module)
    if match:
        kind, index, inner = match.groups()
        table, prefix = (_JOINT_NAMES, "double_layers") if kind == "joint_transformer_blocks" else \
            (_SINGLE_NAMES, "single_layers")
        if inner in table:
            return f"{prefix}.{index}.{table[inner]}"
    elif module in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[module]
    raise ValueError(f"export.formats: comfyui has no ComfyUI AuraFlow name for LoRA module {module!r}; drop it "
                     "from train.lora_targets or export the 'diffusers' format only")


def comfyui_lora(lora: TensorDict) -> TensorDict:
    """The LoRA under the original AuraFlow names, `diffusion_model.`-prefixed (the generic keys of ComfyUI's
    comfy/lora.py `model_lora_keys_unet`), as `lora_down`/`lora_up` with `.alpha` = rank (lora_B is pre-scaled).
    AuraFlow keeps q, k and v apart, so nothing is fused."""
    from diffusion_pipe.lora_keys import down_up_alpha, lora_modules

    out: TensorDict = {}
    for module, (a, b) in lora_modules(lora).items():
        original = auraflow_original_module(module)
        if original == "modF.1":  # the original orders this modulation's output (shift, scale), diffusers (scale, shift)
            first, second = b.chunk(2, dim=0)
            b = torch.cat([second, first], dim=0)
        out.update(down_up_alpha(f"diffusion_model.{original}", a, b))
    return out
