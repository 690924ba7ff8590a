"""The whole pipeline through DVC itself on the bundled example: what runs, what is skipped, what comes out."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import make_pipeline_repo, run_checked, run_env, torchrun
from tests.encode.helpers import reproduce

FAST = {"steps: 120": "steps: 60", "eval_every_steps: 40": "eval_every_steps: 0"}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    store = root / "store"
    repo = make_pipeline_repo(root / "repo", store, FAST)
    ran = reproduce(repo, store)
    return repo, store, ran


def test_first_repro_runs_every_stage_and_learns(pipeline):
    repo, _, ran = pipeline
    assert ran == ["scan", "encode", "train", "export", "sample"]
    report = json.loads((repo / "reports/train.json").read_text())
    assert report["steps"] == 60
    assert report["eval_loss_end"] < report["eval_loss_start"]
    assert report["eval_loss_improved"] is True
    with open(repo / "reports/train_loss.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 60 and all(float(r["grad_norm"]) > 0 for r in rows)
    encode = json.loads((repo / "reports/encode.json").read_text())
    assert encode["latent"]["computed"] == 36 and encode["text"]["computed"] == 36


def test_second_repro_runs_nothing(pipeline):
    repo, store, _ = pipeline
    manifest = (repo / "data/manifest.parquet").read_bytes()
    assert reproduce(repo, store) == ["scan"]  # scan always runs (dvc.yaml says why): same bytes, nothing after it
    assert (repo / "data/manifest.parquet").read_bytes() == manifest


def test_metrics_are_what_runs_are_compared_by(pipeline):
    """`dvc metrics show` (and so `dvc exp show`) holds the train report's figures, not the scan and encode
    counters, which stay in their reports for a person to read."""
    repo, store, _ = pipeline
    out = run_checked([sys.executable, "-m", "dvc", "metrics", "show", "--json"], cwd=repo, env=run_env(store))
    (workspace,) = json.loads(out.stdout).values()
    files = workspace["data"]
    assert set(files) == {"reports/train.json"}
    assert files["reports/train.json"]["data"]["eval_loss_end"] < files["reports/train.json"]["data"]["eval_loss_start"]


def test_learning_rate_edit_reruns_only_train_and_export(pipeline):
    repo, store, _ = pipeline
    params = repo / "params.yaml"
    params.write_text(params.read_text().replace("learning_rate: 2.0e-3", "learning_rate: 1.0e-3"))
    assert reproduce(repo, store) == ["scan", "train", "export", "sample"]


def test_samples_at_step_0_and_the_end_are_dvc_image_plots(pipeline):
    """train.samples: the example's prompts rendered at step 0 and at the end (step 60) in the run and in
    reports/samples/, which `dvc plots show` serves as images beside the loss curve; the sample stage's
    comparison (without | with the exported LoRA) too."""
    repo, store, _ = pipeline
    report = json.loads((repo / "reports/train.json").read_text())
    run = repo / "runs/samples" / report["run_id"]
    assert sorted(p.name for p in run.glob("step*.png")) == ["step000000.png", "step000060.png"]
    assert sorted(p.name for p in (run / "step000060").iterdir()) == ["00.png", "01.png", "02.png"]
    assert sorted(p.name for p in (repo / "reports/samples").iterdir()) == ["progress.png", "step000000.png",
                                                                           "step000060.png"]
    out = run_checked([sys.executable, "-m", "dvc", "plots", "show", "--json"], cwd=repo, env=run_env(store))
    shown = json.loads(out.stdout)["data"]
    images = {name for name, plots in shown.items() if any(p.get("type") == "image" for p in plots)}
    assert {"reports/samples/step000000.png", "reports/samples/step000060.png", "reports/samples/progress.png",
            "reports/lora_samples/comparison.png"} <= images
    sample = json.loads((repo / "reports/sample.json").read_text())
    assert len(sample["prompts"]) == 3 and all(p["mean_abs_difference"] > 1 for p in sample["prompts"])
    assert 0 < report["sample_seconds"]


def test_exported_lora_loads_in_diffusers_and_changes_output(pipeline):
    from diffusers import FluxPipeline
    from safetensors.torch import load_file

    repo, _, _ = pipeline
    pipe = FluxPipeline.from_pretrained(repo / "examples/flux-tiny/model")

    def generate():
        return pipe("a red circle on a white background", height=64, width=64, num_inference_steps=2,
                    max_sequence_length=32, generator=torch.Generator().manual_seed(0), output_type="pt").images

    before = generate()
    lora_file = repo / "artifacts/shapes-lora.diffusers.safetensors"
    pipe.load_lora_weights(str(lora_file.parent), weight_name=lora_file.name, adapter_name="shapes")
    after = generate()
    assert (before - after).abs().mean() > 1e-4
    # every exported tensor landed in a LoRA layer of the transformer: none left unused
    loaded = {n for n, _ in pipe.transformer.named_parameters() if ".shapes." in n}
    exported = load_file(lora_file)
    assert len(loaded) == len(exported)
    lineage = json.loads((repo / "artifacts/shapes-lora.lineage.json").read_text())
    assert lineage["params"]["train"]["learning_rate"] == 1e-3
    assert set(lineage["dvc_lock"]) >= {"scan", "encode", "train"}


def train_cmd(params: str, nproc: int, out: Path, *extra: str) -> list[str]:
    """The train stage on `nproc` CPU processes (gloo), writing everything under `out`."""
    launch = [sys.executable, "-m", "stages.train"] if nproc == 1 else [*torchrun(nproc), "-m", "stages.train"]
    return [*launch, "--params", params, "--out", str(out), "--report", str(out / "r.json"),
            "--loss-plot", str(out / "loss.csv"), "--runs", str(out / "runs"), "--samples", str(out / "samples"),
            *extra]


def train_losses(repo: Path, store: Path, params: str, nproc: int, out: Path, *extra: str) -> list[float]:
    """Run the train stage (`train_cmd`) and return its loss per step."""
    run_checked(train_cmd(params, nproc, out, *extra), cwd=repo, env=run_env(store))
    return loss_plot(out, "loss")


def loss_plot(out: Path, column: str) -> list[float]:
    """One column of the loss plot a `train_losses` run wrote, per step."""
    with open(out / "loss.csv") as fh:
        return [float(r[column]) for r in csv.DictReader(fh)]


def layout_params(repo: Path, name: str, stages: int, steps: int, **train) -> str:
    """A params file of `stages` pipeline stages and `steps` steps, with more `train` params."""
    text = (repo / "params.yaml").read_text().replace("steps: 60", f"steps: {steps}")
    # a tight clipping norm, so every step clips and the norm must span both stages' gradients to match
    more = "".join(f"\n  {k}: {v}" for k, v in train.items())
    text = text.replace("pipeline_stages: 1", f"pipeline_stages: {stages}\n  max_grad_norm: 0.01{more}")
    (repo / name).write_text(text)
    return name


def test_two_pipeline_stages_match_one(pipeline, tmp_path):
    """A 2-stage run on two CPU processes (gloo) gives the same losses as the 1-stage run, and the same gradient
    norms: the norm that clipping uses spans both stages' LoRA weights."""
    repo, store, _ = pipeline
    one = train_losses(repo, store, layout_params(repo, "p1.yaml", 1, 5), 1, tmp_path / "p1")
    two = train_losses(repo, store, layout_params(repo, "p2.yaml", 2, 5), 2, tmp_path / "p2")
    assert len(one) == 5
    assert one == pytest.approx(two, abs=1e-5)
    assert loss_plot(tmp_path / "p1", "grad_norm") == pytest.approx(loss_plot(tmp_path / "p2", "grad_norm"),
                                                                   rel=1e-4)
    # Samples over 2 stages (rank 0 renders, the other stage's modules run on rank 1) equal those of 1 stage.
    from PIL import Image

    for step in ("step000000", "step000005"):
        (a,), (b,) = (list((tmp_path / p / "runs/samples").glob(f"*/{step}.png")) for p in ("p1", "p2"))
        assert abs(np.asarray(Image.open(a), dtype=int) - np.asarray(Image.open(b), dtype=int)).max() <= 1


def test_a_full_fine_tune_over_two_stages_matches_one(pipeline, tmp_path):
    """train.adapter: full over 2 stages: the same losses as 1 stage, and rank 0 gathers every stage's weights
    into one file equal to the 1-stage run's."""
    from safetensors.torch import load_file

    repo, store, _ = pipeline
    weights = []
    for stages in (1, 2):
        name = layout_params(repo, f"full{stages}.yaml", stages, 3, adapter="full")
        text = (repo / name).read_text()
        (repo / name).write_text(text.replace("formats: [diffusers, comfyui]", "formats: [diffusers]"))
        losses = train_losses(repo, store, name, stages, tmp_path / f"full{stages}")
        weights.append((losses, load_file(tmp_path / f"full{stages}/lora.safetensors")))
    (one, a), (two, b) = weights
    assert one == pytest.approx(two, abs=1e-5)
    assert set(a) == set(b) and not any(".lora_" in k for k in a)
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-4)


SIGNAL_STEPS = 40  # the signal comes at the first checkpoint (step 2): the run must still be going then


@pytest.fixture(scope="module")
def two_stage_whole(pipeline, tmp_path_factory):
    """A 2-stage run with LoRA dropout that is never stopped: its params file and output directory."""
    repo, store, _ = pipeline
    params = layout_params(repo, "r.yaml", 2, SIGNAL_STEPS, lora_dropout=0.2, checkpoint_every_steps=2)
    out = tmp_path_factory.mktemp("whole")
    train_losses(repo, store, params, 2, out)
    return params, out


@pytest.mark.parametrize("ctrl_c", [False, True], ids=["sigterm-to-torchrun", "ctrl-c"])
def test_two_stage_run_stopped_by_a_signal_resumes_exactly(pipeline, two_stage_whole, tmp_path, ctrl_c):
    """SIGTERM to torchrun (what a scheduler preempting the job sends; torchrun passes it on), or Ctrl-C (SIGINT
    to the whole process group, which torchrun passes on again): both stages finish the step, agree, save a
    checkpoint and exit. Run again, the run resumes by itself and gives the losses of a run never stopped: each
    stage restores its own LoRA weights, fp32 masters, Adam moments, RNG states (LoRA dropout is on) and data
    position."""
    repo, store, _ = pipeline
    params, whole = two_stage_whole
    out = tmp_path / "stopped"
    with open(tmp_path / "stopped.log", "w") as log:
        proc = subprocess.Popen(train_cmd(params, 2, out), cwd=repo, env=run_env(store), stdout=log, stderr=log,
                                start_new_session=True)
        deadline = time.monotonic() + 300
        while not list(out.glob("runs/checkpoints/*/latest")):
            assert proc.poll() is None, (tmp_path / "stopped.log").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.01)
        if ctrl_c:
            os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: torchrun and both workers get it
        else:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) != 0
    assert not (out / "loss.csv").exists(), "the run ended before the signal; give it more steps"
    name = "SIGINT" if ctrl_c else "SIGTERM"
    assert f"stopped by {name}; checkpoint saved at step" in (tmp_path / "stopped.log").read_text()
    resumed = train_losses(repo, store, params, 2, out)
    assert 2 <= json.loads((out / "r.json").read_text())["resumed_from"] < SIGNAL_STEPS
    assert len(resumed) == SIGNAL_STEPS and resumed == loss_plot(whole, "loss")
    assert loss_plot(out, "grad_norm") == loss_plot(whole, "grad_norm")


def test_pipeline_times_data_parallel(pipeline, tmp_path):
    """2 stages x 2 data-parallel replicas (4 processes) match 1 stage x 2 replicas: the same global batches,
    the same losses; and differ from one replica alone, which sees half the data per step."""
    repo, store, _ = pipeline
    dp = train_losses(repo, store, layout_params(repo, "dp.yaml", 1, 3), 2, tmp_path / "dp")
    pp_dp = train_losses(repo, store, layout_params(repo, "ppdp.yaml", 2, 3), 4, tmp_path / "ppdp")
    single = train_losses(repo, store, layout_params(repo, "single.yaml", 1, 3), 1, tmp_path / "single")
    assert dp == pytest.approx(pp_dp, abs=1e-5)
    assert dp != pytest.approx(single, abs=1e-5)
