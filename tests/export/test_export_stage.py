"""The export stage end to end with lora_alpha != lora_rank: every exported form applies the trained strength.

The example trains a few steps with rank 4, alpha 12 (scale 3), so a LoRA loaded at the wrong scale (alpha
dropped, folded twice, 2 x alpha, rank recorded as alpha) gives another output. The reference is the trained
module itself: the base denoiser with the train stage's own LoRA code (add_lora, the trained rank and alpha)
holding the trained weights. Checked numerically against it: the diffusers file loaded by FluxPipeline's
load_lora_weights, and the merged checkpoint; the ComfyUI file's alpha/rank-scaled updates carry exactly the
diffusers file's total update.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffusion_pipe.config import from_dict
from diffusion_pipe.models import load_adapter
from diffusion_pipe.params import ModelParams
from diffusion_pipe.train.lora import add_lora
from tests.conftest import make_pipeline_repo, run_checked, run_env
from tests.encode.helpers import stage_in_process
from tests.export.test_merge import forward

RANK, ALPHA = 4, 12.0
EDITS = {"steps: 120": "steps: 4", "eval_every_steps: 40": "eval_every_steps: 0", "warmup_steps: 10": "warmup_steps: 0",
         "learning_rate: 2.0e-3": "learning_rate: 2.0e-2", "lora_rank: 8": f"lora_rank: {RANK}",
         "lora_alpha: 8.0": f"lora_alpha: {ALPHA}", "name: shapes-lora": "name: shapes-lora\n  merged: true"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """The example (six images) through scan, encode and export in this process and train as its command."""
    root = tmp_path_factory.mktemp("export-stage")
    store = root / "store"
    repo = make_pipeline_repo(root / "repo", store, EDITS, dvc=False)
    for item in sorted((repo / "examples/flux-tiny/data").iterdir())[12:]:
        item.unlink()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(repo)
        stage_in_process("scan", store)
        stage_in_process("encode", store)
        run_checked([sys.executable, "-m", "stages.train"], cwd=repo, env=run_env(store))
        stage_in_process("export", store)
    return repo


@pytest.fixture(scope="module")
def trained_module(exported: Path) -> torch.nn.Module:
    """The base denoiser with the train stage's LoRA modules holding the trained weights, at the trained scale."""
    model = from_dict(ModelParams, {"family": "flux", "path": str(exported / "examples/flux-tiny/model"),
                                    "dtype": "float32"}, "model")
    adapter = load_adapter(model)
    lora = load_file(exported / "runs/train/lora.safetensors")
    targets = sorted({k.rsplit(".lora_", 1)[0] for k in lora})
    denoiser = adapter.load_denoiser(torch.device("cpu"))
    add_lora(denoiser, targets, RANK, ALPHA, dropout=0.0)
    params = dict(denoiser.named_parameters())
    with torch.no_grad():
        for key, value in lora.items():
            params[key.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")].copy_(value)
    return denoiser.eval()


@pytest.fixture(scope="module")
def base_output(exported: Path) -> torch.Tensor:
    from diffusers import FluxTransformer2DModel

    return forward(FluxTransformer2DModel.from_pretrained(exported / "examples/flux-tiny/model/transformer"))


def test_the_trained_lora_changes_the_output_far_beyond_tolerance(trained_module, base_output) -> None:
    # a wrong scale (x2, x1/3) must be far outside the tolerance the comparisons below use
    assert (forward(trained_module) - base_output).abs().max() > 1e-3


def test_diffusers_file_loaded_by_the_pipeline_gives_the_trained_output(exported, trained_module) -> None:
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(exported / "examples/flux-tiny/model")
    path = exported / "artifacts/shapes-lora.diffusers.safetensors"
    pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name="shapes")
    torch.testing.assert_close(forward(pipe.transformer), forward(trained_module), rtol=1e-5, atol=1e-5)


def test_merged_checkpoint_gives_the_trained_output(exported, trained_module) -> None:
    from diffusers import FluxTransformer2DModel

    merged = FluxTransformer2DModel.from_pretrained(exported / "artifacts/shapes-lora.merged/transformer")
    torch.testing.assert_close(forward(merged), forward(trained_module), rtol=1e-5, atol=1e-5)


def _update_energy(pairs: list[tuple[torch.Tensor, torch.Tensor, float]]) -> float:
    """Sum over modules of ||scale * up @ down||^2: fusing q/k/v (A stacked, B block-diagonal) keeps it."""
    return sum(float((scale * up.double() @ down.double()).square().sum()) for up, down, scale in pairs)


def test_comfyui_file_carries_alpha_equal_rank_and_the_same_update(exported) -> None:
    diffusers = load_file(exported / "artifacts/shapes-lora.diffusers.safetensors")
    comfy = load_file(exported / "artifacts/shapes-lora.comfyui.safetensors")
    bases = sorted(k.removesuffix(".lora_down.weight") for k in comfy if k.endswith(".lora_down.weight"))
    assert bases and all(k.startswith("diffusion_model.") for k in comfy)
    for base in bases:  # ComfyUI scales by alpha / rank: 1, the scale is folded into lora_up
        assert float(comfy[f"{base}.alpha"]) == comfy[f"{base}.lora_down.weight"].shape[0]
    comfy_pairs = [(comfy[f"{b}.lora_up.weight"], comfy[f"{b}.lora_down.weight"],
                    float(comfy[f"{b}.alpha"]) / comfy[f"{b}.lora_down.weight"].shape[0]) for b in bases]
    modules = sorted(k.removesuffix(".lora_A.weight") for k in diffusers if k.endswith(".lora_A.weight"))
    diffusers_pairs = [(diffusers[f"{m}.lora_B.weight"], diffusers[f"{m}.lora_A.weight"], 1.0) for m in modules]
    assert _update_energy(comfy_pairs) == pytest.approx(_update_energy(diffusers_pairs), rel=1e-6)


def test_the_lineage_and_metadata_record_the_trained_scale(exported) -> None:
    from safetensors import safe_open

    with safe_open(str(exported / "runs/train/lora.safetensors"), "pt") as f:
        meta = f.metadata()
    assert (int(meta["lora_rank"]), float(meta["lora_alpha"])) == (RANK, ALPHA)
    lineage = json.loads((exported / "artifacts/shapes-lora.lineage.json").read_text())
    assert (lineage["params"]["train"]["lora_rank"], lineage["params"]["train"]["lora_alpha"]) == (RANK, ALPHA)


def test_export_refuses_a_lora_trained_with_other_params_than_params_yaml_holds(exported, tmp_path) -> None:
    """params.yaml edited while train ran (so dvc.lock records the edit): the LoRA's own record says what it was
    trained with, and export refuses to stamp another story on it. Nothing is written."""
    import dataclasses

    from diffusion_pipe.errors import UserError
    from diffusion_pipe.export.lora import export_lora
    from diffusion_pipe.params import load_params

    params = load_params(exported / "params.yaml")
    edited = dataclasses.replace(params, train=dataclasses.replace(params.train, learning_rate=1.0e-3))
    args = (exported, exported / "runs/train/lora.safetensors", exported / "data/manifest.parquet",
            exported / "data/encoded.parquet", exported / "reports/train.json")
    with pytest.raises(UserError, match=r"lora.safetensors was trained with other params than params.yaml holds "
                                        r"now: train.learning_rate: 0.02 -> 0.001 .*dvc repro --force train"):
        export_lora(edited, *args, tmp_path / "edited")
    assert not (tmp_path / "edited").exists()
    edited = dataclasses.replace(params, scan=dataclasses.replace(params.scan, workers=3))  # not read by train
    assert export_lora(edited, *args, tmp_path / "scan-edited")
def test_an_export_that_runs_out_of_room_publishes_nothing_and_names_the_file(exported, tmp_path) -> None:
    """A real file size limit (RLIMIT_FSIZE, as a full disk fails a write): past the diffusers file but short of
    the ComfyUI one, and past both LoRA files but short of the merged weights. Either way the export stops with
    one error naming the file that did not fit and the errno, and publishes none of its files: no LoRA file
    without the others and its lineage."""
    from tests.train.test_checkpoint import file_size_limited

    artifacts = exported / "artifacts"
    diffusers, comfyui = ((artifacts / f"shapes-lora.{fmt}.safetensors").stat().st_size
                          for fmt in ("diffusers", "comfyui"))
    merged = max(p.stat().st_size for p in (artifacts / "shapes-lora.merged").rglob("*.safetensors"))
    lineage = (artifacts / "shapes-lora.lineage.json").stat().st_size
    assert max(diffusers, lineage) < comfyui < merged
    for limit, short in (((max(diffusers, lineage) + comfyui) // 2, "shapes-lora.comfyui.safetensors"),
                         ((comfyui + merged) // 2, "shapes-lora.merged")):
        out = tmp_path / f"out-{limit}"
        result = subprocess.run([sys.executable, "-m", "stages.export", "--out", str(out)], cwd=exported,
                                env=run_env(exported.parent / "store"), capture_output=True, text=True,
                                preexec_fn=file_size_limited(limit), timeout=600)
        assert result.returncode == 2, result.stderr[-3000:]
        assert (f"error: cannot write {out / short}: the file would exceed the file size limit (ulimit -f) (EFBIG"
                in result.stderr), result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        assert not out.exists() or list(out.iterdir()) == []
