"""Qwen-Image-Edit (image editing on Qwen-Image's MMDiT): trained on (control, target) pairs, its Qwen2.5-VL text
encoder reading the image to edit with the instruction.

QwenImageEditPipeline appends the control image's packed latent tokens to the noisy target's (rotary positions
for two images: the control's on the next frame index) and keeps only the target's prediction; training does the
same through every pipeline layer and `prediction_to_latents`. Its text entry is the pipeline's own
`encode_prompt` over the caption and the control image (the VL encoder's vision tokens stay in the embedding), so
text entries are per (caption, control image) and keyed by both (`capabilities.text_reads_conditioning`): editing
a control image re-encodes its latent and its caption's entry, nothing else. The image the VL encoder reads is the
control image as training crops it to the target's bucket, resized as the pipeline resizes its prompt image (to
the area it reads images at, keeping the aspect ratio).

Both checkpoint lines train: Qwen-Image-Edit (QwenImageEditPipeline) and Qwen-Image-Edit-2509 / 2511
(QwenImageEditPlusPipeline: another template, "Picture 1:" before the image, which the VL encoder reads at a
smaller area; 2511's `zero_cond_t` modulates the control tokens by the embedding of timestep 0, which the layers
do as its forward does); the model's `model_index.json` says which pipeline encodes its prompts. One control
image per sample.

transformers builds Qwen2VLProcessor with a video processor, and that only with torchvision; the processor here
is Qwen2VLProcessor without one, over the PIL image processor (the same on a machine with torchvision, so text
keys and entries do not depend on what is installed). Samples render through the edit pipeline: a sample prompt's
texts are read with its control image at the sample's size (entries keyed by it, embedded by encode as a training
caption's); the pipeline encodes the control image itself, as at inference. Caption dropout drops to the
empty caption read with the sample's control image (an entry per control image, made by encode)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import Capabilities, TensorDict
from diffusion_pipe.models.common import (PipelineTextEncoder, image_only_qwen_vl_processor, load_component,
                                         padded_text_entry)
from diffusion_pipe.models.flux import pack_latents, unpack_latents
from diffusion_pipe.models.qwenimage import MODEL_INDEX, QwenImageAdapter

PIPELINES = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")


def _pixels_to_pil(pixels_C1HW: torch.Tensor) -> object:
    from PIL import Image

    array = ((pixels_C1HW[:, 0].float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).cpu().numpy()
    return Image.fromarray(array)


class QwenImageEditAdapter(QwenImageAdapter):
    """Qwen-Image-Edit[-2509/-2511] in diffusers format (transformer, vae, text_encoder, processor, scheduler)."""

    name: ClassVar[str] = "qwenimage_edit"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("image",), tasks=("edit",), objective="flow", export_formats=("diffusers", "comfyui"),
        conditioning_latents=1, text_reads_conditioning=True,
    )
    tiny_vision_tokens: ClassVar[tuple[str, ...]] = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")

    def pipeline_name(self) -> str:
        """The pipeline class `model_index.json` names; a ConfigError unless it is an edit pipeline."""
        from diffusion_pipe.config import ConfigError

        name = self.model_json("model_index.json").get("_class_name", "")
        if name not in PIPELINES:
            raise ConfigError(f"model.path: {self.model_dir} is a {name or 'unknown'} model; family "
                              f"'{self.name}' trains Qwen-Image-Edit ({' or '.join(PIPELINES)}): set model.family "
                              "to the model's own family (`diffusion-pipe models`)")
        return name

    def _text_pipeline(self, text_encoder: nn.Module | None = None, processor: object | None = None) -> object:
        import diffusers

        return getattr(diffusers, self.pipeline_name())(scheduler=None, vae=None, transformer=None,
                                                        text_encoder=text_encoder, tokenizer=None,
                                                        processor=processor)

    def _prompt_area(self) -> int:
        """The area (pixels) the pipeline resizes the image its VL encoder reads to: 1024^2 for Edit, the Plus
        pipeline's CONDITION_IMAGE_SIZE for 2509 / 2511."""
        if self.pipeline_name() == "QwenImageEditPlusPipeline":
            return importlib.import_module("diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus"
                                           ).CONDITION_IMAGE_SIZE
        return 1024 * 1024

    # ---- encode side -------------------------------------------------------------------------------
    def text_component_dirs(self) -> tuple[dict[str, Path], dict[str, Path]]:
        """The VL encoder, and the processor's files (tokenizer and image preprocessing settings)."""
        return {"text_encoder": self.model_dir / "text_encoder"}, {"processor": self.model_dir / "processor"}

    def text_template(self) -> str:
        """The pipeline's template, the tokens it drops, the area its prompt image is resized to and the image
        processor that turns it into patches: each changes the entry."""
        pipe = self._text_pipeline()
        return json.dumps({"pipeline": self.pipeline_name(), "template": pipe.prompt_template_encode,
                           "drop_tokens": pipe.prompt_template_encode_start_idx, "image_area": self._prompt_area(),
                           "image_processor": "Qwen2VLImageProcessorPil"})

    def load_text_encoders(self, device: torch.device) -> PipelineTextEncoder:
        from transformers import Qwen2_5_VLForConditionalGeneration

        encoder = load_component(Qwen2_5_VLForConditionalGeneration, self.model_dir / "text_encoder", self.dtype,
                                 device)
        processor = image_only_qwen_vl_processor(self.model_dir / "processor")
        return PipelineTextEncoder(self._text_pipeline(encoder, processor))

    def encode_text(self, encoders: PipelineTextEncoder, captions: list[str], max_length: int) -> list[TensorDict]:
        raise ValueError(f"family '{self.name}' reads every caption with its control image "
                         "(encode_conditioned_text)")

    @torch.no_grad()
    def encode_conditioned_text(self, encoders: PipelineTextEncoder, captions: list[str], images_BC1HW: torch.Tensor,
                                max_length: int) -> list[TensorDict]:
        """The pipeline's `encode_prompt` of each caption with its image (resized as the pipeline resizes its
        prompt image), one caption at a time as the pipeline encodes a prompt (the Plus pipeline reads a list of
        images as several images of one prompt), zero-padded to `max_length` with the mask of its tokens."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

        pipe = encoders.pipeline
        out = []
        for caption, pixels in zip(captions, images_BC1HW):
            image = _pixels_to_pil(pixels)
            width, height = calculate_dimensions(self._prompt_area(), image.width / image.height)[:2]
            image = pipe.image_processor.resize(image, height, width)
            states, _ = pipe.encode_prompt([caption], image=[image], device=pipe.text_encoder.device)
            length = states.shape[1]
            if length > max_length:
                from diffusion_pipe.config import ConfigError

                raise ConfigError(f"encode.text_max_length: {max_length} is shorter than a caption read with its "
                                  f"{width}x{height} control image ({length} tokens, most of them the image's); "
                                  f"set it to at least {length}")
            out.append(padded_text_entry(states[0], max_length))
        return out

    # ---- train side --------------------------------------------------------------------------------
    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        from diffusion_pipe.models.qwenimage import QwenImageBlock, QwenImageEmbed, QwenImageOut

        config = denoiser.config
        if config.use_additional_t_cond or config.use_layer3d_rope:
            raise ValueError(f"{self.denoiser_dir()}: this is a Qwen-Image layered transformer "
                             "(use_additional_t_cond / use_layer3d_rope); family 'qwenimage_edit' trains the edit "
                             "models")
        return [QwenImageEmbed(denoiser), *(QwenImageBlock(b) for b in denoiser.transformer_blocks),
                QwenImageOut(denoiser)]

    def conditioned_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                           guidance: float, conditioning: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Qwen-Image's inputs with the control image's packed tokens after the target's and its grid after the
        target's, as the edit pipelines call the transformer (`img_shapes`)."""
        self.check_conditioning_count(conditioning)
        hidden, timestep, states, mask, grid = self.model_inputs(noisy_latents, timesteps, text, guidance)
        (control,) = conditioning
        b, _, h, w = control.shape
        control_grid = torch.tensor([[[1, h // 2, w // 2]]] * b)
        return (torch.cat((hidden, pack_latents(control).to(hidden.dtype)), dim=1), timestep, states, mask,
                torch.cat((grid, control_grid), dim=1))

    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The target's tokens only (the first H/2 * W/2, as the pipeline keeps them), unpacked."""
        height, width = like.shape[-2], like.shape[-1]
        return unpack_latents(prediction[:, :(height // 2) * (width // 2)], height, width)

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        import diffusers

        return getattr(diffusers, self.pipeline_name())

    def sample_control_inputs(self, image: object) -> dict:
        """The image to edit, which the pipeline encodes as it does at inference (resized to about 1 MP, its aspect
        kept); the prompts' text entries were read with it at the sample's size."""
        return {"image": image}

    # ---- model -------------------------------------------------------------------------------------
    @classmethod
    def tiny_template(cls) -> str:
        from diffusers import QwenImageEditPipeline

        return QwenImageEditPipeline(None, None, None, None, None, None).prompt_template_encode

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0, plus: bool = False) -> None:
        """Qwen-Image's tiny components with a processor (the tokenizer with the vision tokens the VL encoder
        expects, and a PIL image processor that reads a tiny image as a few patches), as a QwenImageEditPipeline
        directory; `plus` writes a QwenImageEditPlusPipeline one whose transformer has `zero_cond_t` (2511)."""
        from diffusers import QwenImageTransformer2DModel
        from transformers import Qwen2VLImageProcessorPil

        out_dir = Path(out_dir)
        super().build_tiny(out_dir, seed=seed)
        processor_dir = out_dir / "processor"  # as the real repos: the tokenizer's files and the image processor's
        processor_dir.mkdir(parents=True, exist_ok=True)
        for f in (out_dir / "tokenizer").iterdir():
            (processor_dir / f.name).write_bytes(f.read_bytes())
        # 28-pixel patches merged 2x2 after the pipeline's resize: 4 vision tokens
        Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56).save_pretrained(processor_dir)
        if plus:
            torch.manual_seed(seed + 1)
            QwenImageTransformer2DModel(
                patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6), zero_cond_t=True,
            ).save_pretrained(out_dir / "transformer")
        pipeline = "QwenImageEditPlusPipeline" if plus else "QwenImageEditPipeline"
        (out_dir / "model_index.json").write_text(
            MODEL_INDEX.replace('"QwenImagePipeline"', f'"{pipeline}"').replace(
                '"scheduler"', '"processor": ["transformers", "Qwen2VLProcessor"],\n  "scheduler"'))
