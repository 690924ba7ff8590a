"""Z-Image (single-stream DiT over one [image, caption] sequence, flow matching; Qwen3 text encoder under its chat
template, Flux's VAE), through diffusers components.

Z-Image's transformer counts time the other way (1 is clean) and predicts the negated velocity; ZImagePipeline
feeds it 1 - t and negates its output, and so does this adapter, so training sees the usual flow convention.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Adapter, Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import PipelineTextEncoder, attention_mask, bare_pipeline, dtype_name, \
    load_component, padded_text_entry, save_tiny_qwen_tokenizer
from diffusion_pipe.models.wan import TopLevelParameters

# Qwen3's chat template, reduced to what ZImagePipeline renders (one user message, the generation prompt, with
# or without the empty thinking block): the tiny tokenizer carries it as the real one does.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


class ZImageEmbed(nn.Module):
    """First layer: everything before the main layers, as ZImageTransformer2DModel.forward does it: patchify,
    embed and refine the image tokens and the caption tokens separately, then join them into one padded
    sequence. Returns (sequence, mask, rotary tables as a real view, adaLN input)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.t_embedder = transformer.t_embedder
        self.all_x_embedder = transformer.all_x_embedder
        self.noise_refiner = transformer.noise_refiner
        self.cap_embedder = transformer.cap_embedder
        self.context_refiner = transformer.context_refiner
        self.top = TopLevelParameters(transformer)  # the pad tokens
        # The transformer's sequence-building methods (pure but for its rotary tables); a list, so it is not
        # registered as a submodule: this layer owns only the modules above.
        self._model = [transformer]

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        latents, timesteps, text, text_mask = inputs
        model = self._model[0]
        device = latents.device
        adaln = self.t_embedder(timesteps * model.t_scale).type_as(latents)
        images = list(latents.unsqueeze(2).unbind(0))
        captions = [t[m.bool()] for t, m in zip(text, text_mask)]
        x, caps, _, x_pos, cap_pos, x_pad, cap_pad = model.patchify_and_embed(images, captions, 2, 1)
        x_lens = [len(i) for i in x]
        x = self.all_x_embedder["2-1"](torch.cat(x, dim=0))
        x, x_freqs, x_mask, _, _ = model._prepare_sequence(list(x.split(x_lens, dim=0)), x_pos, x_pad,
                                                           self.top.x_pad_token, None, device)
        for layer in self.noise_refiner:
            x = layer(x, x_mask, x_freqs, adaln)
        cap_lens = [len(c) for c in caps]
        caps = self.cap_embedder(torch.cat(caps, dim=0))
        caps, cap_freqs, cap_mask, _, _ = model._prepare_sequence(list(caps.split(cap_lens, dim=0)), cap_pos,
                                                                  cap_pad, self.top.cap_pad_token, None, device)
        for layer in self.context_refiner:
            caps = layer(caps, cap_mask, cap_freqs)
        sequence, freqs, mask, _ = model._build_unified_sequence(
            x, x_freqs, x_lens, None, caps, cap_freqs, cap_lens, None, None, None, None, None, False, device)
        if mask is None:  # every item as long: nothing to mask, and attention runs unmasked as diffusers runs it
            mask = torch.ones((sequence.shape[0], 1), dtype=torch.bool, device=device)  # see `attention_mask`
        # integers and a real view: what a stage boundary sends (no bool or complex tensors)
        return sequence, mask.long(), torch.view_as_real(freqs).contiguous(), adaln


class ZImageBlock(nn.Module):
    """One main layer over the joint sequence; takes and returns (sequence, mask, freqs, adaln)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        sequence, mask, freqs, adaln = inputs
        sequence = self.block(sequence, attention_mask(mask), torch.view_as_complex(freqs), adaln)
        return sequence, mask, freqs, adaln


class ZImageOut(nn.Module):
    """Last layer: the final adaptive layer; image tokens come first in every item's sequence."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.final_layer = transformer.all_final_layer["2-1"]

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        sequence, _mask, _freqs, adaln = inputs
        return self.final_layer(sequence, c=adaln)


class ZImageAdapter(Adapter):
    """Z-Image (Turbo, Base) in diffusers format (transformer, vae, text_encoder, tokenizer, scheduler)."""

    name: ClassVar[str] = "zimage"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image",), tasks=("t2i",), objective="flow", export_formats=("diffusers", "comfyui"),
    )

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def pixel_multiple(self) -> int:
        return self.vae_scale * 2  # the transformer's 2x2 patches

    def text_component_dirs(self) -> tuple[dict[str, Path], dict[str, Path]]:
        """The chat template ZImagePipeline wraps captions in is a tokenizer file: the tokenizer hash keys it."""
        return {"text_encoder": self.model_dir / "text_encoder"}, {"tokenizer": self.model_dir / "tokenizer"}

    def load_text_encoders(self, device: torch.device) -> PipelineTextEncoder:
        from diffusers import ZImagePipeline
        from transformers import AutoModel, AutoTokenizer

        encoder = load_component(AutoModel, self.model_dir / "text_encoder", self.dtype, device)
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir / "tokenizer")
        return PipelineTextEncoder(bare_pipeline(ZImagePipeline, text_encoder=encoder, tokenizer=tokenizer))

    @torch.no_grad()
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        if pixels_BCFHW.shape[2] != 1:
            raise ValueError(f"family 'zimage' trains on images only; got {pixels_BCFHW.shape[2]} frames")
        # The distribution's mode, unscaled: normalisation happens at load time, so a scaling change is free.
        latents = vae.encode(pixels_BCFHW[:, :, 0].to(vae.device, vae.dtype)).latent_dist.mode()
        return [{"latents": x.contiguous().cpu()} for x in latents]

    @torch.no_grad()
    def encode_text(self, encoders: PipelineTextEncoder, captions: list[str], max_length: int) -> list[TensorDict]:
        """ZImagePipeline.encode_prompt (the caption as a chat user message, the encoder's second-to-last hidden
        states of the real tokens), zero-padded to `max_length` with a mask of the real tokens."""
        pipe = encoders.pipeline
        states, _ = pipe.encode_prompt(list(captions), device=pipe.text_encoder.device,
                                       do_classifier_free_guidance=False, max_sequence_length=max_length)
        return [padded_text_entry(real, max_length) for real in states]

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
        from diffusers import ZImageTransformer2DModel

        return ZImageTransformer2DModel

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        return ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        config = denoiser.config
        if tuple(config.all_patch_size) != (2,) or tuple(config.all_f_patch_size) != (1,) or config.siglip_feat_dim:
            raise ValueError(f"{self.denoiser_dir()}: family 'zimage' trains the text-to-image transformer "
                             "(2x2 patches, no SigLIP/omni inputs) only")
        return [ZImageEmbed(denoiser), *(ZImageBlock(b) for b in denoiser.layers), ZImageOut(denoiser)]

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """As ZImagePipeline calls the transformer: time runs from 1 (noise) to 0 in the objective, from 0 to 1
        in Z-Image's transformer."""
        return (noisy_latents.to(self.dtype), (1 - timesteps).to(self.dtype), text["prompt_embeds"].to(self.dtype),
                text["prompt_mask"].long())

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The image tokens (first in each sequence) unpatchified as ZImageTransformer2DModel.unpatchify does, and
        negated as ZImagePipeline negates them: the transformer predicts minus the velocity."""
        b, c, h, w = like.shape
        tokens = prediction[:, :(h // 2) * (w // 2)]
        x = tokens.reshape(b, h // 2, w // 2, 2, 2, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)
        return -x

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        from diffusers import ZImagePipeline

        return ZImagePipeline

    def sample_inputs(self, text: TensorDict, negative: TensorDict, guidance: float, cfg_scale: float) -> dict:
        """ZImagePipeline takes lists of the real tokens' states; `guidance` is its classifier-free guidance
        scale (Z-Image Turbo samples without: guidance 0 or 1)."""
        def real(entry: TensorDict) -> list[torch.Tensor]:
            return [entry["prompt_embeds"][entry["prompt_mask"].bool()].to(self.dtype)]

        return {"prompt_embeds": real(text), "negative_prompt_embeds": real(negative), "guidance_scale": guidance}

    # ---- export side -------------------------------------------------------------------------------
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        if fmt == "diffusers":
            return {f"transformer.{k}": v for k, v in lora.items()}
        if fmt == "comfyui":
            # ComfyUI maps `diffusion_model.<diffusers name>` onto its own Z-Image (Lumina2) model: comfy/lora.py
            # model_lora_keys_unet through comfy/utils.py z_image_to_diffusers (q/k/v into slices of its qkv),
            # the feed-forward names being the same in both; the same key layout as Qwen-Image's export.
            from diffusion_pipe.models.qwenimage import comfyui_lora

            return comfyui_lora(lora)
        raise self.unknown_format(fmt)

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """Z-Image's layout at toy width: 2 main layers and one refiner of each kind, a 2-layer Qwen3 with a
        tokenizer carrying the chat template, a 3-level VAE."""
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
        from transformers import Qwen3Config, Qwen3Model

        out_dir = Path(out_dir)
        tokenizer = save_tiny_qwen_tokenizer(out_dir / "tokenizer", template="<|im_start|>user\n<|im_end|>\n"
                                             "<|im_start|>assistant\n", chat_template=QWEN3_CHAT_TEMPLATE)
        torch.manual_seed(seed)
        Qwen3Model(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
            bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )).save_pretrained(out_dir / "text_encoder")
        AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 16),
            down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
            layers_per_block=1, norm_num_groups=4, sample_size=64, scaling_factor=0.8, shift_factor=0.1,
            use_quant_conv=False, use_post_quant_conv=False,
        ).save_pretrained(out_dir / "vae")
        ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2, n_refiner_layers=1,
            n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[8, 4, 4], axes_lens=[256, 64, 64],
        ).to(torch.bfloat16).save_pretrained(out_dir / "transformer")  # its timestep MLP is 1024 wide whatever
        # the config (diffusers fixes mid_size): bfloat16 halves the file, loading casts to model.dtype
        FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(out_dir / "scheduler")
        (out_dir / "model_index.json").write_text(MODEL_INDEX)


MODEL_INDEX = """{
  "_class_name": "ZImagePipeline",
  "_diffusers_version": "0.42.1",
  "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
  "text_encoder": ["transformers", "Qwen3Model"],
  "tokenizer": ["transformers", "Qwen2Tokenizer"],
  "transformer": ["diffusers", "ZImageTransformer2DModel"],
  "vae": ["diffusers", "AutoencoderKL"]
}
"""
