"""`train.lora_targets`: module-name suffixes (matched on '.' boundaries) that say which Linear modules get LoRA;
empty uses the family's defaults; a list naming no Linear module is refused, naming the param (README, params)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from diffusion_pipe.config import ConfigError
from diffusion_pipe.models.flux import FluxAdapter
from diffusion_pipe.train.build import build_local_model
from tests.conftest import make_pipeline_repo, run_checked, run_env, run_stages

# Not the Flux defaults: to_k, to_v, add_*_proj, to_out.0, proj_mlp, ff.net.0.proj, ff_context.* are left out.
CUSTOM = ("to_q", "ff.net.2", "proj_out")
# The tiny Flux's Linear modules those suffixes name, written out by hand: "ff.net.2" does not name
# "ff_context.net.2", and the top-level "proj_out" (the output projection) stays frozen: the Flux adapter
# excludes it from LoRA.
CUSTOM_MODULES = {
    *(f"transformer_blocks.{i}.attn.to_q" for i in range(2)),
    *(f"single_transformer_blocks.{i}.attn.to_q" for i in range(2)),
    *(f"transformer_blocks.{i}.ff.net.2" for i in range(2)),
    *(f"single_transformer_blocks.{i}.proj_out" for i in range(2)),
}


def lora_modules(model: torch.nn.Module) -> set[str]:
    """The modules of `model` that hold a LoRA (have lora_A / lora_B parameters)."""
    found = set()
    for name, _ in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            found.add(name.split(".lora_")[0])
    return found


def build(model_dir, targets: tuple[str, ...]):
    adapter = FluxAdapter(model_dir, torch.float32)
    return adapter, build_local_model(adapter, 1, 0, targets=targets, rank=4, alpha=4.0, dropout=0.0, seed=0)


def test_custom_targets_put_lora_exactly_on_the_modules_they_name(tiny_flux_dir):
    adapter, local = build(tiny_flux_dir, CUSTOM)
    assert sorted(local.lora_targets) == sorted(CUSTOM_MODULES)
    assert lora_modules(local.denoiser) == CUSTOM_MODULES
    # only the LoRA trains
    trainable = {n.split(".lora_")[0] for n, p in local.denoiser.named_parameters() if p.requires_grad}
    assert trainable == CUSTOM_MODULES
    # the defaults the custom list leaves out get none
    names = {n for n, _ in local.denoiser.named_modules()}
    for left_out in ("to_k", "to_v", "add_q_proj", "to_out.0", "proj_mlp", "ff.net.0.proj", "ff_context.net.2"):
        assert left_out in adapter.default_lora_targets
        named = {n for n in names if n.endswith(f".{left_out}")}
        assert named, left_out  # the tiny model has such modules ...
        assert not named & lora_modules(local.denoiser), left_out  # ... and none holds a LoRA


def test_default_targets_cover_more_than_the_custom_list(tiny_flux_dir):
    """The comparison point: with the family's defaults, modules the custom list leaves out hold a LoRA."""
    _, local = build(tiny_flux_dir, FluxAdapter(tiny_flux_dir, torch.float32).default_lora_targets)
    with_lora = lora_modules(local.denoiser)
    assert "transformer_blocks.0.attn.to_k" in with_lora and "transformer_blocks.0.ff_context.net.2" in with_lora
    assert "proj_out" not in with_lora  # the excluded output projection, with the defaults too
    assert CUSTOM_MODULES < with_lora


def test_suffixes_match_whole_name_components(tiny_flux_dir):
    """A suffix names a module whose name ends with it after a '.': "attn.to_k" (two components) names every
    attention's to_k, "q_proj" names no "add_q_proj"."""
    _, local = build(tiny_flux_dir, ("attn.to_k", "q_proj"))
    assert lora_modules(local.denoiser) == {*(f"transformer_blocks.{i}.attn.to_k" for i in range(2)),
                                            *(f"single_transformer_blocks.{i}.attn.to_k" for i in range(2))}


@pytest.mark.parametrize("targets", [("norm1",), ("attn",), ("o_q",), ("nothing_here", "attn")],
                         ids=["a-norm-module", "an-attention-module", "not-on-a-dot-boundary", "unknown-names"])
def test_a_list_naming_no_linear_module_is_refused_naming_the_param(tiny_flux_dir, targets):
    with pytest.raises(ConfigError, match=r"^train\.lora_targets: none of ") as err:
        build(tiny_flux_dir, targets)
    assert str(list(targets)) in str(err.value)


@pytest.fixture(scope="module")
def pipeline_repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-targets")
    return make_pipeline_repo(root / "repo", root / "store", {"steps: 120": "steps: 1", "eval_every_steps: 40":
                                                               "eval_every_steps: 0"}, dvc=False), root / "store"


def with_targets(repo, targets: list[str], name: str):
    """A copy of the repo's params.yaml with `train.lora_targets: targets`, written beside it."""
    params = (repo / "params.yaml").read_text()
    path = repo / f"params-{name}.yaml"
    line = f"  lora_targets: {json.dumps(targets)}\n"
    path.write_text(params.replace("  lora_alpha: 8.0\n", f"  lora_alpha: 8.0\n{line}"))
    return path


def test_train_stage_refuses_targets_naming_no_linear_module(pipeline_repo, tmp_path):
    """Through the train stage: the custom list reaches the model (the run stops on it, exit status 2, one line
    naming the param), before any data is read (an encoded table without rows is enough to get there)."""
    import subprocess

    import pyarrow as pa
    import pyarrow.parquet as pq

    repo, store = pipeline_repo
    empty = tmp_path / "encoded.parquet"
    pq.write_table(pa.table({"split": pa.array([], pa.string())}), empty)
    params = with_targets(repo, ["norm1"], "refused")
    out = subprocess.run([sys.executable, "-m", "stages.train", "--params", str(params), "--encoded", str(empty),
                          "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")],
                         cwd=repo, env=run_env(store), capture_output=True, text=True, timeout=600)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "train.lora_targets: none of ['norm1'] names a Linear module of the model" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow  # about 20 s: encode and a one-step run
def test_trained_lora_holds_exactly_the_custom_targets(pipeline_repo, tmp_path):
    from safetensors import safe_open

    repo, store = pipeline_repo
    run_stages(repo, store)
    params = with_targets(repo, list(CUSTOM), "custom")
    run_checked([sys.executable, "-m", "stages.train", "--params", str(params), "--runs", str(tmp_path / "runs"),
                 "--out", str(tmp_path / "out"), "--report", str(tmp_path / "report.json"),
                 "--loss-plot", str(tmp_path / "loss.csv")], cwd=repo, env=run_env(store))
    with safe_open(tmp_path / "out" / "lora.safetensors", "pt") as fh:
        keys, metadata = set(fh.keys()), fh.metadata()
    assert keys == {f"{m}.lora_{ab}.weight" for m in CUSTOM_MODULES for ab in "AB"}
    assert set(json.loads(metadata["lora_targets"])) == CUSTOM_MODULES
    assert json.loads((tmp_path / "report.json").read_text())["lora_modules"] == len(CUSTOM_MODULES)
