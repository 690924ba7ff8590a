"""LoKr, LoHa and DoRA in the layouts loaders read, written through each family's own LoRA export.

A family's `export_lora` knows where its LoRA modules land in each format (ComfyUI's names, kohya's, a fused
projection such as ComfyUI's Flux qkv); these functions reuse it instead of knowing any family:

- LoHa's delta is (w1_a w1_b) * (w2_a w2_b), two low-rank products multiplied elementwise. Each product is
  exported as a LoRA of its own; whatever the family does to a LoRA (rename it, reorder its rows or columns,
  stack several into a fused projection with zero rows where a part is missing) it does to both alike, and that
  commutes with the elementwise product, so the two exported LoRAs are the LyCORIS factors at the family's key.
- LoKr's delta is kron(w1, w2), which stacking or reordering breaks: it is written where the family's LoRA of
  the module lands whole and in order (probed with a LoRA of values 1, 2, 3, ...); elsewhere under the module's
  diffusers name where ComfyUI maps those onto slices of its fused projections (Flux), else refused.
- DoRA is the LoRA plus `.dora_scale`, the magnitude per output feature, shape (out, 1): exported as a LoRA whose
  B column holds it, so that fused projections get it stacked like the LoRA's rows.

Input is always PEFT-named (`<module>.lokr_w1`, `.hada_w1_a`, `.lora_magnitude_vector`, ...) with the alpha/rank
scale folded in (`lora_keys.fold_scale`), so every output applies at scale 1: `.alpha` is the rank a loader
divides by.
"""

from __future__ import annotations

import torch

from diffusion_pipe.lora_keys import TensorDict, split_key

_LOKR = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
_LOHA = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
_LORA = ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector")
# the formats LoKr and LoHa are written in: ComfyUI's LoRA loader reads both layouts, diffusers neither
LYCORIS_FORMATS = ("comfyui", "kohya")


def adapter_modules(tensors: TensorDict) -> dict[str, dict[str, torch.Tensor]]:
    """Module name -> {tensor name ('lokr_w1', 'lora_A.weight', ...): value} of PEFT-named adapter tensors; a key
    of no adapter tensor is a ValueError naming it."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        tensor = next((t for t in (*_LOKR, *_LOHA, *_LORA) if key.endswith(f".{t}")), None)
        if tensor is None:
            raise ValueError(f"adapter key {key!r} is no LoRA, DoRA, LoKr or LoHa tensor; the trained file is not "
                             "one the train stage wrote")
        out.setdefault(key[: -len(tensor) - 1], {})[tensor] = value
    return dict(sorted(out.items()))


def adapter_kind(tensors: TensorDict) -> str:
    """'lokr', 'loha', 'dora' or 'lora': what a PEFT-named adapter file holds."""
    names = {t for parts in adapter_modules(tensors).values() for t in parts}
    if names & set(_LOKR):
        return "lokr"
    if names & set(_LOHA):
        return "loha"
    return "dora" if "lora_magnitude_vector" in names else "lora"


def export_adapter(adapter, folded: TensorDict, fmt: str) -> TensorDict:
    """`folded` (PEFT-named, scale folded in) in export format `fmt` of `adapter`'s family: a LoRA through the
    family's `export_lora`; DoRA, LoKr and LoHa through it as the module docstring tells."""
    kind = adapter_kind(folded)
    if kind == "lora":
        return adapter.export_lora(folded, fmt)
    if kind in ("lokr", "loha") and fmt not in LYCORIS_FORMATS:
        raise ValueError(f"export.formats: {fmt!r} loads no {kind} (diffusers' load_lora_weights reads LoRA and "
                         f"DoRA only); export {kind} as {' or '.join(LYCORIS_FORMATS)}")
    modules = adapter_modules(folded)
    return {"lokr": _export_lokr, "loha": _export_loha, "dora": _export_dora}[kind](adapter, modules, fmt)


def _through_export(adapter, fmt: str, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]
                    ) -> dict[str, dict[str, torch.Tensor]]:
    """Export prefix -> {"A": down, "B": up} of the LoRA whose module `m` has factors `pairs[m]` = (A, B), as the
    family writes it in `fmt` (its `.alpha` tensors dropped)."""
    lora = {}
    for module, (a, b) in pairs.items():
        lora[f"{module}.lora_A.weight"], lora[f"{module}.lora_B.weight"] = a.contiguous(), b.contiguous()
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in adapter.export_lora(lora, fmt).items():
        split = split_key(key)
        if split is None:
            raise ValueError(f"family '{adapter.name}' exports {key!r} in {fmt!r}, which is no LoRA tensor")
        if split[1] != "alpha":
            out.setdefault(split[0], {})[split[1]] = value
    return out


def _export_loha(adapter, modules: dict[str, dict[str, torch.Tensor]], fmt: str) -> TensorDict:
    """LoHa: each Hadamard factor exported as a LoRA (see the module docstring)."""
    first = _through_export(adapter, fmt, {m: (t["hada_w1_b"], t["hada_w1_a"]) for m, t in modules.items()})
    second = _through_export(adapter, fmt, {m: (t["hada_w2_b"], t["hada_w2_a"]) for m, t in modules.items()})
    assert first.keys() == second.keys(), (sorted(first), sorted(second))
    out: TensorDict = {}
    for prefix, w1 in first.items():
        w2 = second[prefix]
        out |= {f"{prefix}.hada_w1_a": w1["B"], f"{prefix}.hada_w1_b": w1["A"], f"{prefix}.hada_w2_a": w2["B"],
                f"{prefix}.hada_w2_b": w2["A"], f"{prefix}.alpha": torch.tensor(float(w1["A"].shape[0]))}
    return out


def lokr_shape(tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(out, in) features of the module a LoKr's tensors adapt: the products of its two factors' shapes."""
    def factor(name: str) -> tuple[int, int]:  # a full factor, or the product of its low-rank pair
        if name in tensors:
            return tuple(tensors[name].shape)
        return tensors[f"{name}_a"].shape[0], tensors[f"{name}_b"].shape[1]

    (out1, in1), (out2, in2) = factor("lokr_w1"), factor("lokr_w2")
    return out1 * out2, in1 * in2


def _whole_prefix(adapter, fmt: str, module: str, out_f: int, in_f: int) -> str | None:
    """Where the family's `fmt` LoRA of `module` lands whole and in order (its own key, rows and columns
    unchanged), or None when it is fused with others or reordered."""
    a = torch.arange(1, in_f + 1, dtype=torch.float32)[None]
    b = torch.arange(1, out_f + 1, dtype=torch.float32)[:, None]
    landed = _through_export(adapter, fmt, {module: (a, b)})
    if len(landed) != 1:
        return None
    prefix, pair = next(iter(landed.items()))
    whole = torch.equal(pair.get("A", torch.empty(0)), a) and torch.equal(pair.get("B", torch.empty(0)), b)
    return prefix if whole else None


def _export_lokr(adapter, modules: dict[str, dict[str, torch.Tensor]], fmt: str) -> TensorDict:
    """LoKr: each module's tensors under the key its LoRA lands at, where that LoRA lands whole."""
    out: TensorDict = {}
    prefixes: dict[str, str] = {}
    for module, tensors in modules.items():
        prefix = _whole_prefix(adapter, fmt, module, *lokr_shape(tensors))
        if prefix is None and fmt == "comfyui" and adapter.comfyui_reads_diffusers_names:
            prefix = f"transformer.{module}"  # ComfyUI applies it to its slice of the fused projection
        if prefix is None or prefix in prefixes:
            raise ValueError(f"export.formats: family '{adapter.name}' writes {module!r} in {fmt!r} fused with other "
                             "projections or reordered (ComfyUI's fused qkv, say), which a Kronecker product cannot "
                             f"express; train adapter: loha or lora, or leave {module.rsplit('.', 1)[-1]!r} out of "
                             "train.lora_targets")
        prefixes[prefix] = module
        out |= {f"{prefix}.{name}": value.contiguous() for name, value in tensors.items()}
        # ComfyUI divides by the rank of a low-rank factor only (w2_b's, else w1_b's), scale 1 without one
        low_rank = tensors.get("lokr_w2_b", tensors.get("lokr_w1_b"))
        out[f"{prefix}.alpha"] = torch.tensor(float(low_rank.shape[0]) if low_rank is not None else 1.0)
    return out


def _export_dora(adapter, modules: dict[str, dict[str, torch.Tensor]], fmt: str) -> TensorDict:
    """DoRA: the LoRA as the family exports it, plus the magnitude of every exported key, as `.dora_scale`
    (ComfyUI, kohya; shape (out, 1)) or `.lora_magnitude_vector` (diffusers / PEFT; shape (out,))."""
    lora = {f"{m}.{name}": t[name] for m, t in modules.items() for name in ("lora_A.weight", "lora_B.weight")}
    out = adapter.export_lora(lora, fmt)
    ones = {m: torch.ones(1, t["lora_A.weight"].shape[1]) for m, t in modules.items()}
    magnitudes = _through_export(adapter, fmt, {m: (ones[m], t["lora_magnitude_vector"][:, None])
                                                for m, t in modules.items()})
    covered = _through_export(adapter, fmt, {m: (ones[m], torch.ones(t["lora_magnitude_vector"].shape[0], 1))
                                             for m, t in modules.items()})
    for prefix, pair in magnitudes.items():
        if not bool((covered[prefix]["B"].sum(dim=1) > 0).all()):
            raise ValueError(f"export.formats: family '{adapter.name}' writes {prefix!r} in {fmt!r} as one projection "
                             "fused from several, and this run trained DoRA on only some of them: the magnitude of "
                             "the others is not known; add the other parts to train.lora_targets, or set "
                             "train.lora_dora: false")
        magnitude = pair["B"].sum(dim=1)  # one column per fused part, each row in exactly one
        if fmt in LYCORIS_FORMATS:
            out[f"{prefix}.dora_scale"] = magnitude[:, None].contiguous()
        else:
            out[f"{prefix}.lora_magnitude_vector"] = magnitude.contiguous()
    return out
