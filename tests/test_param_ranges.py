"""Every numeric param has a range, checked at load: a bad value fails at once, naming the key and the range,
instead of minutes later inside training (YAML's .nan and .inf included)."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path

import pytest

from diffusion_pipe import params as P
from diffusion_pipe.config import ConfigError, Range
from diffusion_pipe.params import load_params

BASE = "model: {path: m}\nscan:\n  datasets: [{path: d}]\n"


def _load(tmp_path: Path, section: str, body: str) -> P.Params:
    path = tmp_path / "params.yaml"
    if section == "dataset":
        text = BASE.replace("datasets: [{path: d}]", f"datasets: [{{path: d, {body}}}]")
    elif section == "scan":
        text = BASE + f"  {body}\n"
    else:
        text = BASE + f"{section}:\n  {body}\n"
    path.write_text(text)
    return load_params(path)


@pytest.mark.parametrize("section, body, error", [
    ("train", "learning_rate: .nan", r"train\.learning_rate: got nan, expected a finite number"),
    ("train", "max_grad_norm: .inf", r"train\.max_grad_norm: got inf, expected a finite number"),
    ("train", "lora_dropout: 1.5", r"train\.lora_dropout: 1\.5 is out of range \[0, 1\)"),
    ("train", "adam_betas: [0.9, 1.5]", r"train\.adam_betas\[1\]: 1\.5 is out of range \[0, 1\)"),
    ("train", "lora_alpha: -1.0", r"train\.lora_alpha: -1 is out of range \(0, inf\)"),
    ("train", "warmup_steps: -5", r"train\.warmup_steps: -5 is out of range \[0, inf\)"),
    ("train", "max_grad_norm: -1.0", r"train\.max_grad_norm: -1 is out of range \[0, inf\)"),
    ("train", "eval_timesteps: [0.5, 2.0]", r"train\.eval_timesteps\[1\]: 2 is out of range \[0, 1\]"),
    ("train", "seed: -1", r"train\.seed: -1 is out of range \[0, 4\.29497e\+09\]"),
    # the timestep and noise params: a shift of 1e308 is inf in float32 and trained on NaN
    ("train", "flow_shift: 1.0e308", r"train\.flow_shift: 1e\+308 is out of range \[0\.01, 100\]"),
    ("train", "flow_shift: 0.0", r"train\.flow_shift: 0 is out of range \[0\.01, 100\]"),
    ("train", "guidance: 1.0e308", r"train\.guidance: 1e\+308 is out of range \[0, 100\]"),
    ("train", "min_snr_gamma: 1.0e308", r"train\.min_snr_gamma: 1e\+308 is out of range \[0, 1000\]"),
    ("train", "noise_offset: 1.5", r"train\.noise_offset: 1\.5 is out of range \[0, 1\]"),
    ("encode", "pack_size_mb: 0", r"encode\.pack_size_mb: 0 is out of range \(0, 65536\]"),
    ("scan", "max_caption_bytes: 0", r"scan\.max_caption_bytes: 0 is out of range \[1, inf\)"),
    ("dataset", "eval_fraction: 1.0", r"scan\.datasets\[0\]\.eval_fraction: 1 is out of range \[0, 1\)"),
])
def test_bad_values_fail_at_load_naming_key_and_range(tmp_path, section, body, error):
    with pytest.raises(ConfigError, match=error):
        _load(tmp_path, section, body)


def test_values_at_the_edges_of_their_ranges_load(tmp_path):
    assert _load(tmp_path, "train", "lora_dropout: 0.0").train.lora_dropout == 0.0
    assert _load(tmp_path, "train", "eval_timesteps: [0.0, 1.0]").train.eval_timesteps == (0.0, 1.0)
    assert _load(tmp_path, "train", "max_grad_norm: 0.0").train.max_grad_norm == 0.0  # 0: no clipping
    assert _load(tmp_path, "train", "flow_shift: 100.0").train.flow_shift == 100.0


def _params_classes() -> list[type]:
    return [c for c in vars(P).values() if dataclasses.is_dataclass(c) and c.__module__ == P.__name__]


def _numeric(tp: object) -> bool:
    if tp in (int, float):
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):  # `float | None`: a number, or null
        return any(_numeric(a) for a in typing.get_args(tp))
    return typing.get_origin(tp) is tuple and any(a in (int, float) for a in typing.get_args(tp))


@pytest.mark.parametrize("cls", _params_classes(), ids=lambda c: c.__name__)
def test_every_numeric_param_has_one_range_and_its_default_is_in_it(cls):
    hints = typing.get_type_hints(cls)
    ranges: dict[str, Range] = getattr(cls, "RANGES", {})
    numeric = {f.name for f in dataclasses.fields(cls) if _numeric(hints[f.name])}
    assert numeric == set(ranges), f"{cls.__name__}: add a Range to RANGES for {sorted(numeric - set(ranges))}"
    for f in dataclasses.fields(cls):
        if f.name in ranges and f.default is not dataclasses.MISSING:
            values = f.default if isinstance(f.default, tuple) else (f.default,)
            assert all(v is None or v in ranges[f.name] for v in values), (cls.__name__, f.name, f.default)
