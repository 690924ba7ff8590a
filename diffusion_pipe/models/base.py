"""The adapter contract: what a model family tells the stages. Adapters describe; they do not train.

An adapter knows its family's diffusers components: how to load them, how to encode media and text, how to
split the denoiser into pipeline layers, and how its LoRA keys are named in each export format. Training maths
lives in `diffusion_pipe.train.objectives`, parallelism in `diffusion_pipe.train.pipeline`.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.params import SamplePrompt

TensorDict = dict[str, torch.Tensor]
Spec = dict[str, tuple[tuple[int, ...], str]]  # tensor name -> (shape, dtype name)


@dataclass(frozen=True)
class Capabilities:
    """What a family can train on and export to."""

    media: tuple[str, ...]  # "image", "video"
    tasks: tuple[str, ...]  # "t2i", "t2v", "i2v", "edit"
    objective: str  # "flow", "epsilon", "v": the default; a checkpoint may pick another (`Adapter.objective`)
    export_formats: tuple[str, ...]
    objectives: tuple[str, ...] = ()  # every objective the family trains with; empty: just `objective`
    # Conditioning latents each sample carries besides its target: the control / reference images of an edit
    # family (scan.datasets[].control), or an image-to-video family's first frame. 0: the family takes none.
    conditioning_latents: int = 0
    # How a conditioning latent is made. '': a control image encoded as it is (edit families). Otherwise the name
    # of a rule (it enters the latent key) by which `Adapter.conditioning_pixels` turns a first frame into what
    # the VAE encodes (Wan I2V: the frame followed by black frames to the target's length); the first frame is
    # the dataset's control image where it declares one, else the clip's own (its window's) first frame.
    conditioning_rule: str = ""
    # Whether the text encoder reads the sample's conditioning image with its caption (Qwen-Image-Edit's VL
    # encoder sees the image to edit): text entries are then per (caption, image), keyed by both, and made by
    # `Adapter.encode_conditioned_text`.
    text_reads_conditioning: bool = False
    # Media the model generates that the family does not train (LTX-2's audio, generated with its video): the
    # models table says "no audio" beside `media`.
    untrained_media: tuple[str, ...] = ()

    @property
    def all_objectives(self) -> tuple[str, ...]:
        """Every objective a checkpoint of this family may train with."""
        return self.objectives or (self.objective,)


@dataclass(frozen=True)
class Batch:
    """One micro-batch as the objective sees it: clean latents (normalised), the text conditioning, and the
    conditioning latents (normalised, one (B, ...) tensor per slot, each in the target's bucket and never noised)."""

    latents: torch.Tensor
    text: TensorDict
    conditioning: tuple[torch.Tensor, ...] = ()


class Adapter(ABC):
    """One model family. Subclasses set `name` and `capabilities` and implement the methods below."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    experts: ClassVar[tuple[str, ...]] = ()  # values `model.expert` may take (Wan 2.2: "high", "low")
    # Whether ComfyUI's LoRA loader also maps this family's diffusers module names under `transformer.` (onto
    # slices of the projections its own layout fuses): a LoKr module that its ComfyUI layout fuses is written so.
    comfyui_reads_diffusers_names: ClassVar[bool] = False

    def __init__(self, model_dir: Path, dtype: torch.dtype, expert: str | None = None) -> None:
        if expert and expert not in self.experts:
            from diffusion_pipe.config import ConfigError

            choices = f"one of {', '.join(self.experts)}" if self.experts else "empty: it has no experts"
            raise ConfigError(f"model.expert: {expert!r} is not an expert of family '{self.name}'; "
                              f"set it to {choices}")
        self.model_dir = model_dir
        self.dtype = dtype
        self.expert = expert or None

    def component_config(self, component: str) -> dict:
        """The diffusers `config.json` of one component directory (`vae`, `transformer`, `text_encoder`, ...)."""
        return self.model_json(f"{component}/config.json")

    def model_json(self, name: str) -> dict:
        """The JSON object in file `name` of the model folder ('model_index.json', 'vae/config.json', ...): a
        ModelFolderError naming it and what the folder should hold when it is missing or not JSON."""
        from diffusion_pipe.model_folder import read_model_json

        return read_model_json(self.model_dir / name, self.model_dir)

    # ---- encode side -------------------------------------------------------------------------------
    @property
    def vae_scale(self) -> int:
        """Pixels per latent cell along a side, as diffusers' image pipelines compute it for an AutoencoderKL:
        one halving per down block but the last. Families whose VAE says it differently override this."""
        return 2 ** (len(self.component_config("vae")["block_out_channels"]) - 1)

    @property
    @abstractmethod
    def pixel_multiple(self) -> int:
        """Bucket sides must be multiples of this many pixels (VAE factor x patch size)."""

    def vae_dir(self) -> Path:
        """The diffusers component directory whose weights make the latents."""
        return self.model_dir / "vae"

    def vae_class(self) -> type[nn.Module]:
        """The diffusers class of the VAE: AutoencoderKL unless the family says otherwise."""
        from diffusers import AutoencoderKL

        return AutoencoderKL

    def text_component_dirs(self) -> tuple[dict[str, Path], dict[str, Path]]:
        """(text encoder dirs, tokenizer dirs) by component name; their hashes key the text entries (a chat
        template kept in the tokenizer's files included). The default is the one-encoder layout most families
        have: `text_encoder/` and `tokenizer/`."""
        return {"text_encoder": self.model_dir / "text_encoder"}, {"tokenizer": self.model_dir / "tokenizer"}

    def load_tokenizers(self) -> dict[str, object]:
        """Every tokenizer of `text_component_dirs` by component name, each checked to tell words apart
        (`common.load_tokenizer`): encode loads them once before anything is encoded or reused, whatever the
        family, so a folder without its vocabulary files is refused instead of training on one text. A folder of
        an image processor's settings alone (Wan 2.1 I2V's `image_processor/`) is no tokenizer and is left out."""
        from diffusion_pipe.models.common import is_image_processor_only, load_tokenizer

        return {name: load_tokenizer(d) for name, d in self.text_component_dirs()[1].items()
                if not is_image_processor_only(d)}

    def caption_token_limits(self, tokenizers: dict[str, object], max_length: int) -> dict[str, int]:
        """How many tokens of a caption (special tokens included) each tokenizer's encoder reads, by tokenizer
        name; a longer caption is cut there (encode counts such captions). The default is how diffusers' pipelines
        read them: a CLIP encoder at its tokenizer's `model_max_length` (its positions, 77), whatever
        `encode.text_max_length` says; any other at `max_length` (`encode.text_max_length`), or its tokenizer's
        `model_max_length` where that is shorter. A family that reads an encoder otherwise overrides this, and
        leaves out a tokenizer that never cuts a caption (one that reads only part of it, or refuses a longer one)."""
        limits = {}
        for name, tokenizer in tokenizers.items():
            own = int(getattr(tokenizer, "model_max_length", max_length) or max_length)
            limits[name] = own if type(tokenizer).__name__.startswith("CLIPTokenizer") else min(max_length, own)
        return limits

    def text_template(self) -> str:
        """The template or system prompt the family's pipeline wraps each caption in before encoding, as a
        string: it changes the embedding, so it is part of the text key. '' when captions are encoded bare."""
        return ""

    def load_vae(self, device: torch.device) -> nn.Module:
        """The frozen VAE, in eval mode, on `device`."""
        from diffusion_pipe.models.common import load_component

        return load_component(self.vae_class(), self.vae_dir(), self.dtype, device)

    @abstractmethod
    def load_text_encoders(self, device: torch.device) -> object:
        """Whatever `encode_text` needs (encoders and tokenizers), frozen, on `device`."""

    @abstractmethod
    def encode_media(self, vae: nn.Module, pixels_BCFHW: torch.Tensor) -> list[TensorDict]:
        """Latents for pixels in [-1, 1] (frames F=1 for images), one entry per item, as the VAE produces them."""

    @abstractmethod
    def encode_text(self, encoders: object, captions: list[str], max_length: int) -> list[TensorDict]:
        """Text conditioning, one entry per caption."""

    def encode_conditioned_text(self, encoders: object, captions: list[str], images_BC1HW: torch.Tensor,
                                max_length: int) -> list[TensorDict]:
        """Text conditioning of each caption read with its image (pixels in [-1, 1], one per caption, at the
        sample's size): families with `capabilities.text_reads_conditioning`."""
        raise NotImplementedError(f"family '{self.name}' encodes captions without an image")

    @abstractmethod
    def latent_spec(self, width: int, height: int, frames: int) -> Spec:
        """Shapes/dtypes a latent entry for this bucket must have (checked before training)."""

    @abstractmethod
    def text_spec(self, max_length: int) -> Spec:
        """Shapes/dtypes a text entry must have (checked before training)."""

    # ---- train side --------------------------------------------------------------------------------
    @abstractmethod
    def normalise_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Map stored VAE output to the denoiser's latent space (shift/scale), at load time."""

    def objective(self) -> str:
        """The training objective of this checkpoint ('flow', 'epsilon', 'v'); families whose checkpoints
        differ (SDXL epsilon vs v-prediction) read it from the model's files."""
        return self.capabilities.objective

    def noise_schedule(self) -> dict:
        """The scheduler config (`scheduler/scheduler_config.json`): DDPM objectives take their betas and
        `num_train_timesteps` from it, so training uses the same schedule as inference."""
        return self.model_json("scheduler/scheduler_config.json")

    def timestep_range(self) -> tuple[float, float]:
        """The [lo, hi) fraction of the noise schedule this denoiser trains on; (0, 1) for all of it.
        Mixture-of-experts families (Wan 2.2) train each expert on its own range."""
        return (0.0, 1.0)

    @abstractmethod
    def denoiser_class(self) -> type[nn.Module]:
        """The diffusers class of the denoiser (built from its config on the meta device for training)."""

    def denoiser_dir(self) -> Path:
        """The diffusers component directory of the denoiser's config and safetensors weights: `transformer` (a
        UNet family, or one with several experts, names its own)."""
        return self.model_dir / "transformer"

    def load_denoiser(self, device: torch.device) -> nn.Module:
        """The whole frozen denoiser in `self.dtype` on `device` (tests, merging; training loads per stage)."""
        from diffusion_pipe.models.common import load_component

        return load_component(self.denoiser_class(), self.denoiser_dir(), self.dtype, device)

    @property
    @abstractmethod
    def default_lora_targets(self) -> tuple[str, ...]:
        """Module-name suffixes LoRA wraps when `train.lora_targets` is empty."""

    def lora_exclude(self) -> str | None:
        """A regex of module names that match target suffixes but must stay frozen; None: exclude nothing."""
        return None

    @abstractmethod
    def pipeline_layers(self, denoiser: nn.Module) -> list[nn.Module]:
        """Ordered modules whose composition equals the denoiser's forward; each takes and returns a tuple."""

    @abstractmethod
    def model_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                     guidance: float) -> tuple[torch.Tensor, ...]:
        """The tuple the first pipeline layer takes. `timesteps` are in the objective's units: flow matching
        t in [0, 1]; epsilon and v prediction the discrete DDPM timestep (0 .. N-1, as floats)."""

    def conditioned_inputs(self, noisy_latents: torch.Tensor, timesteps: torch.Tensor, text: TensorDict,
                           guidance: float, conditioning: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The first layer's tuple for a micro-batch with its conditioning latents (`Batch.conditioning`, as many
        as `capabilities.conditioning_latents`): what training calls. A family that takes conditioning overrides
        this and places them (Kontext: packed tokens after the target's, with their own position ids; they travel
        through every pipeline layer with the target's and `prediction_to_latents` drops them before the loss).
        The default is `model_inputs`, for families that take none."""
        self.check_conditioning_count(conditioning)
        return self.model_inputs(noisy_latents, timesteps, text, guidance)

    def check_conditioning_count(self, conditioning: tuple[torch.Tensor, ...]) -> None:
        """ValueError unless a micro-batch carries as many conditioning latents as the family takes: the first
        thing every `conditioned_inputs` does."""
        if len(conditioning) != self.capabilities.conditioning_latents:
            raise ValueError(f"family '{self.name}' takes {self.capabilities.conditioning_latents} conditioning "
                             f"latents per sample, got {len(conditioning)}")

    def conditioning_pixels(self, first_frame_BC1HW: torch.Tensor, frames: int) -> torch.Tensor:
        """What the VAE encodes into a sample's conditioning latent, from its first frame (pixels in [-1, 1])
        and the target's frame count: families with a `capabilities.conditioning_rule` implement it as their
        pipeline builds its condition, so that training sees what inference feeds the denoiser."""
        raise NotImplementedError(f"family '{self.name}' has no conditioning rule")

    def keep_clean(self, noisy_latents: torch.Tensor, target: torch.Tensor,
                   latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(noisy latents, loss target) for a micro-batch of clean `latents`. A family conditioned on part of the
        sample itself (Wan 2.2 TI2V: a clip's first latent frame) puts the clean latents there and leaves that
        part out of the target; its `model_inputs` marks it clean (timestep 0) and `prediction_to_latents` drops
        it from the prediction, so the loss covers what the model must generate. The default changes nothing."""
        return noisy_latents, target

    @abstractmethod
    def prediction_to_latents(self, prediction: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Reshape the last layer's output to the latent layout of `like` (e.g. unpack Flux tokens), dropping
        any output that is not the target's (conditioning tokens)."""

    # ---- export side -------------------------------------------------------------------------------
    @abstractmethod
    def export_lora(self, lora: TensorDict, fmt: str) -> TensorDict:
        """The LoRA in export format `fmt` (one of `capabilities.export_formats`).

        `lora` holds PEFT-named tensors ('blocks.0.attn.to_q.lora_A.weight', ...) with the alpha/rank scale
        already folded into lora_B, so the result must apply at scale 1: formats that carry alpha get
        `.alpha` = rank of that module. Unknown `fmt`: ValueError naming `export.formats` (`unknown_format`).
        """

    def transformer_export(self, lora: TensorDict, fmt: str, comfyui: Callable[[TensorDict], TensorDict]) -> TensorDict:
        """The `export_lora` of a family whose diffusers pipeline loads PEFT names under `transformer.` and whose
        ComfyUI layout `comfyui(lora)` writes."""
        if fmt == "diffusers":
            return {f"transformer.{k}": v for k, v in lora.items()}
        if fmt == "comfyui":
            return comfyui(lora)
        raise self.unknown_format(fmt)

    def unknown_format(self, fmt: str) -> ValueError:
        """The error `export_lora` raises for a format this family does not write, naming the param and the
        family's formats."""
        return ValueError(f"export.formats: {fmt!r} is not supported by family '{self.name}' "
                          f"(supported: {', '.join(self.capabilities.export_formats)})")

    # ---- sample side -------------------------------------------------------------------------------
    def pipeline_class(self) -> type:
        """The family's diffusers pipeline class: training samples and the `sample` stage render with it."""
        from diffusion_pipe.config import ConfigError

        raise ConfigError(f"train.samples.prompts: family '{self.name}' cannot render samples yet; "
                          "leave the prompts empty")

    def sample_size_multiple(self) -> int:
        """Sample widths and heights must be multiples of this: `pixel_multiple`, unless the family's pipeline
        demands more (LTXPipeline: 32)."""
        return self.pixel_multiple

    def sample_pipeline(self, denoiser: nn.Module, vae: nn.Module) -> object:
        """The family's pipeline over `denoiser` (as it is being trained), `vae` and the model's own scheduler,
        without text encoders: prompts arrive as stored embeddings (`sample_inputs`), so no text encoder sits
        in memory during training."""
        from diffusion_pipe.models.common import bare_pipeline

        pipe = bare_pipeline(self.pipeline_class(), **{self.denoiser_dir().name: denoiser, "vae": vae,
                                                       "scheduler": self.load_scheduler()},
                             **self.pipeline_config())
        pipe.set_progress_bar_config(desc="samples", unit="step", leave=False, file=sys.stderr)
        return pipe

    def load_pipeline(self, skip: tuple[str, ...] = ()) -> object:
        """The family's whole pipeline from the model folder (the `sample` stage renders with it), without the
        components in `skip` (text encoders and tokenizers, whose embeddings it is given): each component that
        model_index.json lists is checked first, so a folder lacking one (or its config or weights) is a
        ModelFolderError naming it, as everywhere else, and so is a file diffusers or transformers cannot load."""
        from diffusion_pipe.model_folder import model_folder_error, require_pipeline_components

        require_pipeline_components(self.model_dir, skip)
        try:
            return self.pipeline_class().from_pretrained(self.model_dir, torch_dtype=self.dtype,
                                                         **{name: None for name in skip})
        except (OSError, ValueError) as exc:  # a weights file cut short, a config of another model
            raise model_folder_error(self.model_dir, f"the {self.pipeline_class().__name__} cannot load from it "
                                     f"({exc})", self.model_dir) from exc

    def load_scheduler(self, component: str = "scheduler") -> object:
        """The diffusers scheduler of folder `component` (the class its scheduler_config.json names): a
        ModelFolderError naming the file when it is missing or names no diffusers scheduler."""
        import diffusers

        from diffusion_pipe.model_folder import model_folder_error

        config = self.model_json(f"{component}/scheduler_config.json")
        name = config.get("_class_name", "")
        scheduler_cls = getattr(diffusers, name, None) if name else None
        if scheduler_cls is None:
            raise model_folder_error(self.model_dir / component / "scheduler_config.json",
                                     f"names no diffusers scheduler class (_class_name: {name!r})", self.model_dir)
        return scheduler_cls.from_pretrained(self.model_dir / component)

    def pipeline_config(self) -> dict:
        """Settings the family's pipeline takes besides its components (Krea 2: the text layers it taps), as the
        model's `model_index.json` gives them: {} for most families."""
        return {}

    @property
    def samples_need_control(self) -> bool:
        """Whether every sample prompt renders from an image (`SamplePrompt.control`): edit families (the image to
        edit) and image-to-video ones (the first frame)."""
        return self.capabilities.conditioning_latents > 0

    # Keys of `sample_inputs` the pipeline takes once for a whole batch of prompts (Wan 2.1 I2V's image embeddings,
    # which it repeats per prompt): the prompts of a batch share their control image, so the first prompt's value
    # is passed rather than all of them joined.
    sample_shared_inputs: ClassVar[tuple[str, ...]] = ()

    def sample_control_inputs(self, image: object) -> dict:
        """The pipeline call's keyword arguments that carry one prompt's control image (a PIL image already at the
        sample's size): families whose samples render from one (`samples_need_control`)."""
        raise NotImplementedError(f"family '{self.name}' renders samples without a control image")

    def sample_texts(self, prompt: SamplePrompt) -> tuple[str, ...]:
        """The texts a resolved sample prompt renders from, which encode embeds into the store: the prompt and
        its negative prompt (the empty one too: classifier-free guidance runs on its embeddings). A family whose
        guidance can do without a negative prompt leaves it out when `sample_inputs` will not read it."""
        return (prompt.prompt, prompt.negative_prompt)

    def sample_inputs(self, text: TensorDict, negative: TensorDict | None, guidance: float,
                      cfg_scale: float) -> dict:
        """The pipeline call's keyword arguments for one prompt from its stored text entries (`text`, and
        `negative` for the negative prompt, each unbatched; None when `sample_texts` left it out): embeddings,
        guidance and CFG as the family takes them. `guidance` is the pipeline's `guidance_scale`; `cfg_scale`
        true CFG where that is separate."""
        raise NotImplementedError(f"family '{self.name}' has no sample_inputs")

    @classmethod
    @abstractmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """Write a tiny random-init model of this family in diffusers format (tests, examples)."""
