"""What encode feeds the key functions: each input that changes the stored bytes reaches the keys plan_samples
makes from a real (tiny) model directory, and nothing else does.

tests/encode/test_keys.py checks the key functions themselves; these tests check the wiring in front of them (a
VAE hash, tokenizer hashes, text_max_length or bucket that never reached a key would reuse stale entries).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pytest

from diffusion_pipe.config import from_dict
from diffusion_pipe.encode.encode import Sample, plan_samples
from diffusion_pipe.encode.keys import latent_key, text_key
from diffusion_pipe.encode.media import RESIZE_SPEC, frames_spec
from diffusion_pipe.models import load_adapter
from diffusion_pipe.models.flux import FluxAdapter
from diffusion_pipe.params import EncodeParams, ModelParams
from diffusion_pipe.weights import component_hash, tokenizer_hash

ROWS = [
    {"dataset": "shapes", "path": "a.png", "status": "ok", "media": "image", "content_hash": "1" * 32,
     "caption": "a red circle", "buckets": ["64x64x1", "80x48x1"], "split": "train", "repeats": 1},
    {"dataset": "shapes", "path": "b.png", "status": "ok", "media": "image", "content_hash": "2" * 32,
     "caption": "a blue square", "buckets": ["64x64x1"], "split": "eval", "repeats": 2},
    {"dataset": "shapes", "path": "c.png", "status": "excluded", "media": "image", "content_hash": "3" * 32,
     "caption": "corrupt", "buckets": [], "split": "train", "repeats": 1},
]


@pytest.fixture
def model_dir(tiny_flux_dir: Path, tmp_path: Path, store_env: Path) -> Path:
    """A private copy of the tiny Flux model, which a test may edit (the session's copy must stay as built)."""
    return Path(shutil.copytree(tiny_flux_dir, tmp_path / "model"))


def plan(model_dir: Path, dtype: str = "float32", rows: list[dict] | None = None,
         **encode: object) -> list[Sample]:
    model = from_dict(ModelParams, {"family": "flux", "path": str(model_dir), "dtype": dtype}, "model")
    params = from_dict(EncodeParams, {"text_max_length": 32, **encode}, "encode")
    return plan_samples(pa.Table.from_pylist(rows or ROWS), load_adapter(model), model, params)


def latent_keys(samples: list[Sample]) -> list[str]:
    return [s.latent_key for s in samples]


def text_keys(samples: list[Sample]) -> list[str]:
    return [s.text_key for s in samples]


def all_differ(a: list[str], b: list[str]) -> bool:
    return len(a) == len(b) and not set(a) & set(b)


def test_keys_are_made_from_the_model_files_and_params(model_dir: Path) -> None:
    samples = plan(model_dir, text_max_length=24)
    assert [s.sample_id for s in samples] == ["shapes/a.png@64x64x1", "shapes/a.png@80x48x1",
                                              "shapes/b.png@64x64x1"]  # excluded rows have no sample
    vae = component_hash(model_dir / "vae")
    encoders = {n: component_hash(model_dir / n) for n in ("text_encoder", "text_encoder_2")}
    tokenizers = {n: tokenizer_hash(model_dir / n) for n in ("tokenizer", "tokenizer_2")}
    for s in samples:
        assert s.latent_key == latent_key(content_hash=s.content_hash, bucket=s.bucket, resize=RESIZE_SPEC,
                                          frames=frames_spec("image", 1), vae_hash=vae, vae_dtype="float32")
        assert s.text_key == text_key(caption=s.caption, template="", encoder_hashes=encoders,
                                      tokenizer_hashes=tokenizers, max_length=24, dtype="float32")


def test_each_bucket_of_an_item_is_its_own_latent(model_dir: Path) -> None:
    a64, a80, b64 = plan(model_dir)
    assert a64.latent_key != a80.latent_key and a64.text_key == a80.text_key
    assert len({a64.latent_key, a80.latent_key, b64.latent_key}) == 3
    # a bucket change of one item (a new resolution) changes its latent and nothing else
    moved = [{**ROWS[0], "buckets": ["48x48x1", "80x48x1"]}, *ROWS[1:]]
    m48, m80, mb = plan(model_dir, rows=moved)
    assert m48.latent_key not in {a64.latent_key, a80.latent_key}
    assert (m80.latent_key, mb.latent_key) == (a80.latent_key, b64.latent_key)
    assert text_keys([m48, m80, mb]) == text_keys([a64, a80, b64])


def test_text_max_length_changes_every_text_key_and_no_latent(model_dir: Path) -> None:
    before, after = plan(model_dir, text_max_length=32), plan(model_dir, text_max_length=16)
    assert all_differ(sorted(set(text_keys(before))), sorted(set(text_keys(after))))
    assert latent_keys(before) == latent_keys(after)


@pytest.mark.parametrize("tokenizer", ["tokenizer", "tokenizer_2"])
def test_a_changed_tokenizer_changes_every_text_key_and_no_latent(model_dir: Path, tokenizer: str) -> None:
    from transformers import AutoTokenizer

    before = plan(model_dir)
    edited = AutoTokenizer.from_pretrained(model_dir / tokenizer)
    edited.add_tokens(["<shape>"])  # the same encoders, fed other token ids: other embeddings
    shutil.rmtree(model_dir / tokenizer)
    edited.save_pretrained(model_dir / tokenizer)
    after = plan(model_dir)
    assert all_differ(sorted(set(text_keys(before))), sorted(set(text_keys(after))))
    assert latent_keys(before) == latent_keys(after)


@pytest.mark.parametrize("component", ["vae", "text_encoder", "text_encoder_2"])
def test_other_weights_change_exactly_their_family(model_dir: Path, tmp_path: Path, component: str) -> None:
    before = plan(model_dir)
    other = tmp_path / "other"
    FluxAdapter.build_tiny(other, seed=1)  # the same configs, other random weights
    shutil.rmtree(model_dir / component)
    shutil.copytree(other / component, model_dir / component)
    after = plan(model_dir)
    changed, kept = (latent_keys, text_keys) if component == "vae" else (text_keys, latent_keys)
    assert all_differ(sorted(set(changed(before))), sorted(set(changed(after))))
    assert kept(before) == kept(after)


def test_dtype_changes_both_families_and_a_caption_one_text(model_dir: Path) -> None:
    base, bf16 = plan(model_dir), plan(model_dir, dtype="bfloat16")
    assert all_differ(latent_keys(base), latent_keys(bf16))
    assert all_differ(sorted(set(text_keys(base))), sorted(set(text_keys(bf16))))
    recaptioned = plan(model_dir, rows=[ROWS[0], {**ROWS[1], "caption": "a blue square."}, ROWS[2]])
    assert latent_keys(recaptioned) == latent_keys(base)
    assert text_keys(recaptioned)[:2] == text_keys(base)[:2] and text_keys(recaptioned)[2] != text_keys(base)[2]


def test_moving_the_model_directory_changes_no_key(model_dir: Path, tmp_path: Path) -> None:
    before = plan(model_dir)
    moved = Path(shutil.move(model_dir, tmp_path / "elsewhere"))
    after = plan(moved)
    assert latent_keys(before) == latent_keys(after) and text_keys(before) == text_keys(after)
