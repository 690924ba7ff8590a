"""A tiny Flux with a LoRA that changes its output, and the sample prompts' text entries in a store."""

from __future__ import annotations

from pathlib import Path

import torch

from diffusion_pipe.config import from_dict
from diffusion_pipe.encode.encode import sample_text_keys
from diffusion_pipe.models.flux import FluxAdapter
from diffusion_pipe.params import ModelParams, SampleParams
from diffusion_pipe.sample.render import encode_sample_texts, prompt_texts
from diffusion_pipe.store import Store
from diffusion_pipe.train.build import LocalModel, build_local_model

SAMPLES = {"width": 32, "height": 32, "steps": 3, "every_steps": 2,
           "prompts": [{"prompt": "a red circle on a white background", "seed": 1},
                       {"prompt": "a blue square on a black background", "seed": 2}]}


def sample_params(**edits) -> SampleParams:
    return from_dict(SampleParams, SAMPLES | edits, "train.samples")


def model_params(model_dir: Path) -> ModelParams:
    return ModelParams(family="flux", path=str(model_dir), dtype="float32")


def lora_model(adapter: FluxAdapter, dropout: float = 0.0) -> LocalModel:
    """The denoiser with a rank-4 LoRA (alpha = rank: scale 1), as training builds it on one stage."""
    local = build_local_model(adapter, 1, 0, targets=adapter.default_lora_targets, rank=4, alpha=4.0,
                              dropout=dropout, seed=0)
    local.denoiser.train()  # as the engine leaves it between steps
    return local


def train_a_little(denoiser: torch.nn.Module, seed: int = 0) -> None:
    """Stand in for training: give every lora_B (zero at init) values that visibly change the output."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in denoiser.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator))


def store_prompts(adapter: FluxAdapter, model_dir: Path, samples: SampleParams, store: Store,
                  max_length: int = 32) -> None:
    """Embed the prompts into `store` as the encode stage does."""
    encoders = adapter.load_text_encoders(torch.device("cpu"))
    texts = prompt_texts(adapter, samples.resolved())
    keys = sample_text_keys(adapter, model_params(model_dir), max_length, texts)
    entries = encode_sample_texts(adapter, encoders, texts, max_length)
    with store.writer("text") as writer:
        for text, key in keys.items():
            writer.add(key, entries[text])
