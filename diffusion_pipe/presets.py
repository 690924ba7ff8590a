"""GPU presets: the params files under `examples/<name>/params-<N>gb[-<variant>].yaml`, each sized (and, where its
header says so, measured) for a family on a card of N GB. `diffusion-pipe init --family F` picks the one for the
card it finds (or `--vram N`) and writes its sections into params.yaml, comments and all.

A preset's family is what its own `model.family` says, so a new preset file needs no table here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from diffusion_pipe.config import ConfigError

# Where the presets ship: the examples folder of this source checkout.
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
_NAME = re.compile(r"params-(?P<gb>\d+)gb(?P<variant>-[a-z0-9-]+)?\.yaml")
# The sections a preset sets; scan (the dataset) and model.path / model.family stay the user's.
PRESET_SECTIONS = ("model", "encode", "train", "export")
USER_MODEL_KEYS = ("path", "family", "transformer", "vae", "text_encoders")


@dataclass(frozen=True)
class Preset:
    """One preset file: the card size it is for, its variant (e.g. "fp8"; "" for the plain one), and its header
    comment (what it was sized from, measured figures or "untested")."""

    path: Path
    family: str
    vram_gb: int
    variant: str
    header: str


def model_section(text: str) -> dict:
    """The `model` section of the params file `text` ({} when it has none)."""
    from ruamel.yaml import YAML

    return (YAML(typ="safe", pure=True).load(text) or {}).get("model") or {}


def read_preset(path: Path) -> Preset | None:
    """The preset at `path`, or None when its name is not `params-<N>gb[-variant].yaml`."""
    match = _NAME.fullmatch(path.name)
    if match is None:
        return None
    text = path.read_text()
    family = model_section(text).get("family", "")
    header = "\n".join(line[1:].strip() for line in text.splitlines()[: next(
        (i for i, line in enumerate(text.splitlines()) if not line.startswith("#")), 0)])
    return Preset(path, family, int(match["gb"]), (match["variant"] or "").lstrip("-"), header)


def family_presets(family: str, examples: Path = EXAMPLES) -> list[Preset]:
    """Every preset of `family` under `examples`, smallest card first (the plain variant before others)."""
    presets = [p for path in sorted(examples.glob("*/params-*gb*.yaml")) if (p := read_preset(path))]
    return sorted((p for p in presets if p.family == family), key=lambda p: (p.vram_gb, p.variant != "", p.variant))


def choose_preset(presets: list[Preset], vram_gb: float, family: str) -> Preset:
    """The preset for the largest card that fits in `vram_gb` (the plain variant where several are for that
    size); a ConfigError naming the sizes there are when none fits or the family has none."""
    if not presets:
        raise ConfigError(f"--family {family}: no GPU presets ship for it (examples/*/params-<N>gb.yaml); write "
                          "params.yaml's train section by hand (see the README), or pass --no-preset")
    fitting = [p for p in presets if p.vram_gb <= vram_gb]
    if not fitting:
        sizes = ", ".join(f"{p.vram_gb} GB" for p in presets)
        raise ConfigError(f"--vram: a {vram_gb:.0f} GB card is smaller than every {family} preset ({sizes}): "
                          f"start from {presets[0].path.name} and lower the resolution, or pass --no-preset")
    best = max(p.vram_gb for p in fitting)
    return next(p for p in fitting if p.vram_gb == best)


def detected_vram_gb() -> float | None:
    """The first CUDA GPU's memory in GB (10^9 bytes, as cards are sold: an 80 GB H100 reports 85.5), else None."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 1e9


def apply_preset(params: dict, preset_doc: dict) -> list[str]:
    """Write a preset's sections into `params` (a round-trip YAML mapping, edited in place; the preset's
    comments come along), keeping scan and the user's model location. Returns what changed."""
    changes = []
    for section in PRESET_SECTIONS:
        value = preset_doc.get(section)
        if value is None:
            continue
        if section == "model":
            model = params.setdefault("model", {})
            for key in [k for k in model if k not in USER_MODEL_KEYS]:
                del model[key]
            for key, item in value.items():
                if key not in USER_MODEL_KEYS:
                    model[key] = item
            changes.append("params.yaml: model settings (dtype, base weights) from the preset")
        else:
            params[section] = value
            changes.append(f"params.yaml: {section} from the preset")
    return changes
