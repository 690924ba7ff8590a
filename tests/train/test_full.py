"""train.adapter: full: every weight of the denoiser trains (no LoRA), the export is the whole denoiser as a
diffusers component directory, and the sample stage loads it the way users load a fine-tune (`from_pretrained`
of the component, in place of the base's)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys

import pytest
import torch
from safetensors import safe_open

from diffusion_pipe.config import ConfigError
from diffusion_pipe.models import load_adapter
from diffusion_pipe.params import load_params
from tests.conftest import REPO, make_pipeline_repo, run_checked, run_env

FULL = {"steps: 120": "steps: 3\n  adapter: full", "eval_every_steps: 40": "eval_every_steps: 0",
        "every_steps: 60": "every_steps: 0", "formats: [diffusers, comfyui]": "formats: [diffusers]",
        "learning_rate: 2.0e-3": "learning_rate: 1.0e-3"}


def _stage(repo, store, name: str) -> None:
    run_checked([sys.executable, "-m", f"stages.{name}"], cwd=repo, env=run_env(store))


def test_full_fine_tune_trains_every_weight_and_exports_a_denoiser_the_pipeline_loads(tmp_path, monkeypatch):
    store = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store, FULL, dvc=False)
    for stage in ("scan", "encode", "train"):
        _stage(repo, store, stage)

    params = load_params(repo / "params.yaml")
    model = dataclasses.replace(params.model, path=str(repo / params.model.path))
    base = dict(load_adapter(model).load_denoiser(torch.device("cpu")).named_parameters())
    with safe_open(repo / "runs/train/lora.safetensors", "pt") as f:
        meta, trained = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    assert meta["diffusion_pipe.adapter"] == "full"
    assert set(trained) == set(base)  # every parameter, under the denoiser's own names: no LoRA tensors
    unchanged = sorted(name for name, value in trained.items() if torch.equal(value, base[name]))
    assert not unchanged  # every weight moved, from the first layer's embedders to the last projection
    report = json.loads((repo / "reports/train.json").read_text())
    assert report["adapter"] == "full" and report["lora_modules"] == 0
    # the checkpoint holds the fp32 masters and AdamW state of every weight
    (checkpoint,) = (repo / "runs/checkpoints").glob("*/step3/stage0.safetensors")
    with safe_open(checkpoint, "pt") as f:
        assert sum(k.startswith("master/") for k in f.keys()) == len(base)

    _stage(repo, store, "export")
    exported = repo / "artifacts/shapes-lora.full"
    lineage = json.loads((repo / "artifacts/shapes-lora.lineage.json").read_text())
    assert json.loads((exported / "lineage.json").read_text())["kind"] == "full"
    # `diffusion-pipe lineage DIR --verify` audits it as it does a merged directory: inputs and exported files
    from diffusion_pipe.lineage.cli import lineage_command

    monkeypatch.setenv("DIFFUSION_PIPE_STORE", str(store))
    text, status = lineage_command(exported, verify=True, repo=repo, other=None, as_json=False)
    assert status == 0, text
    assert "ok     exported file transformer/diffusion_pytorch_model.safetensors" in text
    assert set(lineage["files"]) == {f"shapes-lora.full/{p.relative_to(exported).as_posix()}"
                                     for p in exported.rglob("*") if p.is_file()}
    assert not list((repo / "artifacts").glob("*.safetensors"))  # no LoRA files beside it
    from diffusers import FluxTransformer2DModel

    loaded = dict(FluxTransformer2DModel.from_pretrained(exported / "transformer").named_parameters())
    assert set(loaded) == set(trained)
    for name, value in trained.items():
        assert torch.equal(loaded[name].detach(), value), name

    _stage(repo, store, "sample")
    sampled = json.loads((repo / "reports/sample.json").read_text())
    assert sampled["lora"].endswith("shapes-lora.full") and len(sampled["prompts"]) == 3
    assert all(p["mean_abs_difference"] > 0.5 for p in sampled["prompts"])  # the fine-tune, not the base, rendered


@pytest.mark.parametrize("edit, message", [
    ({"dtype: float32": "dtype: float32\n  base_dtype: float8"}, "model.base_dtype: 'float8' stores frozen weights"),
    ({"formats: [diffusers]": "formats: [diffusers, comfyui]"}, "the LoRA formats ['comfyui']"),
    ({"name: shapes-lora": "name: shapes-lora\n  merged: true"}, "merged (True) do not apply"),
    ({"steps: 3": "steps: 3\n  blocks_to_swap: 2"}, "blocks_to_swap (which keeps frozen weights"),
    ({"steps: 3": "steps: 3\n  save_lora_every_steps: 1"}, "save_lora_every_steps (LoRA files) need adapter: lora"),
])
def test_what_a_full_fine_tune_cannot_do_is_refused_when_params_load(tmp_path, edit, message):
    text = (REPO / "params.yaml").read_text()
    for old, new in {**FULL, **edit}.items():
        text = text.replace(old, new)
    (tmp_path / "params.yaml").write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_params(tmp_path / "params.yaml")


def test_an_interrupted_full_fine_tune_resumes_to_the_same_weights(tmp_path):
    """The checkpoint of a full fine-tune (every weight's fp32 master and AdamW state) resumes exactly: a run
    resumed from step 2 ends with the weights of the run that went straight through."""
    from safetensors.torch import load_file

    store = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store, {**FULL, "steps: 3": "steps: 4\n  checkpoint_every_steps: 2"},
                              dvc=False)
    for stage in ("scan", "encode", "train"):
        _stage(repo, store, stage)
    straight = load_file(repo / "runs/train/lora.safetensors")
    (run,) = (repo / "runs/checkpoints").iterdir()
    shutil.rmtree(run / "step4")  # as if the run had stopped after the checkpoint of step 2
    (repo / "runs/train/lora.safetensors").unlink()
    _stage(repo, store, "train")
    assert json.loads((repo / "reports/train.json").read_text())["resumed_from"] == 2
    resumed = load_file(repo / "runs/train/lora.safetensors")
    assert set(resumed) == set(straight)
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name
