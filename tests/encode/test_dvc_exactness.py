"""`dvc repro` on the bundled example recomputes exactly the stale entries, counted in reports/encode.json.

One repo walks through the edits in order (each step's counts depend on the store the previous steps left).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from diffusion_pipe.models.flux import FluxAdapter
from tests.conftest import make_pipeline_repo
from tests.encode.helpers import encode_counts, reproduce

CAPTION = "examples/flux-tiny/data/000_red_circle_on_white.txt"


def _counts(latent: tuple[int, int], text: tuple[int, int]) -> dict[str, dict[str, int]]:
    """Expected counts from (computed, reused_local) per family, with nothing fetched (no remote)."""
    return {fam: {"computed": c, "reused_local": r, "fetched_remote": 0}
            for fam, (c, r) in (("latent", latent), ("text", text))}


def _repo(tmp_path: Path) -> tuple[Path, Path]:
    store = tmp_path / "store"
    return make_pipeline_repo(tmp_path / "repo", store, {"workers: 0": "workers: 0\n  remote: ''"}), store


def test_caption_edit_and_revert(tmp_path: Path) -> None:
    repo, store = _repo(tmp_path)
    params, caption = repo / "params.yaml", repo / CAPTION

    assert reproduce(repo, store, "encode") == ["scan", "encode"]
    assert encode_counts(repo) == _counts((36, 0), (36, 0))

    # one caption edited: one text embedding, no latent
    original = caption.read_text()
    caption.write_text("a red circle on a snow-white background\n")
    assert reproduce(repo, store, "encode") == ["scan", "encode"]
    # (the old caption's entry is still wanted, reused: the example's first sample prompt is the same text)
    assert encode_counts(repo) == _counts((0, 36), (1, 36))

    # reverted: nothing computed, the old entry is still in the store (encode really runs: its dvc.yaml entry
    # keeps it out of DVC's run-cache, which would restore the table without looking at the store)
    packs = sorted(p.name for p in store.rglob("*.safetensors"))
    caption.write_text(original)
    assert reproduce(repo, store, "encode") == ["scan", "encode"]
    assert encode_counts(repo) == _counts((0, 36), (0, 36))
    assert sorted(p.name for p in store.rglob("*.safetensors")) == packs

    # the learning rate is not an input of encode: it does not run at all (scan runs on every repro, dvc.yaml
    # says why, and rewrites the same manifest)
    params.write_text(params.read_text().replace("learning_rate: 2.0e-3", "learning_rate: 1.0e-3"))
    assert reproduce(repo, store, "encode") == ["scan"]


@pytest.mark.slow  # about 60 s here: four encode runs
def test_resolution_and_vae_changes(tmp_path: Path) -> None:
    repo, store = _repo(tmp_path)
    params = repo / "params.yaml"
    assert reproduce(repo, store, "encode") == ["scan", "encode"]

    # a new resolution: every latent, no text
    params.write_text(params.read_text().replace("resolutions: [64]", "resolutions: [48]"))
    assert reproduce(repo, store, "encode") == ["scan", "encode"]
    assert encode_counts(repo) == _counts((36, 0), (0, 36))

    # reverted: nothing computed
    params.write_text(params.read_text().replace("resolutions: [48]", "resolutions: [64]"))
    assert reproduce(repo, store, "encode") == ["scan", "encode"]
    assert encode_counts(repo) == _counts((0, 36), (0, 36))

    # a VAE with different weights (same config): every latent, no text
    other = tmp_path / "other-model"
    FluxAdapter.build_tiny(other, seed=1)
    vae = repo / "examples/flux-tiny/model/vae"
    shutil.rmtree(vae)
    shutil.copytree(other / "vae", vae)
    assert reproduce(repo, store, "encode") == ["scan", "encode"]
    assert encode_counts(repo) == _counts((36, 0), (0, 36))


@pytest.mark.slow  # about 20 s: two encode runs
@pytest.mark.parametrize("edit", [{"batch_size: 8": "batch_size: 3"}])
def test_settings_that_do_not_change_bytes_keep_every_key(tmp_path: Path, edit: dict[str, str]) -> None:
    """encode.batch_size re-runs the stage (it is an encode param) but every entry is reused."""
    repo, store = _repo(tmp_path)
    reproduce(repo, store, "encode")
    before = (repo / "data/encoded.parquet").read_bytes()
    params = repo / "params.yaml"
    for old, new in edit.items():
        params.write_text(params.read_text().replace(old, new))
    assert reproduce(repo, store, "encode") == ["scan", "encode"]
    assert encode_counts(repo) == _counts((0, 36), (0, 36))
    assert (repo / "data/encoded.parquet").read_bytes() == before
