"""Every bundled tiny example runs end to end as the README tells users to run it: its params.yaml copied over the
repository's, then `dvc repro` (scan, encode, train, export, sample). Slow (about 20 s an example): few steps, but
each stage is a real process through DVC, with the example's own params as committed (a key DVC reads missing
from one of them, or a family whose export or samples break, fails here)."""

import json
import math
import re
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

from diffusion_pipe.sample.render import grid_layout
from diffusion_pipe.sample.stage import comparison_columns
from tests.conftest import REPO, make_pipeline_repo, run_checked, run_env

EXAMPLES = sorted(p.parent.name for p in (REPO / "examples").glob("*-tiny/params.yaml"))


def _short(params: dict) -> dict:
    """The example's params with a short run: 4 steps, eval at the start and the end, the sample prompts kept
    (rendered at step 0 and the end) with 2 denoising steps."""
    train = params["train"]
    train.update(steps=4, warmup_steps=0, eval_every_steps=0)
    train.pop("epochs", None)
    if train.get("samples", {}).get("prompts"):
        train["samples"].update(every_steps=0, steps=2)
    return params


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES)
def test_bundled_example_runs_through_dvc_repro(tmp_path, example):
    store = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store)
    params = yaml.safe_load((REPO / "examples" / example / "params.yaml").read_text())
    (repo / "params.yaml").write_text(yaml.safe_dump(_short(params), sort_keys=False))
    repro = run_checked([sys.executable, "-m", "dvc", "repro", "-q"], cwd=repo, env=run_env(store))

    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert set(lock) == {"scan", "encode", "train", "export", "sample"}  # every stage ran and was recorded
    report = json.loads((repo / "reports/train.json").read_text())
    assert report["steps"] == 4 and math.isfinite(report["train_loss_last"])
    name = params["export"]["name"]
    for fmt in params["export"]["formats"]:
        assert (repo / "artifacts" / f"{name}.{fmt}.safetensors").stat().st_size > 0
    lineage = json.loads((repo / "artifacts" / f"{name}.lineage.json").read_text())
    assert lineage["base_model"]["family"] == params["model"]["family"]
    sample = json.loads((repo / "reports/sample.json").read_text())
    prompts = params["train"]["samples"]["prompts"]
    assert len(sample["prompts"]) == len(prompts)
    if prompts:  # rendering shows progress, in training and in the sample stage
        assert re.search(r"samples: +\d+%\|", repro.stderr) and re.search(r"sample: +\d+%\|", repro.stderr)
    if prompts:  # a row per prompt: without | with the LoRA, after the image it edits for an edit family; labelled
        samples = params["train"]["samples"]
        sizes = [(p.get("height") or samples.get("height", 512), p.get("width") or samples.get("width", 512))
                 for p in prompts]
        columns = comparison_columns(bool(prompts[0].get("control")), params["train"].get("adapter") == "full")
        layout = grid_layout([[size] * len(columns) for size in sizes], [p["prompt"] for p in prompts], columns)
        with Image.open(repo / "reports/lora_samples/comparison.png") as grid:
            assert (grid.height, grid.width) == (layout.height, layout.width)
