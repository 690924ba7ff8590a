"""`train.save_lora_every_steps`: the LoRA every N steps in the export formats, the last one what export writes,
without changing the run (its identity, its losses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from diffusion_pipe.config import ConfigError, from_dict
from diffusion_pipe.params import ModelParams, TrainParams
from diffusion_pipe.train.loop import run_identity
from diffusion_pipe.train.step_loras import step_lora_steps
from tests.conftest import REPO, run_checked, run_env, train_example

STEPS = 6
PARAMS = {"steps: 120": f"steps: {STEPS}",
          "eval_every_steps: 40": "eval_every_steps: 0\n  save_lora_every_steps: 3",
          "every_steps: 60": "every_steps: 0"}


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The bundled example, 6 steps with a LoRA every 3, through scan, encode, train and export."""
    root = tmp_path_factory.mktemp("step-loras")
    repo, report, _ = train_example(root, PARAMS, dvc=False)
    run_checked([sys.executable, "-m", "stages.export"], cwd=repo, env=run_env(root / "store"))
    return repo, report


@pytest.mark.slow  # the fixture runs scan, encode, train and export: about 70 s on 2 shared cores
def test_loras_at_every_n_steps_in_every_export_format(trained):
    repo, report = trained
    run_dir = repo / "runs/loras" / report["run_id"]
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "step-000003.comfyui.safetensors", "step-000003.diffusers.safetensors",
        "step-000006.comfyui.safetensors", "step-000006.diffusers.safetensors"]
    tensors, meta = read(run_dir / "step-000003.diffusers.safetensors")
    assert meta["diffusion_pipe.run_id"] == report["run_id"] and meta["diffusion_pipe.step"] == "3"
    assert meta["diffusion_pipe.export_format"] == "diffusers" and meta["diffusion_pipe.family"] == "flux"
    identity = json.loads(meta["diffusion_pipe.identity"])
    assert identity == json.loads((repo / "runs/checkpoints" / report["run_id"] / "identity.json").read_text())
    later, _ = read(run_dir / "step-000006.diffusers.safetensors")
    assert tensors.keys() == later.keys()
    assert any(not torch.equal(tensors[k], later[k]) for k in tensors)  # training went on between them


@pytest.mark.slow  # shares the fixture above
def test_the_lora_of_the_last_step_equals_the_exported_one(trained):
    """The last step is a multiple of N: its files hold what the export stage writes from the final LoRA."""
    repo, report = trained
    for fmt in ("diffusers", "comfyui"):
        final, _ = read(repo / f"artifacts/shapes-lora.{fmt}.safetensors")
        last, _ = read(repo / "runs/loras" / report["run_id"] / f"step-{STEPS:06d}.{fmt}.safetensors")
        assert final.keys() == last.keys() and final
        assert all(torch.equal(final[k], last[k]) for k in final), fmt


def test_the_param_does_not_change_the_run(tmp_path):
    """Like the checkpoint cadence, it changes nothing that is trained: the same run id, so changing it
    continues a run instead of starting another."""
    encoded = tmp_path / "encoded.parquet"
    encoded.write_bytes(b"table")
    model = ModelParams(path="m")
    ids = {json.dumps(run_identity(model, TrainParams(save_lora_every_steps=n), encoded, 32, 1), sort_keys=True)
           for n in (0, 5)}
    assert len(ids) == 1


def test_steps_and_range():
    assert step_lora_steps(3, 7) == [3, 6] and step_lora_steps(3, 6) == [3, 6] and step_lora_steps(0, 6) == []
    with pytest.raises(ConfigError, match=r"train.save_lora_every_steps: -1 is out of range \[0, inf\)"):
        from_dict(TrainParams, {"save_lora_every_steps": -1}, "train")


@pytest.mark.slow  # two more train runs, one of them on 2 processes: about 40 s
def test_two_pipeline_stages_write_the_whole_lora(trained, tmp_path):
    """Over 2 pipeline stages (2 processes, gloo) each rank holds half the LoRA: the file gathers both halves
    and equals a 1-stage run's."""
    from tests.conftest import torchrun

    repo, _ = trained
    text = (repo / "params.yaml").read_text().replace(f"steps: {STEPS}", "steps: 3")
    files = {}
    for stages in (1, 2):
        (tmp_path / f"p{stages}.yaml").write_text(text.replace("pipeline_stages: 1", f"pipeline_stages: {stages}"))
        out = tmp_path / f"s{stages}"
        launch = [sys.executable] if stages == 1 else torchrun(2)
        run_checked([*launch, "-m", "stages.train", "--params", str(tmp_path / f"p{stages}.yaml"), "--out", str(out),
                     "--report", str(out / "r.json"), "--loss-plot", str(out / "loss.csv"), "--runs", str(out / "runs"),
                     "--samples", str(out / "samples")], cwd=repo, env=run_env(repo.parent / "store"))
        (path,) = (out / "runs/loras").glob("*/step-000003.diffusers.safetensors")
        files[stages] = read(path)[0]
    one, two = files[1], files[2]
    assert one.keys() == two.keys()
    # both stages' layers are there: the double-stream blocks (first stage) and the single-stream ones (second)
    assert {k.split(".")[1] for k in two} == {"transformer_blocks", "single_transformer_blocks"}
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # scans and encodes the bundled example, then one train start: about 30 s on 2 shared cores
def test_a_format_the_family_cannot_write_stops_train_before_step_1(tmp_path):
    """The export stage would fail after the whole run: train refuses it first, naming the param."""
    from tests.train.test_options import _encoded_repo, _train

    repo, store = _encoded_repo(tmp_path)
    failed = _train(repo, store, "kohya", {"formats: [diffusers, comfyui]": "formats: [diffusers, kohya]"},
                    check=False)
    assert failed.returncode != 0 and "Traceback" not in failed.stderr
    assert "export.formats: ['kohya'] not written by model family 'flux' (supported: diffusers, comfyui)" in \
        failed.stderr
    assert "fix the list before training" in failed.stderr and "train: checkpoint" not in failed.stderr


@pytest.mark.slow  # shares the fixture above (on a copy of its repo): one more train stage that trains nothing
def test_setting_it_on_a_finished_run_writes_no_file_for_steps_already_trained(trained, tmp_path):
    """The README's promise: the run id stays, so the finished run only loads and writes its LoRA again (the same
    tensors); steps trained before the change get no file."""
    import shutil

    repo, report = trained
    copy = tmp_path / "repo"
    shutil.copytree(repo, copy, symlinks=True)
    params = copy / "params.yaml"
    params.write_text(params.read_text().replace("save_lora_every_steps: 3", "save_lora_every_steps: 2"))
    before, _ = read(copy / "runs/train/lora.safetensors")
    run_checked([sys.executable, "-m", "stages.train"], cwd=copy, env=run_env(repo.parent / "store"))
    again = json.loads((copy / "reports/train.json").read_text())
    assert again["run_id"] == report["run_id"]
    assert sorted(p.name for p in (copy / "runs/loras" / report["run_id"]).iterdir()) == [
        "step-000003.comfyui.safetensors", "step-000003.diffusers.safetensors",
        "step-000006.comfyui.safetensors", "step-000006.diffusers.safetensors"]
    after, _ = read(copy / "runs/train/lora.safetensors")
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


# builds a LoRA'd tiny Flux and writes its step-1 LoRA (argv: model folder, LoRA folder)
_SAVE_A_STEP_LORA = """
import sys
from pathlib import Path
import torch
from diffusion_pipe.errors import UserError
from diffusion_pipe.models.flux import FluxAdapter
from diffusion_pipe.train.build import build_local_model
from diffusion_pipe.train.step_loras import StepLoras
adapter = FluxAdapter(Path(sys.argv[1]), torch.float32)
local = build_local_model(adapter, 1, 0, targets=adapter.default_lora_targets, rank=4, alpha=4.0, dropout=0.0, seed=0)
loras = StepLoras(1, 1, ("diffusers",), adapter, local.denoiser, torch.nn.ModuleList(local.layers), 0, 4, 4.0,
                  Path(sys.argv[2]), {}, "run")
try:
    loras.save(1)
except UserError as e:
    sys.exit(f"{type(e).__name__}: {e}")
"""


def test_a_full_disk_names_the_step_lora_and_leaves_nothing(tiny_flux_dir, tmp_path):
    """A LoRA written along the way onto a disk without room for it (a real file size limit): one WriteError naming
    the LoRA file, not an OSError on its temp file's name; neither the file nor a temp file is left."""
    from tests.train.test_checkpoint import file_size_limited

    out = subprocess.run([sys.executable, "-c", _SAVE_A_STEP_LORA, str(tiny_flux_dir), str(tmp_path / "loras")],
                         cwd=REPO, capture_output=True, text=True, preexec_fn=file_size_limited(1000), timeout=300)
    target = tmp_path / "loras" / "step-000001.diffusers.safetensors"
    assert out.returncode == 1, out.stderr
    assert out.stderr.startswith(f"WriteError: cannot write {target}: the file would exceed the file size limit "
                                 "(ulimit -f) (EFBIG"), out.stderr
    assert list(target.parent.iterdir()) == []
