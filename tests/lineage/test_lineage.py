"""Lineage end to end: one real `dvc repro` of the example, then verify, print and diff its exports, and make
each kind of drift happen on a copy (caption edited, base weights swapped, store pack deleted or corrupted)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors import safe_open

from diffusion_pipe.cli import main
from diffusion_pipe.lineage.diff import diff_lineage
from diffusion_pipe.lineage.record import METADATA_KEY, md5_file, read_lineage
from diffusion_pipe.hashing import hash_file
from diffusion_pipe.models.flux import FluxAdapter

from tests.conftest import make_pipeline_repo, run_checked, run_env

FAST = {"steps: 120": "steps: 6", "eval_every_steps: 40": "eval_every_steps: 0",
        "name: shapes-lora": "name: shapes-lora\n  merged: true"}
ARTIFACTS = ("shapes-lora.diffusers.safetensors", "shapes-lora.comfyui.safetensors", "shapes-lora.lineage.json",
             "shapes-lora.merged")


def run(args: list[str], cwd: Path, store: Path) -> None:
    run_checked(args, cwd=cwd, env=run_env(store), timeout=300)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> tuple[Path, Path]:
    """(repo, store) after one `dvc repro` of a committed copy of the example, with a merged export."""
    root = tmp_path_factory.mktemp("lineage")
    store = root / "store"
    repo = make_pipeline_repo(root / "repo", store, FAST)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    run([*git, "add", "-A"], repo, store)
    run([*git, "commit", "-q", "-m", "example"], repo, store)
    run([sys.executable, "-m", "dvc", "repro", "-q"], repo, store)
    return repo, store


def lineage_cli(args: list[str], store: Path):
    return CliRunner().invoke(main, ["lineage", *map(str, args)], env={"DIFFUSION_PIPE_STORE": str(store)})


def copy_repo(repo: Path, dest: Path) -> Path:
    shutil.copytree(repo, dest, symlinks=True)
    return dest


def test_record_holds_everything_the_issue_lists(pipeline):
    repo, _ = pipeline
    record = json.loads((repo / "artifacts/shapes-lora.lineage.json").read_text())
    assert record["kind"] == "export" and record["params"]["train"]["steps"] == 6
    assert record["inputs"]["manifest"] == {"path": "data/manifest.parquet",
                                            "xxh3_128": hash_file(repo / "data/manifest.parquet"),
                                            "md5": md5_file(repo / "data/manifest.parquet")}
    assert record["inputs"]["encoded"]["xxh3_128"] == hash_file(repo / "data/encoded.parquet")
    assert record["inputs"]["lora"]["xxh3_128"] == hash_file(repo / "runs/train/lora.safetensors")
    assert record["inputs"]["store_keys"]["latent"] == 36 and record["inputs"]["store_keys"]["text"] == 36
    assert set(record["base_model"]["weights"]) == {"transformer", "vae", "text_encoder", "text_encoder_2"}
    # dvc repro wrote each upstream stage's entry before export ran; the export's own entry is never recorded
    assert set(record["dvc_lock"]) == {"scan", "encode", "train"} and "dvc_lock_omitted" not in record
    train_outs = {o["path"]: o["md5"] for o in record["dvc_lock"]["train"]["outs"]}
    assert train_outs["runs/train/lora.safetensors"] == record["inputs"]["lora"]["md5"]
    shapes = record["inputs"]["datasets"]["shapes"]
    assert shapes["path"] == "examples/flux-tiny/data" and shapes["items"] == 36
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert record["git"]["commit"] == head
    env = record["environment"]
    assert env["python"] and env["torch"] and "torch" in env["packages"] and "diffusers" in env["packages"]
    training = record["training"]
    assert training["seed"] == 0 and training["steps"] == 6
    assert training["train_loss_last"] > 0 and training["eval_loss_end"] > 0
    assert "trained_lora" in record  # the train stage's own record, or None where it wrote none
    # the same record in every file's metadata, and the files' hashes in lineage.json
    for name in ARTIFACTS[:2]:
        with safe_open(str(repo / "artifacts" / name), "pt") as f:
            assert json.loads(f.metadata()[METADATA_KEY]) == {k: v for k, v in record.items() if k != "files"}
        assert record["files"][name] == hash_file(repo / "artifacts" / name)


@pytest.mark.parametrize("artifact", ARTIFACTS)
def test_fresh_export_verifies(pipeline, artifact):
    repo, store = pipeline
    result = lineage_cli(["--verify", "--repo", repo, repo / "artifacts" / artifact], store)
    assert result.exit_code == 0, result.output
    assert "DRIFT" not in result.output and "items match" in result.output
    assert "ok     store latent entries: 36 present and intact" in result.output
    assert "ok     dataset examples/flux-tiny/data: 36 items match\n" in result.output
    assert "ok     dvc.lock entries: encode, scan, train describe the recorded inputs" in result.output


def test_prints_readably_and_as_json(pipeline):
    repo, store = pipeline
    path = repo / "artifacts/shapes-lora.comfyui.safetensors"
    text = lineage_cli([path], store).output
    for section in ("Base model", "Training", "Inputs", "Source", "Environment", "Params"):
        assert f"\n{section}\n" in text
    assert "train.steps" in text and "transformer weights" in text
    assert "  dataset shapes  examples/flux-tiny/data  (36 items; media " in text, text
    assert json.loads(lineage_cli(["--json", path], store).output) == read_lineage(path)


def test_merged_export_is_the_base_plus_the_lora(pipeline):
    import torch
    from safetensors.torch import load_file

    repo, _ = pipeline
    merged = load_file(repo / "artifacts/shapes-lora.merged/transformer/diffusion_pytorch_model.safetensors")
    base = load_file(repo / "examples/flux-tiny/model/transformer/diffusion_pytorch_model.safetensors")
    lora = load_file(repo / "artifacts/shapes-lora.diffusers.safetensors")
    module = "transformer_blocks.1.attn.to_q"
    delta = lora[f"transformer.{module}.lora_B.weight"] @ lora[f"transformer.{module}.lora_A.weight"]
    torch.testing.assert_close(merged[f"{module}.weight"], base[f"{module}.weight"] + delta)
    assert torch.equal(merged["x_embedder.weight"], base["x_embedder.weight"])


def stage(name: str, repo: Path, store: Path, monkeypatch) -> None:
    """Run one stage command in this process (saves an interpreter start and the imports)."""
    import importlib

    monkeypatch.chdir(repo)
    monkeypatch.setenv("DIFFUSION_PIPE_STORE", str(store))
    result = CliRunner().invoke(importlib.import_module(f"stages.{name}").command, [])
    assert result.exit_code == 0, result.output


def test_caption_edit_is_named_before_and_after_the_scan_and_leads_the_diff(pipeline, tmp_path, monkeypatch):
    repo, store = pipeline
    copy = copy_repo(repo, tmp_path / "repo")
    caption = copy / "examples/flux-tiny/data/000_red_circle_on_white.txt"
    caption.write_text("a crimson circle on a white background")
    named = ("DRIFT  dataset examples/flux-tiny/data: 1 change(s) since this was trained: "
             "000_red_circle_on_white.txt: caption 'a red circle on a white background' -> "
             "'a crimson circle on a white background'")
    result = lineage_cli(["--verify", "--repo", copy, copy / "artifacts/shapes-lora.comfyui.safetensors"], store)
    assert result.exit_code == 1 and named in result.output, result.output
    assert "ok     manifest data/manifest.parquet" in result.output  # the scan has not re-run yet
    assert "1 of " in result.output

    # after the scan, the recorded manifest is read back from DVC's cache to name the same file
    stage("scan", copy, store, monkeypatch)
    result = lineage_cli(["--verify", "--repo", copy, copy / "artifacts/shapes-lora.comfyui.safetensors"], store)
    assert named in result.output and "DRIFT  manifest data/manifest.parquet: " in result.output
    assert "ok     encoded table data/encoded.parquet" in result.output  # encode has not re-run yet
    assert "2 of " in result.output

    # a second real export from the changed repository, with a changed param: --diff leads with both causes (an
    # export param: export refuses a train param the LoRA was not trained with)
    params = copy / "params.yaml"
    params.write_text(params.read_text().replace("merged: true", "merged: false"))
    stage("export", copy, store, monkeypatch)
    second = read_lineage(copy / "artifacts/shapes-lora.lineage.json")
    assert "export" not in second["dvc_lock"] and set(second["dvc_lock_omitted"]) == {"scan", "encode"}
    result = lineage_cli([repo / "artifacts/shapes-lora.lineage.json", "--diff",
                          copy / "artifacts/shapes-lora.lineage.json"], store)
    assert result.exit_code == 1
    summary = result.output.splitlines()[2]
    # the second export ran from a tree with an uncommitted caption edit: git.dirty is a code difference
    assert "differences: params 1, captions 1, code 1; derived: " in summary, summary
    groups = [line for line in result.output.splitlines() if line and not line.startswith((" ", "---", "+++"))][1:]
    assert groups[:3] == ["params (1)", "captions (1)", "code (1)"], groups
    assert "  git.dirty: false -> true" in result.output
    assert "  dvc_lock.scan: recorded (" in result.output  # the second export's record left it out
    assert "  params.export.merged: true -> false" in result.output
    assert "  inputs.manifest.xxh3_128: " in result.output
    assert "inputs.encoded" not in result.output and "base_model" not in result.output
    assert "dvc_lock.export" not in result.output


def test_swapped_base_weights_name_the_component(pipeline, tmp_path):
    repo, store = pipeline
    copy = copy_repo(repo, tmp_path / "repo")
    FluxAdapter.build_tiny(tmp_path / "other", seed=1)
    transformer = copy / "examples/flux-tiny/model/transformer"
    shutil.rmtree(transformer)
    shutil.copytree(tmp_path / "other/transformer", transformer)
    result = lineage_cli(["--verify", "--repo", copy, copy / "artifacts/shapes-lora.lineage.json"], store)
    assert result.exit_code == 1
    assert "DRIFT  base model component 'transformer': " in result.output
    assert "the base weights were swapped or changed" in result.output
    assert "ok     base model component 'vae'" in result.output


def test_deleted_or_corrupt_store_pack_is_named(pipeline, tmp_path):
    repo, store = pipeline
    lora = repo / "artifacts/shapes-lora.diffusers.safetensors"
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    latent_sidecar = next((copy / "latent").glob("*.json"))
    keys = json.loads(latent_sidecar.read_text())["entries"]
    latent_sidecar.with_suffix(".safetensors").unlink()
    result = lineage_cli(["--verify", "--repo", repo, lora], copy)
    assert result.exit_code == 1
    assert "DRIFT  store latent entries: " in result.output and "missing from the store" in result.output
    assert any(key in result.output for key in keys)
    assert "ok     store text entries" in result.output

    text_pack = next((copy / "text").glob("*.safetensors"))
    data = bytearray(text_pack.read_bytes())
    data[-1] ^= 0xFF
    text_pack.write_bytes(bytes(data))
    result = lineage_cli(["--verify", "--repo", repo, lora], copy)
    assert f"DRIFT  store text entries: pack {text_pack.stem}" in result.output
    assert "corrupted on disk" in result.output


def test_diff_names_package_versions_and_nested_values():
    a = {"lineage_version": 2, "params": {"train": {"seed": 0}}, "environment": {"packages": {"torch": "2.13.0"}},
         "trained_lora": {"x": 1}}
    b = {"lineage_version": 2, "params": {"train": {"seed": 1}}, "environment": {"packages": {"torch": "2.12.0",
                                                                                              "peft": "0.21"}},
         "trained_lora": {"x": 2}}
    assert diff_lineage(a, b) == [("environment.packages.peft", "<absent>", "0.21"),
                                  ("environment.packages.torch", "2.13.0", "2.12.0"),
                                  ("params.train.seed", 0, 1)]
    assert diff_lineage(a, a) == []


def test_file_without_lineage_is_a_clear_error(tmp_path):
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(1)}, str(path))
    with pytest.raises(ValueError, match="other.safetensors: no diffusion-pipe lineage record in its metadata"):
        read_lineage(path)
    result = CliRunner().invoke(main, ["lineage", str(path)])
    assert result.exit_code == 2 and "no diffusion-pipe lineage record" in result.output


def test_diffusers_export_loads_every_key_and_changes_the_output(pipeline):
    """`FluxPipeline.load_lora_weights` takes every exported tensor, unchanged, and leaves no LoRA weight
    unset: no unexpected and no missing keys."""
    import torch
    from diffusers import FluxPipeline
    from safetensors.torch import load_file

    repo, _ = pipeline
    pipe = FluxPipeline.from_pretrained(repo / "examples/flux-tiny/model")

    def generate() -> torch.Tensor:
        return pipe("a red circle on a white background", height=64, width=64, num_inference_steps=2,
                    max_sequence_length=32, generator=torch.Generator().manual_seed(0), output_type="pt").images

    before = generate()
    path = repo / "artifacts/shapes-lora.diffusers.safetensors"
    pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name="shapes")
    loaded = {n.replace(".shapes.", "."): p for n, p in pipe.transformer.named_parameters() if ".shapes." in n}
    exported = {k.removeprefix("transformer."): v for k, v in load_file(path).items()}
    assert set(loaded) == set(exported)
    assert all(torch.equal(loaded[k].detach(), exported[k]) for k in exported)
    assert (generate() - before).abs().mean() > 1e-4


def test_checkpoint_lineage_for_the_train_stage(pipeline, monkeypatch):
    from diffusion_pipe.lineage.record import checkpoint_lineage, encoded_store_keys, lineage_metadata
    from diffusion_pipe.lineage.verify import verify_lineage
    from diffusion_pipe.params import load_params
    from diffusion_pipe.store import Store

    repo, store = pipeline
    monkeypatch.setenv("DIFFUSION_PIPE_STORE", str(store))
    keys = encoded_store_keys(repo / "data/encoded.parquet")
    record = checkpoint_lineage(load_params(repo / "params.yaml"), repo, Path("data/encoded.parquet"), keys, None)
    assert record["kind"] == "checkpoint" and "lora" not in record["inputs"]
    assert record["training"]["steps"] == 6 and record["training"]["train_loss_last"] is None
    exported = read_lineage(repo / "artifacts/shapes-lora.lineage.json")
    assert record["inputs"]["store_keys"] == exported["inputs"]["store_keys"]
    assert record["base_model"] == exported["base_model"]
    assert json.loads(lineage_metadata(record)[METADATA_KEY]) == record
    assert all(check.ok for check in verify_lineage(record, repo, Store(store)))
