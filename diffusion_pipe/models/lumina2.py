"""Lumina-Image 2.0 (NextDiT over one [caption, image] sequence, flow matching; Gemma 2 text encoder under a
system prompt, Flux's VAE), through diffusers components.

Like Z-Image, the transformer counts time the other way (1 is clean) and predicts the negated velocity;
Lumina2Pipeline feeds it 1 - t and negates its output, and so does this adapter.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Adapter, Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import TOKENIZER_CORPUS, PipelineTextEncoder, attention_mask, dtype_name, \
    load_component


def _pipeline(**components: object) -> object:
    from diffusers import Lumina2Pipeline

    parts = {"transformer": None, "scheduler": None, "vae": None, "text_encoder": None, "tokenizer": None}
    return Lumina2Pipeline(**(parts | components))


class Lumina2Embed(nn.Module):
    """First layer: what Lumina2Transformer2DModel.forward does before its main layers (embeddings, rotary
    tables, both refiners, the joint [caption, image] sequence). Returns (sequence, mask, rotary tables as a real
    view, temb, caption lengths)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.time_caption_embed = transformer.time_caption_embed
        self.rope_embedder = transformer.rope_embedder
        self.x_embedder = transformer.x_embedder
        self.context_refiner = transformer.context_refiner
        self.noise_refiner = transformer.noise_refiner

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        latents, timesteps, text, text_mask = inputs
        text_mask = text_mask.bool()  # the tokenizer's 0/1 mask, as the transformer reads it
        temb, captions = self.time_caption_embed(latents, timesteps, text)
        image, cap_freqs, image_freqs, freqs, cap_lens, seq_lens = self.rope_embedder(latents, text_mask)
        image = self.x_embedder(image)
        for layer in self.context_refiner:
            captions = layer(captions, text_mask, cap_freqs)
        for layer in self.noise_refiner:
            image = layer(image, None, image_freqs, temb)
        batch = latents.shape[0]
        # every item as long: a (B, 1) mask, which the main layers read as none (common.attention_mask)
        mask = torch.zeros(batch, 1 if len(set(seq_lens)) == 1 else max(seq_lens), dtype=torch.long,
                           device=latents.device)
        sequence = image.new_zeros(batch, max(seq_lens), image.shape[-1])
        for i, (cap_len, seq_len) in enumerate(zip(cap_lens, seq_lens)):
            mask[i, :seq_len] = 1
            sequence[i, :cap_len] = captions[i, :cap_len]
            sequence[i, cap_len:seq_len] = image[i]
        # integers and a real view: what a stage boundary sends (no bool or complex tensors)
        return (sequence, mask, torch.view_as_real(freqs).contiguous(), temb,
                torch.tensor(cap_lens, dtype=torch.long, device=latents.device))


class Lumina2Block(nn.Module):
    """One main layer over the joint sequence; takes and returns (sequence, mask, freqs, temb, caption lengths).
    The transformer skips the mask when every item is as long; so does this layer, told by the mask's shape."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        sequence, mask, freqs, temb, cap_lens = inputs
        sequence = self.block(sequence, attention_mask(mask), torch.view_as_complex(freqs), temb)
        return sequence, mask, freqs, temb, cap_lens


class Lumina2Out(nn.Module):
    """Last layer: the output norm and projection, then each item's image tokens (they follow its caption)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.norm_out = transformer.norm_out

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        sequence, mask, _freqs, temb, cap_lens = inputs
        out = self.norm_out(sequence, temb)
        image_tokens = (sequence.shape[1] if mask.shape[1] == 1 else int(mask[0].sum())) - int(cap_lens[0])
        return torch.stack([out[i, int(c):int(c) + image_tokens] for i, c in enumerate(cap_lens)])


class Lumina2Adapter(Adapter):
    """Lumina-Image 2.0 in diffusers format (transformer, vae, text_encoder, tokenizer, scheduler)."""

    name: ClassVar[str] = "lumina2"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image",), tasks=("t2i",), objective="flow", export_formats=("diffusers", "comfyui"),
    )

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def pixel_multiple(self) -> int:
        return self.vae_scale * self.component_config("transformer")["patch_size"]

    def text_template(self) -> str:
        """Lumina2Pipeline's system prompt, read from diffusers (it prefixes every caption)."""
        return json.dumps({"system_prompt": _pipeline().system_prompt, "separator": " <Prompt Start> "})

    def load_text_encoders(self, device: torch.device) -> PipelineTextEncoder:
        from transformers import AutoModel, AutoTokenizer

        encoder = load_component(AutoModel, self.model_dir / "text_encoder", self.dtype, device)
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir / "tokenizer")
        return PipelineTextEncoder(_pipeline(text_encoder=encoder, tokenizer=tokenizer))

    @torch.no_grad()
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        if pixels_BCFHW.shape[2] != 1:
            raise ValueError(f"family 'lumina2' trains on images only; got {pixels_BCFHW.shape[2]} frames")
        # The distribution's mode, unscaled: normalisation happens at load time, so a scaling change is free.
        latents = vae.encode(pixels_BCFHW[:, :, 0].to(vae.device, vae.dtype)).latent_dist.mode()
        return [{"latents": x.contiguous().cpu()} for x in latents]

    @torch.no_grad()
    def encode_text(self, encoders: PipelineTextEncoder, captions: list[str], max_length: int) -> list[TensorDict]:
        """Lumina2Pipeline.encode_prompt: the caption after the system prompt, Gemma 2's second-to-last hidden
        states and the tokens' mask, at `max_length` tokens."""
        pipe = encoders.pipeline
        states, mask, _, _ = pipe.encode_prompt(list(captions), do_classifier_free_guidance=False,
                                                device=pipe.text_encoder.device, max_sequence_length=max_length)
        return [{"prompt_embeds": states[i].contiguous().cpu(), "prompt_mask": mask[i].long().contiguous().cpu()}
                for i in range(len(captions))]

    def latent_spec(self, width: int, height: int, frames: int) -> Spec:
        s = self.vae_scale
        return {"latents": ((self.component_config("vae")["latent_channels"], height // s, width // s), dtype_name(self.dtype))}

    def text_spec(self, max_length: int) -> Spec:
        return {"prompt_embeds": ((max_length, self.component_config("transformer")["cap_feat_dim"]), dtype_name(self.dtype)),
                "prompt_mask": ((max_length,), "int64")}

    # ---- train side --------------------------------------------------------------------------------
    def normalise_latents(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.component_config("vae")
        return (latents - (config.get("shift_factor") or 0.0)) * config["scaling_factor"]

    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import Lumina2Transformer2DModel

        return Lumina2Transformer2DModel

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        return ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "feed_forward.linear_1",
                "feed_forward.linear_2", "feed_forward.linear_3")

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        return [Lumina2Embed(denoiser), *(Lumina2Block(b) for b in denoiser.layers), Lumina2Out(denoiser)]

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """As Lumina2Pipeline calls the transformer: time runs from 0 (noise) to 1 in Lumina 2's transformer."""
        return (noisy_latents.to(self.dtype), (1 - timesteps).to(self.dtype), text["prompt_embeds"].to(self.dtype),
                text["prompt_mask"].long())

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Image tokens unpatchified as Lumina2Transformer2DModel.forward does, negated as Lumina2Pipeline negates
        them: the transformer predicts minus the velocity."""
        b, c, h, w = like.shape
        p = self.component_config("transformer")["patch_size"]
        x = prediction.reshape(b, h // p, w // p, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)
        return -x

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        from diffusers import Lumina2Pipeline

        return Lumina2Pipeline

    def sample_inputs(self, text: TensorDict, negative: TensorDict, guidance: float, cfg_scale: float) -> dict:
        """`guidance` is Lumina2Pipeline's classifier-free guidance scale, over the negative prompt."""
        return {"prompt_embeds": text["prompt_embeds"][None].to(self.dtype),
                "prompt_attention_mask": text["prompt_mask"][None],
                "negative_prompt_embeds": negative["prompt_embeds"][None].to(self.dtype),
                "negative_prompt_attention_mask": negative["prompt_mask"][None], "guidance_scale": guidance}

    # ---- export side -------------------------------------------------------------------------------
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        if fmt == "diffusers":
            return {f"transformer.{k}": v for k, v in lora.items()}
        if fmt == "comfyui":
            config = self.component_config("transformer")
            head_dim = config["hidden_size"] // config["num_attention_heads"]
            return comfyui_lora(lora, q_dim=config["hidden_size"], kv_dim=head_dim * config["num_kv_heads"])
        raise self.unknown_format(fmt)

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """Lumina 2's layout at toy width: 2 main layers and 2 refiners of each kind (grouped-query attention as
        in the real model), a 2-layer Gemma 2 with a tiny BPE Gemma tokenizer, a 4-level VAE."""
        import tempfile

        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, Lumina2Transformer2DModel
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
        from transformers import Gemma2Config, Gemma2Model, GemmaTokenizer

        out_dir = Path(out_dir)
        specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
        bpe = Tokenizer(models.BPE(unk_token="<unk>"))
        bpe.pre_tokenizer = pre_tokenizers.Metaspace()
        bpe.train_from_iterator([*TOKENIZER_CORPUS, _pipeline().system_prompt + " <Prompt Start> "],
                                trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
        with tempfile.TemporaryDirectory() as tmp:
            bpe.model.save(tmp)
            merges = [tuple(line.split()) for line in Path(tmp, "merges.txt").read_text().splitlines()
                      if line and not line.startswith("#")]
        tokenizer = GemmaTokenizer(vocab=bpe.get_vocab(), merges=merges, model_max_length=8192)
        tokenizer.save_pretrained(out_dir / "tokenizer")
        torch.manual_seed(seed)
        Gemma2Model(Gemma2Config(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )).save_pretrained(out_dir / "text_encoder")
        AutoencoderKL(  # four levels (x8): Lumina2Pipeline assumes a VAE factor of 8
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 16, 16),
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=1, norm_num_groups=4, sample_size=64, scaling_factor=0.8, shift_factor=0.1,
            use_quant_conv=False, use_post_quant_conv=False,
        ).save_pretrained(out_dir / "vae")
        Lumina2Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=4, hidden_size=32, num_layers=2, num_refiner_layers=2,
            num_attention_heads=2, num_kv_heads=1, multiple_of=16, norm_eps=1e-5, axes_dim_rope=(4, 6, 6),
            axes_lens=(300, 64, 64), cap_feat_dim=32,
        ).save_pretrained(out_dir / "transformer")
        FlowMatchEulerDiscreteScheduler(shift=6.0).save_pretrained(out_dir / "scheduler")
        (out_dir / "model_index.json").write_text(MODEL_INDEX)


MODEL_INDEX = """{
  "_class_name": "Lumina2Pipeline",
  "_diffusers_version": "0.42.1",
  "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
  "text_encoder": ["transformers", "Gemma2Model"],
  "tokenizer": ["transformers", "GemmaTokenizer"],
  "transformer": ["diffusers", "Lumina2Transformer2DModel"],
  "vae": ["diffusers", "AutoencoderKL"]
}
"""


# diffusers module inside a layer / refiner -> (original NextDiT name, part of the fused qkv or None): the inverse
# of diffusers' convert_lumina2_to_diffusers key map (its LUMINA_KEY_MAP and FINAL_LAYER_MAP).
_BLOCK_NAMES: dict[str, tuple[str, int | None]] = {
    "attn.to_q": ("attention.qkv", 0), "attn.to_k": ("attention.qkv", 1), "attn.to_v": ("attention.qkv", 2),
    "attn.to_out.0": ("attention.out", None), "feed_forward.linear_1": ("feed_forward.w1", None),
    "feed_forward.linear_2": ("feed_forward.w2", None), "feed_forward.linear_3": ("feed_forward.w3", None),
    "norm1.linear": ("adaLN_modulation.1", None),
}
_TOP_LEVEL_NAMES: dict[str, str] = {
    "x_embedder": "x_embedder", "time_caption_embed.caption_embedder.1": "cap_embedder.1",
    "time_caption_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
    "time_caption_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
    "norm_out.linear_1": "final_layer.adaLN_modulation.1", "norm_out.linear_2": "final_layer.linear",
}


def lumina2_original_module(module: str) -> tuple[str, int | None]:
    """A diffusers Lumina 2 module name -> (its name in the original NextDiT, which ComfyUI's Lumina 2 model keeps,
    and its part of the fused qkv or None). 'layers.3.attn.to_k' -> ('layers.3.attention.qkv', 1)."""
    match = re.fullmatch(r"((?:layers|context_refiner|noise_refiner)\.\d+)\.(.+)", module)
    if match and match.group(2) in _BLOCK_NAMES:
        name, part = _BLOCK_NAMES[match.group(2)]
        return f"{match.group(1)}.{name}", part
    if module in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[module], None
    raise ValueError(f"export.formats: comfyui has no ComfyUI Lumina 2 name for LoRA module {module!r}; drop it "
                     "from train.lora_targets or export the 'diffusers' format only")


def comfyui_lora(lora: TensorDict, q_dim: int, kv_dim: int) -> TensorDict:
    """The LoRA under the original NextDiT names, `diffusion_model.`-prefixed (the generic keys of ComfyUI's
    comfy/lora.py `model_lora_keys_unet`), as `lora_down`/`lora_up` with `.alpha` = rank (lora_B is pre-scaled);
    q/k/v fused exactly into one LoRA per qkv (grouped-query widths: q_dim, kv_dim, kv_dim)."""
    from diffusion_pipe.lora_keys import down_up_alpha, fuse_loras, lora_modules

    groups: dict[str, dict[int | None, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, pair in lora_modules(lora).items():
        original, part = lumina2_original_module(module)
        groups.setdefault(original, {})[part] = pair
    out: TensorDict = {}
    for original, parts in sorted(groups.items()):
        a, b = fuse_loras([parts.get(i) for i in range(3)], [q_dim, kv_dim, kv_dim]) \
            if original.endswith(".qkv") else parts[None]
        out.update(down_up_alpha(f"diffusion_model.{original}", a, b))
    return out
