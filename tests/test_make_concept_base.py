"""scripts/make_concept_base.py, the generator of the learning proof's base models, on a short budget: it builds a
family's tiny base through the adapter contract, writes a model the pipeline loads, measures its samples, and
refuses a base that does not paint the named colours (here: too few steps to learn them)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from diffusion_pipe.concept_proof import BASE_COLOURS
from diffusion_pipe.models import adapter_class
from tests.conftest import REPO


@pytest.mark.slow  # about a minute on 2 CPU cores
def test_a_short_pretraining_writes_a_loadable_base_and_is_refused_as_too_weak(tmp_path):
    out = tmp_path / "concept-wan"
    run = subprocess.run([sys.executable, "scripts/make_concept_base.py", "--family", "wan", "--out", str(out),
                          "--steps", "10", "--vae-steps", "10",
                          "--denoiser-config", json.dumps({"num_layers": 1})],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 1, run.stderr[-3000:]
    assert "pretrain longer (--steps)" in run.stderr
    measured = json.loads((out / "base-samples.json").read_text())
    assert set(measured) == set(BASE_COLOURS)
    assert (out / "base-samples.png").is_file()
    adapter = adapter_class("wan")(out / "model", torch.float32)
    assert adapter.load_denoiser(torch.device("cpu")).config.num_layers == 1  # the --denoiser-config override
    vae = adapter.load_vae(torch.device("cpu"))
    assert vae.config.scale_factor_spatial == 2 and len(vae.config.latents_mean) == vae.config.z_dim
