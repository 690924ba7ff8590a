"""Ideogram 4 (single-stream DiT over one packed [text, image] sequence with block-diagonal segment attention and
3-axis MRoPE, flow matching; 13 hidden layers of Qwen3-VL-8B concatenated per token; the Flux.2 VAE), through
diffusers components.

Text goes through Ideogram4Pipeline's own `encode_prompt`: the caption as a chat message, left-padded to
`encode.text_max_length` tokens, the hidden states of the text model's layers 0, 3, ..., 33, 35 concatenated
(53,248 features a token), the padding's zeroed. An entry is the text region of the pipeline's sequence as it makes
it, with the caption's token count, from which the pipeline's own `_prepare_ids` lays out [padding, caption, image]
(the padding is a segment of its own, which no caption or image token attends to). The transformer counts time the
other way (1 is clean) and predicts the negated velocity: the pipeline feeds it 1 - t and negates its output, and so
does this adapter. Latents are the VAE's mode in the pipeline's token layout (2x2 patches, the patch position before
the channel), normalised by the VAE's batch-norm statistics: the inverse of what Ideogram4Pipeline does before
decoding, as it has no encoding path of its own.

Ideogram 4 guides with a second transformer, `unconditional_transformer`, run on the image alone with no text:
LoRA training and export concern `transformer` (where the pipeline's LoRA loader loads); samples run both.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from diffusion_pipe.models.base import Adapter, Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import PipelineTextEncoder, bare_pipeline, dtype_name, load_component, \
    save_tiny_qwen_tokenizer
from diffusion_pipe.params import SamplePrompt

# Qwen3-VL's chat template, reduced to what Ideogram4Pipeline renders (one user message whose content is a list of
# text parts, then the generation prompt): the tiny tokenizer carries it as the real one does.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}{%- if message['content'] is "
    "string %}{{ message['content'] }}{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}"
    "{{ part['text'] }}{%- endif %}{%- endfor %}{%- endif %}{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _token_roles() -> tuple[int, int]:
    """(text, image) token roles of the transformer's `indicator`, from diffusers."""
    from diffusers.models.transformers.transformer_ideogram4 import LLM_TOKEN_INDICATOR, OUTPUT_IMAGE_INDICATOR

    return LLM_TOKEN_INDICATOR, OUTPUT_IMAGE_INDICATOR


class Ideogram4Embed(nn.Module):
    """First layer: Ideogram4Transformer2DModel.forward up to its blocks. The text features arrive for the text
    region only: the pipeline pads them with zeros over the image tokens, which the transformer's text mask zeroes
    again after normalising and projecting them (a tokens x 53,248 product that adds nothing), so the image rows
    take their zeros here. Returns (x, cos, sin, adaln_input, segment_ids)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.input_proj = transformer.input_proj
        self.llm_cond_norm = transformer.llm_cond_norm
        self.llm_cond_proj = transformer.llm_cond_proj
        self.t_embedding = transformer.t_embedding
        self.adaln_proj = transformer.adaln_proj
        self.embed_image_indicator = transformer.embed_image_indicator
        self.rotary_emb = transformer.rotary_emb
        self.roles = _token_roles()

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        latents, timestep, text, position_ids, segment_ids, indicator = inputs
        text_role, image_role = self.roles
        n_text = text.shape[1]
        text_mask = (indicator[:, :n_text] == text_role).to(latents.dtype).unsqueeze(-1)
        image_mask = (indicator[:, n_text:] == image_role).to(latents.dtype).unsqueeze(-1)
        text = self.llm_cond_proj(self.llm_cond_norm(text * text_mask)) * text_mask
        image = self.input_proj(latents * image_mask) * image_mask
        x = torch.cat((text, image), dim=1) + self.embed_image_indicator((indicator == image_role).long())
        adaln_input = F.silu(self.adaln_proj(self.t_embedding(timestep).unsqueeze(1)))
        cos, sin = self.rotary_emb(position_ids)
        return x, cos.to(x.dtype), sin.to(x.dtype), adaln_input, segment_ids


class Ideogram4Block(nn.Module):
    """One block over the whole sequence under the transformer's block-diagonal mask (a token attends within its
    segment); takes and returns (x, cos, sin, adaln_input, segment_ids)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x, cos, sin, adaln_input, segment_ids = inputs
        mask = (segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)).unsqueeze(1)
        return self.block(x, mask, (cos, sin), adaln_input), cos, sin, adaln_input, segment_ids


class Ideogram4Out(nn.Module):
    """Last layer: the final adaptive norm and projection of every token (the image's are the last ones)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.final_layer = transformer.final_layer

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, _cos, _sin, adaln_input, _segment_ids = inputs
        return self.final_layer(x, conditioning=adaln_input)


def sampling_pipeline_class() -> type:
    """Ideogram4Pipeline fed stored text entries instead of prompts: its `__call__` takes no embeddings, only prompt
    strings for `encode_prompt`, and hands its prompts to nothing else (but the prompt enhancer, which samples never
    call). So each prompt is its entry, and `encode_prompt` lays the entries out with the pipeline's own
    `_prepare_ids`, padded over the image tokens as it pads the features it computes; the rest of the call (its
    schedule, asymmetric guidance, decoding) is the pipeline's."""
    from diffusers import Ideogram4Pipeline

    class Ideogram4SamplingPipeline(Ideogram4Pipeline):
        def __call__(self, *args, text_features: torch.Tensor, text_lengths: torch.Tensor, **kwargs):
            entries = [(features, int(length)) for features, length in zip(text_features, text_lengths)]
            return super().__call__(*args, prompt=entries, max_sequence_length=text_features.shape[1], **kwargs)

        def encode_prompt(self, prompt, grid_h, grid_w, max_sequence_length, device):
            features = torch.stack([f for f, _ in prompt]).to(device, torch.float32)
            position_ids, segment_ids, indicator = self._prepare_ids(
                [n for _, n in prompt], grid_h, grid_w, max_sequence_length, device)
            padding = features.new_zeros(len(prompt), grid_h * grid_w, features.shape[-1])
            return torch.cat([features, padding], dim=1), position_ids, segment_ids, indicator

    return Ideogram4SamplingPipeline


class Ideogram4Adapter(Adapter):
    """Ideogram 4 (text-to-image) in diffusers format (transformer, unconditional_transformer, vae, text_encoder,
    tokenizer, scheduler)."""

    name: ClassVar[str] = "ideogram4"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image",), tasks=("t2i",), objective="flow", export_formats=("diffusers", "comfyui"),
    )

    @functools.cached_property
    def _bare(self) -> object:
        """Ideogram4Pipeline without components, for its patch size: built once."""
        from diffusers import Ideogram4Pipeline

        return bare_pipeline(Ideogram4Pipeline)

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def pixel_multiple(self) -> int:
        return self.vae_scale * self._bare.patch_size

    def vae_class(self) -> type[nn.Module]:
        from diffusers import AutoencoderKLFlux2

        return AutoencoderKLFlux2

    def text_template(self) -> str:
        """The text model layers the pipeline concatenates, read from diffusers (the chat template is a tokenizer
        file, hashed with it)."""
        from diffusers.pipelines.ideogram4.pipeline_ideogram4 import QWEN3_VL_ACTIVATION_LAYERS

        return json.dumps({"layers": list(QWEN3_VL_ACTIVATION_LAYERS)})

    def load_text_encoders(self, device: torch.device) -> PipelineTextEncoder:
        from diffusers import Ideogram4Pipeline
        from transformers import AutoTokenizer, Qwen3VLModel

        encoder = load_component(Qwen3VLModel, self.model_dir / "text_encoder", self.dtype, device)
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir / "tokenizer")
        return PipelineTextEncoder(bare_pipeline(Ideogram4Pipeline, text_encoder=encoder, tokenizer=tokenizer))

    @torch.no_grad()
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        """The distribution's mode in Ideogram4Pipeline's token layout: 2x2 patches whose channels run (patch row,
        patch column, VAE channel), normalised by the VAE's batch-norm statistics with its epsilon. The pipeline
        undoes exactly this before decoding."""
        if pixels_BCFHW.shape[2] != 1:
            raise ValueError(f"family 'ideogram4' trains on images only; got {pixels_BCFHW.shape[2]} frames")
        latents = vae.encode(pixels_BCFHW[:, :, 0].to(vae.device, vae.dtype)).latent_dist.mode()
        b, c, h, w = latents.shape
        p = self._bare.patch_size
        patches = latents.view(b, c, h // p, p, w // p, p).permute(0, 3, 5, 1, 2, 4).reshape(b, p * p * c, h // p,
                                                                                           w // p)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(patches)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(patches)
        return [{"latents": x.contiguous().cpu()} for x in (patches - mean) / std]

    @torch.no_grad()
    def encode_text(self, encoders: PipelineTextEncoder, captions: list[str], max_length: int) -> list[TensorDict]:
        """Ideogram4Pipeline.encode_prompt of the captions at `max_length` tokens: the text region of its sequence
        and each caption's token count. The pipeline refuses a caption longer than the region rather than cut it,
        and so does encode, naming the caption."""
        from diffusion_pipe.config import ConfigError

        pipe = encoders.pipeline
        device = pipe.text_encoder.device
        try:
            features, _, _, indicator = pipe.encode_prompt(list(captions), grid_h=1, grid_w=1,
                                                           max_sequence_length=max_length, device=device)
        except ValueError:
            for caption in captions:  # which caption: each alone (a failing batch only)
                try:
                    pipe.encode_prompt([caption], grid_h=1, grid_w=1, max_sequence_length=max_length, device=device)
                except ValueError as exc:
                    raise ConfigError(f"encode.text_max_length: {max_length} tokens cannot hold the caption "
                                      f"{caption[:80]!r} in Ideogram 4's chat template ({exc}); Ideogram4Pipeline "
                                      "refuses a longer prompt rather than cut it: raise encode.text_max_length "
                                      "or shorten the caption") from exc
            raise
        text_role, _ = _token_roles()
        lengths = (indicator[:, :max_length] == text_role).sum(dim=1)
        return [{"text": features[i, :max_length].to(self.dtype).contiguous().cpu(), "text_len": lengths[i].cpu()}
                for i in range(len(captions))]

    def latent_spec(self, width: int, height: int, frames: int) -> Spec:
        p = self._bare.patch_size
        s = self.vae_scale * p
        return {"latents": ((self.component_config("vae")["latent_channels"] * p * p, height // s, width // s),
                            dtype_name(self.dtype))}

    def text_spec(self, max_length: int) -> Spec:
        return {"text": ((max_length, self.component_config("transformer")["llm_features_dim"]),
                         dtype_name(self.dtype)),
                "text_len": ((), "int64")}

    # ---- train side --------------------------------------------------------------------------------
    def normalise_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Identity: encoding already applied the VAE's batch-norm statistics (weights of the VAE, whose hash keys
        the stored latents)."""
        return latents

    def denoiser_class(self) -> type[nn.Module]:
        from diffusers import Ideogram4Transformer2DModel

        return Ideogram4Transformer2DModel

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        return ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0", "feed_forward.w1",
                "feed_forward.w2", "feed_forward.w3")

    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        return [Ideogram4Embed(denoiser), *(Ideogram4Block(b) for b in denoiser.layers), Ideogram4Out(denoiser)]

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """As Ideogram4Pipeline calls its transformer: the latents' tokens (row by row), model time 1 - t, the text
        region's features, and the position ids, segment ids and token roles of [padding, caption, image] from the
        pipeline's own `_prepare_ids`. Ideogram 4 has no guidance embedding."""
        from diffusers import Ideogram4Pipeline

        b, c, h, w = noisy_latents.shape
        features = text["text"]
        position_ids, segment_ids, indicator = Ideogram4Pipeline._prepare_ids(
            text["text_len"].reshape(-1).tolist(), h, w, features.shape[1], noisy_latents.device)
        tokens = noisy_latents.permute(0, 2, 3, 1).reshape(b, h * w, c)
        return (tokens.to(self.dtype), (1 - timesteps.float()).to(self.dtype), features.to(self.dtype), position_ids,
                segment_ids, indicator)

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The image tokens (the last H*W) back to (B, C, H, W), negated: the transformer predicts minus the
        velocity, as Ideogram4Pipeline negates it."""
        b, c, h, w = like.shape
        return -prediction[:, -h * w:].reshape(b, h, w, c).permute(0, 3, 1, 2)

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        return sampling_pipeline_class()

    def sample_pipeline(self, denoiser: nn.Module, vae: nn.Module) -> object:
        """The pipeline over the denoiser being trained, with the model's unconditional transformer (frozen, on the
        VAE's device) for the guidance: loaded for each render and let go after (9.3B parameters for the real
        model, which training does not otherwise hold)."""
        pipe = super().sample_pipeline(denoiser, vae)
        pipe.register_modules(unconditional_transformer=load_component(
            self.denoiser_class(), self.model_dir / "unconditional_transformer", self.dtype, vae.device))
        return pipe

    def sample_texts(self, prompt: SamplePrompt) -> tuple[str, ...]:
        """The prompt alone: the unconditional transformer guides with no text, so there is no negative prompt."""
        return (prompt.prompt,)

    def sample_inputs(self, text: TensorDict, negative: TensorDict | None, guidance: float, cfg_scale: float) -> dict:
        """`guidance` is Ideogram4Pipeline's constant `guidance_scale` (v = g * conditional + (1 - g) *
        unconditional at every step), in place of its 48-step default schedule."""
        return {"text_features": text["text"][None].to(self.dtype), "text_lengths": text["text_len"].reshape(1),
                "guidance_scale": guidance, "guidance_schedule": None}

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
        """Ideogram 4's layout at toy width: two 2-block transformers (conditional and unconditional), a 36-layer
        Qwen3-VL text model 8 wide (the pipeline reads layers up to 35) with a one-block vision tower, a tokenizer
        carrying the chat template, a 3-level Flux.2 VAE with non-trivial batch-norm statistics."""
        from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Ideogram4Transformer2DModel
        from diffusers.pipelines.ideogram4.pipeline_ideogram4 import QWEN3_VL_ACTIVATION_LAYERS
        from transformers import Qwen3VLConfig, Qwen3VLModel

        out_dir = Path(out_dir)
        tokenizer = save_tiny_qwen_tokenizer(out_dir / "tokenizer", template="<|im_start|>user\n<|im_end|>\n"
                                             "<|im_start|>assistant\n", chat_template=QWEN3_VL_CHAT_TEMPLATE)
        torch.manual_seed(seed)
        text_width = 8
        Qwen3VLModel(Qwen3VLConfig(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=text_width, intermediate_size=16,
                             num_hidden_layers=max(QWEN3_VL_ACTIVATION_LAYERS) + 1, num_attention_heads=1,
                             num_key_value_heads=1, head_dim=8, max_position_embeddings=2048,
                             rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                              "mrope_section": [2, 1, 1]},
                             pad_token_id=tokenizer.pad_token_id),
            vision_config=dict(depth=1, hidden_size=8, intermediate_size=16, num_heads=1, patch_size=4,
                               out_hidden_size=text_width, num_position_embeddings=16, deepstack_visual_indexes=[]),
        )).save_pretrained(out_dir / "text_encoder")
        vae = AutoencoderKLFlux2(
            block_out_channels=(8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 3,
            up_block_types=("UpDecoderBlock2D",) * 3, layers_per_block=1, latent_channels=4, norm_num_groups=4,
            sample_size=64, use_quant_conv=False, use_post_quant_conv=False,
        )
        vae.bn.running_mean.normal_(0.0, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
        vae.save_pretrained(out_dir / "vae")
        for component in ("transformer", "unconditional_transformer"):
            Ideogram4Transformer2DModel(
                in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2, intermediate_size=64,
                adaln_dim=16, llm_features_dim=text_width * len(QWEN3_VL_ACTIVATION_LAYERS), mrope_section=(4, 2, 2),
            ).save_pretrained(out_dir / component)
        FlowMatchEulerDiscreteScheduler().save_pretrained(out_dir / "scheduler")
        (out_dir / "model_index.json").write_text(MODEL_INDEX)


MODEL_INDEX = """{
  "_class_name": "Ideogram4Pipeline",
  "_diffusers_version": "0.42.1",
  "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
  "text_encoder": ["transformers", "Qwen3VLModel"],
  "tokenizer": ["transformers", "Qwen2Tokenizer"],
  "transformer": ["diffusers", "Ideogram4Transformer2DModel"],
  "unconditional_transformer": ["diffusers", "Ideogram4Transformer2DModel"],
  "vae": ["diffusers", "AutoencoderKLFlux2"]
}
"""


# diffusers block module -> (its name in Ideogram 4's original model, which ComfyUI's keeps, and its part of the fused
# qkv or None): the inverse of diffusers' _convert_non_diffusers_ideogram4_lora_to_diffusers.
_BLOCK_NAMES: dict[str, tuple[str, int | None]] = {
    "attention.to_q": ("attention.qkv", 0), "attention.to_k": ("attention.qkv", 1),
    "attention.to_v": ("attention.qkv", 2), "attention.to_out.0": ("attention.o", None),
    "feed_forward.w1": ("feed_forward.w1", None), "feed_forward.w2": ("feed_forward.w2", None),
    "feed_forward.w3": ("feed_forward.w3", None), "adaln_modulation": ("adaln_modulation", None),
}
# modules outside the blocks, named alike in both
_TOP_LEVEL_NAMES = ("input_proj", "llm_cond_proj", "t_embedding.mlp_in", "t_embedding.mlp_out", "adaln_proj",
                    "final_layer.linear", "final_layer.adaln_modulation")


def ideogram4_original_module(module: str) -> tuple[str, int | None]:
    """A diffusers Ideogram 4 module name -> (its name in the original model, its part of a fused qkv or None).
    'layers.0.attention.to_k' -> ('layers.0.attention.qkv', 1)."""
    index, _, inner = module.removeprefix("layers.").partition(".")
    if module.startswith("layers.") and index.isdigit() and inner in _BLOCK_NAMES:
        name, part = _BLOCK_NAMES[inner]
        return f"layers.{index}.{name}", part
    if module in _TOP_LEVEL_NAMES:
        return module, None
    raise ValueError(f"export.formats: comfyui has no ComfyUI Ideogram 4 name for LoRA module {module!r}; drop it "
                     "from train.lora_targets or export the 'diffusers' format only")


def comfyui_lora(lora: TensorDict, inner_dim: int) -> TensorDict:
    """The LoRA under Ideogram 4's original names, `diffusion_model.`-prefixed (the generic keys of ComfyUI's
    comfy/lora.py `model_lora_keys_unet` for its Ideogram 4 model, and what Ideogram4Pipeline's loader converts), as
    `lora_down`/`lora_up` with `.alpha` = rank (lora_B is pre-scaled): q/k/v fused exactly into one LoRA per qkv."""
    from diffusion_pipe.lora_keys import down_up_alpha, fuse_loras, lora_modules

    groups: dict[str, dict[int | None, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, pair in lora_modules(lora).items():
        original, part = ideogram4_original_module(module)
        groups.setdefault(original, {})[part] = pair
    out: TensorDict = {}
    for original, parts in sorted(groups.items()):
        a, b = fuse_loras([parts.get(i) for i in range(3)], [inner_dim] * 3) if original.endswith(".qkv") \
            else parts[None]
        out.update(down_up_alpha(f"diffusion_model.{original}", a, b))
    return out
