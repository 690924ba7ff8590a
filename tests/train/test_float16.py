"""float16 models train where the hardware can: the loss is scaled for backward and unscaled for the update (the
tiny example). Where DeepSpeed's backend cannot reduce float16 gradients (its CPU backend on most processors), the
train stage stops before loading anything, with an error naming model.dtype."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import run_env, run_stages, train_example

F16_EDITS = {"dtype: float32": "dtype: float16", "steps: 120": "steps: 24", "eval_every_steps: 40": "eval_every_steps: 0"}


def _float16_trainable() -> bool:
    from deepspeed.accelerator import get_accelerator

    return torch.float16 in get_accelerator().supported_dtypes()


@pytest.mark.skipif(not _float16_trainable(), reason="DeepSpeed's backend here reduces no float16 gradients "
                    "(CPU without AVX512-FP16/AMX-FP16); test_float16_unsupported_is_a_param_error runs instead")
def test_float16_model_trains_with_loss_scaling(tmp_path):
    _, report, rows = train_example(tmp_path, F16_EDITS)
    losses = [float(r["loss"]) for r in rows]
    # unscaled losses, of the size the fp32 run reports (about 1), which fall
    assert len(losses) == 24 and all(0.05 < x < 5 for x in losses)
    assert sum(losses[-8:]) < sum(losses[:8])
    assert all(float(r["grad_norm"]) < 1e3 for r in rows)  # the norm of unscaled gradients
    assert report["lora_dtype"] == "float16"


@pytest.mark.skipif(_float16_trainable(), reason="float16 trains here; test_float16_model_trains_with_loss_scaling "
                    "runs instead")
def test_float16_unsupported_is_a_param_error(tmp_path):
    from tests.conftest import make_pipeline_repo, run_checked

    store = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store, F16_EDITS, dvc=False)
    run_stages(repo, store)
    out = subprocess.run([sys.executable, "-m", "stages.train"], cwd=repo, env=run_env(store), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode != 0
    assert "model.dtype: float16 training is not supported" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert not (repo / "runs/train/lora.safetensors").exists()
