"""train.init_lora: a run starts from a LoRA file in any layout the family exports, at the strength it applies."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from diffusion_pipe.cli_support import stage_param_paths
from diffusion_pipe.config import ConfigError
from diffusion_pipe.hashing import hash_file
from diffusion_pipe.lineage.record import METADATA_KEY
from diffusion_pipe.lora_keys import fold_scale, lora_modules
from diffusion_pipe.models.flux import FluxAdapter
from diffusion_pipe.params import ModelParams, TrainParams
from diffusion_pipe.train.build import build_local_model
from diffusion_pipe.train.loop import run_identity
from tests.conftest import make_pipeline_repo, run_env, run_stages

RANK, FILE_ALPHA, RUN_ALPHA = 4, 8.0, 4.0  # the file applies at scale 2, the run trains at scale 1
TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "proj_mlp", "proj_out", "ff.net.2", "norm_out.linear")
FUSED = ("img_attn.qkv", "txt_attn.qkv", "linear1")  # ComfyUI's Flux fuses these: not splittable


@pytest.fixture(scope="module")
def adapter(tiny_flux_dir):
    return FluxAdapter(tiny_flux_dir, torch.float32)


def build(adapter, init_lora=None, rank=RANK):
    return build_local_model(adapter, 1, 0, targets=TARGETS, rank=rank, alpha=RUN_ALPHA, dropout=0.0, seed=0,
                             init_lora=init_lora)


@pytest.fixture(scope="module")
def trained(adapter):
    """A LoRA as the train stage holds it (PEFT names, scale FILE_ALPHA / RANK not folded), random A and B."""
    generator = torch.Generator().manual_seed(1)
    local = build(adapter)
    lora = {}
    for name in local.lora_targets:
        module = local.denoiser.get_submodule(name)
        lora[f"{name}.lora_A.weight"] = torch.randn(RANK, module.in_features, generator=generator) * 0.1
        lora[f"{name}.lora_B.weight"] = torch.randn(module.out_features, RANK, generator=generator) * 0.1
    return lora


def forward(denoiser) -> torch.Tensor:
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        return denoiser(hidden_states=torch.randn(1, 16, 16, generator=generator),
                        encoder_hidden_states=torch.randn(1, 8, 32, generator=generator),
                        pooled_projections=torch.randn(1, 32, generator=generator),
                        timestep=torch.tensor([0.5]), img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3),
                        guidance=torch.tensor([1.0]), return_dict=False)[0]


def base_plus(adapter, lora: dict, scale: float, modules: set[str] | None = None) -> torch.Tensor:
    """The base denoiser's output with `lora` merged into its weights at `scale` (only `modules`, when given)."""
    cls = adapter.denoiser_class()
    denoiser = cls.from_pretrained(adapter.denoiser_dir())
    with torch.no_grad():
        for name, (a, b) in lora_modules(lora).items():
            if modules is None or name in modules:
                denoiser.get_submodule(name).weight += scale * b @ a
    return forward(denoiser)


def write(path, tensors, metadata=None):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def exact_comfyui(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items() if not any(f".{f}." in k for f in FUSED)}


def comfyui_modules(adapter, trained) -> set[str]:
    """The modules whose ComfyUI keys are not fused."""
    return {m for m in lora_modules(trained)
            if set(exact_comfyui(adapter.export_lora({f"{m}.lora_A.weight": trained[f"{m}.lora_A.weight"],
                                                      f"{m}.lora_B.weight": trained[f"{m}.lora_B.weight"]},
                                                     "comfyui")))}


def test_ours_and_diffusers_start_at_base_plus_that_lora(adapter, trained, tmp_path):
    expected = base_plus(adapter, trained, FILE_ALPHA / RANK)
    ours = write(tmp_path / "lora.safetensors", trained, {"lora_rank": str(RANK), "lora_alpha": str(FILE_ALPHA)})
    assert torch.allclose(forward(build(adapter, ours).denoiser), expected, atol=1e-5)
    diffusers = write(tmp_path / "d.safetensors",
                      adapter.export_lora(fold_scale(trained, RANK, FILE_ALPHA), "diffusers"),
                      {"diffusion_pipe.export_format": "diffusers", "lora_rank": "4", "lora_alpha": "4"})
    assert torch.allclose(forward(build(adapter, diffusers).denoiser), expected, atol=1e-5)
    # as diffusers' save_lora_weights writes it: unfolded, its LoraConfig in the metadata
    config = {"transformer.r": RANK, "transformer.lora_alpha": FILE_ALPHA, "transformer.rank_pattern": {}}
    saved = write(tmp_path / "s.safetensors", adapter.export_lora(trained, "diffusers"),
                  {"lora_adapter_metadata": json.dumps(config)})
    assert torch.allclose(forward(build(adapter, saved).denoiser), expected, atol=1e-5)
    assert not torch.allclose(forward(build(adapter).denoiser), expected, atol=1e-3)


def test_comfyui_and_kohya_with_alpha_start_at_base_plus_that_lora(adapter, trained, tmp_path, capsys):
    """ComfyUI's unfused keys (its modulation's halves swapped back) and kohya names with an `.alpha` other than
    the rank: the file's alpha/rank lands in the run's own scale; the fused modules keep LoRA's usual init."""
    modules = comfyui_modules(adapter, trained)
    expected = base_plus(adapter, trained, FILE_ALPHA / RANK, modules)
    comfy = exact_comfyui(adapter.export_lora(fold_scale(trained, RANK, FILE_ALPHA), "comfyui"))
    assert "diffusion_model.final_layer.adaLN_modulation.1.lora_up.weight" in comfy
    path = write(tmp_path / "c.safetensors", comfy)
    assert torch.allclose(forward(build(adapter, path).denoiser), expected, atol=1e-5)
    assert f"{len(modules)} LoRA modules start from it, {len(lora_modules(trained)) - len(modules)} from" \
        in capsys.readouterr().err
    # kohya: unscaled B with alpha = FILE_ALPHA (scale 2)
    kohya = {}
    for key, value in exact_comfyui(adapter.export_lora(trained, "comfyui")).items():
        name = "lora_unet_" + key.removeprefix("diffusion_model.")
        for suffix in (".lora_down.weight", ".lora_up.weight", ".alpha"):
            if name.endswith(suffix):
                name = name[: -len(suffix)].replace(".", "_") + suffix
        kohya[name] = torch.tensor(FILE_ALPHA) if name.endswith(".alpha") else value
    path = write(tmp_path / "k.safetensors", kohya)
    assert torch.allclose(forward(build(adapter, path).denoiser), expected, atol=1e-5)


def test_a_fused_comfyui_key_is_refused(adapter, trained, tmp_path):
    path = write(tmp_path / "c.safetensors", adapter.export_lora(trained, "comfyui"))
    with pytest.raises(ConfigError, match=r"c\.safetensors holds 'diffusion_model\.double_blocks\.0\.img_attn\.qkv', "
                                          r"a fused projection"):
        build(adapter, path)


def test_errors_name_the_file_and_the_fix(adapter, trained, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"train\.init_lora: .*nope\.safetensors does not exist"):
        build(adapter, tmp_path / "nope.safetensors")
    (tmp_path / "x.ckpt").write_bytes(b"PK\x03\x04 not safetensors")
    with pytest.raises(ConfigError, match=r"x\.ckpt is not a safetensors file"):
        build(adapter, tmp_path / "x.ckpt")
    path = write(tmp_path / "r.safetensors", trained)
    with pytest.raises(ConfigError, match=r"r\.safetensors has rank 4 .* train\.lora_rank is 8; set "
                                          r"train\.lora_rank: 4"):
        build(adapter, path, rank=8)
    stray = {**trained, "transformer.no_such_block.to_q.lora_A.weight": torch.zeros(RANK, 4),
             "transformer.no_such_block.to_q.lora_B.weight": torch.zeros(4, RANK)}
    path = write(tmp_path / "u.safetensors", stray)
    with pytest.raises(ConfigError, match=r"u\.safetensors holds 'transformer\.no_such_block\.to_q', which maps to "
                                          r"no LoRA module"):
        build(adapter, path)
    path = write(tmp_path / "n.safetensors", {**trained, "some.other.weight": torch.zeros(2)})
    with pytest.raises(ConfigError, match=r"holds 'some\.other\.weight', which is no LoRA tensor"):
        build(adapter, path)


def test_the_file_content_is_part_of_the_run_and_a_train_dep(tmp_path):
    encoded = tmp_path / "encoded.parquet"
    encoded.write_bytes(b"x")
    lora = tmp_path / "start.safetensors"
    lora.write_bytes(b"one")
    model, train = ModelParams(path="m"), TrainParams(init_lora=str(lora))
    first = run_identity(model, train, encoded, 32, 1)
    lora.write_bytes(b"two")
    assert run_identity(model, train, encoded, 32, 1) != first
    params = SimpleNamespace(model=model, train=train)
    assert ("train.init_lora", [str(lora)]) in stage_param_paths("train", params)
    assert ("train.init_lora", []) in stage_param_paths("train", SimpleNamespace(model=model, train=TrainParams()))


@pytest.mark.slow  # scan, encode and a 1-step train of the bundled example: about 40 s on 2 shared cores
def test_a_run_starts_from_the_file_and_records_it(tmp_path):
    """Through the stage commands: the trained LoRA is the file's (one step at a negligible learning rate), the
    file's hash is in the run identity and the lineage record, and other targets keep LoRA's usual init."""
    store = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store, {
        "steps: 120": "steps: 1", "learning_rate: 2.0e-3": "learning_rate: 1.0e-12", "warmup_steps: 10":
        "warmup_steps: 0", "eval_every_steps: 40": "eval_every_steps: 0\n  init_lora: start.safetensors",
        "every_steps: 60": "every_steps: 0"}, dvc=False)
    run_stages(repo, store, ("scan", "encode"))
    generator = torch.Generator().manual_seed(3)
    a, b = torch.randn(8, 32, generator=generator), torch.randn(32, 8, generator=generator)
    start = {"transformer_blocks.0.attn.to_q.lora_A.weight": a, "transformer_blocks.0.attn.to_q.lora_B.weight": b}
    write(repo / "start.safetensors", start, {"lora_rank": "8", "lora_alpha": "16.0"})  # scale 2, the run's 1
    refused = subprocess.run([sys.executable, "-m", "stages.train"], cwd=repo, env=run_env(store),
                             capture_output=True, text=True)
    assert refused.returncode == 2
    assert "train.init_lora: start.safetensors is not a dependency of stage 'train' in dvc.yaml" in refused.stderr
    dvc_yaml = repo / "dvc.yaml"
    dvc_yaml.write_text(dvc_yaml.read_text().replace("cmd: python -m stages.train\n    deps:\n",
                                                     "cmd: python -m stages.train\n    deps:\n      - start.safetensors\n"))
    run_stages(repo, store, ("train",))
    with safe_open(str(repo / "runs/train/lora.safetensors"), "pt") as f:
        trained = {k: f.get_tensor(k) for k in f.keys()}
        lineage = json.loads(f.metadata()[METADATA_KEY])
    assert torch.allclose(trained["transformer_blocks.0.attn.to_q.lora_A.weight"], a, atol=1e-6)
    assert torch.allclose(trained["transformer_blocks.0.attn.to_q.lora_B.weight"], 2 * b, atol=1e-6)
    assert not trained["transformer_blocks.0.attn.to_k.lora_B.weight"].abs().max() > 1e-6  # usual init: zero
    digest = hash_file(repo / "start.safetensors")
    assert lineage["inputs"]["init_lora"]["xxh3_128"] == digest
    run_id = json.loads((repo / "reports/train.json").read_text())["run_id"]
    assert json.loads((repo / "runs/checkpoints" / run_id / "identity.json").read_text())["init_lora"] == digest
