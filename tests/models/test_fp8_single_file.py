"""fp8 single files beyond ComfyUI's per-tensor `.scale_weight`: the newer `.weight_scale` suffix, per-row scales
(shape [out] or [out, 1]) that must follow their rows through the fused qkv / linear1 weights diffusers' converter
splits, and float8_e5m2. A tiny Flux transformer is written in BFL's layout and loaded through a model view.

The scales are far from 1 (10^-2 .. 10^2, drawn per row or per BFL tensor), so a scale that is ignored, applied
twice or applied to another part's rows moves the loaded weights by far more than fp8's rounding error: every
weight is compared exactly to the dequantised values the test computes, and to the original float32 weights
within fp8's precision."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from diffusion_pipe.models import load_adapter
from diffusion_pipe.params import ModelParams
from tests.models.test_single_file import flux_to_bfl

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MANTISSA_BITS = {E4M3: 3, E5M2: 2}
FIT = 448.0  # |w / scale| at most this (ComfyUI's max |w| / 448), in range of both formats
# the fused BFL weights diffusers' converter splits: (BFL weight, its parts in row order)
FUSED = [("double_blocks.0.img_attn.qkv.weight", [f"transformer_blocks.0.attn.to_{x}.weight" for x in "qkv"]),
         ("double_blocks.1.txt_attn.qkv.weight", [f"transformer_blocks.1.attn.add_{x}_proj.weight" for x in "qkv"]),
         ("single_blocks.0.linear1.weight", [*(f"single_transformer_blocks.0.attn.to_{x}.weight" for x in "qkv"),
                                             "single_transformer_blocks.0.proj_mlp.weight"])]


def quantised_names(state: dict[str, torch.Tensor]) -> list[str]:
    """The weights fp8 files store in fp8 (matrices); biases and norms stay in a float dtype."""
    return [name for name, tensor in state.items() if name.endswith(".weight") and tensor.dim() >= 2]


def bfl_owner(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """diffusers weight name -> the BFL weight holding its rows (to_q/to_k/to_v share one fused qkv)."""
    names = list(state)
    ids = flux_to_bfl({name: torch.full((t.shape[0],), float(i)) for i, (name, t) in enumerate(state.items())})
    return {names[int(i)]: bfl for bfl, v in ids.items() for i in v.unique().tolist()}


def scaled_weights(state: dict[str, torch.Tensor], per_row: bool, seed: int = 1):
    """(original weights, the row scale of each quantised one): a scale per row, or one per BFL tensor (shared by
    the parts of a fused qkv), drawn log-uniformly from 10^-2 .. 10^2, with each row rescaled so that its largest
    |w / scale| is FIT. The original weights are what a full-precision file would hold; fp8 keeps them within its
    rounding error."""
    g = torch.Generator().manual_seed(seed)
    owner = bfl_owner(state)
    per_bfl = {bfl: 10 ** (torch.rand((), generator=g) * 4 - 2) for bfl in sorted(set(owner.values()))}
    originals, scales = dict(state), {}
    for name in quantised_names(state):
        w = state[name].float()
        rows = w.shape[0]
        s = 10 ** (torch.rand(rows, generator=g) * 4 - 2) if per_row else per_bfl[owner[name]].expand(rows)
        originals[name] = w / w.abs().amax(dim=1, keepdim=True) * FIT * s[:, None]
        scales[name] = s.clone()
    return originals, scales


def quantise(originals, scales, fmt):
    """(fp8 state, dequantised reference): each weight divided by its row scales and rounded to `fmt`; the
    reference is exactly what a correct loader makes of it (float32 product of fp8 value and scale)."""
    fp8, reference = dict(originals), dict(originals)
    for name, s in scales.items():
        fp8[name] = (originals[name] / s[:, None]).to(fmt)
        reference[name] = fp8[name].float() * s[:, None]
    return fp8, reference


def fp8_file(fp8: dict[str, torch.Tensor], scales: dict[str, torch.Tensor] | None, granularity: str,
             suffix: str) -> dict[str, torch.Tensor]:
    """The BFL-layout file of `fp8` (diffusers names), its scales per tensor ([]), per row ([out]) or per row as a
    column ([out, 1]), stored under `<module><suffix>` as ComfyUI's files do."""
    bfl = flux_to_bfl(fp8)
    if scales is None:
        return bfl
    row_scales = flux_to_bfl({name: scales.get(name, t) for name, t in fp8.items()})  # rows follow the weights
    out = dict(bfl)
    for name, tensor in bfl.items():
        if tensor.dtype not in MANTISSA_BITS:
            continue
        s = row_scales[name]
        if granularity == "tensor":
            assert torch.equal(s, s[:1].expand_as(s)), name
            s = s[0].reshape(())
        elif granularity == "row_col":
            s = s[:, None]
        out[name.removesuffix(".weight") + suffix] = s.contiguous()
        if suffix == ".weight_scale":  # newer files scale the inputs too; that says nothing about the weights
            out[name.removesuffix(".weight") + ".input_scale"] = torch.tensor(1.0)
    if suffix == ".scale_weight":
        out["scaled_fp8"] = torch.empty(0, dtype=E4M3)
    return out


def tolerance(original: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """Per element, twice the error of rounding `original / scale` to `fmt` and multiplying back: relative
    2^-mantissa_bits for normal numbers (2^-3 for e4m3, 2^-2 for e5m2), the subnormal step times scale below."""
    bits = MANTISSA_BITS[fmt]
    subnormal_step = torch.finfo(fmt).smallest_normal * 2.0 ** -bits
    return original.abs() * 2.0 ** -bits + subnormal_step * scale


def within_fp8(loaded: torch.Tensor, original: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> bool:
    return bool(((loaded.float() - original.float()).abs() <= tolerance(original, scale, fmt)).all())


@pytest.fixture(scope="module")
def flux(tiny_flux_dir, tmp_path_factory):
    """(model dir, its float32 transformer state, load(name, file state) -> loaded float32 state dict)."""
    from diffusion_pipe.models.flux import FluxAdapter

    state = FluxAdapter(tiny_flux_dir, torch.float32).load_denoiser(torch.device("cpu")).state_dict()
    root = tmp_path_factory.mktemp("fp8-files")

    def load(name: str, file_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        save_file(file_state, root / f"{name}.safetensors")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("DIFFUSION_PIPE_STORE", str(root / "store"))
            adapter = load_adapter(ModelParams(family="flux", path=str(tiny_flux_dir), dtype="float32",
                                               transformer=str(root / f"{name}.safetensors")))
            loaded = adapter.load_denoiser(torch.device("cpu")).state_dict()
        assert set(loaded) == set(state)
        return loaded

    return tiny_flux_dir, {k: v.contiguous() for k, v in state.items()}, load


def assert_dequantised(loaded, originals, reference, scales, fmt) -> None:
    """Every tensor exactly the dequantised reference, and within fp8's precision of the original weights."""
    for name, want in reference.items():
        assert loaded[name].dtype == torch.float32, name
        assert torch.equal(loaded[name], want), name
        if name in scales:
            assert within_fp8(loaded[name], originals[name], scales[name][:, None], fmt), name


@pytest.mark.parametrize("granularity", ["tensor", "row", "row_col"])
def test_weight_scale_suffix_loads_like_scale_weight(flux, granularity):
    """ComfyUI's newer `.weight_scale` files (with `.input_scale`s) load to the same dequantised weights as
    `.scale_weight` files of the same fp8 values, per tensor or per row."""
    _, state, load = flux
    originals, scales = scaled_weights(state, per_row=granularity != "tensor")
    fp8, reference = quantise(originals, scales, E4M3)
    new = load(f"weight-scale-{granularity}", fp8_file(fp8, scales, granularity, ".weight_scale"))
    old = load(f"scale-weight-{granularity}", fp8_file(fp8, scales, granularity, ".scale_weight"))
    assert not [name for name in state if not torch.equal(new[name], old[name])]
    assert_dequantised(new, originals, reference, scales, E4M3)
    # the scales matter: the fp8 values alone, or scaled twice, are far from the weights
    name = "transformer_blocks.0.ff.net.0.proj.weight"
    s = scales[name][:, None]
    assert not within_fp8(fp8[name].float(), originals[name], s, E4M3)
    assert not within_fp8(reference[name] * s, originals[name], s, E4M3)


@pytest.mark.parametrize("granularity", ["row", "row_col"])
def test_per_row_scales_follow_their_rows_through_fused_qkv_split(flux, granularity):
    """Per-row scales of BFL's fused qkv (double blocks) and linear1 (single blocks: q, k, v, mlp) are split with
    their rows: each of diffusers' to_q / to_k / to_v / proj_mlp weights is multiplied by its own rows' scales."""
    _, state, load = flux
    originals, scales = scaled_weights(state, per_row=True)
    fp8, reference = quantise(originals, scales, E4M3)
    file = fp8_file(fp8, scales, granularity, ".weight_scale")
    loaded = load(f"fused-{granularity}", file)
    for fused, parts in FUSED:
        stored = file[fused.removesuffix(".weight") + ".weight_scale"].reshape(-1)
        assert stored.shape[0] == file[fused].shape[0] == sum(state[p].shape[0] for p in parts)
        start = 0
        for part in parts:
            rows = slice(start, start + state[part].shape[0])
            start = rows.stop
            assert torch.equal(stored[rows], scales[part])  # the file's rows of this part carry its scales
            assert torch.equal(loaded[part], file[fused][rows].float() * stored[rows, None]), part
            assert within_fp8(loaded[part], originals[part], scales[part][:, None], E4M3), part
            # another part's rows' scales (the fused weight's first rows, say) would be visibly wrong
            if rows.start:
                first = stored[:rows.stop - rows.start, None]
                assert not within_fp8(fp8[part].float() * first, originals[part], first, E4M3), part
    assert_dequantised(loaded, originals, reference, scales, E4M3)


@pytest.mark.parametrize("granularity", ["unscaled", "tensor", "row"])
def test_float8_e5m2_file_loads_dequantised(flux, granularity):
    """float8_e5m2 weights (2 mantissa bits), unscaled or with per-tensor or per-row scales, load dequantised to
    within e5m2's precision of the original weights."""
    _, state, load = flux
    if granularity == "unscaled":
        originals = state
        scales = {name: torch.ones(state[name].shape[0]) for name in quantised_names(state)}
    else:
        originals, scales = scaled_weights(state, per_row=granularity == "row", seed=2)
    fp8, reference = quantise(originals, scales, E5M2)
    file = fp8_file(fp8, None if granularity == "unscaled" else scales, granularity, ".scale_weight")
    assert file["double_blocks.0.img_attn.qkv.weight"].dtype == E5M2
    loaded = load(f"e5m2-{granularity}", file)
    assert_dequantised(loaded, originals, reference, scales, E5M2)
    # e5m2 values read as e4m3 (one byte each too) would be far from the weights
    name = "single_transformer_blocks.0.attn.to_k.weight"
    misread = fp8[name].view(torch.uint8).view(E4M3).float() * scales[name][:, None]
    assert not within_fp8(misread, originals[name], scales[name][:, None], E5M2)


def test_pipeline_stage_reads_per_row_scaled_parts(flux, tmp_path):
    """A pipeline stage materialising only some layers (train.build.load_weights over the model view) gets the
    fused weights' parts dequantised with their own rows' scales, as the whole-model load does."""
    from accelerate import init_empty_weights

    from diffusion_pipe.train.build import load_weights

    model_dir, state, _ = flux
    originals, scales = scaled_weights(state, per_row=True, seed=3)
    fp8, reference = quantise(originals, scales, E4M3)
    file = tmp_path / "flux1-rows.safetensors"
    save_file(fp8_file(fp8, scales, "row", ".weight_scale"), file)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DIFFUSION_PIPE_STORE", str(tmp_path / "store"))
        adapter = load_adapter(ModelParams(family="flux", path=str(model_dir), dtype="float32", transformer=str(file)))
    cls, directory = adapter.denoiser_class(), adapter.denoiser_dir()
    with init_empty_weights(include_buffers=False):
        meta = cls.from_config(cls.load_config(directory))
    names = {*FUSED[2][1], *FUSED[0][1], "single_transformer_blocks.0.attn.to_k.bias"}
    load_weights(meta, names, directory, torch.float32)
    for name in names:
        assert torch.equal(meta.get_parameter(name), reference[name]), name
        if name in scales:
            assert within_fp8(meta.get_parameter(name), originals[name], scales[name][:, None], E4M3), name
