"""train.adapter: lokr | loha and train.lora_dora, all through peft: their params and the combinations refused,
the run identity at their defaults, training and exact resume on the bundled example, and exports that load as
the trained peft modules apply (ComfyUI's LyCORIS keys, diffusers' DoRA)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffusion_pipe.adapter_keys import export_adapter
from diffusion_pipe.config import ConfigError, from_dict
from diffusion_pipe.lora_keys import fold_scale
from diffusion_pipe.params import ModelParams, TrainParams, load_params
from diffusion_pipe.train.loop import run_identity
from diffusion_pipe.train.lora import AdapterKind, add_lora, lora_state_dict, target_module_names
from tests.adapter_weights import by_prefix, exported_weight_errors, in_layout, peft_weights
from tests.conftest import encoded_example, resumed_without, run_checked, run_env, trained_run
from tests.train.test_optimizers import _exported_weights_match

REPO = Path(__file__).resolve().parents[2]
RANK, ALPHA = 4, 8.0  # alpha != rank: an export that drops the scale applies at the wrong strength

# --- params ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("train, match", [
    ({"adapter": "lokr", "lora_dora": True}, r"train\.lora_dora: .*adapter is 'lokr'.*set train\.adapter: lora"),
    ({"adapter": "loha", "lora_dora": True}, r"train\.lora_dora: .*only adapter: lora"),
    ({"adapter": "full", "lora_dora": True}, r"train\.lora_dora: .*adapter is 'full'"),
    ({"adapter": "lokr", "lora_dropout": 0.1}, r"train\.lora_dropout: .*drop train\.lora_dropout"),
    ({"adapter": "loha", "lokr_factor": 4}, r"train\.lokr_factor: .*only adapter: lokr"),
    ({"lokr_decompose_both": True}, r"train\.lokr_decompose_both: .*adapter is 'lora'"),
    ({"adapter": "lokr", "lokr_factor": 0}, r"train\.lokr_factor: 0 splits nothing"),
    ({"adapter": "lokr", "lokr_factor": -2}, r"train\.lokr_factor: -2 is out of range"),
    ({"adapter": "lokr", "init_lora": "x.safetensors"}, r"train\.init_lora: .*'lokr'.*drop init_lora"),
    ({"adapter": "loha", "init_lora": "x.safetensors"}, r"train\.init_lora: .*'loha'"),
    ({"lora_dora": True, "init_lora": "x.safetensors"}, r"train\.init_lora: .*no DoRA magnitude"),
    ({"lora_dora": True, "optimizer": "muon"}, r"train\.optimizer: muon .*lora_dora: false"),
    ({"adapter": "dora"}, r"train\.adapter: got 'dora', expected one of 'lora' \| 'lokr' \| 'loha' \| 'full'"),
])
def test_bad_adapter_params_name_the_param_and_the_fix(train, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(TrainParams, train, "train")


@pytest.mark.parametrize("model, train, export, match", [
    ({}, {"adapter": "lokr"}, {"formats": ["diffusers", "comfyui"]},
     r"export\.formats: lists 'diffusers'.*loads no lokr.*export\.formats: \[comfyui\]"),
    ({}, {"adapter": "loha"}, {"formats": ["diffusers"]}, r"export\.formats: .*loads no loha"),
    ({}, {"adapter": "loha"}, {"formats": ["comfyui"], "merged": True}, r"export\.merged: .*trains loha"),
    ({}, {"lora_dora": True}, {"merged": True}, r"export\.merged: .*trains DoRA.*merged: false"),
    ({"base_dtype": "float8"}, {"lora_dora": True}, {}, r"train\.lora_dora: .*model\.base_dtype: 'float8'"),
])
def test_adapter_combinations_across_sections_are_refused(tmp_path, model, train, export, match):
    params = tmp_path / "params.yaml"
    params.write_text(json.dumps({"model": {"path": "m", **model}, "scan": {"datasets": [{"path": "d"}]},
                                  "train": train, "export": export}))
    with pytest.raises(ConfigError, match=match):
        load_params(params)


def test_each_adapter_loads_with_its_options(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(json.dumps({"model": {"path": "m"}, "scan": {"datasets": [{"path": "d"}]},
                                  "train": {"adapter": "lokr", "lokr_factor": 4, "lokr_decompose_both": True},
                                  "export": {"formats": ["comfyui"]}}))
    train = load_params(params).train
    assert AdapterKind.of(train) == AdapterKind("lokr", False, 4, True)
    assert AdapterKind.of(from_dict(TrainParams, {"lora_dora": True}, "train")).label == "DoRA"


def test_run_identity_is_unchanged_at_the_defaults_and_changes_with_each_option(tmp_path):
    """A run from before these params existed continues (their defaults are left out of the identity, whose
    `train` keys are exactly today's); each non-default value is another run."""
    encoded = tmp_path / "encoded.parquet"
    encoded.write_bytes(b"x")
    model = ModelParams(path="m")

    def identity(**changes) -> dict:
        return run_identity(model, TrainParams(**changes), encoded, 32, 1)

    new = {"lora_dora", "lokr_factor", "lokr_decompose_both"}
    assert not new & identity()["train"].keys()
    assert identity()["train"]["adapter"] == "lora"
    others = [identity(lora_dora=True), identity(adapter="lokr"), identity(adapter="loha"),
              identity(adapter="lokr", lokr_factor=4), identity(adapter="lokr", lokr_decompose_both=True)]
    assert len({json.dumps(i, sort_keys=True) for i in [identity(), *others]}) == 1 + len(others)
    assert identity(lora_dora=True)["train"]["lora_dora"] is True


# --- training the bundled example ------------------------------------------------------------------------------

STEPS = 6
PARAMS = {"steps: 120": f"steps: {STEPS}", "lr_scheduler: cosine": "lr_scheduler: constant",
          "warmup_steps: 10": "warmup_steps: 0",
          "eval_every_steps: 40": "eval_every_steps: 0\n  checkpoint_every_steps: 3\n  save_lora_every_steps: 3",
          "every_steps: 60": "every_steps: 3"}  # samples at steps 0, 3 and 6: the adapters render mid-run too
RECIPES = {  # what each adds to the bundled train section, and the formats it exports
    "lokr": ("adapter: lokr\n  lokr_factor: 4", "[comfyui]"),
    "loha": ("adapter: loha", "[comfyui]"),
    "dora": ("lora_dora: true", "[diffusers, comfyui]"),
}
TENSORS = {"lokr": "lokr_w1", "loha": "hada_w1_a", "dora": "lora_magnitude_vector"}


@pytest.fixture(scope="module")
def encoded_repo(tmp_path_factory):
    return encoded_example(tmp_path_factory.mktemp("adapters"), PARAMS)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_adapter_trains_the_example_and_resumes_exactly(encoded_repo, tmp_path, name):
    """6 steps, checkpoints at 3 and 6: the eval loss falls; the trained file holds the adapter's own tensors,
    each the weight a checkpoint's master holds; the LoRA written at step 3 is in the export formats; the run
    resumed from its step-3 checkpoint ends with the same losses, evaluations and bytes; the options are in the
    run's identity and lineage."""
    repo, store = encoded_repo
    recipe, formats = RECIPES[name]
    text = (repo / "params.yaml").read_text().replace("lora_rank: 8", f"lora_rank: 8\n  {recipe}")
    params = tmp_path / "params.yaml"
    params.write_text(text.replace("formats: [diffusers, comfyui]", f"formats: {formats}"))
    runs = tmp_path / "runs"
    cmd, whole, report = trained_run(params, runs, repo, store)
    assert report["eval_loss_end"] < report["eval_loss_start"], report
    trained = load_file(runs / "out/lora.safetensors")
    assert any(k.endswith(f".{TENSORS[name]}") for k in trained), sorted(trained)[:4]
    (run_dir,) = (runs / "checkpoints").iterdir()
    identity = json.loads((run_dir / "identity.json").read_text())
    lineage = json.loads((run_dir / "lineage.json").read_text())
    for key, value in {"lokr": {"adapter": "lokr", "lokr_factor": 4}, "loha": {"adapter": "loha"},
                       "dora": {"lora_dora": True}}[name].items():
        assert identity["train"][key] == lineage["params"]["train"][key] == value
    assert _exported_weights_match(runs / "out/lora.safetensors", run_dir / f"step{STEPS}")
    step_loras = {p.name: p for p in (runs / "loras").rglob("*.safetensors")}
    assert sorted(p for p in step_loras if p.startswith("step-000003")) == sorted(
        f"step-000003.{f}.safetensors" for f in formats.strip("[]").split(", "))
    run_checked([sys.executable, "-m", "stages.export", "--params", str(params), "--lora",
                 str(runs / "out/lora.safetensors"), "--out", str(tmp_path / "artifacts")],
                cwd=repo, env=run_env(store))
    exported = load_file(tmp_path / "artifacts/shapes-lora.comfyui.safetensors")
    last = load_file(step_loras[f"step-{STEPS:06d}.comfyui.safetensors"])  # written along the way, the same way
    assert exported.keys() == last.keys() and all(torch.equal(exported[k], last[k]) for k in exported)

    # the run as it was when stopped after its step-3 checkpoint, run again
    assert resumed_without(run_dir / f"step{STEPS}", cmd, repo, store, whole, report)["resumed_from"] == 3


@pytest.mark.slow  # four short train runs, two of them on 2 processes: about 2 minutes
@pytest.mark.parametrize("name", ["lokr", "dora"])
def test_two_pipeline_stages_train_what_one_stage_trains(encoded_repo, tmp_path, name):
    """Over 2 pipeline stages (2 processes, gloo), each rank injecting the adapter with the other stage's layers
    still unloaded (meta), the trained file gathers both halves and equals a 1-stage run's (DoRA's magnitude is
    the norm of weights loaded before injection, LoKr's factors are seeded per name)."""
    from tests.conftest import torchrun

    repo, store = encoded_repo
    recipe, formats = RECIPES[name]
    text = (repo / "params.yaml").read_text().replace("lora_rank: 8", f"lora_rank: 8\n  {recipe}")
    text = text.replace("formats: [diffusers, comfyui]", f"formats: {formats}").replace(f"steps: {STEPS}", "steps: 3")
    files = {}
    for stages in (1, 2):
        (tmp_path / f"p{stages}.yaml").write_text(text.replace("pipeline_stages: 1", f"pipeline_stages: {stages}"))
        out = tmp_path / f"s{stages}"
        launch = [sys.executable] if stages == 1 else torchrun(2)
        run_checked([*launch, "-m", "stages.train", "--params", str(tmp_path / f"p{stages}.yaml"), "--out",
                     str(out), "--report", str(out / "r.json"), "--loss-plot", str(out / "loss.csv"), "--runs",
                     str(out / "runs")], cwd=repo, env=run_env(store))
        files[stages] = load_file(out / "lora.safetensors")
    one, two = files[1], files[2]
    assert one.keys() == two.keys() and any(k.startswith("single_transformer_blocks.") for k in two)
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-6)


# --- exports: what the exported keys apply equals what the trained peft module applies (tests/adapter_weights.py) -

KINDS = {"lokr": AdapterKind("lokr"), "lokr-decomposed": AdapterKind("lokr", lokr_decompose_both=True),
         "lokr-factor": AdapterKind("lokr", lokr_factor=4), "loha": AdapterKind("loha"),
         "dora": AdapterKind("lora", dora=True)}


def _trained_flux(model_dir: Path, kind: AdapterKind, targets: tuple[str, ...] = ()):
    """(adapter, denoiser with `kind` injected, every adapter tensor moved off its init so that no factor is zero)."""
    from diffusion_pipe.models.flux import FluxAdapter

    adapter = FluxAdapter(model_dir, torch.float32)
    denoiser = adapter.denoiser_class().from_pretrained(model_dir / "transformer")
    names = target_module_names(denoiser, targets or adapter.default_lora_targets, adapter.lora_exclude())
    add_lora(denoiser, names, RANK, ALPHA, 0.0, kind=kind)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in denoiser.parameters():
            if param.requires_grad:
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return adapter, denoiser


@pytest.mark.parametrize("name", sorted(KINDS))
def test_the_comfyui_export_applies_what_the_trained_module_applies(tiny_flux_dir, name):
    """Every key of the ComfyUI file, through the LyCORIS formulas, makes the weight the trained peft modules
    make: whole modules, modules ComfyUI fuses (LoHa and DoRA stacked into its qkv; LoKr under the diffusers
    names ComfyUI maps onto slices of it), at alpha != rank."""
    adapter, denoiser = _trained_flux(tiny_flux_dir, KINDS[name])
    exported = export_adapter(adapter, fold_scale(lora_state_dict(denoiser), RANK, ALPHA), "comfyui")
    assert exported_weight_errors(adapter, denoiser, exported, "comfyui") == {}
    prefixes, modules = by_prefix(exported), peft_weights(denoiser)
    if name.startswith("lokr"):  # a key per module: its ComfyUI one where whole, else (fused q/k/v) its diffusers one
        assert len(prefixes) == len(modules) and any(p.startswith("transformer.") for p in prefixes)
    else:
        assert prefixes.keys() == in_layout(adapter, {m: w for m, (w, _) in modules.items()}, "comfyui").keys()


def test_lokr_is_refused_where_the_format_fuses_and_comfyui_maps_no_diffusers_names(tiny_flux_dir, monkeypatch):
    from diffusion_pipe.models.flux import FluxAdapter

    monkeypatch.setattr(FluxAdapter, "comfyui_reads_diffusers_names", False)
    adapter, denoiser = _trained_flux(tiny_flux_dir, AdapterKind("lokr"))
    with pytest.raises(ValueError, match=r"export\.formats: family 'flux' writes '.*attn\.to_[qkv]' in 'comfyui' "
                                         r"fused .*train adapter: loha or lora, or leave 'to_[qkv]' out of "
                                         r"train\.lora_targets"):
        export_adapter(adapter, fold_scale(lora_state_dict(denoiser), RANK, ALPHA), "comfyui")


def test_dora_is_refused_where_a_fused_projection_is_trained_in_part(tiny_flux_dir):
    adapter, denoiser = _trained_flux(tiny_flux_dir, KINDS["dora"], targets=("to_q", "to_out.0"))
    with pytest.raises(ValueError, match=r"fused from several.*magnitude of the others is not known"):
        export_adapter(adapter, fold_scale(lora_state_dict(denoiser), RANK, ALPHA), "comfyui")


@pytest.mark.parametrize("name", ["lokr", "loha"])
def test_lycoris_adapters_have_no_diffusers_export(tiny_flux_dir, name):
    adapter, denoiser = _trained_flux(tiny_flux_dir, KINDS[name])
    with pytest.raises(ValueError, match=rf"export\.formats: 'diffusers' loads no {name}.*comfyui or kohya"):
        export_adapter(adapter, fold_scale(lora_state_dict(denoiser), RANK, ALPHA), "diffusers")


def test_the_diffusers_dora_export_loads_with_load_lora_weights_as_trained(tiny_flux_dir):
    """diffusers' FluxPipeline.load_lora_weights reads the DoRA magnitude (`lora_magnitude_vector`): the loaded
    modules compute what the trained ones do."""
    from diffusers import FluxPipeline

    adapter, denoiser = _trained_flux(tiny_flux_dir, KINDS["dora"])
    exported = export_adapter(adapter, fold_scale(lora_state_dict(denoiser), RANK, ALPHA), "diffusers")
    assert any(k.endswith(".lora_magnitude_vector") for k in exported)
    pipe = FluxPipeline.from_pretrained(tiny_flux_dir, torch_dtype=torch.float32)
    pipe.load_lora_weights(exported)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    for name in ("transformer_blocks.0.attn.to_q", "single_transformer_blocks.1.proj_mlp"):
        loaded, trained = pipe.transformer.get_submodule(name), denoiser.get_submodule(name)
        assert torch.allclose(loaded(x[:, :loaded.in_features]), trained(x[:, :trained.in_features]), atol=1e-6)
        assert not torch.allclose(loaded(x[:, :loaded.in_features]), loaded.get_base_layer()(x[:, :loaded.in_features]))


def test_adapter_tensors_start_from_the_seed_not_the_global_rng(tiny_flux_dir):
    """LoKr's and LoHa's random factors, like lora_A, are drawn per tensor name from the run seed
    (`init_lora_deterministic`): the same whatever torch's global RNG holds, so every rank agrees."""
    from diffusion_pipe.train.build import init_lora_deterministic

    def initial(kind: AdapterKind, global_seed: int) -> dict[str, torch.Tensor]:
        from diffusion_pipe.models.flux import FluxAdapter

        adapter = FluxAdapter(tiny_flux_dir, torch.float32)
        denoiser = adapter.denoiser_class().from_pretrained(tiny_flux_dir / "transformer")
        torch.manual_seed(global_seed)
        add_lora(denoiser, target_module_names(denoiser, ("to_q", "ff.net.0.proj")), RANK, ALPHA, 0.0, kind=kind)
        init_lora_deterministic(denoiser, seed=0)
        return lora_state_dict(denoiser)

    for kind in (KINDS["lokr"], KINDS["lokr-decomposed"], KINDS["loha"]):
        first, again = initial(kind, 1), initial(kind, 2)
        assert first.keys() == again.keys()
        assert all(torch.equal(first[k], again[k]) for k in first), kind
