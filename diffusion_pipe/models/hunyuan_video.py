"""HunyuanVideo (the original, 13B) text-to-video: a dual- then single-stream DiT, guidance-distilled, flow
matching; a Llama text model prompted with a template and CLIP's pooled embedding; a causal 3D VAE (x8 spatial,
x4 temporal), through diffusers components. Images are one-frame videos.

Prompt encoding is HunyuanVideoPipeline's own (`encode_prompt` with its default template and crop); this file
splits the transformer's forward into pipeline layers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Adapter, Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import TOKENIZER_CORPUS, dtype_name, load_component, save_tiny_tokenizers
from diffusion_pipe.models.hunyuan_video15 import unpatchify


def _prompt_template() -> dict:
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    return DEFAULT_PROMPT_TEMPLATE


def _text_pipeline(encoders: dict) -> object:
    """A HunyuanVideoPipeline holding only the text encoders and tokenizers: its own prompt encoding runs on them."""
    from diffusers import HunyuanVideoPipeline

    return HunyuanVideoPipeline(transformer=None, vae=None, scheduler=None, **encoders)


def sequence_mask(text_mask: torch.Tensor, num_latent_tokens: int) -> torch.Tensor:
    """The joint sequence's attention mask (B, 1, 1, N) as HunyuanVideoTransformer3DModel.forward builds it: every
    latent token, then as many text tokens as the caption has (the text's own mask is padding at the end). The
    mask may require grad (a float tensor sent between pipeline stages does): it is counted through a comparison,
    which autograd does not track, since an integer sum of it would fail."""
    b, n_text = text_mask.shape
    indices = torch.arange(num_latent_tokens + n_text, device=text_mask.device).unsqueeze(0)
    effective = num_latent_tokens + text_mask.gt(0).sum(dim=1, dtype=torch.int)
    return (indices < effective.unsqueeze(1)).view(b, 1, 1, -1)


class HunyuanVideoEmbed(nn.Module):
    """First layer: rotary tables, timestep + guidance + pooled-text conditioning, patch embedding and the refined
    text tokens. Returns (tokens, text, text_mask, temb, cos, sin)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.rope = transformer.rope
        self.time_text_embed = transformer.time_text_embed
        self.x_embedder = transformer.x_embedder
        self.context_embedder = transformer.context_embedder

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        latents, timesteps, text, text_mask, pooled, guidance = inputs
        t = timesteps * 1000
        cos, sin = self.rope(latents)
        temb, _ = self.time_text_embed(t, pooled, guidance * 1000)
        hidden = self.x_embedder(latents)
        text = self.context_embedder(text, t, text_mask)
        return hidden, text, text_mask, temb, cos, sin


class HunyuanVideoBlock(nn.Module):
    """One dual- or single-stream block; both take and return (tokens, text, text_mask, temb, cos, sin)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, text, text_mask, temb, cos, sin = inputs
        mask = sequence_mask(text_mask, hidden.shape[1])
        hidden, text = self.block(hidden, text, temb, mask, (cos, sin))
        return hidden, text, text_mask, temb, cos, sin


class HunyuanVideoOut(nn.Module):
    """Last layer: adaptive output norm and projection to patch tokens (unpatchified by the adapter)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.norm_out = transformer.norm_out
        self.proj_out = transformer.proj_out

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        hidden, _text, _mask, temb, _cos, _sin = inputs
        return self.proj_out(self.norm_out(hidden, temb))


class HunyuanVideoAdapter(Adapter):
    """HunyuanVideo text-to-video in diffusers format (transformer, vae, text_encoder + tokenizer: Llama,
    text_encoder_2 + tokenizer_2: CLIP, scheduler)."""

    name: ClassVar[str] = "hunyuan_video"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image", "video"), tasks=("t2v",), objective="flow", export_formats=("diffusers", "comfyui"),
    )

    def _patch(self) -> tuple[int, int, int]:
        c = self.component_config("transformer")
        return (c["patch_size_t"], c["patch_size"], c["patch_size"])

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def pixel_multiple(self) -> int:
        return self.component_config("vae")["spatial_compression_ratio"] * self._patch()[1]

    def vae_class(self) -> type[nn.Module]:
        from diffusers import AutoencoderKLHunyuanVideo

        return AutoencoderKLHunyuanVideo

    def text_component_dirs(self) -> tuple[dict[str, Path], dict[str, Path]]:
        d = self.model_dir
        return ({"text_encoder": d / "text_encoder", "text_encoder_2": d / "text_encoder_2"},
                {"tokenizer": d / "tokenizer", "tokenizer_2": d / "tokenizer_2"})

    def text_template(self) -> str:
        """The pipeline's prompt template and crop: both change the embedding."""
        return json.dumps(_prompt_template(), sort_keys=True)

    def load_text_encoders(self, device: torch.device) -> object:
        from transformers import AutoTokenizer, CLIPTextModel, LlamaModel

        d = self.model_dir
        return _text_pipeline({
            "text_encoder": load_component(LlamaModel, d / "text_encoder", self.dtype, device),
            "tokenizer": AutoTokenizer.from_pretrained(d / "tokenizer"),
            "text_encoder_2": load_component(CLIPTextModel, d / "text_encoder_2", self.dtype, device),
            "tokenizer_2": AutoTokenizer.from_pretrained(d / "tokenizer_2")})

    @torch.no_grad()
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        frames = pixels_BCFHW.shape[2]
        temporal = self.component_config("vae")["temporal_compression_ratio"]
        if (frames - 1) % temporal:
            raise ValueError(f"family 'hunyuan_video': {frames} frames; its VAE needs {temporal}k+1 frames "
                             f"(1, {temporal + 1}, {2 * temporal + 1}, ..): set scan.datasets[].frames to such counts")
        latents = vae.encode(pixels_BCFHW.to(vae.device, vae.dtype)).latent_dist.mode()
        return [{"latents": x.contiguous().cpu()} for x in latents]

    @torch.no_grad()
    def encode_text(self, encoders: object, captions: list[str], max_length: int) -> list[TensorDict]:
        """HunyuanVideoPipeline.encode_prompt: the Llama states of the templated caption (template cropped off)
        with their mask, and CLIP's pooled embedding."""
        states, pooled, mask = encoders.encode_prompt(captions, prompt_template=_prompt_template(),
                                                      device=encoders.text_encoder.device, dtype=self.dtype,
                                                      max_sequence_length=max_length)
        return [{"llama": states[i].cpu(), "llama_mask": mask[i].to(self.dtype).cpu(), "clip_pooled": pooled[i].cpu()}
                for i in range(len(captions))]

    def latent_spec(self, width: int, height: int, frames: int) -> Spec:
        c = self.component_config("vae")
        s, st = c["spatial_compression_ratio"], c["temporal_compression_ratio"]
        return {"latents": ((c["latent_channels"], (frames - 1) // st + 1, height // s, width // s),
                            dtype_name(self.dtype))}

    def text_spec(self, max_length: int) -> Spec:
        dt = dtype_name(self.dtype)
        return {"llama": ((max_length, self.component_config("text_encoder")["hidden_size"]), dt),
                "llama_mask": ((max_length,), dt),
                "clip_pooled": ((self.component_config("text_encoder_2")["hidden_size"],), dt)}

    # ---- train side --------------------------------------------------------------------------------
    def normalise_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """x scaling_factor, the inverse of what HunyuanVideoPipeline applies before decoding."""
        return latents * self.component_config("vae")["scaling_factor"]

    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import HunyuanVideoTransformer3DModel

        return HunyuanVideoTransformer3DModel

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        return ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                "ff_context.net.2", "proj_mlp", "proj_out")

    def lora_exclude(self) -> str:
        """Frozen despite matching target names: the text refiner's blocks and the final projection."""
        return r"^context_embedder\.|^proj_out$"

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        blocks = [*denoiser.transformer_blocks, *denoiser.single_transformer_blocks]
        return [HunyuanVideoEmbed(denoiser), *(HunyuanVideoBlock(b) for b in blocks), HunyuanVideoOut(denoiser)]

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """(latents, t in [0, 1], Llama states and mask, CLIP pooled, the distilled guidance value)."""
        b = noisy_latents.shape[0]
        return (noisy_latents.to(self.dtype), timesteps.to(self.dtype), text["llama"].to(self.dtype),
                text["llama_mask"].to(self.dtype), text["clip_pooled"].to(self.dtype),
                torch.full((b,), guidance, dtype=self.dtype))

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return unpatchify(prediction, like, self._patch())

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        from diffusers import HunyuanVideoPipeline

        return HunyuanVideoPipeline

    def sample_texts(self, prompt) -> tuple[str, ...]:
        """Guidance-distilled: HunyuanVideoPipeline renders without a negative prompt unless true CFG is asked."""
        return (prompt.prompt, prompt.negative_prompt) if prompt.cfg_scale > 1 else (prompt.prompt,)

    def sample_inputs(self, text: TensorDict, negative: TensorDict | None, guidance: float,
                      cfg_scale: float) -> dict:
        """`guidance` is the distilled guidance; `cfg_scale` > 1 adds true CFG over the negative prompt."""
        out = {"prompt_embeds": text["llama"][None].to(self.dtype),
               "prompt_attention_mask": text["llama_mask"][None].to(self.dtype),
               "pooled_prompt_embeds": text["clip_pooled"][None].to(self.dtype), "guidance_scale": guidance}
        if negative is not None and cfg_scale > 1:
            out |= {"negative_prompt_embeds": negative["llama"][None].to(self.dtype),
                    "negative_prompt_attention_mask": negative["llama_mask"][None].to(self.dtype),
                    "negative_pooled_prompt_embeds": negative["clip_pooled"][None].to(self.dtype),
                    "true_cfg_scale": cfg_scale}
        return out

    # ---- export side -------------------------------------------------------------------------------
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        if fmt == "diffusers":
            return {f"transformer.{k}": v for k, v in lora.items()}
        if fmt == "comfyui":
            from diffusion_pipe.models.flux import comfyui_lora

            # ComfyUI's HunyuanVideo model (comfy/ldm/hunyuan_video/model.py) is built from Flux's
            # DoubleStreamBlock and SingleStreamBlock, so its module names are Flux's original ones (fused qkv,
            # linear1 = q, k, v and mlp). Written here in HunyuanVideo's own original spelling of them
            # (img_attn_qkv, img_mlp.fc1), which comfy/lora.py model_lora_keys_unet maps onto those modules for
            # HunyuanVideo ("diffusion-pipe lora format") and diffusers' HunyuanVideo LoRA converter reads too.
            c = self.component_config("transformer")
            inner = c["num_attention_heads"] * c["attention_head_dim"]
            flux_named = comfyui_lora(lora, inner_dim=inner, mlp_dim=int(inner * c["mlp_ratio"]))
            return {hunyuan_original_name(k): v for k, v in flux_named.items()}
        raise self.unknown_format(fmt)

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """HunyuanVideo's layout at toy width: one dual- and one single-stream block, a 4-level VAE (x8 spatial,
        x4 temporal), a 3-layer Llama whose tokenizer knows the template's words and special tokens, a CLIP."""
        from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoTransformer3DModel
        from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

        out_dir = Path(out_dir)
        tokenizer = save_tiny_llama3_tokenizer(out_dir / "tokenizer", _prompt_template()["template"])
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            clip_tok, _ = save_tiny_tokenizers(Path(tmp))
        clip_tok.save_pretrained(out_dir / "tokenizer_2")
        torch.manual_seed(seed)
        LlamaModel(LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )).save_pretrained(out_dir / "text_encoder")
        CLIPTextModel(CLIPTextConfig(
            vocab_size=len(clip_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=77, projection_dim=32,
            bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id,
            pad_token_id=clip_tok.pad_token_id,
        )).save_pretrained(out_dir / "text_encoder_2")
        AutoencoderKLHunyuanVideo(latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                                  norm_num_groups=4).save_pretrained(out_dir / "vae")
        HunyuanVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, text_embed_dim=32, pooled_projection_dim=32,
            rope_axes_dim=(4, 6, 6),
        ).save_pretrained(out_dir / "transformer")
        FlowMatchEulerDiscreteScheduler(shift=7.0).save_pretrained(out_dir / "scheduler")
        (out_dir / "model_index.json").write_text(MODEL_INDEX)


# ComfyUI's replacements from its (Flux-built) HunyuanVideo module names to HunyuanVideo's original ones, in
# comfy/lora.py model_lora_keys_unet; applied in the same order.
# The LoRA halves are named lora_A/lora_B, as that format has them (ComfyUI takes either spelling).
_ORIGINAL_SPELLING = (("_mod.lin.", "_mod.linear."), ("_attn.qkv.", "_attn_qkv."), ("_attn.proj.", "_attn_proj."),
                      ("mlp.0.", "mlp.fc1."), ("mlp.2.", "mlp.fc2."), (".modulation.lin.", ".modulation.linear."),
                      (".lora_down.weight", ".lora_A.weight"), (".lora_up.weight", ".lora_B.weight"))


def hunyuan_original_name(key: str) -> str:
    """A `diffusion_model.` LoRA key under ComfyUI's module name -> under HunyuanVideo's original one
    ('double_blocks.0.img_attn.qkv.lora_down.weight' -> 'double_blocks.0.img_attn_qkv.lora_A.weight')."""
    for old, new in _ORIGINAL_SPELLING:
        key = key.replace(old, new)
    return key


LLAMA3_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                         "<|eot_id|>")


def save_tiny_llama3_tokenizer(out_dir: Path, template: str) -> object:
    """A byte-level BPE trained on a few sentences and on `template`'s words, with Llama 3's special tokens and
    its begin-of-text prefix, as a fast tokenizer saved to `out_dir`. Returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    text = template.replace("{}", " ")
    for special in LLAMA3_SPECIAL_TOKENS:
        text = text.replace(special, "\n")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([*TOKENIZER_CORPUS, text], trainers.BpeTrainer(
        vocab_size=600, special_tokens=list(LLAMA3_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = LLAMA3_SPECIAL_TOKENS[0]
    bpe.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bpe.token_to_id(bos))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=bos, eos_token="<|eot_id|>",
                                        pad_token="<|end_of_text|>", model_max_length=1024)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


MODEL_INDEX = """{
  "_class_name": "HunyuanVideoPipeline",
  "_diffusers_version": "0.42.1",
  "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
  "text_encoder": ["transformers", "LlamaModel"],
  "text_encoder_2": ["transformers", "CLIPTextModel"],
  "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
  "tokenizer_2": ["transformers", "CLIPTokenizer"],
  "transformer": ["diffusers", "HunyuanVideoTransformer3DModel"],
  "vae": ["diffusers", "AutoencoderKLHunyuanVideo"]
}
"""
