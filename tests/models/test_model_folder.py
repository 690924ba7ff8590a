"""A model folder that lacks a part, or holds a tokenizer without its vocabulary: one error naming the part and what
a diffusers folder holds, wherever the part is loaded (encode side and train side), instead of a bare [Errno 2], a
library traceback, or (the tokenizer) a run that trains on one text for every caption."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from diffusion_pipe.model_folder import MissingModelKey, ModelFolderError
from diffusion_pipe.models.common import load_tokenizer
from diffusion_pipe.models.flux import FluxAdapter
from diffusion_pipe.train.build import build_local_model
from diffusion_pipe.weights import component_hash, tokenizer_hash

CPU = torch.device("cpu")
LAYOUT = r"must be a diffusers-format model folder, which holds model_index.json, the denoiser in transformer/ or unet/"


@pytest.fixture
def model_dir(tiny_flux_dir: Path, tmp_path: Path, store_env: Path) -> Path:
    """A private copy of the tiny Flux model, which a test may break."""
    return Path(shutil.copytree(tiny_flux_dir, tmp_path / "model"))


def _build_stage(adapter: FluxAdapter) -> object:
    return build_local_model(adapter, 1, 0, targets=adapter.default_lora_targets, rank=2, alpha=2.0, dropout=0.0,
                             seed=0)


def _sample_stage_pipeline(adapter: FluxAdapter) -> object:
    """What the sample stage loads: the whole pipeline but its text encoders and tokenizers."""
    encoders, tokenizers = adapter.text_component_dirs()
    return adapter.load_pipeline(skip=(*encoders, *tokenizers))


# (part removed, what loads it, the message's problem): each load a stage makes of a component file or folder
CASES: list[tuple[str, Callable[[FluxAdapter], object], str]] = [
    ("transformer/config.json", _build_stage, "missing"),  # train: was diffusers' OSError traceback
    ("transformer/config.json", lambda a: a.load_denoiser(CPU), "missing"),
    ("transformer/diffusion_pytorch_model.safetensors", _build_stage, "no .safetensors weights"),
    ("vae/config.json", lambda a: a.vae_scale, "missing"),  # encode plans: was a bare [Errno 2]
    ("vae/config.json", lambda a: a.load_vae(CPU), "missing"),
    ("vae", lambda a: component_hash(a.vae_dir()), "no such folder"),  # was a NotADirectoryError traceback
    ("vae", lambda a: a.latent_spec(64, 64, 1), "missing, and so is its folder vae/"),
    ("scheduler/scheduler_config.json", lambda a: a.noise_schedule(), "missing"),  # train's DDPM schedule
    ("scheduler/scheduler_config.json", lambda a: a.sample_pipeline(None, None), "missing"),  # training samples
    ("text_encoder/model.safetensors", lambda a: a.load_text_encoders(CPU), "CLIPTextModel cannot load from it"),
    ("tokenizer", lambda a: tokenizer_hash(a.model_dir / "tokenizer"), "no such folder"),
    ("tokenizer", lambda a: a.load_tokenizers(), "no such folder"),
    # the sample stage's pipeline: was diffusers' traceback (or, for a folder, its hub lookup)
    ("model_index.json", _sample_stage_pipeline, "missing"),
    ("transformer", _sample_stage_pipeline, "no such folder"),
    ("vae/diffusion_pytorch_model.safetensors", _sample_stage_pipeline, "no .safetensors weights of the "
                                                                        "AutoencoderKL"),
    ("scheduler/scheduler_config.json", _sample_stage_pipeline, "no config of the FlowMatchEulerDiscreteScheduler"),
]


@pytest.mark.parametrize(("part", "load", "problem"), CASES, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(CASES)])
def test_a_missing_part_is_named_with_what_a_diffusers_folder_holds(model_dir: Path, part: str,
                                                                    load: Callable[[FluxAdapter], object],
                                                                    problem: str) -> None:
    path = model_dir / part
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    adapter = FluxAdapter(model_dir, torch.float32)
    with pytest.raises(ModelFolderError, match=rf"{model_dir}/{part.split('/')[0]}.*: {problem}.*{LAYOUT}"):
        load(adapter)


def test_a_config_cut_short_is_named_not_a_json_traceback(model_dir: Path) -> None:
    (model_dir / "vae" / "config.json").write_text('{"block_out_channels": [16,')
    with pytest.raises(ModelFolderError, match=rf"{model_dir}/vae/config.json: not valid JSON .*{LAYOUT}"):
        FluxAdapter(model_dir, torch.float32).vae_scale


@pytest.mark.parametrize(("part", "load"), [
    ("text_encoder/model.safetensors", lambda a: a.load_text_encoders(CPU)),  # transformers: a SafetensorError
    ("transformer/diffusion_pytorch_model.safetensors", _build_stage),  # train's own loader: a SafetensorError
    ("vae/diffusion_pytorch_model.safetensors", lambda a: a.load_vae(CPU)),  # diffusers: an OSError
    ("vae/diffusion_pytorch_model.safetensors", _sample_stage_pipeline),  # the pipeline's from_pretrained
], ids=["text_encoder", "transformer", "vae", "sample-stage-vae"])
def test_a_weights_file_cut_short_is_named(model_dir: Path, part: str, load: Callable[[FluxAdapter], object]) -> None:
    path = model_dir / part
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    with pytest.raises(ModelFolderError, match=rf"{model_dir}/{part.split('/')[0]}.*: .*{LAYOUT}"):
        load(FluxAdapter(model_dir, torch.float32))


def test_a_config_without_a_key_the_family_reads_names_the_file_and_key(model_dir: Path) -> None:
    """A config of another model (or format): the key is named, not a bare KeyError; still a KeyError to library
    code that reads a config with a fallback."""
    (model_dir / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL", "in_channels": 3}))
    with pytest.raises(MissingModelKey, match=rf"{model_dir}/vae/config.json: has no 'block_out_channels': is it "
                                              rf"this model family's vae, in diffusers format\?.*{LAYOUT}") as err:
        FluxAdapter(model_dir, torch.float32).vae_scale
    assert isinstance(err.value, KeyError)


def test_a_scheduler_config_naming_no_scheduler_is_named(model_dir: Path) -> None:
    (model_dir / "scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": "NoSuchScheduler"}))
    with pytest.raises(ModelFolderError, match=r"scheduler_config.json: names no diffusers scheduler class "
                                               r"\(_class_name: 'NoSuchScheduler'\)"):
        FluxAdapter(model_dir, torch.float32).sample_pipeline(None, None)


@pytest.mark.parametrize("tokenizer", ["tokenizer", "tokenizer_2"])  # CLIP's BPE, T5's Unigram
def test_a_tokenizer_without_its_vocabulary_is_refused(model_dir: Path, tokenizer: str) -> None:
    """transformers loads such a folder as a tokenizer of its special tokens alone, mapping every word to <unk>:
    every caption would encode alike, and a CLIP-only family would learn nothing from its captions."""
    (model_dir / tokenizer / "tokenizer.json").unlink()
    with pytest.raises(ModelFolderError, match=rf"{model_dir}/{tokenizer}: its tokenizer \(\w+, \d+ tokens\) "
                                               r"encodes the words .*'red', 'cat'.* alike.*vocabulary files"):
        FluxAdapter(model_dir, torch.float32).load_tokenizers()


def test_working_tokenizers_pass_and_are_returned(model_dir: Path) -> None:
    tokenizers = FluxAdapter(model_dir, torch.float32).load_tokenizers()
    assert set(tokenizers) == {"tokenizer", "tokenizer_2"}
    again = load_tokenizer(model_dir / "tokenizer")
    assert again("a red cat").input_ids == tokenizers["tokenizer"]("a red cat").input_ids
