"""The `sample` stage loads the exported LoRA with load_lora_weights and renders without and with it; with it,
the pictures are those training rendered with the same LoRA in memory (same seeds, same pipeline)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from torch import nn

from diffusion_pipe.config import from_dict
from diffusion_pipe.models.flux import FluxAdapter
from diffusion_pipe.params import Params
from diffusion_pipe.sample.render import grid_layout
from diffusion_pipe.sample.stage import comparison_columns, sample_lora
from diffusion_pipe.store import Store
from diffusion_pipe.train.lora import lora_state_dict
from diffusion_pipe.train.pipeline import Dist
from diffusion_pipe.train.samples import TrainingSamples
from tests.sample.helpers import SAMPLES, lora_model, model_params, store_prompts, train_a_little


def _params_dict(model_dir, samples=SAMPLES) -> dict:
    return {"model": {"family": "flux", "path": str(model_dir), "dtype": "float32"},
            "scan": {"datasets": [{"path": "data"}]}, "encode": {"text_max_length": 32}, "train": {"samples": samples}}


def _params(model_dir, samples=SAMPLES) -> Params:
    return from_dict(Params, _params_dict(model_dir, samples), "params")


def _pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).astype(int)


def test_sample_stage_renders_the_exported_lora_as_training_did(tiny_flux_dir, tmp_path):
    adapter = FluxAdapter(tiny_flux_dir, torch.float32)
    local = lora_model(adapter)
    train_a_little(local.denoiser)
    lora_file = tmp_path / "artifacts" / "lora.diffusers.safetensors"
    lora_file.parent.mkdir()
    save_file(adapter.export_lora(lora_state_dict(local.denoiser), "diffusers"), str(lora_file))

    out = tmp_path / "reports" / "lora_samples"
    report = sample_lora(_params(tiny_flux_dir), lora_file, out, tmp_path / "reports" / "sample.json",
                         tmp_path / "videos", "cpu")

    assert sorted(p.name for p in out.iterdir()) == ["00-with.png", "00-without.png", "01-with.png",
                                                     "01-without.png", "comparison.png"]
    assert json.loads((tmp_path / "reports" / "sample.json").read_text()) == report
    assert all(p["mean_abs_difference"] > 2 for p in report["prompts"])  # the file loaded and changed the output
    # a row per prompt, without | with, labelled: each cell is its file scaled up 4 times (32 px to 128)
    comparison = _pixels(out / "comparison.png")
    layout = grid_layout([[(32, 32)] * 2] * 2, [p["prompt"] for p in SAMPLES["prompts"]],
                         comparison_columns(control=False, full=False))
    assert comparison.shape == (layout.height, layout.width, 3) and layout.up == 4
    for i, boxes in enumerate(layout.cells):
        for tag, (top, left, bottom, right) in zip(("without", "with"), boxes):
            assert np.array_equal(comparison[top:bottom, left:right],
                                  _pixels(out / f"{i:02d}-{tag}.png").repeat(4, axis=0).repeat(4, axis=1))

    # Training's renderer, on the LoRA still in memory: the same pictures as the exported file loaded by diffusers.
    store = Store(tmp_path / "store")
    store_prompts(adapter, tiny_flux_dir, _params(tiny_flux_dir).train.samples, store)
    TrainingSamples.create(_params(tiny_flux_dir).train.samples, 4, model_params(tiny_flux_dir), 32, adapter, store,
                           local.denoiser, nn.ModuleList(local.layers),
                           Dist(rank=0, world=1, local_rank=0, device=torch.device("cpu")), 1, 1, tmp_path / "run",
                           None, writer=None).render(4, final=True)
    for i in range(2):
        assert np.abs(_pixels(tmp_path / "run" / "step000004" / f"{i:02d}.png")
                      - _pixels(out / f"{i:02d}-with.png")).max() <= 1


def test_without_prompts_or_a_diffusers_export_the_stage_renders_nothing(tiny_flux_dir, tmp_path):
    """The stage is in every pipeline's dvc.yaml: with nothing to render it writes empty outputs, so dvc repro
    goes on, and says why."""
    report = sample_lora(_params(tiny_flux_dir, SAMPLES | {"prompts": []}), tmp_path / "x", tmp_path / "out",
                         tmp_path / "r.json", tmp_path, "cpu")
    assert report["skipped"] == "train.samples.prompts is empty"
    assert json.loads((tmp_path / "r.json").read_text()) == report and not any((tmp_path / "out").iterdir())
    comfy_only = from_dict(Params, {**_params_dict(tiny_flux_dir), "export": {"formats": ["comfyui"]}}, "params")
    assert sample_lora(comfy_only, tmp_path / "x", tmp_path / "out", tmp_path / "r.json", tmp_path,
                       "cpu")["skipped"] == "export.formats has no 'diffusers'"


def test_sample_stage_errors_name_the_fix(tiny_flux_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no exported LoRA there; run the export stage with 'diffusers'"):
        sample_lora(_params(tiny_flux_dir), tmp_path / "missing.safetensors", tmp_path, tmp_path / "r.json",
                    tmp_path, "cpu")
