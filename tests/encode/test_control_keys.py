"""What encode feeds the key function for control images: the same inputs as any image latent (the control image's
own bytes, its target's bucket, the resize rule, the VAE's weights and dtype), so each control latent is keyed
by exactly what its stored bytes depend on."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pytest

from diffusion_pipe.config import ConfigError, from_dict
from diffusion_pipe.encode.encode import plan_samples
from diffusion_pipe.encode.keys import latent_key
from diffusion_pipe.encode.media import RESIZE_SPEC, frames_spec
from diffusion_pipe.models import load_adapter
from diffusion_pipe.models.flux_kontext import FluxKontextAdapter
from diffusion_pipe.params import EncodeParams, ModelParams
from diffusion_pipe.weights import component_hash

ROWS = [
    {"dataset": "edits", "path": "a.png", "status": "ok", "media": "image", "content_hash": "1" * 32,
     "caption": "make it red", "buckets": ["64x64x1", "80x48x1"], "split": "train", "repeats": 1,
     "control_paths": ["a.jpg"], "control_hashes": ["c" * 32]},
    {"dataset": "edits", "path": "b.png", "status": "ok", "media": "image", "content_hash": "2" * 32,
     "caption": "make it blue", "buckets": ["64x64x1"], "split": "eval", "repeats": 1,
     "control_paths": ["b.png"], "control_hashes": ["d" * 32]},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kontext")
    FluxKontextAdapter.build_tiny(out, seed=0)
    return out


def plan(model_dir: Path, rows: list[dict], family: str = "flux_kontext"):
    model = from_dict(ModelParams, {"family": family, "path": str(model_dir), "dtype": "float32"}, "model")
    params = from_dict(EncodeParams, {"text_max_length": 16}, "encode")
    return plan_samples(pa.Table.from_pylist(rows), load_adapter(model), model, params)


def test_control_keys_are_image_latent_keys_at_the_targets_bucket(model_dir: Path, store_env: Path) -> None:
    samples = plan(model_dir, ROWS)
    vae = component_hash(model_dir / "vae")
    for s, control_hash in zip(samples, ("c" * 32, "c" * 32, "d" * 32)):
        assert s.conditioning_keys == (latent_key(content_hash=control_hash, bucket=s.bucket, resize=RESIZE_SPEC,
                                                  frames=frames_spec("image", 1), vae_hash=vae,
                                                  vae_dtype="float32"),)
    a64, a80, _ = samples
    assert a64.conditioning_keys != a80.conditioning_keys  # one control image, two buckets: two latents
    # an edited control image changes its own key only
    edited = plan(model_dir, [{**ROWS[0], "control_hashes": ["e" * 32]}, ROWS[1]])
    assert [s.latent_key for s in edited] == [s.latent_key for s in samples]
    assert [s.text_key for s in edited] == [s.text_key for s in samples]
    assert edited[2].conditioning_keys == samples[2].conditioning_keys
    assert edited[0].conditioning_keys != samples[0].conditioning_keys


def test_control_keys_follow_the_vae(model_dir: Path, tmp_path: Path, store_env: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    FluxKontextAdapter.build_tiny(tmp_path / "seed1", seed=1)
    shutil.rmtree(other / "vae")
    shutil.copytree(tmp_path / "seed1" / "vae", other / "vae")
    before, after = plan(model_dir, ROWS), plan(other, ROWS)
    assert not {k for s in before for k in s.conditioning_keys} & {k for s in after for k in s.conditioning_keys}


def test_the_family_and_the_dataset_must_agree_on_control_images(model_dir: Path, store_env: Path) -> None:
    with pytest.raises(ConfigError, match=r"dataset 'edits' has control images \(`control`\), but model family "
                                          r"'flux' trains on none"):
        plan(model_dir, ROWS, family="flux")
    with pytest.raises(ConfigError, match=r"dataset 'edits' has 0 control image\(s\) per item, but model family "
                                          r"'flux_kontext' trains on 1.*set `control` on the dataset"):
        plan(model_dir, [{**ROWS[0], "control_paths": [], "control_hashes": []}])
