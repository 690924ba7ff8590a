"""Checkpoints as users have them: a component's weights from one single file, with a diffusers config as skeleton.

A component's source is either a diffusers component folder (config.json + weights) or a single .safetensors
file in its original layout (BFL / ComfyUI / LDM / original Wan keys, bf16 or fp8, with or without ComfyUI's
per-tensor scales). Both look the same to every adapter: `resolve_model` composes a *model view*, a folder under
the store root whose entries link to the skeleton's components, except that each component given as a single
file is a folder holding the skeleton's config.json and a `single_file.json` marker naming the file. Adapters
keep reading `model_dir / "vae" / "config.json"`; hashing (`diffusion_pipe.weights.component_hash`), whole loads
(`load_component`) and per-stage loads (`train.build.load_weights`) read the marker.

Key names are converted by diffusers' own single-file converters (`SINGLE_FILE_LOADABLE_CLASSES`), run over a
state dict whose tensors are zero-copy views of the memory-mapped file: the converters rename, chunk, split and
reshape, which stay views, so running one over a 24 GB file reads nothing but the few tensors it concatenates.
A pipeline stage then copies out only its own tensors. fp8 scales run through the same converter as
zero-memory expanded tensors, so each converted tensor is paired with its per-element scale, whatever the
converter did to it. Transformers text encoders keep their own key names in single files; their own loader
maps legacy names.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from diffusion_pipe.hashing import hash_json
from diffusion_pipe.model_folder import model_folder_error
from diffusion_pipe.weights import SINGLE_FILE_MARKER

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
# ComfyUI's fp8 files: "<module>.scale_weight" (older "scaled_fp8" files) or "<module>.weight_scale" (newer
# quantised files) multiply "<module>.weight"; input scales and format markers say nothing about the weights.
_WEIGHT_SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
_IGNORED_SUFFIXES = (".scale_input", ".input_scale", ".comfy_quant")
_IGNORED_KEYS = ("scaled_fp8",)
VIEW_RECORD = "view.json"  # in a model view: the skeleton it was composed over


def read_single_file_marker(directory: Path) -> Path | None:
    """The single file a model view's component folder stands for; None for a diffusers component folder."""
    marker = Path(directory) / SINGLE_FILE_MARKER
    if not marker.is_file():
        return None
    return Path(json.loads(marker.read_text())["file"])


def mmap_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a .safetensors file as a zero-copy view of the memory-mapped file (copy-on-write: the
    file is never written). Pages are read only when a tensor's data is touched."""
    path = Path(path)
    with path.open("rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
        size = os.fstat(f.fileno()).st_size
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + header_len else None
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
        except KeyError:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which training cannot read; "
                             "convert the file to bf16, fp16 or fp8") from None
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end == start:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            count = (end - start) // torch.empty((), dtype=dtype).element_size()
            tensors[name] = torch.frombuffer(mapped, dtype=dtype, count=count, offset=base + start).view(shape)
    return tensors


def split_scales(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(weights, scales by the weight key they multiply): ComfyUI's fp8 scale tensors separated from the
    weights, their format markers and input scales dropped."""
    weights, scales = {}, {}
    for name, tensor in tensors.items():
        if name in _IGNORED_KEYS or name.endswith(_IGNORED_SUFFIXES):
            continue
        suffix = next((s for s in _WEIGHT_SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix:
            scales[name.removesuffix(suffix) + ".weight"] = tensor
        else:
            weights[name] = tensor
    if missing := sorted(set(scales) - set(weights)):
        raise ValueError(f"scales for weights the file lacks: {missing[:3]}")
    return weights, scales


def _expanded_scale(scale: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """`scale` (per tensor, or per output row) broadcast to `like`'s shape without memory; 1 when absent."""
    if scale is None:
        return torch.ones((), dtype=torch.float32).expand(like.shape)
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(()).expand(like.shape)
    if like.dim() >= 1 and scale.numel() == like.shape[0]:
        return scale.reshape(like.shape[0], *([1] * (like.dim() - 1))).expand(like.shape)
    raise ValueError(f"a scale of shape {tuple(scale.shape)} does not fit a weight of shape {tuple(like.shape)}")


class _ViewsNotCopies(TorchFunctionMode):
    """How diffusers' converters run here. `torch.cat` of one tensor (the converters' idiom for "this slice")
    returns the slice itself: a view of the mapped file instead of a copy of it, which would read every fused
    qkv weight of a 24 GB file into memory. And a split whose sizes a converter hard-codes for its family's
    published width (diffusers' Flux converter: 3072) is scaled to the tensor's width when they do not fit it
    (models of another width, like the tests' tiny ones); where they fit, nothing changes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.cat and len(args) == 1 and not kwargs and len(args[0]) == 1:
            return args[0][0]
        if func in (torch.split, torch.Tensor.split) and len(args) >= 2 and isinstance(args[1], (list, tuple)):
            tensor, sizes = args[0], list(args[1])
            dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
            total, width = sum(sizes), tensor.shape[dim]
            if total != width and all(size * width % total == 0 for size in sizes):
                return func(tensor, [size * width // total for size in sizes], dim)
        return func(*args, **kwargs)


def _diffusers_converter(cls: type):
    """diffusers' key converter for model class `cls` (None for classes without a single-file layout)."""
    import diffusers
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    for class_name, functions in SINGLE_FILE_LOADABLE_CLASSES.items():
        loadable = getattr(diffusers, class_name, None)
        if loadable is not None and issubclass(cls, loadable):
            return functions["checkpoint_mapping_fn"]
    return None


def _model_keys(cls: type, config: dict) -> set[str]:
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = cls.from_config(config)
    return set(model.state_dict())


@dataclass
class SingleFileWeights:
    """A single file's tensors under the diffusers model's names, not yet read: `tensor(name, dtype)` copies one
    out (dequantised when the file holds scales)."""

    file: Path
    raw: dict[str, torch.Tensor]
    scales: dict[str, torch.Tensor] | None

    def keys(self) -> list[str]:
        """The converted tensor names."""
        return list(self.raw)

    def tensor(self, name: str, dtype: torch.dtype | None) -> torch.Tensor:
        """Tensor `name` in `dtype` (floating-point tensors only; None keeps the stored dtype), in this
        process's own memory, not the file's mapping."""
        raw = self.raw[name]
        if not raw.is_floating_point():
            return raw.clone()
        if self.scales is not None:
            value = raw.float() * self.scales[name]
            return value.to(dtype or torch.float32)
        if dtype is None and raw.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            dtype = torch.bfloat16  # an unscaled fp8 file has no dtype of its own to compute in
        return raw.to(dtype or raw.dtype, copy=True)


def single_file_weights(file: Path, cls: type, config: dict) -> SingleFileWeights:
    """The tensors of single file `file` under the names of diffusers/transformers class `cls` built from
    `config`, converted by diffusers' converter for `cls` (none for files already in diffusers' names or for
    transformers classes). Reads no tensor data beyond what the converter concatenates."""
    weights, scales = split_scales(mmap_safetensors(file))
    converter = _diffusers_converter(cls)
    model_keys = _model_keys(cls, config) if converter is not None else set()
    if converter is not None and not model_keys <= set(weights):
        try:
            with _ViewsNotCopies():
                converted = converter(checkpoint=dict(weights), config=config)
                converted_scales = converter(checkpoint={
                    k: _expanded_scale(scales.get(k), w) if w.is_floating_point() else w
                    for k, w in weights.items()}, config=config) if scales else None
        except (KeyError, IndexError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{file}: diffusers could not convert it for {cls.__name__} ({type(exc).__name__}: "
                             f"{exc}); is it the right component for this family (a transformer file given as "
                             "the VAE, or a model of another family)?") from exc
        if missing := sorted(model_keys - set(converted)):
            raise ValueError(f"{file}: diffusers could not convert it for {cls.__name__}: {len(missing)} of its "
                             f"{len(model_keys)} tensors are missing (e.g. {missing[0]}); is it the right component "
                             "for this family (a transformer file given as the VAE, or a model of another family)?")
        return SingleFileWeights(file, converted, converted_scales)
    expanded = {k: _expanded_scale(scales.get(k), w) for k, w in weights.items()} if scales else None
    return SingleFileWeights(file, weights, expanded)


def _is_diffusers_class(cls: type) -> bool:
    from diffusers import ModelMixin

    return issubclass(cls, ModelMixin)


def load_single_file_component(cls: type, directory: Path, file: Path, dtype: torch.dtype) -> nn.Module:
    """The whole component from its single file, through the library's own loader: diffusers'
    `from_single_file` with the view's config, or transformers' `from_pretrained(config=, state_dict=)`."""
    if _is_diffusers_class(cls):
        config = dict(cls.load_config(directory))
        weights = single_file_weights(file, cls, config)
        state = {name: weights.tensor(name, dtype) for name in weights.keys()}
        if _diffusers_converter(cls) is not None:
            return cls.from_single_file(state, config=str(directory.parent), subfolder=directory.name,
                                        torch_dtype=dtype, local_files_only=True)
        # diffusers has no single-file layout for this class: a file in its own names still loads
        from accelerate import init_empty_weights

        with init_empty_weights():
            module = cls.from_config(config)
        try:
            module.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as exc:
            raise ValueError(f"{file}: diffusers has no single-file converter for {cls.__name__}, and the file "
                             f"is not in its diffusers names ({str(exc).splitlines()[1][:200]}); convert it to a "
                             "diffusers folder, or give its model.path component instead") from None
        return module.to(dtype)
    from transformers import AutoConfig

    weights = single_file_weights(file, cls, {})
    state = {name: weights.tensor(name, dtype) for name in weights.keys()}
    module, info = cls.from_pretrained(None, config=AutoConfig.from_pretrained(directory), state_dict=state,
                                       dtype=dtype, output_loading_info=True)
    # transformers initialises what the file lacks at random and only warns: a wrong file would encode noise
    if missing := sorted(info["missing_keys"]):
        raise ValueError(f"{file}: {len(missing)} tensors of {cls.__name__} are not in it (e.g. {missing[0]}; it "
                         f"holds e.g. {next(iter(state), 'nothing')}); is it the {directory.name} of this "
                         "family, as a text-encoder file on its own (not inside an all-in-one checkpoint)?")
    return module


# ---- model views ---------------------------------------------------------------------------------------------
def views_root() -> Path:
    """Where model views live: <store root>/model-views (outside the repository, like the store)."""
    from diffusion_pipe.store.store import default_root

    return default_root() / "model-views"


def compose_view(skeleton: Path, files: dict[str, Path], root: Path | None = None) -> Path:
    """A model view of `skeleton` (a diffusers model folder) whose components `files` (name -> single file)
    come from single files. Named by the inputs' paths, so the same inputs give the same folder; created once,
    atomically (a concurrent creator's identical folder wins)."""
    root = Path(root) if root is not None else views_root()
    files = {name: Path(f).resolve() for name, f in files.items()}
    for name, f in files.items():
        if not (skeleton / name / "config.json").is_file():
            raise model_folder_error(skeleton / name / "config.json", f"missing, and the single file {f} is "
                                     "built with it (a skeleton needs at least every component's config)", skeleton)
    view = root / hash_json({"skeleton": str(skeleton), "files": {k: str(v) for k, v in files.items()}})[:20]
    if view.is_dir():
        return view
    tmp = root / f".tmp-{view.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / VIEW_RECORD).write_text(json.dumps({"skeleton": str(skeleton)}))
    for entry in sorted(skeleton.iterdir()):
        if entry.name in files:
            (tmp / entry.name).mkdir()
            shutil.copyfile(entry / "config.json", tmp / entry.name / "config.json")
            (tmp / entry.name / SINGLE_FILE_MARKER).write_text(json.dumps({"file": str(files[entry.name])}))
        else:
            (tmp / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    try:
        tmp.rename(view)
    except OSError:  # another process published the same view first
        shutil.rmtree(tmp, ignore_errors=True)
    return view


def hub_revision(model_dir: Path) -> str | None:
    """The commit of a Hugging Face cache snapshot (`.../snapshots/<commit>`), or of the snapshot a model view
    was composed over; None for any other folder."""
    model_dir = Path(model_dir)
    if (model_dir / VIEW_RECORD).is_file():
        model_dir = Path(json.loads((model_dir / VIEW_RECORD).read_text())["skeleton"])
    return model_dir.name if model_dir.parent.name == "snapshots" else None


def single_file_params(model) -> dict[str, str]:
    """The `model.*` params that name single files, by param name (empty entries left out)."""
    out = {"model.transformer": model.transformer, "model.vae": model.vae}
    out |= {f"model.text_encoders[{i}]": f for i, f in enumerate(model.text_encoders)}
    return {k: v for k, v in out.items() if v}


def resolve_model(model, root: Path | None = None) -> Path:
    """The model folder adapters read for params section `model` (a `ModelParams`): `model.path` resolved
    (relative to `root`, default the working directory; a hub id through the Hugging Face cache), or, when
    `model.transformer`, `model.vae` or `model.text_encoders` name single files, a model view of it with those
    components taken from them. A hub skeleton then fetches only configs, tokenizers and the weights of the
    components no single file replaces."""
    from diffusion_pipe.config import ConfigError
    from diffusion_pipe.models import adapter_class
    from diffusion_pipe.models.common import DTYPES, HUB_CONFIG_PATTERNS, resolve_model_dir

    named = single_file_params(model)
    if not named:
        return resolve_model_dir(model.path, root)
    skeleton = resolve_model_dir(model.path, root, allow_patterns=HUB_CONFIG_PATTERNS)
    adapter = adapter_class(model.family)(skeleton, DTYPES[model.dtype], expert=model.expert or None)
    text_names = list(adapter.text_component_dirs()[0])
    if model.text_encoders and len(model.text_encoders) != len(text_names):
        raise ConfigError(f"model.text_encoders: {len(model.text_encoders)} files given, family "
                          f"'{model.family}' has {len(text_names)} text encoders ({', '.join(text_names)}); list "
                          "one file per encoder in that order, \"\" for one taken from model.path")
    components = {"model.transformer": adapter.denoiser_dir().name, "model.vae": adapter.vae_dir().name}
    components |= {f"model.text_encoders[{i}]": name for i, name in enumerate(text_names)}
    files = {}
    for param, value in named.items():
        file = Path(value).expanduser()
        file = file if file.is_absolute() or root is None else Path(root) / file
        if not file.is_file() or file.suffix != ".safetensors":
            raise FileNotFoundError(f"{param}: {value!r} is not a .safetensors file; point it at the single "
                                    "file of that component (ComfyUI's models/ folders hold them)")
        files[components[param]] = file
    if hub_revision(skeleton) is not None:  # a hub snapshot: fetch the weights no single file replaces
        rest = [name for name in (*components.values(),) if name not in files]
        skeleton = resolve_model_dir(model.path, root,
                                     allow_patterns=[*HUB_CONFIG_PATTERNS, *(f"{n}/*" for n in rest)])
    return compose_view(skeleton, files)
