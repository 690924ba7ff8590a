"""The sections of `params.yaml`, one frozen dataclass each, plus the loader for the whole file.

Each stage reads only its own section and `model`; DVC's granular `params:` lists in `dvc.yaml` name exactly
those keys, so editing one key re-runs only the stages that read it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from diffusion_pipe.config import ConfigError, Range, _closest, from_dict, load_yaml
from diffusion_pipe.redact import redact

Dtype = Literal["float32", "bfloat16", "float16"]

# Ranges shared by many params (each class's RANGES names one per numeric field; config.from_dict checks them).
_AT_LEAST_0 = Range(0)
_AT_LEAST_1 = Range(1)
_POSITIVE = Range(0, lo_open=True)
_FRACTION = Range(0, 1, hi_open=True)  # probabilities and fractions that must leave something: [0, 1)
_SEED = Range(0, 2**32 - 1)  # what every RNG we seed (torch, numpy, Python) accepts


@dataclass(frozen=True)
class ModelParams:
    """Which base model: a registered family and where its diffusers-format weights are."""

    family: str = "flux"
    path: str = ""  # a local diffusers directory (relative to the repo root) or a hub id
    dtype: Dtype = "bfloat16"  # dtype of the frozen base weights and of the encoders
    expert: str = ""  # mixture-of-experts models (Wan 2.2): which expert to train, "high" or "low"
    # Single .safetensors files (original / ComfyUI layout, bf16 or fp8) replacing model.path's components;
    # model.path then only needs their configs (diffusion_pipe.models.checkpoints).
    transformer: str = ""  # the denoiser (the UNet for SDXL)
    vae: str = ""
    text_encoders: tuple[str, ...] = ()  # one per text encoder in the family's order, "" keeps model.path's
    # "float8": the frozen denoiser weights of the blocks stay in fp8 (a scale per row) and compute in
    # model.dtype (train/fp8.py); "float8_matmul" also multiplies in fp8 where the GPU supports it.
    base_dtype: Literal["", "float8", "float8_matmul"] = ""

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("model.path is empty: set it to a diffusers directory or a hub id")


@dataclass(frozen=True)
class DatasetParams:
    """One dataset directory and how its items are captioned, bucketed and split."""

    RANGES: ClassVar[dict[str, Range]] = {
        "repeats": Range(1, 10_000), "resolutions": Range(16, 16_384), "frames": Range(1, 10_000),
        "eval_fraction": _FRACTION, "frame_windows": Range(0, 10_000), "loss_weight": Range(0, 1000, lo_open=True),
        "shuffle_tags": Range(0, 1000), "keep_tags": Range(0, 1000),
    }

    path: str
    name: str = ""  # defaults to the directory's base name
    repeats: int = 1
    resolutions: tuple[int, ...] = (512,)  # bucket target areas, as side lengths (512 -> 512*512 pixels)
    frames: tuple[int, ...] = (1,)  # frame buckets for videos; images always have 1 frame
    # Which frames of a longer clip fill its frame bucket: `first` (its first frames), `windows` (several windows,
    # each a training sample of its own: `frame_windows` of them spread evenly, 0 = as many as fit without
    # overlapping) or `whole` (the whole clip at a lower frame rate: every k-th frame). scan/buckets.py.
    frame_extraction: Literal["first", "windows", "whole"] = "first"
    frame_windows: int = 0
    never_upscale: bool = False
    caption_policy: Literal["error", "default", "skip"] = "error"
    caption_extension: str = ".txt"  # a caption file is the media file's base name + this (e.g. ".caption")
    default_caption: str = ""
    caption_prefix: str = ""
    # Tag shuffling (scan/captions.py): each caption also trains as `shuffle_tags` orders of its tags (split at
    # `tag_separator`), the first `keep_tags` tags kept in place; encode embeds each order, train picks one per
    # sample and step. 0: the caption as written.
    shuffle_tags: int = 0
    keep_tags: int = 0
    tag_separator: str = ","
    # Each training sample's loss is multiplied by this (a dataset that should count more, or less, per sample).
    loss_weight: float = 1.0
    eval_fraction: float = 0.0
    # Follow symlinks whose target lies outside `path` (off: such links are excluded rows, never read).
    follow_outside_links: bool = False
    # Edit families (flux_kontext): a directory of control images, one per media file of `path`, matched by
    # relative path without extension (`path/a/cat.png` <- `control/a/cat.jpg`); see scan/manifest.py. For an
    # image-to-video family (wan_i2v) each clip's first frame, in place of the clip's own.
    control: str = ""

    @property
    def manifest_name(self) -> str:
        """The dataset's name in the manifest: `name`, else the base name of its directory ('.' resolved)."""
        if self.name:
            return self.name
        base = os.path.basename(os.path.normpath(self.path))
        return base if base not in ("", ".", "..") else os.path.basename(os.path.abspath(self.path))

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"dataset {self.path!r}: repeats must be >= 1, got {self.repeats}")
        if not self.resolutions or min(self.resolutions) <= 0:
            raise ValueError(f"dataset {self.path!r}: resolutions must be positive, got {self.resolutions}")
        if not self.frames or min(self.frames) <= 0:
            raise ValueError(f"dataset {self.path!r}: frames must be positive, got {self.frames}")
        if not re.fullmatch(r"\.[A-Za-z0-9_]+", self.caption_extension):
            raise ValueError(f"dataset {self.path!r}: caption_extension {self.caption_extension!r} is not a file "
                             "extension such as '.txt' or '.caption'")
        if self.frame_windows and self.frame_extraction != "windows":
            raise ValueError(f"dataset {self.path!r}: frame_windows is {self.frame_windows}, but frame_extraction is "
                             f"{self.frame_extraction!r}; set frame_extraction: windows (or drop frame_windows)")
        if (self.keep_tags or self.tag_separator != ",") and not self.shuffle_tags:
            raise ValueError(f"dataset {self.path!r}: keep_tags and tag_separator apply to tag shuffling, but "
                             "shuffle_tags is 0; set shuffle_tags to the number of tag orders to train on")
        if not self.tag_separator.strip():
            raise ValueError(f"dataset {self.path!r}: tag_separator {self.tag_separator!r} is blank; captions are "
                             "normalised to single spaces, so use a visible separator such as ',' or ';'")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"dataset {self.path!r}: eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.caption_policy == "default" and not self.default_caption:
            raise ValueError(
                f"dataset {self.path!r}: caption_policy is 'default' but default_caption is empty; set it"
            )


@dataclass(frozen=True)
class ScanParams:
    """The scan stage: which datasets, and how buckets are laid out."""

    RANGES: ClassVar[dict[str, Range]] = {
        "bucket_step": Range(1, 1024), "min_aspect": Range(0, 1, lo_open=True), "max_aspect": Range(1, 100),
        "max_image_pixels": _AT_LEAST_0, "max_caption_bytes": _AT_LEAST_1, "workers": Range(0, 4096),
    }

    datasets: tuple[DatasetParams, ...] = ()
    bucket_step: int = 64  # bucket sides are multiples of this many pixels
    min_aspect: float = 0.5  # narrowest bucket, width / height
    max_aspect: float = 2.0  # widest bucket, width / height
    # Larger images are excluded ('too_large', read from the header, never decoded). 0: what training can use,
    # AUTO_PIXELS_PER_BUCKET_PIXEL x the largest bucket area (a larger image shrinks over 10x per side to fit
    # its bucket), but never under AUTO_MIN_IMAGE_PIXELS (a 100-megapixel camera's photos always pass).
    max_image_pixels: int = 0
    # Longer caption files exclude their item ('caption_too_long'), unread: a 50 MB caption took 3.7 GB in encode.
    max_caption_bytes: int = 65_536
    workers: int = 0  # 0: every core

    AUTO_PIXELS_PER_BUCKET_PIXEL: ClassVar[int] = 100
    AUTO_MIN_IMAGE_PIXELS: ClassVar[int] = 100_000_000

    @property
    def image_pixel_limit(self) -> int:
        """The pixel count over which an image is excluded: `max_image_pixels`, or when 0 its default (above)."""
        if self.max_image_pixels:
            return self.max_image_pixels
        largest = max(res for ds in self.datasets for res in ds.resolutions)
        return max(self.AUTO_MIN_IMAGE_PIXELS, self.AUTO_PIXELS_PER_BUCKET_PIXEL * largest * largest)

    def __post_init__(self) -> None:
        if not self.datasets:
            raise ValueError("datasets is empty: list at least one dataset directory under scan.datasets")
        if self.bucket_step <= 0:
            raise ValueError(f"bucket_step must be > 0, got {self.bucket_step}")
        if not 0 < self.min_aspect <= 1 <= self.max_aspect:
            raise ValueError(
                f"min_aspect and max_aspect must satisfy 0 < min_aspect <= 1 <= max_aspect, "
                f"got {self.min_aspect} and {self.max_aspect}"
            )
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0 (0: every core), got {self.workers}")
        if self.max_image_pixels < 0:
            raise ValueError(f"max_image_pixels must be >= 0 (0: what training can use), got {self.max_image_pixels}")
        from diffusion_pipe.scan.buckets import bucket_layout  # lazy: the scan package imports this module

        for i, ds in enumerate(self.datasets):
            for res in ds.resolutions:
                if not bucket_layout(res, self.bucket_step, self.min_aspect, self.max_aspect):
                    raise ValueError(
                        f"datasets[{i}].resolutions: {res} has no bucket with sides that are multiples of "
                        f"bucket_step {self.bucket_step} and aspect in [{self.min_aspect}, {self.max_aspect}]; "
                        f"use a resolution that is a multiple of bucket_step (>= it), or a smaller bucket_step"
                    )


@dataclass(frozen=True)
class EncodeParams:
    """The encode stage: how latents and text embeddings are computed."""

    RANGES: ClassVar[dict[str, Range]] = {
        "batch_size": _AT_LEAST_1, "text_max_length": Range(1, 65_536), "pack_size_mb": Range(0, 65_536, lo_open=True),
        "workers": Range(0, 4096), "worker_stall_timeout_s": _POSITIVE,
    }

    batch_size: int = 8
    device: Literal["auto", "cpu", "cuda"] = "auto"
    text_max_length: int = 512  # tokens of the sequence text encoder (T5 for Flux)
    pack_size_mb: float = 256  # a store pack is flushed once it holds this much (fractions: small test packs)
    workers: int = 2  # CPU workers decoding and resizing media, overlapping with the encoders
    # Where the store is shared: "dvc" (the repo's default DVC remote, if one is configured), "dvc:NAME" (DVC
    # remote NAME), "" (none: local store only), or a URL/path (/mnt/share, ssh://host/path, s3://bucket/prefix).
    remote: str = "dvc"
    push: bool = True  # upload the packs this run computed to the remote
    # Under a launcher (torchrun), rank 0 waits for the other workers' entries; it gives up when none arrived
    # for this long.
    worker_stall_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.text_max_length < 1:
            raise ValueError(f"text_max_length must be >= 1, got {self.text_max_length}")
        if not self.pack_size_mb > 0:
            raise ValueError(f"pack_size_mb must be > 0, got {self.pack_size_mb}")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0 (0: decode in the encoding process), got {self.workers}")
        if self.worker_stall_timeout_s <= 0:
            raise ValueError(f"worker_stall_timeout_s must be > 0, got {self.worker_stall_timeout_s}")
        if self.remote != self.remote.strip():
            raise ValueError(f"remote {redact(self.remote)!r} has surrounding spaces; remove them")
        if self.remote.startswith("dvc:") and not self.remote[4:]:
            raise ValueError("remote 'dvc:' names no DVC remote; write 'dvc:NAME', 'dvc' for the default, or ''")
        if "://" in self.remote and not self.remote.split("://", 1)[1].strip("/"):
            raise ValueError(f"remote {redact(self.remote)!r} has no host or path after the scheme; e.g. s3://bucket/prefix")

    @property
    def pack_bytes(self) -> int:
        """pack_size_mb in bytes (at least 1)."""
        return max(1, int(self.pack_size_mb * (1 << 20)))


@dataclass(frozen=True)
class SamplePrompt:
    """One prompt rendered during training (and by the `sample` stage), with the same seed every time. Sizes,
    frames, steps and guidance of 0 (or less, for guidance) take the `train.samples` defaults."""

    RANGES: ClassVar[dict[str, Range]] = {
        "seed": _SEED, "width": _AT_LEAST_0, "height": _AT_LEAST_0, "frames": _AT_LEAST_0, "steps": _AT_LEAST_0,
        "guidance": Range(), "cfg_scale": _AT_LEAST_0,  # guidance: any finite value (< 0: the default)
    }

    prompt: str
    negative_prompt: str = ""  # families with classifier-free guidance (cfg_scale > 1) use it
    seed: int = 0
    width: int = 0
    height: int = 0
    frames: int = 0  # video families; 1 renders an image
    steps: int = 0
    guidance: float = -1.0  # the family's `guidance_scale` (Flux: distilled guidance; SDXL, Wan: CFG scale)
    cfg_scale: float = 0.0  # Flux: true classifier-free guidance with negative_prompt when > 1
    control: str = ""  # edit families: the image the prompt edits (a path; cover-cropped to the sample's size)

    def __post_init__(self) -> None:
        if not self.prompt.strip():
            raise ValueError("a sample prompt is empty; write the text to render under prompt")
        if min(self.width, self.height, self.frames, self.steps) < 0:
            raise ValueError(f"prompt {self.prompt!r}: width, height, frames and steps must be >= 0 (0: default)")


@dataclass(frozen=True)
class SampleParams:
    """`train.samples`: prompts rendered at step 0, every `every_steps` steps and at the end of training, with
    the LoRA as it is then; also what the `sample` stage renders with and without the exported LoRA."""

    RANGES: ClassVar[dict[str, Range]] = {
        "every_steps": _AT_LEAST_0, "width": _AT_LEAST_1, "height": _AT_LEAST_1, "frames": _AT_LEAST_1,
        "steps": _AT_LEAST_1, "guidance": _AT_LEAST_0, "cfg_scale": _AT_LEAST_0,
    }

    prompts: tuple[SamplePrompt, ...] = ()
    every_steps: int = 0  # 0: only at step 0 and at the end
    width: int = 512
    height: int = 512
    frames: int = 1
    steps: int = 20
    guidance: float = 3.5
    cfg_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"samples.every_steps must be >= 0 (0: at step 0 and the end), got {self.every_steps}")
        if min(self.width, self.height, self.frames, self.steps) < 1:
            raise ValueError("samples: width, height, frames and steps must be >= 1")

    def resolved(self) -> tuple[SamplePrompt, ...]:
        """Every prompt with the section's defaults filled in."""
        from dataclasses import replace

        return tuple(replace(p, width=p.width or self.width, height=p.height or self.height,
                             frames=p.frames or self.frames, steps=p.steps or self.steps,
                             guidance=p.guidance if p.guidance >= 0 else self.guidance,
                             cfg_scale=p.cfg_scale or self.cfg_scale) for p in self.prompts)



# train.optimizer: the optimizers train/optim.py's OPTIMIZERS builds; each one's `train.optimizer_args` are the
# fields of its class in OPTIMIZER_ARGS (an unknown key is an error naming it). train.learning_rate and
# train.weight_decay apply to every one; train.adam_betas and train.adam_eps to the Adam family (adamw, adamw8bit,
# prodigy, schedulefree_adamw).
Optimizer = Literal["adamw", "adamw8bit", "prodigy", "schedulefree_adamw", "adafactor", "muon"]
_ADAM_FAMILY = ("adamw", "adamw8bit", "prodigy", "schedulefree_adamw")


@dataclass(frozen=True)
class AdamWArgs:
    """train.optimizer: adamw (torch's AdamW) has no args of its own beyond train.adam_betas and adam_eps."""


@dataclass(frozen=True)
class AdamW8bitArgs:
    """train.optimizer: adamw8bit (bitsandbytes' AdamW8bit, CUDA GPUs only)."""

    RANGES: ClassVar[dict[str, Range]] = {"min_8bit_size": _AT_LEAST_1}

    min_8bit_size: int = 4096  # tensors with fewer elements keep 32-bit state (bitsandbytes' default)


@dataclass(frozen=True)
class ProdigyArgs:
    """train.optimizer: prodigy (prodigyopt's Prodigy): estimates the step size itself, so train.learning_rate is a
    multiplier of its estimate and is usually 1.0."""

    RANGES: ClassVar[dict[str, Range]] = {
        "d_coef": _POSITIVE, "d0": _POSITIVE, "beta3": _FRACTION, "growth_rate": Range(1), "slice_p": _AT_LEAST_1,
    }

    d_coef: float = 1.0  # scales the estimated step size (below 1: more cautious)
    d0: float = 1.0e-6  # the initial estimate
    beta3: float | None = None  # null: sqrt(adam_betas[1]), Prodigy's default
    growth_rate: float | None = None  # the most the estimate grows per step, as a factor; null: unbounded
    decouple: bool = True  # AdamW-style decoupled weight decay
    use_bias_correction: bool = False
    safeguard_warmup: bool = False  # recommended with a warmup (train.warmup_steps > 0)
    slice_p: int = 1  # estimate from every p-th weight only (less memory; about 11 is reasonable)


@dataclass(frozen=True)
class ScheduleFreeAdamWArgs:
    """train.optimizer: schedulefree_adamw (schedulefree's AdamWScheduleFree): no LR schedule (train.lr_scheduler
    must be constant and train.warmup_steps 0); its own warmup is `warmup_steps` here."""

    RANGES: ClassVar[dict[str, Range]] = {"warmup_steps": _AT_LEAST_0, "r": _AT_LEAST_0, "weight_lr_power": _AT_LEAST_0}

    warmup_steps: int = 0  # linear warmup of the step size, inside the optimizer
    r: float = 0.0  # polynomial weighting of the average
    weight_lr_power: float = 2.0  # during warmup, each average weight is the step size to this power


@dataclass(frozen=True)
class AdafactorArgs:
    """train.optimizer: adafactor (transformers' Adafactor) with the step size train.learning_rate (its
    relative_step mode is not offered: it would ignore the learning rate)."""

    RANGES: ClassVar[dict[str, Range]] = {"clip_threshold": _POSITIVE, "decay_rate": Range(-1, 0),
                                          "beta1": _FRACTION, "eps": _POSITIVE}

    scale_parameter: bool = False  # scale the step size by each weight's RMS
    clip_threshold: float = 1.0  # the most an update's RMS may be
    decay_rate: float = -0.8  # the second moment's decay, as a power of the step
    beta1: float | None = None  # null: no first moment (Adafactor's memory saving); e.g. 0.9 to keep one
    eps: tuple[float, float] = (1.0e-30, 1.0e-3)  # added to squared gradients; the least weight scale


@dataclass(frozen=True)
class MuonArgs:
    """train.optimizer: muon (torch.optim.Muon): orthogonalised momentum, for 2-D weight matrices only (a LoRA's A
    and B on linear layers)."""

    RANGES: ClassVar[dict[str, Range]] = {"momentum": _FRACTION, "ns_steps": Range(1, 100), "eps": _POSITIVE}

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations
    eps: float = 1.0e-7
    # "match_rms_adamw" scales each update to AdamW's size, so AdamW's learning rate and weight decay carry over
    adjust_lr_fn: Literal["original", "match_rms_adamw"] = "original"


OPTIMIZER_ARGS: dict[str, type] = {
    "adamw": AdamWArgs, "adamw8bit": AdamW8bitArgs, "prodigy": ProdigyArgs,
    "schedulefree_adamw": ScheduleFreeAdamWArgs, "adafactor": AdafactorArgs, "muon": MuonArgs,
}


@dataclass(frozen=True)
class TrainParams:
    """The train stage: optimisation, LoRA, objective, parallel layout, checkpoints and evaluation."""

    RANGES: ClassVar[dict[str, Range]] = {
        "seed": _SEED, "steps": _AT_LEAST_1, "micro_batch_size": _AT_LEAST_1, "gradient_accumulation_steps": _AT_LEAST_1,
        "learning_rate": Range(0, 1, lo_open=True), "warmup_steps": _AT_LEAST_0, "weight_decay": _AT_LEAST_0,
        "adam_betas": _FRACTION, "adam_eps": Range(0, 1, lo_open=True), "max_grad_norm": _AT_LEAST_0,  # 0: no clipping
        "lora_rank": Range(1, 4096), "lora_alpha": _POSITIVE, "lora_dropout": _FRACTION, "lokr_factor": Range(-1, 4096),
        # The timestep and noise params, bounded well past any meaningful value: a shift of 100 already puts 99%
        # of uniform timesteps above 0.5 (published models use 1-17), and a shift or guidance past float32's
        # 3.4e38 is infinite in the step, which then trains on NaN (and the divergence error would blame the
        # learning rate). At a min-SNR gamma of 1000 only SD's cleanest step (SNR about 1180) is weighted down.
        "flow_shift": Range(0.01, 100), "guidance": Range(0, 100), "noise_offset": Range(0, 1),
        "min_snr_gamma": Range(0, 1000), "epochs": _AT_LEAST_0,
        "pipeline_stages": _AT_LEAST_1, "blocks_to_swap": _AT_LEAST_0, "max_gpu_memory_gb": _AT_LEAST_0,
        "activation_checkpointing_share": Range(0, 1, lo_open=True),
        "checkpoint_every_steps": _AT_LEAST_0, "checkpoint_every_minutes": _AT_LEAST_0, "keep_checkpoints": _AT_LEAST_0,
        "eval_every_steps": _AT_LEAST_0, "eval_timesteps": Range(0, 1),  # a fraction of the noise schedule
        "save_lora_every_steps": _AT_LEAST_0, "caption_dropout": Range(0, 1),
        # where the Huber losses turn from quadratic to linear, in units of the target (unit-variance latents)
        "huber_c": Range(0, 100, lo_open=True), "timestep_range": Range(0, 1), "mask_min_weight": Range(0, 1),
        "ema_decay": _FRACTION,
    }

    seed: int = 0
    steps: int = 100
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1.0e-4  # prodigy: a multiplier of the step size it estimates, usually 1.0
    # which optimizer steps the LoRA (see OPTIMIZER_ARGS above); its own args in optimizer_args, a mapping
    optimizer: Optimizer = "adamw"
    optimizer_args: Any = None  # read into OPTIMIZER_ARGS[optimizer] (None or {}: its defaults)
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1.0e-8
    max_grad_norm: float = 1.0
    # what trains: "lora" (adapters on lora_targets), "lokr" (LyCORIS LoKr: a Kronecker product of two small
    # matrices), "loha" (LyCORIS LoHa: a Hadamard product of two low-rank products), all three through peft, with
    # lora_rank / lora_alpha as their rank and alpha; LoKr and LoHa export to ComfyUI and kohya, not diffusers
    # (docs/training.md#lokr-loha-and-dora). Or "full" (every weight of the denoiser; the export is then a
    # diffusers component directory, artifacts/<export.name>.full/, and the lora_* params are not used)
    adapter: Literal["lora", "lokr", "loha", "full"] = "lora"
    lora_rank: int = 16
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0  # adapter: lora only
    lora_dora: bool = False  # adapter: lora only: DoRA, a learned magnitude per output feature besides the LoRA
    # adapter: lokr: how each dimension splits between the two Kronecker factors (peft's decompose_factor): the
    # first factor's size where it divides the dimension, else the divisor pair nearest it; -1: nearest the square
    # root. The second factor is low-rank (lora_rank) when lora_rank is under half its size, else full.
    lokr_factor: int = -1
    lokr_decompose_both: bool = False  # adapter: lokr: the first factor low-rank too, under the same rule
    lora_targets: tuple[str, ...] = ()  # module name suffixes; empty: the family's defaults
    # a LoRA .safetensors file the adapters start from instead of LoRA's usual init (continue a LoRA): ours
    # (runs/train/lora.safetensors) or an export (diffusers, ComfyUI, kohya); its rank must equal lora_rank; it
    # lands at the strength it applies whatever lora_alpha is; targets it lacks start as usual ("": none)
    init_lora: str = ""
    timestep_sampling: Literal["uniform", "logit_normal"] = "logit_normal"
    flow_shift: float = 1.0
    guidance: float = 1.0  # value fed to guidance-distilled models (Flux-dev) during training
    epochs: int = 0  # > 0: train this many passes over the train split; `steps` is then computed, not read
    noise_offset: float = 0.0  # add this x a per-channel constant to the noise (0.05-0.1 helps learn brightness)
    min_snr_gamma: float = 0.0  # > 0: min-SNR-gamma loss weighting (epsilon / v families; 5 is usual)
    # the training loss of each element's error d (eval always measures MSE): "mse" d^2; "huber" d^2 up to
    # |d| = huber_c, then linear; "pseudo_huber" its smooth form 2 c (sqrt(d^2 + c^2) - c). Loss weights apply to all
    loss: Literal["mse", "huber", "pseudo_huber"] = "mse"
    huber_c: float = 0.1  # the Huber losses' threshold c (loss: huber or pseudo_huber only)
    # [min, max]: training timesteps are drawn only in this part of the noise schedule (0 clean, 1 pure noise), for
    # every timestep_sampling, after flow_shift; eval timesteps are not affected
    timestep_range: tuple[float, float] = (0.0, 1.0)
    # loss masks (`<name>.mask.png` beside an image, white = learn, black = ignore): each latent element weighs
    # mask_min_weight + (1 - mask_min_weight) x mask, so a little of the black background is still learned; only
    # samples with a mask are weighted
    mask_min_weight: float = 0.0
    pipeline_stages: int = 1
    activation_checkpointing: bool = False
    # With activation_checkpointing: the share of each stage's layers that recompute their activations in
    # backward (spread evenly); the others keep theirs, trading memory for speed (train/pipeline.py).
    activation_checkpointing_share: float = 1.0
    # With activation_checkpointing: what a recomputed layer keeps (train/pipeline.py `_keeps`). "": nothing, every
    # op runs again in backward; "attention": attention's outputs; "narrow": those and the outputs of products no
    # wider than their input (projections, an MLP's down projection), so an MLP's up projection and the cheap ops
    # run again.
    activation_checkpointing_keep: Literal["", "attention", "narrow"] = ""
    compile: bool = False  # torch.compile each pipeline layer of this rank (GPUs; the first steps compile)
    # the attention kernel on GPUs: "flash", torch's flash attention (train/pipeline.py `use_attention_kernel`), the
    # only one left: a str, so that a params.yaml still saying "cudnn" gets REMOVED_ATTENTION's reason
    attention: str = "flash"
    blocks_to_swap: int = 0  # frozen weights of this many blocks per stage wait in CPU memory between uses
    # with blocks_to_swap: copy the next swapped block's weights while the current one computes (one more block's
    # weights on the GPU at a time); false: copy each block's when it is needed, the compute waiting for the copy
    swap_prefetch: bool = True
    max_gpu_memory_gb: float = 0.0  # cap this process's GPU memory (0: no cap), e.g. to prove a 24 GB fit
    device: Literal["auto", "cpu", "cuda"] = "auto"
    checkpoint_every_steps: int = 0  # 0: only at the end (and on Ctrl-C)
    # also after the first step that ends this long after the last save (0: never): a crash loses at most this
    checkpoint_every_minutes: float = 30.0
    keep_checkpoints: int = 0  # keep only the newest N checkpoints of a run (0: keep all)
    # also write the LoRA every N steps (0: never) in export.formats, to runs/loras/<run id>/ (train/step_loras.py)
    save_lora_every_steps: int = 0
    # the probability that a training sample takes the empty caption's embedding instead of its own (keeps
    # classifier-free guidance working); encode embeds the empty caption when this is > 0
    caption_dropout: float = 0.0
    eval_every_steps: int = 0  # 0: only at the start and the end
    eval_timesteps: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    # > 0: also keep an exponential moving average of the trained weights, ema = d * ema + (1 - d) * w after each
    # optimizer step (train/ema.py), written to runs/train/lora.ema.safetensors for export.ema (0: off; 0.999 is
    # usual, about the last 1000 steps' weights). Evaluation and samples use the training weights
    ema_decay: float = 0.0
    samples: SampleParams = field(default_factory=SampleParams)  # images rendered as training goes

    REMOVED_ATTENTION: ClassVar[str] = (
        "attention: cudnn was removed: cuDNN's attention kernel computed wrong gradients on an H100 (a relative "
        "difference of 5.9 from flash attention's) and crashed with an illegal memory access on an H200, so a run "
        "with it could train on wrong gradients; set attention: flash (the default), or delete the line")

    def __post_init__(self) -> None:
        self._check_optimizer()
        if self.attention == "cudnn":
            raise ValueError(self.REMOVED_ATTENTION)
        if self.attention != "flash":
            raise ValueError(f"attention: got {self.attention!r}; the only kernel is 'flash' (or delete the line)")
        if self.steps < 1 or self.micro_batch_size < 1 or self.gradient_accumulation_steps < 1:
            raise ValueError("steps, micro_batch_size and gradient_accumulation_steps must be >= 1")
        if self.pipeline_stages < 1:
            raise ValueError(f"pipeline_stages must be >= 1, got {self.pipeline_stages}")
        if self.blocks_to_swap < 0 or self.max_gpu_memory_gb < 0:
            raise ValueError("blocks_to_swap and max_gpu_memory_gb must be >= 0")
        if self.checkpoint_every_steps < 0 or self.checkpoint_every_minutes < 0 or self.keep_checkpoints < 0:
            raise ValueError("checkpoint_every_steps, checkpoint_every_minutes and keep_checkpoints must be >= 0")
        if self.lora_rank < 1:
            raise ValueError(f"lora_rank must be >= 1, got {self.lora_rank}")
        if self.epochs < 0 or self.noise_offset < 0 or self.min_snr_gamma < 0:
            raise ValueError("epochs, noise_offset and min_snr_gamma must be >= 0")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.adapter == "full" and (self.blocks_to_swap or self.save_lora_every_steps):
            raise ValueError(f"adapter is 'full', which trains every weight; blocks_to_swap (which keeps frozen "
                             f"weights in CPU memory) and save_lora_every_steps (LoRA files) need adapter: lora; "
                             f"set them to 0 (they are {self.blocks_to_swap} and {self.save_lora_every_steps})")
        self._check_loss_and_timesteps()
        if self.ema_decay and self.adapter == "full":
            raise ConfigError(f"train.ema_decay: {self.ema_decay:g} averages LoRA adapters, and train.adapter is full; "
                              "set ema_decay: 0, or train a LoRA")
        self._check_adapter()
        if self.activation_checkpointing_keep and not self.activation_checkpointing:
            raise ValueError(f"activation_checkpointing_keep is {self.activation_checkpointing_keep!r}, but "
                             "activation_checkpointing is off; set activation_checkpointing: true (or drop it)")
        if self.activation_checkpointing_share != 1.0 and not self.activation_checkpointing:
            raise ValueError(f"activation_checkpointing_share is {self.activation_checkpointing_share:g}, but "
                             "activation_checkpointing is off; set activation_checkpointing: true (or drop the share)")

    def _check_adapter(self) -> None:
        """Refuse an adapter option the chosen train.adapter does not read, or a combination peft cannot train."""
        defaults = TrainParams.__dataclass_fields__
        owners = {"lora_dora": ("lora",), "lora_dropout": ("lora",), "lokr_factor": ("lokr",),
                  "lokr_decompose_both": ("lokr",)}
        for name, adapters in owners.items():
            if self.adapter not in adapters and getattr(self, name) != defaults[name].default:
                raise ConfigError(f"train.{name}: is {getattr(self, name)!r}, and train.adapter is {self.adapter!r}, "
                                  f"which does not read it (only adapter: {' or '.join(adapters)} does); drop "
                                  f"train.{name}, or set train.adapter: {adapters[0]}")
        if self.lokr_factor == 0:
            raise ConfigError("train.lokr_factor: 0 splits nothing; set -1 (split each dimension evenly) or the "
                              "first Kronecker factor's size (>= 1)")
        if self.init_lora and self.adapter in ("lokr", "loha"):
            raise ConfigError(f"train.init_lora: starts LoRA adapters (lora_A / lora_B), and train.adapter is "
                              f"{self.adapter!r}, which has other tensors; drop init_lora, or train adapter: lora")
        if self.init_lora and self.lora_dora:
            raise ConfigError("train.init_lora: a LoRA file holds no DoRA magnitude, and train.lora_dora is true; "
                              "drop init_lora, or set lora_dora: false")
        if self.lora_dora and self.optimizer == "muon":
            raise ConfigError("train.optimizer: muon updates 2-D weight matrices only, and train.lora_dora trains a "
                              "magnitude vector per module (1-D); set lora_dora: false, or choose another optimizer")

    def _check_loss_and_timesteps(self) -> None:
        if self.loss == "mse" and self.huber_c != 0.1:
            raise ValueError(f"huber_c is {self.huber_c:g}, but loss is 'mse', which does not read it; set loss: "
                             "huber or pseudo_huber (or drop huber_c)")
        if self.huber_c <= 0:
            raise ValueError(f"huber_c must be > 0, got {self.huber_c:g}")
        if len(self.timestep_range) != 2 or not 0 <= self.timestep_range[0] < self.timestep_range[1] <= 1:
            raise ValueError(f"timestep_range must be [min, max] with 0 <= min < max <= 1, got "
                             f"{list(self.timestep_range)}")

    def _check_optimizer(self) -> None:
        """Read `optimizer_args` into the chosen optimizer's args class, and refuse what that optimizer cannot do."""
        cls, args = OPTIMIZER_ARGS[self.optimizer], self.optimizer_args
        if not isinstance(args, cls):
            if dataclasses.is_dataclass(args):
                raise ConfigError(f"train.optimizer_args: holds {type(args).__name__}, and train.optimizer is "
                                  f"{self.optimizer!r}, whose args are {cls.__name__}")
            object.__setattr__(self, "optimizer_args", from_dict(cls, args, "train.optimizer_args"))
        if self.optimizer not in _ADAM_FAMILY:
            defaults = TrainParams.__dataclass_fields__
            for name in ("adam_betas", "adam_eps"):
                if getattr(self, name) != defaults[name].default:
                    raise ConfigError(f"train.{name}: {self.optimizer} does not use it (only {', '.join(_ADAM_FAMILY)} "
                                      f"do); drop it, or set that optimizer's own train.optimizer_args")
        if self.optimizer == "schedulefree_adamw" and (self.lr_scheduler != "constant" or self.warmup_steps):
            raise ConfigError(f"train.optimizer: schedulefree_adamw replaces the learning-rate schedule, and "
                              f"train.lr_scheduler is {self.lr_scheduler!r} with train.warmup_steps "
                              f"{self.warmup_steps}; "
                              "set lr_scheduler: constant and warmup_steps: 0 (its own warmup is "
                              "train.optimizer_args.warmup_steps)")
        if self.optimizer == "muon" and self.adapter == "full":
            raise ConfigError("train.optimizer: muon updates 2-D weight matrices only, and train.adapter: full trains "
                              "every weight (biases and norms are 1-D); train a LoRA, or choose another optimizer")


@dataclass(frozen=True)
class ExportParams:
    """The export stage: which LoRA formats to write, and whether to write a merged checkpoint too."""

    formats: tuple[Literal["diffusers", "comfyui", "kohya"], ...] = ("diffusers",)
    name: str = "lora"  # files are artifacts/<name>.<format>.safetensors, <name>.lineage.json, <name>.merged/
    merged: bool = False  # also write the base denoiser with the LoRA folded in (diffusers format)
    # the EMA of the trained weights (train.ema_decay > 0): "off" exports the trained LoRA; "beside" also writes
    # <name>.ema.<format>.safetensors and <name>.ema.lineage.json; "instead" writes the EMA under the usual names
    # (<name>.<format>.safetensors, and <name>.merged/), so the sample stage renders it
    ema: Literal["off", "beside", "instead"] = "off"

    def __post_init__(self) -> None:
        if not self.formats and not self.merged:
            raise ValueError("formats is empty and merged is false: nothing to export; list a format")
        if len(set(self.formats)) != len(self.formats):
            raise ValueError(f"formats lists a format twice: {list(self.formats)}")
        if not self.name or self.name != self.name.strip() or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"name {self.name!r} must be a plain file name (no '/', not hidden, not empty)")


@dataclass(frozen=True)
class Params:
    """The whole `params.yaml`."""

    model: ModelParams
    scan: ScanParams
    encode: EncodeParams = field(default_factory=EncodeParams)
    train: TrainParams = field(default_factory=TrainParams)
    export: ExportParams = field(default_factory=ExportParams)

    def __post_init__(self) -> None:
        if self.export.ema != "off" and not self.train.ema_decay:
            raise ConfigError(f"export.ema: {self.export.ema} exports the EMA of the trained weights, and "
                              "train.ema_decay is 0 (no EMA is kept); set train.ema_decay (e.g. 0.999), or "
                              "export.ema: off")
        self._check_adapter_export()
        if self.train.adapter == "full":  # what a full fine-tune cannot do, across sections
            if self.model.base_dtype:
                raise ConfigError(f"model.base_dtype: '{self.model.base_dtype}' stores frozen weights in fp8, and "
                                  "train.adapter: full freezes none; leave base_dtype empty, or train a LoRA")
            if self.export.merged or set(self.export.formats) - {"diffusers"}:
                raise ConfigError(f"export: with train.adapter: full the export is the whole denoiser as a diffusers "
                                  f"component directory (artifacts/{self.export.name}.full/); the LoRA formats "
                                  f"{sorted(set(self.export.formats) - {'diffusers'})} and merged "
                                  f"({self.export.merged}) do not apply: set export.formats: [diffusers] and "
                                  "export.merged: false")

    def _check_adapter_export(self) -> None:
        """Refuse, across sections, what LoKr, LoHa and DoRA cannot do: diffusers loads no LoKr / LoHa, a merged
        export folds LoRAs only, and DoRA norms the base weights, which fp8 storage scales per row."""
        train, export = self.train, self.export
        if train.adapter in ("lokr", "loha") and "diffusers" in export.formats:
            raise ConfigError(f"export.formats: lists 'diffusers', and diffusers' load_lora_weights loads no "
                              f"{train.adapter} (train.adapter: {train.adapter}); export it for ComfyUI "
                              "(export.formats: [comfyui], or kohya), or train adapter: lora")
        if export.merged and (train.adapter in ("lokr", "loha") or train.lora_dora):
            raise ConfigError(f"export.merged: folds a plain LoRA into the base weights, and this run trains "
                              f"{'DoRA' if train.lora_dora else train.adapter}; set export.merged: false")
        if train.lora_dora and self.model.base_dtype:
            raise ConfigError(f"train.lora_dora: DoRA divides by the norm of each base weight row, and "
                              f"model.base_dtype: '{self.model.base_dtype}' stores those weights in fp8 with a "
                              "scale per row that peft's DoRA does not apply; leave base_dtype empty, or set "
                              "lora_dora: false")


_SECTIONS: dict[str, type] = {
    "model": ModelParams, "scan": ScanParams, "encode": EncodeParams, "train": TrainParams, "export": ExportParams,
}


def load_params(path: str | Path = "params.yaml") -> Params:
    """Load and validate the whole params file; any bad key anywhere is an error naming it."""
    data = load_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections ({', '.join(_SECTIONS)})")
    for key in data:
        if key not in _SECTIONS:
            raise ConfigError(f"{path}: unknown section '{key}'{_closest(str(key), _SECTIONS)}")
    for name in ("model", "scan"):
        if name not in data:
            raise ConfigError(f"{path}: section '{name}' is missing; add it (see the README)")
    return Params(**{name: from_dict(cls, data.get(name), name) for name, cls in _SECTIONS.items()})
