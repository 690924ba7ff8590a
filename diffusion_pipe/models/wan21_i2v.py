"""Wan 2.1 I2V (14B-480P / 720P) trained for image-to-video: Wan 2.2 I2V's conditioning (wan_i2v.py: the
first-frame mask and the latent of the first frame followed by black frames) and a CLIP image embedding.

WanImageToVideoPipeline feeds a transformer with `image_dim` its `encode_image` of the first frame (its
CLIPImageProcessor, then the CLIPVisionModel's penultimate hidden states); the transformer's condition embedder
projects them and places them before the text's states for cross-attention, whose blocks read the image's part
with their own key and value projections (`add_k_proj`, `add_v_proj`) and split it from the text's at 512 text
tokens, a length diffusers hard-codes: `encode.text_max_length` must be 512. The embedding is part of the text
entry (`capabilities.text_reads_conditioning`): an entry per (caption, first frame), keyed by both and by the CLIP
encoder and processor, made by the pipeline's own `encode_image` of the first frame at the sample's bucket (the
frame the condition latent starts from: the clip's window's own, or the dataset's control image).

The image processor is CLIPImageProcessorPil (transformers' own fallback without torchvision: entries do not depend
on what is installed). Samples render from each prompt's control image, whose CLIP states its text entries hold.
Caption dropout drops to the empty caption read with the same first frame (an entry per window, made by encode).
Not yet, refused naming its param: the first-last-frame checkpoint (FLF2V: two images' embeddings).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import torch

from diffusion_pipe.models.base import Capabilities, Spec, TensorDict
from diffusion_pipe.models.common import PipelineTextEncoder, bare_pipeline, dtype_name, load_component
from diffusion_pipe.models.qwenimage_edit import _pixels_to_pil
from diffusion_pipe.models.wan import WanAdapter, WanTextEncoder
from diffusion_pipe.models.wan_i2v import CONDITION_RULE, WanI2VAdapter

TEXT_TOKENS = 512  # WanAttnProcessor takes all but the last 512 context states as the image's


class Wan21I2VAdapter(WanI2VAdapter):
    """Wan 2.1 I2V in diffusers format (transformer, vae, text_encoder, tokenizer, image_encoder, image_processor,
    scheduler)."""

    name: ClassVar[str] = "wan21_i2v"
    capabilities: ClassVar[Capabilities] = Capabilities(
        media=("video",), tasks=("i2v",), objective="flow", export_formats=("diffusers", "comfyui"),
        conditioning_latents=1, conditioning_rule=CONDITION_RULE, text_reads_conditioning=True,
    )
    experts: ClassVar[tuple[str, ...]] = ()  # one transformer

    def check_transformer(self, config: dict) -> None:
        """A ConfigError for a transformer without a CLIP image embedding (Wan 2.2 I2V-A14B: family 'wan_i2v'),
        or one that reads two images' (FLF2V, `pos_embed_seq_len`)."""
        from diffusion_pipe.config import ConfigError

        if not config.get("image_dim"):
            raise ConfigError(f"model.path: {self.model_dir} is a Wan 2.2 I2V checkpoint (its transformer takes no "
                              "CLIP image embedding, image_dim); family 'wan21_i2v' trains Wan 2.1 I2V "
                              "(Wan-AI/Wan2.1-I2V-14B-480P-Diffusers, -720P-Diffusers): set model.family to 'wan_i2v'")
        if config.get("pos_embed_seq_len"):
            raise ConfigError(f"model.path: {self.model_dir} is a Wan 2.1 FLF2V checkpoint (first and last frame, "
                              "pos_embed_seq_len), which family 'wan21_i2v' does not train: use a Wan 2.1 I2V model")

    @staticmethod
    def _check_text_length(max_length: int) -> None:
        if max_length != TEXT_TOKENS:
            from diffusion_pipe.config import ConfigError

            raise ConfigError(f"encode.text_max_length: {max_length}; family 'wan21_i2v' needs {TEXT_TOKENS} (the "
                              f"transformer takes the context states before the last {TEXT_TOKENS} as the image's): "
                              f"set it to {TEXT_TOKENS}")

    # ---- encode side -------------------------------------------------------------------------------
    def text_component_dirs(self) -> tuple[dict[str, Path], dict[str, Path]]:
        """UMT5 and the CLIP vision encoder; the tokenizer and the CLIP image processor's settings."""
        d = self.model_dir
        return ({"text_encoder": d / "text_encoder", "image_encoder": d / "image_encoder"},
                {"tokenizer": d / "tokenizer", "image_processor": d / "image_processor"})

    def text_template(self) -> str:
        """What the pipeline's `encode_image` does to the first frame: the processor class, and the hidden
        state it reads (tests check it against the pipeline's code). Either changes the entry."""
        return json.dumps({"image_processor": "CLIPImageProcessorPil", "image_embeds": "hidden_states[-2]"})

    def load_text_encoders(self, device: torch.device) -> PipelineTextEncoder:
        """WanImageToVideoPipeline over UMT5 and the CLIP vision encoder with its image processor."""
        from diffusers import WanImageToVideoPipeline
        from transformers import CLIPImageProcessorPil, CLIPVisionModel

        text = super().load_text_encoders(device)
        return PipelineTextEncoder(bare_pipeline(
            WanImageToVideoPipeline, tokenizer=text.tokenizer, text_encoder=text.t5,
            image_encoder=load_component(CLIPVisionModel, self.model_dir / "image_encoder", self.dtype, device),
            image_processor=CLIPImageProcessorPil.from_pretrained(self.model_dir / "image_processor")))

    def encode_text(self, encoders: PipelineTextEncoder, captions: list[str], max_length: int) -> list[TensorDict]:
        raise ValueError(f"family '{self.name}' reads every caption with its first frame (encode_conditioned_text)")

    @torch.no_grad()
    def encode_conditioned_text(self, encoders: PipelineTextEncoder, captions: list[str], images_BC1HW: torch.Tensor,
                                max_length: int) -> list[TensorDict]:
        """Wan's UMT5 entry of each caption (WanAdapter.encode_text) and the pipeline's own `encode_image` of its
        first frame (`image_embeds`, the CLIP states the transformer embeds)."""
        self._check_text_length(max_length)
        pipe = encoders.pipeline
        texts = WanAdapter.encode_text(self, WanTextEncoder(pipe.text_encoder, pipe.tokenizer), captions, max_length)
        images = pipe.encode_image([_pixels_to_pil(p) for p in images_BC1HW], torch.device("cpu"))
        return [{**text, "image_embeds": image.contiguous()} for text, image in zip(texts, images)]

    def text_spec(self, max_length: int) -> Spec:
        self._check_text_length(max_length)
        clip = self.component_config("image_encoder")
        tokens = (clip["image_size"] // clip["patch_size"]) ** 2 + 1  # the patches and the class token
        return {**super().text_spec(max_length),
                "image_embeds": ((tokens, clip["hidden_size"]), dtype_name(self.dtype))}

    # ---- train side --------------------------------------------------------------------------------
    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        """Wan's, and the cross-attention's key and value projections of the image states."""
        return (*super().default_lora_targets, "attn2.add_k_proj", "attn2.add_v_proj")

    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """Wan's inputs and the CLIP image states, which the first layer embeds and places before the text's."""
        return (*super().model_inputs(noisy_latents, timesteps, text, guidance),
                text["image_embeds"].to(self.dtype))

    # ---- sample side -------------------------------------------------------------------------------
    sample_shared_inputs: ClassVar[tuple[str, ...]] = ("image_embeds",)  # the pipeline repeats them per prompt

    def pipeline_class(self) -> type:
        """WanImageToVideoPipeline, taking the first frame (for its condition latent) and its stored CLIP states
        together, which its input check refuses (it expects one or the other): rendering loads no image encoder."""
        from diffusers import WanImageToVideoPipeline

        class StoredImageEmbedsPipeline(WanImageToVideoPipeline):
            def check_inputs(self, prompt, negative_prompt, image, height, width, prompt_embeds=None,
                             negative_prompt_embeds=None, image_embeds=None, *args, **kwargs):
                return super().check_inputs(prompt, negative_prompt, image, height, width, prompt_embeds,
                                            negative_prompt_embeds, None, *args, **kwargs)

        return StoredImageEmbedsPipeline

    def sample_inputs(self, text: TensorDict, negative: TensorDict, guidance: float, cfg_scale: float) -> dict:
        """Wan's, and the CLIP states of the prompt's first frame (its text entry was read with it), which
        WanImageToVideoPipeline takes as `image_embeds` instead of encoding the image itself."""
        return {**super().sample_inputs(text, negative, guidance, cfg_scale),
                "image_embeds": text["image_embeds"][None].to(self.dtype)}

    # ---- model -------------------------------------------------------------------------------------
    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """Wan 2.2 I2V's tiny model with Wan 2.1 I2V's transformer (`image_dim` and `added_kv_proj_dim`, as
        Wan2.1-I2V-14B-480P-Diffusers' config, at toy width), a 3-layer CLIPVisionModel over 32-pixel images in
        8-pixel patches (17 states) and its image processor, in a WanImageToVideoPipeline model index."""
        from diffusers import WanTransformer3DModel
        from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModel

        out_dir = Path(out_dir)
        WanI2VAdapter.build_tiny(out_dir, seed)
        torch.manual_seed(seed + 2)
        WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16 + 4 + 16,
            out_channels=16, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32, image_dim=32, added_kv_proj_dim=2 * 12,
        ).save_pretrained(out_dir / "transformer")
        CLIPVisionModel(CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=32,
            patch_size=8, projection_dim=16, hidden_act="gelu",
        )).save_pretrained(out_dir / "image_encoder")
        CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
            out_dir / "image_processor")
        index = json.loads((out_dir / "model_index.json").read_text())
        index |= {"image_encoder": ["transformers", "CLIPVisionModel"],
                  "image_processor": ["transformers", "CLIPImageProcessor"]}
        (out_dir / "model_index.json").write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")
