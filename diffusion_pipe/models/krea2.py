"""Krea 2 (single-stream MMDiT with a text-fusion stage, flow matching; Qwen3-VL text encoder under Qwen-Image's
system prompt, the Qwen-Image VAE), through diffusers components.

Text goes through Krea2Pipeline's own `encode_prompt`: the caption in the chat template padded to a fixed length
in the middle of it, hidden states of twelve Qwen3-VL layers stacked per token, and a mask. The transformer fuses
those layers (`text_fusion`, in the first pipeline layer), joins text and packed image tokens in one sequence and
predicts the velocity of the image tokens. The latents are Qwen-Image's (same VAE), so the encode side is
Qwen-Image's.
"""

from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from diffusion_pipe.models.base import Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import PipelineTextEncoder, bare_pipeline, dtype_name, load_component, \
    save_tiny_qwen_tokenizer
from diffusion_pipe.models.qwenimage import QwenImageAdapter


class Krea2Embed(nn.Module):
    """First layer: the timestep embedding and its shared modulation, the text fusion and projection, the image
    token embedding, the joint [text, image] sequence and its rotary tables.
    Returns (hidden, temb, temb_mod, text_mask, cos, sin)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.time_embed = transformer.time_embed
        self.time_mod_proj = transformer.time_mod_proj
        self.text_fusion = transformer.text_fusion
        self.txt_in = transformer.txt_in
        self.img_in = transformer.img_in
        self.rotary_emb = transformer.rotary_emb

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, timesteps, text, text_mask, position_ids = inputs
        temb = self.time_embed(timesteps, dtype=hidden.dtype)
        temb_mod = self.time_mod_proj(F.gelu(temb, approximate="tanh"))
        encoder = self.txt_in(self.text_fusion(text, attention_mask=text_mask.bool()[:, None, None, :]))
        hidden = torch.cat((encoder, self.img_in(hidden)), dim=1)
        # the ids are the same for every item of a micro-batch (one bucket): take the first row
        cos, sin = self.rotary_emb(position_ids[0])
        return hidden, temb, temb_mod, text_mask, cos, sin


def _joint_mask(text_mask: torch.Tensor, length: int) -> torch.Tensor:
    """The key-padding mask of the joint sequence, as Krea2Transformer2DModel builds it: text as masked, image
    tokens all valid."""
    image = text_mask.new_ones(text_mask.shape[0], length - text_mask.shape[1])
    return torch.cat((text_mask, image), dim=1).bool()[:, None, None, :]


class Krea2Block(nn.Module):
    """One transformer block over the joint sequence; takes and returns
    (hidden, temb, temb_mod, text_mask, cos, sin)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, temb, temb_mod, text_mask, cos, sin = inputs
        hidden = self.block(hidden, temb_mod, (cos, sin), _joint_mask(text_mask, hidden.shape[1]))
        return hidden, temb, temb_mod, text_mask, cos, sin


class Krea2Out(nn.Module):
    """Last layer: the image tokens of the joint sequence through the final adaptive norm and projection."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.final_layer = transformer.final_layer

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        hidden, temb, _temb_mod, text_mask, _cos, _sin = inputs
        return self.final_layer(hidden[:, text_mask.shape[1]:], temb)


class Krea2Adapter(QwenImageAdapter):
    """Krea 2 (text-to-image) in diffusers format (transformer, vae, text_encoder, tokenizer, scheduler)."""

    name: ClassVar[str] = "krea2"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image",), tasks=("t2i",), objective="flow", export_formats=("diffusers", "comfyui"),
    )

    @cached_property
    def _index(self) -> dict:
        """Krea2Pipeline's own settings in model_index.json (tapped layers, patch size, distilled or not), read
        once: training asks for the patch size every micro-batch."""
        path = self.model_dir / "model_index.json"
        index = json.loads(path.read_text()) if path.is_file() else {}
        return {k: index[k] for k in ("text_encoder_select_layers", "is_distilled", "patch_size")
                if index.get(k) is not None}

    def pipeline_config(self) -> dict:
        return dict(self._index)

    def _pipeline(self, **components: object) -> object:
        from diffusers import Krea2Pipeline

        return bare_pipeline(Krea2Pipeline, **components, **self.pipeline_config())

    @cached_property
    def _bare(self) -> object:
        """Krea2Pipeline without components, for its template, packing and position ids: built once, not per
        micro-batch."""
        return self._pipeline()

    @property
    def patch_size(self) -> int:
        return self._index.get("patch_size", 2)

    # ---- encode side (latents: Qwen-Image's) -------------------------------------------------------
    @property
    def pixel_multiple(self) -> int:
        return self.vae_scale * self.patch_size

    def text_template(self) -> str:
        """Krea2Pipeline's template (prefix, the suffix after the padding, the tokens it drops) and the layers it
        taps, read from diffusers and the model's index."""
        pipe = self._bare
        return json.dumps({"prefix": pipe.prompt_template_encode_prefix, "suffix": pipe.prompt_template_encode_suffix,
                           "drop_tokens": pipe.prompt_template_encode_start_idx,
                           "suffix_tokens": pipe.prompt_template_encode_num_suffix_tokens,
                           "layers": list(pipe.text_encoder_select_layers)})

    def load_text_encoders(self, device: torch.device) -> PipelineTextEncoder:
        from transformers import AutoTokenizer, Qwen3VLModel

        encoder = load_component(Qwen3VLModel, self.model_dir / "text_encoder", self.dtype, device)
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir / "tokenizer")
        return PipelineTextEncoder(self._pipeline(text_encoder=encoder, tokenizer=tokenizer))

    @torch.no_grad()
    def encode_text(self, encoders: PipelineTextEncoder, captions: list[str], max_length: int) -> list[TensorDict]:
        """Krea2Pipeline.encode_prompt: (max_length, tapped layers, width) states and the mask of real tokens."""
        pipe = encoders.pipeline
        states, mask = pipe.encode_prompt(captions, device=pipe.text_encoder.device, max_sequence_length=max_length)
        return [{"prompt_embeds": states[i].contiguous().cpu(), "prompt_mask": mask[i].long().contiguous().cpu()}
                for i in range(len(captions))]

    def text_spec(self, max_length: int) -> Spec:
        config = self.component_config("transformer")
        return {"prompt_embeds": ((max_length, config["num_text_layers"], config["text_hidden_dim"]),
                                  dtype_name(self.dtype)),
                "prompt_mask": ((max_length,), "int64")}

    # ---- train side --------------------------------------------------------------------------------
    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import Krea2Transformer2DModel

        return Krea2Transformer2DModel

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        return ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_gate", "attn.to_out.0", "ff.gate", "ff.up",
                "ff.down")

    def lora_exclude(self) -> str:
        """The text-fusion blocks have the same module names as the main blocks; the default trains the main
        blocks, as Krea 2 LoRAs do."""
        return r"^text_fusion\."

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        return [Krea2Embed(denoiser), *(Krea2Block(b) for b in denoiser.transformer_blocks), Krea2Out(denoiser)]

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """As Krea2Pipeline calls the transformer: packed latent tokens, t in [0, 1], the tapped text states and
        their mask, the joint sequence's position ids (one row per item); Krea 2 has no guidance embedding."""
        b, c, h, w = noisy_latents.shape
        p = self.patch_size
        pipe = self._bare
        prompt_embeds = text["prompt_embeds"].to(self.dtype)
        ids = pipe.prepare_position_ids(prompt_embeds.shape[1], h // p, w // p, noisy_latents.device)
        return (pipe._pack_latents(noisy_latents, b, c, h, w).to(self.dtype), timesteps.to(self.dtype),
                prompt_embeds, text["prompt_mask"].long(), ids.expand(b, -1, -1).contiguous())

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Tokens (B, H/p * W/p, C*p*p) back to (B, C, H, W): the inverse of the pipeline's `_pack_latents`."""
        b, c, h, w = like.shape
        p = self.patch_size
        x = prediction.reshape(b, h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, c, h, w)

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        from diffusers import Krea2Pipeline

        return Krea2Pipeline

    def sample_inputs(self, text: TensorDict, negative: TensorDict, guidance: float, cfg_scale: float) -> dict:
        """`guidance` is Krea2Pipeline's classifier-free guidance scale, over the negative prompt."""
        return {"prompt_embeds": text["prompt_embeds"][None].to(self.dtype),
                "prompt_embeds_mask": text["prompt_mask"][None].bool(),
                "negative_prompt_embeds": negative["prompt_embeds"][None].to(self.dtype),
                "negative_prompt_embeds_mask": negative["prompt_mask"][None].bool(), "guidance_scale": guidance}

    # ---- export side -------------------------------------------------------------------------------
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        return self.transformer_export(lora, fmt, comfyui_lora)

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """Krea 2's layout at toy width: a 2-block transformer with a one-block text fusion over 2 tapped layers, a
        2-layer Qwen3-VL with a one-block vision tower, Qwen-Image's tiny VAE, and a tokenizer in which the
        pipeline's template prefix is 34 tokens and its suffix 5, as in the real one."""
        from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Pipeline, \
            Krea2Transformer2DModel
        from transformers import Qwen3VLConfig, Qwen3VLModel

        out_dir = Path(out_dir)
        pipe = Krea2Pipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
        tokenizer = save_tiny_qwen_tokenizer(out_dir / "tokenizer", template=pipe.prompt_template_encode_prefix
                                             + pipe.prompt_template_encode_suffix)
        torch.manual_seed(seed)
        vocab = len(tokenizer)
        Qwen3VLModel(Qwen3VLConfig(
            text_config={"vocab_size": vocab, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
                         "max_position_embeddings": 2048, "bos_token_id": None,
                         "eos_token_id": tokenizer.eos_token_id,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                             "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
            vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                           "out_hidden_size": 16, "deepstack_visual_indexes": []},
            # image and video tokens outside the tiny vocabulary: captions never contain them
            image_token_id=vocab, video_token_id=vocab + 1, vision_start_token_id=vocab + 2,
            vision_end_token_id=vocab + 3,
        )).save_pretrained(out_dir / "text_encoder")
        AutoencoderKLQwenImage(
            base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
            latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 2.0],
        ).save_pretrained(out_dir / "vae")
        Krea2Transformer2DModel(
            in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=32, timestep_embed_dim=16, text_hidden_dim=16, num_text_layers=2,
            text_num_attention_heads=2, text_num_key_value_heads=2, text_intermediate_size=32,
            num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(2, 2, 4),
        ).save_pretrained(out_dir / "transformer")
        FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                        base_image_seq_len=256, max_image_seq_len=6400,
                                        ).save_pretrained(out_dir / "scheduler")
        (out_dir / "model_index.json").write_text(MODEL_INDEX)


MODEL_INDEX = """{
  "_class_name": "Krea2Pipeline",
  "_diffusers_version": "0.42.1",
  "is_distilled": false,
  "patch_size": 2,
  "text_encoder_select_layers": [1, 2],
  "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
  "text_encoder": ["transformers", "Qwen3VLModel"],
  "tokenizer": ["transformers", "Qwen2Tokenizer"],
  "transformer": ["diffusers", "Krea2Transformer2DModel"],
  "vae": ["diffusers", "AutoencoderKLQwenImage"]
}
"""

# diffusers module inside a main block -> the original Krea 2 name ComfyUI's model and the reference trainer use:
# the inverse of diffusers' `_convert_non_diffusers_krea2_lora_to_diffusers`.
_BLOCK_NAMES = {"attn.to_q": "attn.wq", "attn.to_k": "attn.wk", "attn.to_v": "attn.wv", "attn.to_out.0": "attn.wo",
                "attn.to_gate": "attn.gate", "ff.gate": "mlp.gate", "ff.up": "mlp.up", "ff.down": "mlp.down"}
_TOP_LEVEL = {"img_in": "first", "final_layer.linear": "last.linear", "time_embed.linear_1": "tmlp.0",
              "time_embed.linear_2": "tmlp.2", "time_mod_proj": "tproj.1", "txt_in.linear_1": "txtmlp.1",
              "txt_in.linear_2": "txtmlp.3", "text_fusion.projector": "txtfusion.projector"}


def krea2_original_name(module: str) -> str:
    """The original Krea 2 module name (`blocks.0.attn.wq`) of a diffusers Krea2Transformer2DModel module
    (`transformer_blocks.0.attn.to_q`); ValueError for one without a counterpart."""
    match = re.fullmatch(r"(transformer_blocks|text_fusion\.(?:layerwise|refiner)_blocks)\.(\d+)\.(.+)", module)
    if match and match.group(3) in _BLOCK_NAMES:
        outer = "blocks" if match.group(1) == "transformer_blocks" else match.group(1).replace("text_fusion",
                                                                                               "txtfusion")
        return f"{outer}.{match.group(2)}.{_BLOCK_NAMES[match.group(3)]}"
    if module in _TOP_LEVEL:
        return _TOP_LEVEL[module]
    raise ValueError(f"{module}: no original Krea 2 (ComfyUI) name for this module; drop it from train.lora_targets "
                     "or export the 'diffusers' format")


def comfyui_lora(lora: TensorDict) -> TensorDict:
    """The LoRA under the original Krea 2 names, `diffusion_model.`-prefixed (ComfyUI's generic
    `diffusion_model.<module>` keys), as `lora_A` / `lora_B`. No `.alpha`: lora_B is pre-scaled, so the scale is 1,
    which ComfyUI applies when a LoRA has no alpha; and diffusers' own Krea 2 converter refuses any key it does
    not map, `.alpha` included, so a file with it would not load into Krea2Pipeline (tested without)."""
    out: TensorDict = {}
    for key, value in lora.items():
        module, _, suffix = key.rpartition(".lora_")
        if suffix not in ("A.weight", "B.weight"):
            raise ValueError(f"{key}: not a PEFT LoRA weight (expected .lora_A.weight or .lora_B.weight)")
        out[f"diffusion_model.{krea2_original_name(module)}.lora_{suffix}"] = value
    return out
