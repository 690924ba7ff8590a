"""HiDream-I1 (double-stream then single-stream DiT with mixture-of-experts feed-forwards, flow matching; two CLIPs
with projection, T5 and Llama 3.1 with the hidden states of all its layers; Flux's VAE), through diffusers
components.

Text goes through HiDreamImagePipeline's own `encode_prompt`: T5's states and Llama's states of every layer, each at
`encode.text_max_length` tokens (the pipeline pads both to it, and the transformer attends to the padding: no mask),
and the two CLIP projections concatenated. The transformer projects T5 and one Llama layer per block (its
`llama_layers`) in the first pipeline layer; each block then joins the running text stream with its own Llama layer.
Latents are the VAE's mode, normalised at load time by the shift and scale HiDreamImagePipeline inverts.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Adapter, Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import PipelineTextEncoder, bare_pipeline, dtype_name, load_component, \
    save_tiny_qwen_tokenizer, save_tiny_tokenizers

_TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")
_TOKENIZERS = ("tokenizer", "tokenizer_2", "tokenizer_3", "tokenizer_4")


def _pipeline(**components: object) -> object:
    from diffusers import HiDreamImagePipeline

    return bare_pipeline(HiDreamImagePipeline, **components)


@contextlib.contextmanager
def routed_experts_with_grad(module: nn.Module) -> Iterator[None]:
    """While autograd records, the mixture-of-experts feed-forwards of `module` take their training branch.

    Outside training mode diffusers' MOEFeedForwardSwiGLU routes tokens through `moe_infer`, which runs under
    `torch.no_grad()`: the routed experts' LoRAs, and every layer before them through those experts, would get no
    gradient. Both branches compute the same weighted sum of each token's chosen experts (tested), so the training
    branch changes no prediction. The gates stay as they are (their training mode only adds an unused aux loss)."""
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

    switched = [m for m in module.modules() if isinstance(m, MOEFeedForwardSwiGLU) and not m.training] \
        if torch.is_grad_enabled() else []
    for moe in switched:
        moe.training = True
    try:
        yield
    finally:
        for moe in switched:
            moe.training = False


def skip_unused_aux_loss(block: nn.Module) -> None:
    """Stop `block`'s mixture-of-experts gates computing their load-balancing loss. The engine runs every layer in
    training mode, in which diffusers' MoEGate computes that loss on every call; MOEFeedForwardSwiGLU discards it
    (its `AddAuxiliaryLoss` line is commented out), so with the gate's `alpha` at 0 the gate skips it and nothing it
    returns changes: its routing and weights are computed before. Outside training the gate never computes it."""
    from diffusers.models.transformers.transformer_hidream_image import MoEGate

    for gate in block.modules():
        if isinstance(gate, MoEGate):
            gate.alpha = 0.0


def _key_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The image tokens' key mask the transformer's `patchify` made, in `dtype`: None (a (B, 1) stand-in in the layer
    tuple) for square latents, which it does not pad. The tuple carries it as integers: no gradient flows back to it,
    which a pipeline stage expects of every float tensor it receives."""
    return None if mask.shape[1] == 1 else mask.to(dtype)


class HiDreamEmbed(nn.Module):
    """First layer, as HiDreamImageTransformer2DModel.forward up to its blocks: the transformer's own `patchify`
    (non-square latents padded to its `max_seq` tokens, with a key mask), the patch, timestep and pooled-text
    embeddings, T5's and each block's Llama layer's projections, and the rotary tables of [image, text, Llama].
    Returns (image, text, llama, temb, rope, mask, img_sizes): `text` is [T5, last block's Llama] as every block
    starts from it, `llama` each block's projected Llama layer (B, blocks, L, D)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.x_embedder = transformer.x_embedder
        self.t_embedder = transformer.t_embedder
        self.p_embedder = transformer.p_embedder
        self.pe_embedder = transformer.pe_embedder
        self.caption_projection = transformer.caption_projection
        self.llama_layers = tuple(transformer.config.llama_layers)
        self.patchify = transformer.patchify  # a method: no weights, the transformer is not a child

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        latents, timesteps, t5, llama, pooled = inputs
        hidden, mask, img_sizes, img_ids = self.patchify(latents)
        hidden = self.x_embedder(hidden)
        temb = self.t_embedder(timesteps, latents.dtype) + self.p_embedder(pooled)
        by_layer = llama.transpose(0, 1)  # the pipeline's layout: (layers, B, L, D)
        llama = torch.stack([self.caption_projection[i](by_layer[k]) for i, k in enumerate(self.llama_layers)],
                            dim=1)
        text = torch.cat((self.caption_projection[-1](t5), llama[:, -1]), dim=1)
        txt_ids = img_ids.new_zeros(len(latents), text.shape[1] + llama.shape[2], 3)
        rope = self.pe_embedder(torch.cat((img_ids, txt_ids), dim=1))
        mask = mask.long() if mask is not None else img_sizes.new_ones(len(latents), 1)
        return hidden, text, llama, temb, rope, mask, img_sizes


class HiDreamDoubleBlock(nn.Module):
    """One double-stream block over the image tokens and [text, its Llama layer]; the text stream keeps its length.
    Takes and returns (image, text, llama, temb, rope, mask, img_sizes)."""

    def __init__(self, block: nn.Module, index: int) -> None:
        super().__init__()
        self.block = block
        self.index = index
        skip_unused_aux_loss(block)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        image, text, llama, temb, rope, mask, img_sizes = inputs
        with routed_experts_with_grad(self.block):
            image, joined = self.block(hidden_states=image, hidden_states_masks=_key_mask(mask, image.dtype),
                                       encoder_hidden_states=torch.cat((text, llama[:, self.index]), dim=1),
                                       temb=temb, image_rotary_emb=rope)
        # contiguous: a stage boundary sends what a layer returns, and only contiguous tensors can be sent
        return image, joined[:, :text.shape[1]].contiguous(), llama, temb, rope, mask, img_sizes


class HiDreamSingleBlock(nn.Module):
    """One single-stream block over [image, text, its Llama layer] (the Llama tokens dropped after it, keys of the
    text never masked). Takes and returns (image, text, llama, temb, rope, mask, img_sizes)."""

    def __init__(self, block: nn.Module, index: int) -> None:
        super().__init__()
        self.block = block
        self.index = index
        skip_unused_aux_loss(block)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        image, text, llama, temb, rope, mask, img_sizes = inputs
        n_image, n_text = image.shape[1], text.shape[1]
        keys = _key_mask(mask, image.dtype)
        if keys is not None:
            keys = torch.cat((keys, keys.new_ones(len(keys), n_text + llama.shape[2])), dim=1)
        with routed_experts_with_grad(self.block):
            hidden = self.block(hidden_states=torch.cat((image, text, llama[:, self.index]), dim=1),
                                hidden_states_masks=keys, encoder_hidden_states=None, temb=temb,
                                image_rotary_emb=rope)
        return (hidden[:, :n_image].contiguous(), hidden[:, n_image:n_image + n_text].contiguous(), llama, temb, rope,
                mask, img_sizes)


class HiDreamOut(nn.Module):
    """Last layer: the final adaptive norm and projection of the image tokens, unpatchified by the transformer's own
    `unpatchify` as it returns its prediction outside training (each item's first tokens, padding dropped)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.final_layer = transformer.final_layer
        self.unpatchify = transformer.unpatchify  # a method: no weights, the transformer is not a child

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        image, _text, _llama, temb, _rope, _mask, img_sizes = inputs
        return self.unpatchify(self.final_layer(image, temb), img_sizes, is_training=False)


def sampling_pipeline_class() -> type:
    """HiDreamImagePipeline as samples call it, in two respects. It renders the size asked for: the pipeline scales
    every request to the area of its `default_sample_size` (1024x1024 for the released models) and rounds the sides
    down to multiples of twice the VAE factor, so that default is set, per call, a hair above the asked area. And it
    takes Llama's states item-first (`prompt_embeds_llama3_by_item`, the layout in which samples batch prompts),
    handing them on in the pipeline's layer-first layout."""
    from diffusers import HiDreamImagePipeline

    class HiDreamImageSamplingPipeline(HiDreamImagePipeline):
        def __call__(self, *args, height: int | None = None, width: int | None = None,
                     prompt_embeds_llama3_by_item: torch.Tensor | None = None,
                     negative_prompt_embeds_llama3_by_item: torch.Tensor | None = None, **kwargs):
            if height and width:
                self.default_sample_size = (math.sqrt(width * height) + 0.5) / self.vae_scale_factor
            for name, states in (("prompt_embeds_llama3", prompt_embeds_llama3_by_item),
                                 ("negative_prompt_embeds_llama3", negative_prompt_embeds_llama3_by_item)):
                if states is not None:
                    kwargs[name] = states.transpose(0, 1)
            return super().__call__(*args, height=height, width=width, **kwargs)

    return HiDreamImageSamplingPipeline


class HiDreamAdapter(Adapter):
    """HiDream-I1 Full, Dev and Fast (text-to-image) in diffusers format: transformer, vae, scheduler, text_encoder
    and text_encoder_2 (CLIP with projection), text_encoder_3 (T5), text_encoder_4 (Llama 3.1 8B Instruct, which the
    released repositories leave out: add it to the model directory) and their tokenizers."""

    name: ClassVar[str] = "hidream"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image",), tasks=("t2i",), objective="flow", export_formats=("diffusers", "comfyui"),
    )

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def pixel_multiple(self) -> int:
        return self.vae_scale * self.component_config("transformer")["patch_size"]

    def text_component_dirs(self) -> tuple[dict[str, Path], dict[str, Path]]:
        llama = self.model_dir / "text_encoder_4"
        if not (llama / "config.json").is_file():
            raise FileNotFoundError(f"{llama}: missing. HiDream-I1's fourth text encoder is Llama 3.1 8B Instruct, "
                                    "which HiDream-ai's repositories leave out: copy "
                                    "meta-llama/Llama-3.1-8B-Instruct's model into text_encoder_4/ and its tokenizer "
                                    "into tokenizer_4/ of model.path")
        return ({name: self.model_dir / name for name in _TEXT_ENCODERS},
                {name: self.model_dir / name for name in _TOKENIZERS})

    def caption_token_limits(self, tokenizers: dict[str, object], max_length: int) -> dict[str, int]:
        """HiDreamImagePipeline reads its two CLIP encoders (Long-CLIP, 248 positions) at
        min(max_sequence_length, 218) tokens, T5 and Llama at `max_length` capped by their tokenizers."""
        limits = super().caption_token_limits(tokenizers, max_length)
        return limits | {name: min(max_length, 218) for name in ("tokenizer", "tokenizer_2")}

    def load_text_encoders(self, device: torch.device) -> PipelineTextEncoder:
        from transformers import AutoTokenizer, CLIPTextModelWithProjection, LlamaForCausalLM, T5EncoderModel

        classes = (CLIPTextModelWithProjection, CLIPTextModelWithProjection, T5EncoderModel, LlamaForCausalLM)
        encoders = {name: load_component(cls, self.model_dir / name, self.dtype, device)
                    for name, cls in zip(_TEXT_ENCODERS, classes)}
        tokenizers = {name: AutoTokenizer.from_pretrained(self.model_dir / name) for name in _TOKENIZERS}
        return PipelineTextEncoder(_pipeline(**encoders, **tokenizers))

    @torch.no_grad()
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        """The distribution's mode, unscaled: the shift and scale apply at load time (`normalise_latents`)."""
        if pixels_BCFHW.shape[2] != 1:
            raise ValueError(f"family 'hidream' trains on images only; got {pixels_BCFHW.shape[2]} frames")
        latents = vae.encode(pixels_BCFHW[:, :, 0].to(vae.device, vae.dtype)).latent_dist.mode()
        return [{"latents": x.contiguous().cpu()} for x in latents]

    @torch.no_grad()
    def encode_text(self, encoders: PipelineTextEncoder, captions: list[str], max_length: int) -> list[TensorDict]:
        """HiDreamImagePipeline.encode_prompt, the caption fed to all four encoders: T5's states and Llama's states
        of every layer at `max_length` tokens, and the two CLIP projections concatenated."""
        pipe = encoders.pipeline
        t5, _, llama, _, pooled, _ = pipe.encode_prompt(captions, device=pipe.text_encoder.device,
                                                        do_classifier_free_guidance=False,
                                                        max_sequence_length=max_length)
        return [{"t5": t5[i].contiguous().cpu(), "llama": llama[:, i].contiguous().cpu(),
                 "pooled": pooled[i].contiguous().cpu()} for i in range(len(captions))]

    def latent_spec(self, width: int, height: int, frames: int) -> Spec:
        """The VAE's latent; a non-square bucket must fit the transformer's `max_resolution`, up to which its
        `patchify` pads non-square latents (square ones of any size go unpadded)."""
        s = self.vae_scale
        config = self.component_config("transformer")
        p = config["patch_size"]
        patches, most = (height // s // p) * (width // s // p), math.prod(config["max_resolution"]) // p ** 2
        if width != height and patches > most:
            raise ValueError(f"bucket {width}x{height}: {patches} patches, but HiDream-I1 pads non-square images to "
                             f"{most} patches and takes no more; use buckets of at most that area (1024x1024 for "
                             "the released models) in scan.datasets[].resolutions, or square ones")
        return {"latents": ((self.component_config("vae")["latent_channels"], height // s, width // s),
                            dtype_name(self.dtype))}

    def text_spec(self, max_length: int) -> Spec:
        llama = self.component_config("text_encoder_4")
        config = self.component_config("transformer")
        dt = dtype_name(self.dtype)
        return {"t5": ((max_length, config["caption_channels"][0]), dt),
                "llama": ((llama["num_hidden_layers"], max_length, llama["hidden_size"]), dt),
                "pooled": ((config["text_emb_dim"],), dt)}

    # ---- train side --------------------------------------------------------------------------------
    def normalise_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The inverse of what HiDreamImagePipeline applies before decoding (latents / scale + shift)."""
        config = self.component_config("vae")
        return (latents - config["shift_factor"]) * config["scaling_factor"]

    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import HiDreamImageTransformer2DModel

        return HiDreamImageTransformer2DModel

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        """Both streams' attention projections and every feed-forward linear: the routed and shared experts of the
        image stream's mixture of experts and the text stream's feed-forward (the names diffusers' HiDream loader
        and ComfyUI's load as they are). The experts' gate is a bare weight, not a linear: it gets none."""
        return ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out", "attn1.to_q_t", "attn1.to_k_t",
                "attn1.to_v_t", "attn1.to_out_t", "w1", "w2", "w3")

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        if denoiser.config.force_inference_output:
            raise ValueError(f"{self.denoiser_dir() / 'config.json'}: force_inference_output is true, which keeps the "
                             "mixture of experts on its no-grad path in training too: the routed experts would not "
                             "train. Set it to false (it changes no prediction)")
        double = [HiDreamDoubleBlock(b, i) for i, b in enumerate(denoiser.double_stream_blocks)]
        single = [HiDreamSingleBlock(b, len(double) + i) for i, b in enumerate(denoiser.single_stream_blocks)]
        return [HiDreamEmbed(denoiser), *double, *single, HiDreamOut(denoiser)]

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """As HiDreamImagePipeline calls the transformer: latents, the scheduler's timestep (t x 1000), T5's states,
        Llama's layers (batch first here; the first layer puts them in the pipeline's layer-first layout) and the
        pooled CLIP projections. HiDream-I1 has no guidance embedding."""
        return (noisy_latents.to(self.dtype), (timesteps * 1000).to(self.dtype), text["t5"].to(self.dtype),
                text["llama"].to(self.dtype), text["pooled"].to(self.dtype))

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The transformer predicts minus the velocity: negated, as HiDreamImagePipeline negates it."""
        return -prediction

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        return sampling_pipeline_class()

    def sample_inputs(self, text: TensorDict, negative: TensorDict, guidance: float, cfg_scale: float) -> dict:
        """`guidance` is HiDreamImagePipeline's classifier-free guidance scale over the negative prompt (Full: 5;
        Dev and Fast are distilled: 0, no negative pass)."""
        out = {"guidance_scale": guidance}
        for prefix, entry in (("", text), ("negative_", negative)):
            out |= {f"{prefix}prompt_embeds_t5": entry["t5"][None].to(self.dtype),
                    f"{prefix}prompt_embeds_llama3_by_item": entry["llama"][None].to(self.dtype),
                    f"{prefix}pooled_prompt_embeds": entry["pooled"][None].to(self.dtype)}
        return out

    # ---- export side -------------------------------------------------------------------------------
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        """HiDream-I1's original module names are diffusers' own (diffusers' single-file converter only strips the
        prefix), and so are those of ComfyUI's HiDream model, whose LoRA loader reads `diffusion_model.<module>`
        keys (comfy/lora.py `model_lora_keys_unet`); HiDreamImagePipeline's loader reads them too. No `.alpha`:
        lora_B is pre-scaled (scale 1, what ComfyUI applies without one), and diffusers' loader refuses a key
        without "lora" in it."""
        if fmt == "diffusers":
            return {f"transformer.{k}": v for k, v in lora.items()}
        if fmt == "comfyui":
            return {f"diffusion_model.{k}": v for k, v in lora.items()}
        raise self.unknown_format(fmt)

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """HiDream-I1's layout at toy width: 2 double-stream and 2 single-stream blocks with 4 routed experts (2 per
        token) and a shared one, reading Llama layers [0, 1, 2, 2] as the real one reads its last layer repeatedly;
        two CLIPs with projections of different widths and 248 positions (as HiDream's long CLIPs), a T5, a 3-layer
        Llama, a 3-level Flux-style VAE, Full's UniPC flow scheduler. Non-square latents pad to 12x12 patches."""
        import tempfile

        from diffusers import AutoencoderKL, HiDreamImageTransformer2DModel, UniPCMultistepScheduler
        from transformers import CLIPTextConfig, CLIPTextModelWithProjection, LlamaConfig, LlamaForCausalLM, \
            T5Config, T5EncoderModel

        out_dir = Path(out_dir)
        with tempfile.TemporaryDirectory() as tmp:
            clip_tok, t5_tok = save_tiny_tokenizers(Path(tmp))
        clip_tok.model_max_length = 248
        for name in ("tokenizer", "tokenizer_2"):
            clip_tok.save_pretrained(out_dir / name)
        t5_tok.save_pretrained(out_dir / "tokenizer_3")
        llama_tok = save_tiny_qwen_tokenizer(out_dir / "tokenizer_4")
        torch.manual_seed(seed)
        for name, width in (("text_encoder", 16), ("text_encoder_2", 24)):
            CLIPTextModelWithProjection(CLIPTextConfig(
                vocab_size=len(clip_tok), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=248, projection_dim=width,
                bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id,
                pad_token_id=clip_tok.pad_token_id,
            )).save_pretrained(out_dir / name)
        T5EncoderModel(T5Config(
            vocab_size=len(t5_tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, pad_token_id=t5_tok.pad_token_id,
            eos_token_id=t5_tok.eos_token_id, decoder_start_token_id=t5_tok.pad_token_id,
        )).save_pretrained(out_dir / "text_encoder_3")
        LlamaForCausalLM(LlamaConfig(
            vocab_size=len(llama_tok), hidden_size=16, intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=2048,
            bos_token_id=None, eos_token_id=llama_tok.eos_token_id, pad_token_id=llama_tok.eos_token_id,
        )).save_pretrained(out_dir / "text_encoder_4")
        AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 16),
            down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
            layers_per_block=1, norm_num_groups=4, sample_size=64, scaling_factor=1.5, shift_factor=0.06,
            use_quant_conv=False, use_post_quant_conv=False,
        ).save_pretrained(out_dir / "vae")
        HiDreamImageTransformer2DModel(
            patch_size=2, in_channels=4, out_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=8,
            num_attention_heads=2, caption_channels=[32, 16], text_emb_dim=40, num_routed_experts=4,
            num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(24, 24), llama_layers=[0, 1, 2, 2],
        ).save_pretrained(out_dir / "transformer")
        UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                ).save_pretrained(out_dir / "scheduler")
        (out_dir / "model_index.json").write_text(MODEL_INDEX)


MODEL_INDEX = """{
  "_class_name": "HiDreamImagePipeline",
  "_diffusers_version": "0.42.1",
  "scheduler": ["diffusers", "UniPCMultistepScheduler"],
  "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
  "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
  "text_encoder_3": ["transformers", "T5EncoderModel"],
  "text_encoder_4": ["transformers", "LlamaForCausalLM"],
  "tokenizer": ["transformers", "CLIPTokenizer"],
  "tokenizer_2": ["transformers", "CLIPTokenizer"],
  "tokenizer_3": ["transformers", "T5TokenizerFast"],
  "tokenizer_4": ["transformers", "PreTrainedTokenizerFast"],
  "transformer": ["diffusers", "HiDreamImageTransformer2DModel"],
  "vae": ["diffusers", "AutoencoderKL"]
}
"""
