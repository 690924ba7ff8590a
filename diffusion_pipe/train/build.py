"""Building the trainable denoiser on each rank: only this pipeline stage's layers hold real weights.

The denoiser is instantiated on the meta device (no memory), split into pipeline layers, and only the layers
of this rank's stage are loaded from the safetensors files; every other layer stays on meta and is never
touched, so a model larger than one process's memory can be split across stages. LoRA A matrices are
initialised from a generator seeded by (seed, module name), so every parallel layout starts from the same
weights and a 1-stage and an N-stage run agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from diffusion_pipe.hashing import hash_json
from diffusion_pipe.model_folder import model_folder_error, read_model_json, require_file
from diffusion_pipe.models.base import Adapter
from diffusion_pipe.train.lora import RANDOM_INIT, AdapterKind, adapter_tensor, add_lora, target_module_names


@dataclass
class LocalModel:
    """The denoiser (remote layers on meta), its pipeline layers, and which of them this rank owns."""

    denoiser: nn.Module
    layers: list[nn.Module]
    start: int
    stop: int
    lora_targets: list[str]


def stage_bounds(num_layers: int, num_stages: int, stage: int) -> tuple[int, int]:
    """The [start, stop) layer range of `stage`, exactly as DeepSpeed's 'uniform' partitioning computes it."""
    from deepspeed.runtime.utils import partition_uniform

    parts = partition_uniform(num_items=num_layers, num_parts=num_stages)
    return parts[stage], parts[stage + 1]


def _weight_files(directory: Path) -> list[Path]:
    index = sorted(directory.glob("*.safetensors.index.json"))
    if index:
        # a shard the index names but the folder lacks (a download cut short) is named, not a bare [Errno 2]
        shards = read_model_json(index[0]).get("weight_map", {}).values()
        return sorted({require_file(directory / f) for f in shards})
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise model_folder_error(directory, "no .safetensors weights (the denoiser must be in safetensors format)",
                                 directory.parent)
    return files


def load_weights(module: nn.Module, names: set[str], directory: Path, dtype: torch.dtype) -> None:
    """Materialise the parameters and buffers `names` of `module` from the safetensors files in `directory`,
    or from the single file a model view's component stands for (reading only these tensors)."""
    from accelerate.utils import set_module_tensor_to_device
    from safetensors import SafetensorError, safe_open

    from diffusion_pipe.models.checkpoints import read_single_file_marker, single_file_weights

    missing = set(names)
    single = read_single_file_marker(directory)
    if single is not None:
        weights = single_file_weights(single, type(module), dict(type(module).load_config(directory)))
        for key in sorted(missing & set(weights.keys())):
            tensor = weights.tensor(key, dtype)
            set_module_tensor_to_device(module, key, "cpu", value=tensor,
                                        dtype=dtype if tensor.is_floating_point() else None)
            missing.discard(key)
        if missing:
            raise FileNotFoundError(f"{single}: weights missing for {sorted(missing)[:5]} ({len(missing)} "
                                    f"tensors); is it a complete {type(module).__name__} of this model's shape?")
        return
    for path in _weight_files(directory):
        try:
            f = safe_open(str(path), "pt")
        except SafetensorError as exc:
            raise model_folder_error(path, f"not a whole safetensors file ({exc}); a download cut short?",
                                     directory.parent) from None
        with f:
            for key in f.keys():
                if key in missing:
                    tensor = f.get_tensor(key)
                    # without dtype=, accelerate casts to the meta tensor's dtype (fp32 from the config)
                    set_module_tensor_to_device(module, key, "cpu", value=tensor,
                                                dtype=dtype if tensor.is_floating_point() else None)
                    missing.discard(key)
    if missing:
        raise model_folder_error(directory, f"weights missing for {sorted(missing)[:5]} ({len(missing)} tensors)",
                                 directory.parent)


def seed_lora_dropout(seed: int, dp_rank: int) -> None:
    """Seed torch's global RNGs (CPU and every GPU), which LoRA dropout draws from, by (seed, data-parallel rank):
    ranks seeded alike would drop the same units for their different samples, a correlation that averaging their
    gradients does not undo. Stages of one pipeline hold different layers and may share it. Nothing whose value
    the replicas must agree on draws from it (`init_lora_deterministic` has generators of its own)."""
    torch.manual_seed(int(hash_json(["lora_dropout", seed, dp_rank])[:15], 16))


def init_lora_deterministic(model: nn.Module, seed: int) -> None:
    """Re-initialise every materialised adapter tensor that peft draws at random (lora_A, LoKr's and LoHa's:
    `RANDOM_INIT`) like peft does (Kaiming uniform, a=sqrt(5)) but from a generator per tensor name, so the
    weights do not depend on which layers a rank holds."""
    import math

    for name, param in model.named_parameters():
        if (tensor := adapter_tensor(name)) in RANDOM_INIT and param.device.type != "meta":
            generator = torch.Generator().manual_seed(int(hash_json([tensor, seed, name])[:15], 16))
            with torch.no_grad():
                fresh = torch.empty(param.shape, dtype=torch.float32)
                nn.init.kaiming_uniform_(fresh, a=math.sqrt(5), generator=generator)
                param.copy_(fresh.to(param.dtype))


def load_init_lora(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy PEFT-named LoRA start values (`init_lora_weights`) into the materialised adapters of `model`."""
    for name, param in model.named_parameters():
        key = name.replace(".default.", ".")
        if adapter_tensor(name) and key in weights and param.device.type != "meta":
            with torch.no_grad():
                param.copy_(weights[key].to(param.dtype))


def build_local_model(adapter: Adapter, num_stages: int, stage: int, *, targets: tuple[str, ...], rank: int,
                      alpha: float, dropout: float, seed: int, base_dtype: str = "", full: bool = False,
                      init_lora: Path | None = None, kind: AdapterKind = AdapterKind()) -> LocalModel:
    """The LoRA-wrapped denoiser with only `stage`'s layers materialised (on CPU, in the adapter's dtype); with
    `full` (train.adapter: full), the denoiser itself with every weight trainable and no LoRA.
    `base_dtype` "float8" / "float8_matmul" (model.base_dtype) stores the frozen Linear weights of the
    stage's blocks in fp8 (train/fp8.py); the first and last pipeline layers, under 1% of the weights and
    the model's input and output projections, keep the adapter's dtype. `init_lora` (train.init_lora): the LoRA
    file the adapters start from instead of their usual init (train/init_lora.py); `kind`: LoRA, DoRA, LoKr or
    LoHa (train.adapter and its options)."""
    from accelerate import init_empty_weights

    cls, directory = adapter.denoiser_class(), adapter.denoiser_dir()
    require_file(directory / "config.json", adapter.model_dir)
    with init_empty_weights(include_buffers=False):
        denoiser = cls.from_config(cls.load_config(directory))
    denoiser.requires_grad_(False)
    layers = adapter.pipeline_layers(denoiser)
    start, stop = stage_bounds(len(layers), num_stages, stage)
    names = {id(t): n for n, t in [*denoiser.named_parameters(), *denoiser.named_buffers()]}
    local = {names[id(t)] for layer in layers[start:stop]
             for t in [*layer.parameters(), *layer.buffers()] if t.device.type == "meta"}
    load_weights(denoiser, local, directory, adapter.dtype)
    if full:
        denoiser.requires_grad_(True)
        lora_targets: list[str] = []
    else:
        lora_targets = target_module_names(denoiser, targets, adapter.lora_exclude())
        shapes = {n: (denoiser.get_submodule(n).out_features, denoiser.get_submodule(n).in_features)
                  for n in lora_targets}
        add_lora(denoiser, lora_targets, rank, alpha, dropout, dtype=adapter.dtype, kind=kind)
        init_lora_deterministic(denoiser, seed)
        if init_lora is not None:
            from diffusion_pipe.train.init_lora import init_lora_weights

            load_init_lora(denoiser, init_lora_weights(adapter, shapes, init_lora, rank, alpha))
    # Loading replaced parameter objects and peft replaced target modules: layers built before would hold
    # stale references, so the layers are built again from the final model.
    layers = adapter.pipeline_layers(denoiser)
    if base_dtype:
        from diffusion_pipe.train.fp8 import quantise_frozen_linears

        quantise_frozen_linears(layers[max(start, 1):min(stop, len(layers) - 1)],
                                matmul=base_dtype == "float8_matmul")
    denoiser.eval()
    return LocalModel(denoiser, layers, start, stop, lora_targets)
