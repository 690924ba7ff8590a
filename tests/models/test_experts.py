"""`model.expert` selects one expert of a mixture-of-experts model (Wan 2.2) and nothing else."""

import json
import shutil

import pytest

from diffusion_pipe.config import ConfigError
from diffusion_pipe.models import load_adapter
from diffusion_pipe.models.wan import WanAdapter
from diffusion_pipe.params import ModelParams


def test_family_without_experts_refuses_one(tiny_flux_dir):
    with pytest.raises(ConfigError, match=r"model.expert: 'high' is not an expert of family 'flux'; set it to empty"):
        load_adapter(ModelParams(family="flux", path=str(tiny_flux_dir), dtype="float32", expert="high"))


def test_wan22_expert_is_selected_from_params(tmp_path):
    base = tmp_path / "wan21"
    WanAdapter.build_tiny(base, seed=0)
    d = tmp_path / "wan22"
    shutil.copytree(base, d)
    shutil.copytree(d / "transformer", d / "transformer_2")
    index = json.loads((d / "model_index.json").read_text())
    (d / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": 0.875}))
    low = load_adapter(ModelParams(family="wan", path=str(d), dtype="float32", expert="low"))
    assert low.denoiser_dir() == d / "transformer_2" and low.timestep_range() == (0.0, 0.875)
    high = load_adapter(ModelParams(family="wan", path=str(d), dtype="float32", expert="high"))
    assert high.denoiser_dir() == d / "transformer" and high.timestep_range() == (0.875, 1.0)
    assert load_adapter(ModelParams(family="wan", path=str(d), dtype="float32")).timestep_range() == (0.0, 1.0)
    with pytest.raises(ConfigError, match=r"model.expert: 'mid' is not an expert of family 'wan'; set it to one of high, low"):
        load_adapter(ModelParams(family="wan", path=str(d), dtype="float32", expert="mid"))
