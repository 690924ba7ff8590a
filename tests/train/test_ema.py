"""`train.ema_decay` and `export.ema`: the moving average follows ema = d * ema + (1 - d) * w over the fp32 masters
after each optimizer step; the example trains with it and writes it beside the LoRA; checkpoints keep it apart
from the optimizer's state, and a resumed run ends with the same bytes; export writes it with its own lineage;
bad params are clear errors; and at its default nothing about a run changes, its identity included."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from diffusion_pipe.config import ConfigError, from_dict
from diffusion_pipe.dvcfile import require_out
from diffusion_pipe.hashing import hash_json
from diffusion_pipe.params import ExportParams, ModelParams, TrainParams, load_params
from diffusion_pipe.train.ema import Ema
from diffusion_pipe.train.loop import run_identity
from diffusion_pipe.train.optim import LossScaler, MasterWeightAdamW
from tests.conftest import REPO, encoded_example, run_checked, run_env, train_cmd

DECAY = 0.9


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).bfloat16()) for shape in ((6, 4), (4, 6), (3, 5))]


def _step(opt, params, step: int, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * scale).bfloat16()
    opt.step()
    opt.zero_grad()


# --- the average itself -----------------------------------------------------------------------------------------

def test_the_average_follows_the_masters_after_each_step():
    """By hand from the fp32 masters after every step, starting from the masters before step 1."""
    params = _params()
    opt = MasterWeightAdamW(params, lr=1e-1)
    ema = Ema(DECAY, opt)
    reference = [m.detach().clone() for m in opt.masters]
    for step in range(5):
        _step(opt, params, step)
        reference = [DECAY * r + (1 - DECAY) * m.detach() for r, m in zip(reference, opt.masters)]
        assert all(torch.allclose(e, r, rtol=1e-6, atol=1e-7) for e, r in zip(ema.tensors, reference))
    assert all(e.dtype == torch.float32 for e in ema.tensors)
    assert not any(torch.allclose(e, m, rtol=1e-3) for e, m in zip(ema.tensors, opt.masters))


def test_off_keeps_nothing_and_changes_nothing():
    params, ref = _params(), _params()
    opt, ref_opt = MasterWeightAdamW(params, lr=1e-1), MasterWeightAdamW(ref, lr=1e-1)
    ema = Ema(0.0, opt)
    for step in range(3):
        _step(opt, params, step)
        _step(ref_opt, ref, step)
    assert not ema.enabled and ema.tensors == [] and ema.gather(lambda: {"x": torch.ones(1)}) is None
    assert all(torch.equal(p, r) for p, r in zip(params, ref))


def test_a_float16_step_skipped_for_overflow_leaves_the_average():
    params = _params()
    opt = MasterWeightAdamW(params, lr=1e-1, loss_scaler=LossScaler(enabled=True))
    ema = Ema(DECAY, opt)
    _step(opt, params, 0)
    before = ema.state()
    _step(opt, params, 1, scale=float("inf"))
    assert opt.loss_scaler.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(ema.tensors, before))
    _step(opt, params, 2)
    assert not all(torch.equal(a, b) for a, b in zip(ema.tensors, before))


def test_the_average_is_read_through_the_parameters_and_they_are_put_back():
    params = _params()
    opt = MasterWeightAdamW(params, lr=1e-1)
    ema = Ema(DECAY, opt)
    for step in range(3):
        _step(opt, params, step)
    before = [p.detach().clone() for p in params]
    read = ema.gather(lambda: {str(i): p.detach().clone() for i, p in enumerate(params)})
    assert all(torch.equal(read[str(i)], e) and read[str(i)].dtype == torch.float32 for i, e in enumerate(ema.tensors))
    assert all(torch.equal(p, b) and p.dtype == torch.bfloat16 for p, b in zip(params, before))


# --- params, identity, dvc.yaml -------------------------------------------------------------------------------

@pytest.mark.parametrize(("data", "match"), [
    ({"ema_decay": 1.0}, r"train\.ema_decay: 1(\.0)? is out of range \[0, 1\)"),
    ({"ema_decay": -0.1}, r"train\.ema_decay: -0\.1 is out of range \[0, 1\)"),
    ({"ema_decay": "slow"}, r"train\.ema_decay: got 'slow', expected float"),
    ({"ema_decay": 0.99, "adapter": "full"}, r"train\.ema_decay: 0\.99 averages LoRA adapters, and train\.adapter "
                                             r"is full; set ema_decay: 0, or train a LoRA"),
])
def test_bad_ema_params_are_clear_errors(data, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(TrainParams, data, "train")


def test_export_ema_needs_an_ema_and_is_one_of_three(tmp_path):
    params = tmp_path / "params.yaml"
    bundled = (REPO / "params.yaml").read_text()
    params.write_text(bundled.replace("name: shapes-lora", "name: shapes-lora\n  ema: beside"))
    with pytest.raises(ConfigError, match=r"export\.ema: beside exports the EMA of the trained weights, and "
                                          r"train\.ema_decay is 0.*set train\.ema_decay \(e\.g\. 0\.999\), or "
                                          r"export\.ema: off"):
        load_params(params)
    with pytest.raises(ConfigError, match=r"export\.ema: got 'yes', expected one of 'off' \| 'beside' \| 'instead'"):
        from_dict(ExportParams, {"ema": "yes"}, "export")
    params.write_text(bundled.replace("name: shapes-lora", "name: shapes-lora\n  ema: instead")
                      .replace("learning_rate: 2.0e-3", "learning_rate: 2.0e-3\n  ema_decay: 0.999"))
    loaded = load_params(params)
    assert (loaded.export.ema, loaded.train.ema_decay) == ("instead", 0.999)
    assert load_params(REPO / "params.yaml").export.ema == "off"


def test_the_identity_is_unchanged_at_the_default_and_changes_with_a_decay(tmp_path):
    encoded = tmp_path / "encoded.parquet"
    encoded.write_bytes(b"table")
    model = ModelParams(path="m")
    default = run_identity(model, TrainParams(), encoded, 77, 1)
    assert "ema_decay" not in default["train"]
    assert run_identity(model, TrainParams(ema_decay=0.0), encoded, 77, 1) == default
    on = run_identity(model, TrainParams(ema_decay=0.999), encoded, 77, 1)
    assert on["train"]["ema_decay"] == 0.999 and hash_json(on) != hash_json(default)


def test_dvc_yaml_must_list_the_ema_output_exactly_when_it_is_written(tmp_path):
    dvc_yaml = tmp_path / "dvc.yaml"
    dvc_yaml.write_text("stages:\n  train:\n    cmd: x\n    outs:\n      - runs/train/lora.safetensors\n")
    out = "runs/train/lora.ema.safetensors"
    require_out(dvc_yaml, "train", out, "train.ema_decay", written=False)
    with pytest.raises(ConfigError, match=r"train\.ema_decay: stage 'train' writes runs/train/lora\.ema\.safetensors, "
                                          r"which is not an output of it in dvc\.yaml.*add '- runs/train/lora\.ema\."
                                          r"safetensors' under stages\.train\.outs"):
        require_out(dvc_yaml, "train", out, "train.ema_decay", written=True)
    dvc_yaml.write_text(dvc_yaml.read_text() + f"      - {out}:\n          cache: true\n")
    require_out(dvc_yaml, "train", out, "train.ema_decay", written=True)
    with pytest.raises(ConfigError, match=r"is listed under stages\.train\.outs in dvc\.yaml.*remove that line"):
        require_out(dvc_yaml, "train", out, "train.ema_decay", written=False)
    require_out(tmp_path / "none.yaml", "train", out, "train.ema_decay", written=True)  # outside DVC: no check


# --- the tiny example, trained with an EMA ----------------------------------------------------------------------

STEPS = 6
EDITS = {"steps: 120": f"steps: {STEPS}", "lr_scheduler: cosine": "lr_scheduler: constant",
         "warmup_steps: 10": "warmup_steps: 0",
         "eval_every_steps: 40": "eval_every_steps: 0\n  checkpoint_every_steps: 1\n  lora_dropout: 0.1",
         "every_steps: 60": "every_steps: 0"}


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    """The example trained 6 steps with train.ema_decay 0.9, a checkpoint after every step: (repo, store, params
    file, runs directory, train command, the outputs' bytes)."""
    root = tmp_path_factory.mktemp("ema")
    repo, store = encoded_example(root, EDITS)
    params = root / "params.yaml"  # beside no dvc.yaml: the dvc.yaml checks are tested on their own
    params.write_text((repo / "params.yaml").read_text().replace("learning_rate: 2.0e-3",
                                                                 f"learning_rate: 2.0e-2\n  ema_decay: {DECAY}"))
    runs = root / "runs"
    cmd = train_cmd(runs, "--params", str(params))
    run_checked(cmd, cwd=repo, env=run_env(store))
    whole = {f: (runs / f).read_bytes() for f in ("loss.csv", "out/lora.safetensors", "out/lora.ema.safetensors")}
    return repo, store, params, runs, cmd, whole


def _checkpoint(step_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(masters, EMA) by parameter name, from a checkpoint's stage-0 files."""
    tensors = load_file(step_dir / "stage0.safetensors")
    masters = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("master/")}
    return masters, load_file(step_dir / "stage0.ema.safetensors")


def test_the_example_writes_the_average_of_its_masters_beside_the_lora(ema_run):
    """The EMA LoRA is the final checkpoint's average, which follows the recursion from checkpoint to checkpoint
    (and from the start, where each lora_B was zero); it differs from the trained LoRA; its metadata says the
    decay; the optimizer's state holds no EMA."""
    _, _, _, runs, _, _ = ema_run
    (run_dir,) = (runs / "checkpoints").iterdir()
    steps = [_checkpoint(run_dir / f"step{s}") for s in range(1, STEPS + 1)]
    for (_, previous), (masters, ema) in zip(steps, steps[1:]):
        assert ema.keys() == masters.keys()
        for name in masters:
            assert torch.allclose(ema[name], DECAY * previous[name] + (1 - DECAY) * masters[name], rtol=1e-6, atol=1e-8)
    masters, ema = steps[0]
    b_names = [n for n in masters if ".lora_B." in n]
    assert b_names and all(torch.allclose(ema[n], (1 - DECAY) * masters[n], rtol=1e-6, atol=1e-10) for n in b_names)
    assert not any(k.startswith("ema/") for k in load_file(run_dir / f"step{STEPS}/stage0.safetensors"))

    plain, averaged = load_file(runs / "out/lora.safetensors"), load_file(runs / "out/lora.ema.safetensors")
    final_masters, final_ema = steps[-1]
    assert plain.keys() == averaged.keys()
    assert not any(torch.allclose(plain[k], averaged[k], rtol=1e-3) for k in plain if ".lora_B." in k)
    assert all(any(torch.equal(t, e) for e in final_ema.values()) for t in averaged.values())
    assert all(any(torch.equal(t, m) for m in final_masters.values()) for t in plain.values())
    with safe_open(str(runs / "out/lora.ema.safetensors"), "pt") as fh:
        meta = fh.metadata()
    assert float(meta["diffusion_pipe.ema_decay"]) == DECAY
    assert json.loads((run_dir / "identity.json").read_text())["train"]["ema_decay"] == DECAY


def test_a_run_resumed_mid_way_ends_with_the_same_lora_and_average(ema_run, tmp_path):
    repo, store, _, runs, cmd, whole = ema_run
    copy = tmp_path / "runs"
    shutil.copytree(runs, copy)
    (run_dir,) = (copy / "checkpoints").iterdir()
    for step in range(4, STEPS + 1):  # the run as it was when stopped after its step-3 checkpoint
        shutil.rmtree(run_dir / f"step{step}")
    for name in whole:
        (copy / name).unlink()
    run_checked([str(copy) if a == str(runs) else a.replace(str(runs), str(copy)) for a in cmd], cwd=repo,
                env=run_env(store))
    assert json.loads((copy / "report.json").read_text())["resumed_from"] == 3
    assert {f: (copy / f).read_bytes() for f in whole} == whole


def test_a_checkpoint_without_an_average_does_not_resume_with_one(ema_run, tmp_path):
    repo, store, _, runs, cmd, _ = ema_run
    copy = tmp_path / "runs"
    shutil.copytree(runs, copy)
    (run_dir,) = (copy / "checkpoints").iterdir()
    for step in range(4, STEPS + 1):
        shutil.rmtree(run_dir / f"step{step}")
    manifest = json.loads((run_dir / "step3/manifest.json").read_text())  # as a run without train.ema_decay saved it
    del manifest["files"]["stage0.ema.safetensors"]
    (run_dir / "step3/stage0.ema.safetensors").unlink()
    (run_dir / "step3/manifest.json").write_text(json.dumps(manifest))
    out = subprocess.run([a.replace(str(runs), str(copy)) for a in cmd], cwd=repo, env=run_env(store),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "holds no EMA of" in out.stderr and "run without train.ema_decay" in out.stderr, out.stderr[-3000:]


# --- export -----------------------------------------------------------------------------------------------------

def _export(ema_run, tmp_path, ema: str) -> Path:
    repo, store, params, runs, _, _ = ema_run
    edited = tmp_path / "params.yaml"
    edited.write_text(params.read_text().replace("name: shapes-lora", f"name: shapes-lora\n  ema: {ema}"))
    out = tmp_path / "artifacts"
    run_checked([sys.executable, "-m", "stages.export", "--params", str(edited), "--lora",
                 str(runs / "out/lora.safetensors"), "--out", str(out)], cwd=repo, env=run_env(store))
    return out


def test_export_writes_the_average_beside_the_lora_with_its_own_lineage(ema_run, tmp_path):
    _, _, _, runs, _, _ = ema_run
    out = _export(ema_run, tmp_path, "beside")
    names = sorted(p.name for p in out.iterdir())
    assert names == ["shapes-lora.comfyui.safetensors", "shapes-lora.diffusers.safetensors",
                     "shapes-lora.ema.comfyui.safetensors", "shapes-lora.ema.diffusers.safetensors",
                     "shapes-lora.ema.lineage.json", "shapes-lora.lineage.json"]
    plain, averaged = (load_file(out / f"shapes-lora{x}.diffusers.safetensors") for x in ("", ".ema"))
    trained_ema = load_file(runs / "out/lora.ema.safetensors")
    assert plain.keys() == averaged.keys() and any(not torch.equal(plain[k], averaged[k]) for k in plain)
    assert all(any(torch.equal(v, t) for t in trained_ema.values()) for k, v in averaged.items() if "lora_A" in k)
    record = json.loads((out / "shapes-lora.ema.lineage.json").read_text())
    assert record["ema"]["decay"] == DECAY and record["params"]["train"]["ema_decay"] == DECAY
    assert record["inputs"]["lora"]["path"].endswith("lora.ema.safetensors")
    assert set(record["files"]) == {"shapes-lora.ema.comfyui.safetensors", "shapes-lora.ema.diffusers.safetensors"}
    assert "ema" not in json.loads((out / "shapes-lora.lineage.json").read_text())
    with safe_open(str(out / "shapes-lora.ema.comfyui.safetensors"), "pt") as fh:
        assert json.loads(fh.metadata()["diffusion_pipe.lineage"])["ema"]["decay"] == DECAY


def test_export_instead_writes_the_average_under_the_usual_names(ema_run, tmp_path):
    _, _, _, runs, _, _ = ema_run
    out = _export(ema_run, tmp_path, "instead")
    assert sorted(p.name for p in out.iterdir()) == ["shapes-lora.comfyui.safetensors",
                                                      "shapes-lora.diffusers.safetensors", "shapes-lora.lineage.json"]
    exported = load_file(out / "shapes-lora.diffusers.safetensors")
    trained_ema = load_file(runs / "out/lora.ema.safetensors")
    assert all(any(torch.equal(v, t) for t in trained_ema.values()) for k, v in exported.items() if "lora_A" in k)
    assert json.loads((out / "shapes-lora.lineage.json").read_text())["ema"]["decay"] == DECAY


def test_export_of_a_missing_average_names_the_file(ema_run, tmp_path):
    repo, store, params, runs, _, _ = ema_run
    lone = tmp_path / "out"
    lone.mkdir()
    shutil.copy(runs / "out/lora.safetensors", lone / "lora.safetensors")
    edited = tmp_path / "params.yaml"
    edited.write_text(params.read_text().replace("name: shapes-lora", "name: shapes-lora\n  ema: beside"))
    out = subprocess.run([sys.executable, "-m", "stages.export", "--params", str(edited), "--lora",
                          str(lone / "lora.safetensors"), "--out", str(tmp_path / "artifacts")], cwd=repo,
                         env=run_env(store), capture_output=True, text=True, timeout=600)
    assert out.returncode == 2
    assert "lora.ema.safetensors, which does not exist: train with train.ema_decay > 0 writes it" in out.stderr
    assert not (tmp_path / "artifacts").exists() or not any((tmp_path / "artifacts").iterdir())


def test_the_stages_say_which_dvc_yaml_lines_the_ema_needs(ema_run, tmp_path):
    """In a repository whose dvc.yaml (the shipped one) does not list the EMA LoRA: train with an EMA is refused
    before it trains, naming the output to add; export.ema is refused naming the dep to add."""
    repo, store, params, runs, _, _ = ema_run
    beside = repo / "params-ema.yaml"  # beside the repository's dvc.yaml
    beside.write_text(params.read_text().replace("name: shapes-lora", "name: shapes-lora\n  ema: beside"))
    out = subprocess.run([sys.executable, "-m", "stages.train", "--params", str(beside), "--runs", str(tmp_path)],
                         cwd=repo, env=run_env(store), capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "add '- runs/train/lora.ema.safetensors' under stages.train.outs" in out.stderr, \
        out.stderr[-3000:]
    assert not (tmp_path / "checkpoints").exists()
    (repo / "runs/train").mkdir(parents=True)
    for name in ("lora.safetensors", "lora.ema.safetensors"):
        shutil.copy(runs / "out" / name, repo / "runs/train" / name)
    out = subprocess.run([sys.executable, "-m", "stages.export", "--params", str(beside), "--out", str(tmp_path / "a")],
                         cwd=repo, env=run_env(store), capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "export.ema: runs/train/lora.ema.safetensors is not a dependency of stage " \
                                   "'export'" in out.stderr, out.stderr[-3000:]
    shutil.rmtree(repo / "runs/train")
    beside.unlink()


def test_a_run_without_an_average_leaves_no_earlier_average_beside_its_lora(tmp_path):
    """Outside DVC (which deletes a stage's outputs first) an EMA LoRA of an earlier run would pass for this one's."""
    from diffusion_pipe.train.loop import _write_outputs

    out = tmp_path / "out"
    out.mkdir()
    (out / "lora.ema.safetensors").write_bytes(b"an earlier run's")
    lora = {"m.lora_A.weight": torch.ones(2, 3), "m.lora_B.weight": torch.zeros(3, 2)}
    args = [out / "lora.safetensors", tmp_path / "report.json", tmp_path / "loss.csv", tmp_path / "run", lora,
            {"run_id": "r"}, {"losses": [1.0], "grad_norms": [None]}, ModelParams(path="m"), TrainParams(), ["m"],
            None, tmp_path / "encoded.parquet"]
    _write_outputs(*args)
    assert (out / "lora.safetensors").is_file() and not (out / "lora.ema.safetensors").exists()
    args[8] = TrainParams(ema_decay=0.5)
    _write_outputs(*args, {k: v + 1 for k, v in lora.items()})
    assert torch.equal(load_file(out / "lora.ema.safetensors")["m.lora_A.weight"], torch.full((2, 3), 2.0))
