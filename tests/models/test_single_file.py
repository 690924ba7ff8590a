"""Checkpoints as users have them: single files in their original layouts (BFL Flux, ComfyUI text encoders),
bf16 and fp8 (with ComfyUI's per-tensor scales), written from the tiny models and loaded through model views."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from diffusion_pipe.models import load_adapter
from diffusion_pipe.models.checkpoints import hub_revision, resolve_model, single_file_weights
from diffusion_pipe.models.flux import FluxAdapter
from diffusion_pipe.params import ModelParams
from diffusion_pipe.weights import component_hash

FP8_MAX = 448.0  # largest float8_e4m3fn value


def flux_to_bfl(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers Flux transformer state dict in Black Forest Labs' original layout (what ComfyUI and BFL ship):
    fused qkv, single blocks' fused linear1, (shift, scale) order of the final modulation."""
    s = dict(state)
    out = {}

    def take(src: str, dst: str) -> None:
        for suffix in ("weight", "bias"):
            out[f"{dst}.{suffix}"] = s.pop(f"{src}.{suffix}")

    for src, dst in [("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer"),
                     ("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer"),
                     ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
                     ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
                     ("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
                     ("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
                     ("context_embedder", "txt_in"), ("x_embedder", "img_in"), ("proj_out", "final_layer.linear")]:
        take(src, dst)
    doubles = sorted({int(k.split(".")[1]) for k in s if k.startswith("transformer_blocks.")})
    for i in doubles:
        d, b = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for src, dst in [("norm1.linear", "img_mod.lin"), ("norm1_context.linear", "txt_mod.lin"),
                         ("ff.net.0.proj", "img_mlp.0"), ("ff.net.2", "img_mlp.2"),
                         ("ff_context.net.0.proj", "txt_mlp.0"),
                         ("ff_context.net.2", "txt_mlp.2"), ("attn.to_out.0", "img_attn.proj"),
                         ("attn.to_add_out", "txt_attn.proj")]:
            take(d + src, b + dst)
        for suffix in ("weight", "bias"):
            out[f"{b}img_attn.qkv.{suffix}"] = torch.cat([s.pop(f"{d}attn.to_{x}.{suffix}") for x in "qkv"])
            out[f"{b}txt_attn.qkv.{suffix}"] = torch.cat([s.pop(f"{d}attn.add_{x}_proj.{suffix}") for x in "qkv"])
        for src, dst in [("norm_q", "img_attn.norm.query_norm"), ("norm_k", "img_attn.norm.key_norm"),
                         ("norm_added_q", "txt_attn.norm.query_norm"), ("norm_added_k", "txt_attn.norm.key_norm")]:
            out[f"{b}{dst}.scale"] = s.pop(f"{d}attn.{src}.weight")
    singles = sorted({int(k.split(".")[1]) for k in s if k.startswith("single_transformer_blocks.")})
    for i in singles:
        d, b = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        take(d + "norm.linear", b + "modulation.lin")
        take(d + "proj_out", b + "linear2")
        for suffix in ("weight", "bias"):
            out[f"{b}linear1.{suffix}"] = torch.cat(
                [s.pop(f"{d}attn.to_{x}.{suffix}") for x in "qkv"] + [s.pop(f"{d}proj_mlp.{suffix}")])
        out[f"{b}norm.query_norm.scale"] = s.pop(f"{d}attn.norm_q.weight")
        out[f"{b}norm.key_norm.scale"] = s.pop(f"{d}attn.norm_k.weight")
    for suffix in ("weight", "bias"):  # diffusers keeps (scale, shift), BFL (shift, scale)
        scale, shift = s.pop(f"norm_out.linear.{suffix}").chunk(2)
        out[f"final_layer.adaLN_modulation.1.{suffix}"] = torch.cat([shift, scale])
    assert not s, f"unmapped: {sorted(s)}"
    return {k: v.contiguous() for k, v in out.items()}


def to_fp8(state: dict[str, torch.Tensor], scaled: bool) -> dict[str, torch.Tensor]:
    """Weights of 2 or more dimensions in float8_e4m3fn as ComfyUI stores them: with `scaled`, each divided by a
    per-tensor scale (max |w| / 448) kept as '<module>.scale_weight', plus the 'scaled_fp8' marker; vectors
    (biases, norms) stay as they are."""
    out = {}
    for name, tensor in state.items():
        if tensor.dim() >= 2 and name.endswith(".weight"):
            scale = tensor.float().abs().max() / FP8_MAX if scaled else torch.tensor(1.0)
            out[name] = (tensor.float() / scale).to(torch.float8_e4m3fn)
            if scaled:
                out[name.removesuffix("weight") + "scale_weight"] = scale.reshape(())
        else:
            out[name] = tensor
    if scaled:
        out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out


def dequantised(fp8_state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """What a fp8 file's tensor `name` holds, in float32."""
    scale = fp8_state.get(name.removesuffix("weight") + "scale_weight", torch.tensor(1.0))
    return fp8_state[name].float() * scale


@pytest.fixture(scope="module")
def flux_files(tmp_path_factory) -> tuple[Path, dict[str, Path], dict[str, torch.Tensor]]:
    """A tiny Flux in diffusers format, and its transformer as BFL single files in bf16, fp8 and scaled fp8,
    its text encoders as ComfyUI-style single files (transformers keys, CLIP's legacy `text_model.` level)."""
    root = tmp_path_factory.mktemp("flux-single")
    FluxAdapter.build_tiny(root / "model", seed=0)
    adapter = FluxAdapter(root / "model", torch.float32)
    state = {k: v.bfloat16() for k, v in adapter.load_denoiser(torch.device("cpu")).state_dict().items()}
    bfl = flux_to_bfl(state)
    files = {"bf16": root / "flux1-tiny.safetensors", "fp8": root / "flux1-tiny-fp8.safetensors",
             "fp8_scaled": root / "flux1-tiny-fp8-scaled.safetensors"}
    save_file(bfl, files["bf16"])
    save_file(to_fp8(bfl, scaled=False), files["fp8"])
    save_file(to_fp8(bfl, scaled=True), files["fp8_scaled"])
    from safetensors.torch import load_file
    clip = load_file(root / "model" / "text_encoder" / "model.safetensors")
    save_file({f"text_model.{k}": v for k, v in clip.items()}, root / "clip_l.safetensors")
    files["clip_l"] = root / "clip_l.safetensors"
    files["t5"] = root / "model" / "text_encoder_2" / "model.safetensors"
    files["vae"] = root / "model" / "vae" / "diffusion_pytorch_model.safetensors"
    return root / "model", files, state


@pytest.fixture(autouse=True)
def _store(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFUSION_PIPE_STORE", str(tmp_path / "store"))


def params(model_dir: Path, **single) -> ModelParams:
    return ModelParams(family="flux", path=str(model_dir), dtype="bfloat16", **single)


@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8_scaled"])
def test_bfl_transformer_loads_through_diffusers_converter(flux_files, kind):
    """A BFL-layout transformer file loads to exactly the diffusers model's weights (bf16), or to the values its
    fp8 file holds (dequantised by its scales)."""
    model_dir, files, state = flux_files
    adapter = load_adapter(params(model_dir, transformer=str(files[kind])))
    assert adapter.denoiser_dir().name == "transformer" and adapter.model_dir != model_dir.resolve()
    loaded = adapter.load_denoiser(torch.device("cpu")).state_dict()
    assert set(loaded) == set(state)
    if kind == "bf16":
        for name, tensor in state.items():
            assert torch.equal(loaded[name], tensor), name
        return
    from safetensors.torch import load_file
    fp8 = load_file(files[kind])
    bfl_name = {"transformer_blocks.0.attn.to_out.0.weight": "double_blocks.0.img_attn.proj.weight",
                "single_transformer_blocks.0.proj_out.weight": "single_blocks.0.linear2.weight"}
    for name, original in bfl_name.items():
        assert torch.equal(loaded[name], dequantised(fp8, original).bfloat16()), name
    width = state["transformer_blocks.0.attn.to_k.weight"].shape[0]
    k = dequantised(fp8, "double_blocks.0.img_attn.qkv.weight")[width:2 * width]
    assert torch.equal(loaded["transformer_blocks.0.attn.to_k.weight"], k.bfloat16())
    # fp8 keeps about 2 significant bits less than bf16: within 1/8 of each tensor's largest value
    for name, tensor in state.items():
        tol = tensor.float().abs().max() / 8 + 1e-6
        assert (loaded[name].float() - tensor.float()).abs().max() <= tol, name


def test_conversion_reads_views_of_the_file(flux_files):
    """diffusers' converter runs over views of the mapped file: the fused qkv's slices are not copied, so a
    pipeline stage reads only the tensors it takes."""
    from diffusers import FluxTransformer2DModel

    model_dir, files, _ = flux_files
    config = dict(FluxTransformer2DModel.load_config(model_dir / "transformer"))
    weights = single_file_weights(files["bf16"], FluxTransformer2DModel, config)
    q = weights.raw["single_transformer_blocks.0.attn.to_q.weight"]
    mlp = weights.raw["single_transformer_blocks.0.proj_mlp.weight"]
    assert q.untyped_storage().data_ptr() == mlp.untyped_storage().data_ptr()  # both slices of linear1
    assert q.data_ptr() != mlp.data_ptr()


def test_stage_reads_only_its_layers(flux_files):
    """build_local_model over a single file: the stage's layers equal the diffusers-folder build, the other
    stage's stay on the meta device."""
    from diffusion_pipe.train.build import build_local_model

    model_dir, files, state = flux_files
    kwargs = dict(targets=("to_q",), rank=2, alpha=2.0, dropout=0.0, seed=0)
    single = build_local_model(load_adapter(params(model_dir, transformer=str(files["bf16"]))), 2, 0, **kwargs)
    folder = build_local_model(load_adapter(params(model_dir)), 2, 0, **kwargs)
    got, want = single.denoiser.state_dict(), folder.denoiser.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].device == tensor.device, name
        if tensor.device.type != "meta":
            assert torch.equal(got[name], tensor), name
    assert any(t.device.type == "meta" for t in got.values())


def test_text_encoders_and_vae_single_files(flux_files):
    """ComfyUI-style text encoder files (CLIP with the legacy `text_model.` level) and a VAE file load; their
    embeddings equal the diffusers folder's."""
    model_dir, files, _ = flux_files
    single = load_adapter(params(model_dir, vae=str(files["vae"]),
                                 text_encoders=(str(files["clip_l"]), str(files["t5"]))))
    folder = load_adapter(params(model_dir))
    cpu = torch.device("cpu")
    a = single.encode_text(single.load_text_encoders(cpu), ["a red circle"], 16)[0]
    b = folder.encode_text(folder.load_text_encoders(cpu), ["a red circle"], 16)[0]
    assert all(torch.equal(a[k], b[k]) for k in b)
    pixels = torch.rand(1, 3, 1, 32, 32) * 2 - 1
    assert torch.equal(single.encode_media(single.load_vae(cpu), pixels)[0]["latents"],
                       folder.encode_media(folder.load_vae(cpu), pixels)[0]["latents"])


def test_hashes_follow_file_content(flux_files, tmp_path):
    """A single-file component hashes by content: a copy elsewhere hashes the same, another file differently
    (so swapping the VAE file re-encodes every latent, swapping the transformer re-trains)."""
    model_dir, files, _ = flux_files
    copy = tmp_path / "renamed.safetensors"
    copy.write_bytes(files["bf16"].read_bytes())
    a = load_adapter(params(model_dir, transformer=str(files["bf16"])))
    b = load_adapter(params(model_dir, transformer=str(copy)))
    c = load_adapter(params(model_dir, transformer=str(files["fp8"])))
    assert component_hash(a.denoiser_dir()) == component_hash(b.denoiser_dir())
    assert component_hash(a.denoiser_dir()) != component_hash(c.denoiser_dir())
    assert component_hash(a.denoiser_dir()) != component_hash(model_dir / "transformer")
    assert component_hash(a.vae_dir()) == component_hash(model_dir / "vae")  # untouched components link through
    v = load_adapter(params(model_dir, vae=str(files["fp8"])))
    assert component_hash(v.vae_dir()) != component_hash(model_dir / "vae")


def test_errors_name_the_param(flux_files, tmp_path):
    from diffusion_pipe.config import ConfigError

    model_dir, files, _ = flux_files
    with pytest.raises(FileNotFoundError, match=r"model.vae: .*missing.safetensors.* is not a .safetensors file"):
        resolve_model(params(model_dir, vae=str(tmp_path / "missing.safetensors")))
    with pytest.raises(ConfigError, match=r"model.text_encoders: 1 files given, family 'flux' has 2"):
        resolve_model(params(model_dir, text_encoders=(str(files["clip_l"]),)))
    adapter = load_adapter(params(model_dir, vae=str(files["bf16"])))
    with pytest.raises(ValueError, match=r"flux1-tiny.safetensors: diffusers could not convert it for AutoencoderKL"):
        adapter.load_vae(torch.device("cpu"))
    adapter = load_adapter(params(model_dir, text_encoders=(str(files["t5"]), "")))  # T5's file as CLIP's
    with pytest.raises(ValueError, match=r"model.safetensors: \d+ tensors of CLIPTextModel are not in it"):
        adapter.load_text_encoders(torch.device("cpu"))


def test_hub_id_from_cache_offline(flux_files, tmp_path, monkeypatch):
    """A hub id reads the Hugging Face cache under HF_HOME with HF_HUB_OFFLINE=1, and names its revision."""
    model_dir, files, _ = flux_files
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--org--tiny-flux"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    import shutil
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    snapshot = resolve_model(ModelParams(family="flux", path="org/tiny-flux"))
    assert hub_revision(snapshot) == commit
    view = resolve_model(ModelParams(family="flux", path="org/tiny-flux", transformer=str(files["bf16"])))
    assert json.loads((view / "transformer" / "single_file.json").read_text())["file"] == str(files["bf16"])
    assert (view / "vae").resolve() == (snapshot / "vae").resolve()
    assert hub_revision(view) == commit


def test_lineage_names_single_files_by_content(flux_files, tmp_path):
    """The lineage's base weights hash the single files; verify re-resolves the recorded params and catches a
    transformer file changed since."""
    from diffusion_pipe.lineage.record import base_weights
    from diffusion_pipe.lineage.verify import _check_base_model
    from diffusion_pipe.config import to_dict

    model_dir, files, _ = flux_files
    mine = tmp_path / "flux1.safetensors"
    mine.write_bytes(files["bf16"].read_bytes())
    model = params(model_dir, transformer=str(mine))
    weights = base_weights(resolve_model(model))
    assert set(weights) == {"transformer", "vae", "text_encoder", "text_encoder_2"}
    assert weights["transformer"] == component_hash(load_adapter(model).denoiser_dir())
    record = {"base_model": {"family": "flux", "path": str(model_dir), "weights": weights},
              "params": {"model": to_dict(model)}}
    assert all(check.ok for check in _check_base_model(record, tmp_path))
    mine.write_bytes(files["fp8"].read_bytes())
    failed = [c for c in _check_base_model(record, tmp_path) if not c.ok]
    assert [c.item for c in failed] == ["base model component 'transformer'"]


WAN_RENAMES = [  # diffusers -> Wan's original names, the inverse of diffusers' convert_wan_transformer_to_diffusers
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"), ("attn2", "cross_attn"), ("attn1", "self_attn"),
    (".to_out.0.", ".o."), (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."), (".add_k_proj.", ".k_img."),
    (".add_v_proj.", ".v_img."), (".norm_added_k.", ".norm_k_img."), ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"), ("norm2", "norm__swap"), ("norm3", "norm2"), ("norm__swap", "norm3"),
]


def wan_original_name(name: str) -> str:
    """A diffusers Wan transformer tensor's name in Wan's original checkpoints (as ComfyUI ships them)."""
    import re

    if name == "scale_shift_table":
        return "head.modulation"
    if name.startswith("proj_out."):
        return "head.head." + name.removeprefix("proj_out.")
    name = re.sub(r"^(blocks\.\d+\.)scale_shift_table$", r"\1modulation", name)
    for old, new in WAN_RENAMES:
        name = name.replace(old, new)
    return name


@pytest.mark.parametrize("kind", ["bf16", "fp8_scaled"])
def test_wan_original_layout_transformer(tmp_path, kind):
    """A Wan transformer in its original names, under ComfyUI's `model.diffusion_model.` prefix, in bf16 or
    scaled fp8, loads through diffusers' converter: exactly, or to the values the fp8 file holds."""
    from diffusion_pipe.models.wan import WanAdapter

    WanAdapter.build_tiny(tmp_path / "model", seed=0)
    state = {k: v.bfloat16() for k, v in WanAdapter(tmp_path / "model", torch.float32)
             .load_denoiser(torch.device("cpu")).state_dict().items()}
    original = {f"model.diffusion_model.{wan_original_name(k)}": v.contiguous() for k, v in state.items()}
    if kind == "fp8_scaled":
        original = to_fp8(original, scaled=True)
    save_file(original, tmp_path / "wan.safetensors")
    adapter = load_adapter(ModelParams(family="wan", path=str(tmp_path / "model"),
                                       transformer=str(tmp_path / "wan.safetensors")))
    loaded = adapter.load_denoiser(torch.device("cpu")).state_dict()
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        want = tensor if kind == "bf16" else dequantised(original, f"model.diffusion_model.{wan_original_name(name)}")
        assert torch.equal(loaded[name], want.bfloat16()), name


@pytest.mark.parametrize("kind", ["bf16", "fp8_scaled"])
def test_cosmos_predict2_original_layout_transformer(tmp_path, kind):
    """A Cosmos-Predict2 transformer as NVIDIA ships it (original names under `net.`, with the training counters
    and rotary buffers its checkpoints carry), in bf16 or scaled fp8, loads through diffusers' converter: exactly,
    or to the values the fp8 file holds."""
    from diffusion_pipe.models.cosmos2 import Cosmos2Adapter, cosmos_original_name

    Cosmos2Adapter.build_tiny(tmp_path / "model", seed=0)
    state = {k: v.bfloat16() for k, v in Cosmos2Adapter(tmp_path / "model", torch.float32)
             .load_denoiser(torch.device("cpu")).state_dict().items()}

    def original_name(name: str) -> str:
        module, _, param = name.rpartition(".")
        return f"net.{cosmos_original_name(module)}.{param}"

    original = {original_name(k): v.contiguous() for k, v in state.items()}
    if kind == "fp8_scaled":
        original = to_fp8(original, scaled=True)
    extras = {"net.accum_iteration": torch.zeros(1), "net.pos_embedder.seq": torch.arange(8.0),
              "net.pos_embedder.dim_spatial_range": torch.arange(4.0)}
    save_file({**original, **extras}, tmp_path / "cosmos.safetensors")
    adapter = load_adapter(ModelParams(family="cosmos2", path=str(tmp_path / "model"),
                                       transformer=str(tmp_path / "cosmos.safetensors")))
    loaded = adapter.load_denoiser(torch.device("cpu")).state_dict()
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        want = tensor if kind == "bf16" else dequantised(original, original_name(name))
        assert torch.equal(loaded[name], want.bfloat16()), name


def vae_to_ldm(state: dict[str, torch.Tensor], num_up_blocks: int) -> dict[str, torch.Tensor]:
    """A diffusers AutoencoderKL state dict in the LDM layout of BFL's ae.safetensors and SD/SDXL VAE files
    (`encoder.down.0.block.0`, `mid.attn_1` with 1x1-conv attention weights, decoder blocks numbered upwards)."""
    import re

    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    top = DIFFUSERS_TO_LDM_MAPPING["vae"]
    attn = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
    out = {}
    for name, tensor in state.items():
        if name in top:
            out[top[name]] = tensor
            continue
        new = re.sub(r"^encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", name)
        new = re.sub(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", new)
        new = re.sub(r"^decoder\.up_blocks\.(\d+)\.resnets\.",
                     lambda m: f"decoder.up.{num_up_blocks - 1 - int(m[1])}.block.", new)
        new = re.sub(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.",
                     lambda m: f"decoder.up.{num_up_blocks - 1 - int(m[1])}.upsample.", new)
        new = re.sub(r"\.mid_block\.resnets\.(\d+)\.", lambda m: f".mid.block_{int(m[1]) + 1}.", new)
        new = new.replace("conv_shortcut", "nin_shortcut")
        if ".mid_block.attentions.0." in new:
            head, _, tail = new.partition(".mid_block.attentions.0.")
            module, _, suffix = tail.rpartition(".")
            new = f"{head}.mid.attn_1.{attn[module]}.{suffix}"
            if tensor.dim() == 2:  # LDM's attention is 1x1 convolutions
                tensor = tensor[:, :, None, None]
        out[new] = tensor.contiguous()
    return out


@pytest.mark.parametrize("fp8", [False, True])
def test_ldm_vae_file(flux_files, tmp_path, fp8):
    """Flux's VAE as BFL's ae.safetensors lays it out (LDM names), bf16 or scaled fp8, loads through diffusers'
    LDM VAE converter and encodes as the diffusers folder does (bf16), or to the fp8 file's values."""
    from safetensors.torch import load_file

    model_dir, _, _ = flux_files
    config = json.loads((model_dir / "vae" / "config.json").read_text())
    state = {k: v.bfloat16() for k, v in load_file(model_dir / "vae" / "diffusion_pytorch_model.safetensors").items()}
    ldm = vae_to_ldm(state, len(config["up_block_types"]))
    if fp8:
        ldm = to_fp8(ldm, scaled=True)
    save_file(ldm, tmp_path / "ae.safetensors")
    single = load_adapter(params(model_dir, vae=str(tmp_path / "ae.safetensors")))
    loaded = single.load_vae(torch.device("cpu")).state_dict()
    assert set(loaded) == set(state)
    if not fp8:
        assert all(torch.equal(loaded[k], v) for k, v in state.items())
        folder = load_adapter(params(model_dir))
        pixels = torch.rand(1, 3, 1, 32, 32) * 2 - 1
        assert torch.equal(single.encode_media(single.load_vae(torch.device("cpu")), pixels)[0]["latents"],
                           folder.encode_media(folder.load_vae(torch.device("cpu")), pixels)[0]["latents"])
    else:
        conv = dequantised(ldm, "encoder.down.0.block.0.conv1.weight")
        assert torch.equal(loaded["encoder.down_blocks.0.resnets.0.conv1.weight"], conv.bfloat16())
        q = dequantised(ldm, "encoder.mid.attn_1.q.weight")  # the converter's 1x1-conv slice, scaled
        assert q.dim() == 4 and torch.equal(loaded["encoder.mid_block.attentions.0.to_q.weight"],
                                            q[:, :, 0, 0].bfloat16())


@pytest.mark.slow
def test_stages_train_from_single_files(tmp_path):
    """The bundled example through scan, encode and train as stage commands, its transformer a scaled-fp8 BFL
    file kept in fp8 (base_dtype: float8), its VAE an LDM file and its CLIP a ComfyUI-style file: the loss is
    finite and the lineage stamped on the LoRA hashes the single files."""
    import sys

    from safetensors.torch import load_file

    from diffusion_pipe.lineage.record import read_lineage
    from tests.conftest import make_pipeline_repo, run_checked, run_env

    store = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store, {
        "  dtype: float32 ": "  base_dtype: float8\n  transformer: examples/flux-tiny/model/flux1.safetensors\n"
                            "  vae: examples/flux-tiny/model/ae.safetensors\n"
                            "  text_encoders: [examples/flux-tiny/model/clip_l.safetensors, \"\"]\n  dtype: float32 "})
    model = repo / "examples/flux-tiny/model"
    adapter = FluxAdapter(model, torch.float32)
    state = adapter.load_denoiser(torch.device("cpu")).state_dict()
    save_file(to_fp8(flux_to_bfl(state), scaled=True), model / "flux1.safetensors")
    config = json.loads((model / "vae" / "config.json").read_text())
    vae = load_file(model / "vae" / "diffusion_pytorch_model.safetensors")
    save_file(vae_to_ldm(vae, len(config["up_block_types"])), model / "ae.safetensors")
    clip = load_file(model / "text_encoder" / "model.safetensors")
    save_file({f"text_model.{k}": v for k, v in clip.items()}, model / "clip_l.safetensors")
    for stage in ("scan", "encode", "train"):
        run_checked([sys.executable, "-m", f"stages.{stage}"], cwd=repo, env=run_env(store))
    report = json.loads((repo / "reports/train.json").read_text())
    assert report["train_loss_last"] == report["train_loss_last"] < 10  # finite
    lineage = read_lineage(repo / "runs/train/lora.safetensors")
    assert lineage["params"]["model"]["base_dtype"] == "float8"
    weights = lineage["base_model"]["weights"]
    assert set(weights) == {"transformer", "vae", "text_encoder", "text_encoder_2"}
    from diffusion_pipe.hashing import hash_json
    from diffusion_pipe.weights import file_hash_cached
    assert weights["transformer"] == hash_json({
        "kind": "single_file", "config": file_hash_cached(model / "transformer" / "config.json", tmp_path / "hc"),
        "file": file_hash_cached(model / "flux1.safetensors", tmp_path / "hc")})


# diffusers -> SGM/LDM names of the SDXL UNet's resnet parts and top-level modules
UNET_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
               "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
UNET_TOP = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
            "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
            "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2"}
UNET_LEVEL = r"^(down_blocks|up_blocks)\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)\.?(.*)$"


def unet_to_ldm(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """A diffusers UNet2DConditionModel state dict as an SGM/LDM checkpoint holds it (SDXL's
    `model.diffusion_model.input_blocks.4.1...`): input, middle and output blocks in the original numbering."""
    import re

    per_level = config["layers_per_block"]
    stride = per_level + 1
    up_has_attention = ["CrossAttn" in t for t in config["up_block_types"]]
    out = {}
    for name, tensor in state.items():
        module, _, param = name.rpartition(".")
        if module in UNET_TOP:
            new = UNET_TOP[module]
        elif m := re.match(UNET_LEVEL, module):
            kind, level, part, j, rest = m[1], int(m[2]), m[3], int(m[4]), m[5]
            if kind == "down_blocks":
                prefix = f"input_blocks.{1 + level * stride + (per_level if part == 'downsamplers' else j)}"
            else:
                prefix = f"output_blocks.{level * stride + (per_level if part == 'upsamplers' else j)}"
            new = {"resnets": lambda: f"{prefix}.0.{UNET_RESNET.get(rest)}",
                   "attentions": lambda: f"{prefix}.1.{rest}", "downsamplers": lambda: f"{prefix}.0.op",
                   "upsamplers": lambda: f"{prefix}.{2 if up_has_attention[level] else 1}.conv"}[part]()
        else:
            m = re.match(r"^mid_block\.(resnets|attentions)\.(\d+)\.?(.*)$", module)
            new = (f"middle_block.1.{m[3]}" if m[1] == "attentions"
                   else f"middle_block.{2 * int(m[2])}.{UNET_RESNET[m[3]]}")
        out[f"model.diffusion_model.{new}.{param}"] = tensor
    return out


@pytest.mark.parametrize("fp8", [False, True])
def test_sdxl_all_in_one_checkpoint(tmp_path, fp8):
    """One SGM checkpoint holding the UNet (`model.diffusion_model.`) and the VAE (`first_stage_model.`), as
    SDXL ships, given as both model.transformer and model.vae: each loads through diffusers' LDM converters."""
    from diffusion_pipe.models.sdxl import SDXLAdapter

    SDXLAdapter.build_tiny(tmp_path / "model", seed=0)
    folder = SDXLAdapter(tmp_path / "model", torch.float32)
    cpu = torch.device("cpu")
    unet = {k: v.bfloat16() for k, v in folder.load_denoiser(cpu).state_dict().items()}
    vae = {k: v.bfloat16() for k, v in folder.load_vae(cpu).state_dict().items()}
    vae_config = json.loads((tmp_path / "model" / "vae" / "config.json").read_text())
    unet_config = json.loads((tmp_path / "model" / "unet" / "config.json").read_text())
    checkpoint = unet_to_ldm(unet, unet_config) | {
        f"first_stage_model.{k}": v for k, v in vae_to_ldm(vae, len(vae_config["up_block_types"])).items()}
    if fp8:
        checkpoint = to_fp8(checkpoint, scaled=True)
    save_file(checkpoint, tmp_path / "sd_xl_base.safetensors")
    file = str(tmp_path / "sd_xl_base.safetensors")
    adapter = load_adapter(ModelParams(family="sdxl", path=str(tmp_path / "model"), transformer=file, vae=file))
    assert adapter.denoiser_dir().name == "unet"
    for loaded, want in ((adapter.load_denoiser(cpu).state_dict(), unet), (adapter.load_vae(cpu).state_dict(), vae)):
        assert set(loaded) == set(want)
        for name, tensor in want.items():
            tol = tensor.float().abs().max() / 8 + 1e-6 if fp8 else 0
            assert (loaded[name].float() - tensor.float()).abs().max() <= tol, name


@pytest.mark.parametrize("family", sorted(__import__("diffusion_pipe.models", fromlist=["REGISTRY"]).REGISTRY))
def test_every_family_takes_a_denoiser_file(tmp_path, family):
    """Every registered family, with no code of its own for it: its denoiser saved as one file in diffusers'
    names (as some tools save them) loads whole and per stage to the same weights. Families whose diffusers
    class has no single-file converter (hunyuan_video15) take this layout only."""
    from diffusion_pipe.models import adapter_class
    from diffusion_pipe.train.build import load_weights

    cls = adapter_class(family)
    cls.build_tiny(tmp_path / "model", seed=0)
    folder = cls(tmp_path / "model", torch.float32)
    state = {k: v.contiguous() for k, v in folder.load_denoiser(torch.device("cpu")).state_dict().items()}
    save_file(state, tmp_path / "denoiser.safetensors")
    single = load_adapter(ModelParams(family=family, path=str(tmp_path / "model"), dtype="float32",
                                      transformer=str(tmp_path / "denoiser.safetensors")))
    loaded = single.load_denoiser(torch.device("cpu")).state_dict()
    assert set(loaded) == set(state) and all(torch.equal(loaded[k], v) for k, v in state.items())
    from accelerate import init_empty_weights

    denoiser_cls, directory = single.denoiser_class(), single.denoiser_dir()
    with init_empty_weights(include_buffers=False):
        meta = denoiser_cls.from_config(denoiser_cls.load_config(directory))
    some = sorted(state)[:3]
    load_weights(meta, set(some), directory, torch.float32)
    assert all(torch.equal(meta.get_parameter(k) if k in dict(meta.named_parameters()) else meta.get_buffer(k),
                           state[k]) for k in some)
