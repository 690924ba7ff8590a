"""Tag shuffling through the stages: encode embeds every tag order the manifest lists (an edited caption only
its own), train checks them before step 1 and trains each sample with one of its orders, drawn the same way on
a resumed run."""

from __future__ import annotations

import json
import sys

import pyarrow.parquet as pq
import pytest

from diffusion_pipe.models import load_adapter
from diffusion_pipe.params import load_params
from diffusion_pipe.store import Store
from diffusion_pipe.train.data import DataError, MicroBatches, check_entries, read_rows, training_text_keys
from tests.conftest import make_pipeline_repo, run_checked, run_env, run_stages

# The bundled captions read "a red circle on a white background": split at " on ", each has two orders.
SHUFFLE = {"eval_fraction: 0.15": "eval_fraction: 0.15\n      shuffle_tags: 4\n      tag_separator: ' on '"}


def _encode(repo, store) -> dict:
    run_stages(repo, store)
    return json.loads((repo / "reports/encode.json").read_text())


@pytest.fixture(scope="module")
def shuffled(tmp_path_factory):
    root = tmp_path_factory.mktemp("tag-shuffle")
    store = root / "store"
    repo = make_pipeline_repo(root / "repo", store, SHUFFLE, dvc=False)
    return repo, store, _encode(repo, store)


@pytest.mark.slow  # scans and encodes the bundled example (about 20 s on 2 shared cores)
def test_encode_embeds_each_order_once_and_an_edited_caption_only_its_own(shuffled):
    repo, store, report = shuffled
    manifest = pq.read_table(repo / "data/manifest.parquet").to_pylist()
    texts = {t for row in manifest if row["status"] == "ok" for t in [row["caption"], *row["caption_variants"]]}
    swapped = {" on ".join(reversed(row["caption"].split(" on "))) for row in manifest}
    assert texts - {row["caption"] for row in manifest} <= swapped and texts & swapped  # the other order is there
    assert report["text"]["entries"] == len(texts) and report["text"]["computed"] == len(texts)
    table = pq.read_table(repo / "data/encoded.parquet").to_pylist()
    assert all(row["text_variant_keys"] for row in table)

    caption = next((repo / "examples/flux-tiny/data").glob("*.txt"))
    caption.write_text("a violet star on a teal background")
    again = _encode(repo, store)
    # the new caption and its other order; no latent
    assert (again["text"]["computed"], again["latent"]["computed"]) == (2, 0)


@pytest.mark.slow
def test_training_batches_take_one_order_per_sample_and_resume_draws_the_same(shuffled, monkeypatch):
    repo, store_dir, _ = shuffled
    monkeypatch.chdir(repo)
    params = load_params("params.yaml")
    adapter, store = load_adapter(params.model), Store(store_dir)
    rows = read_rows("data/encoded.parquet", "train")
    check_entries(rows, store, adapter, params.encode.text_max_length)
    train = params.train
    loader = MicroBatches(rows, store, adapter, micro_batch_size=train.micro_batch_size, seed=train.seed,
                          dp_rank=0, dp_world=1, timestep_sampling=train.timestep_sampling,
                          flow_shift=train.flow_shift, guidance=train.guidance)
    drawn = []
    for position in range(40):
        picked = [rows[i] for i in loader.indices_at(position)]
        keys = training_text_keys(picked, train.seed, 0, position)
        assert all(k in row.variant_keys for k, row in zip(keys, picked))
        assert keys == training_text_keys(picked, train.seed, 0, position)  # resumed at this position: the same
        drawn += [(row.sample_id, k) for row, k in zip(picked, keys)]
        assert [t.tolist() for t in loader.at(position)[0]] == [t.tolist() for t in loader.make(
            loader.indices_at(position), _noise(train.seed, position), text_keys=keys)[0]]
    orders = {}
    for sample, key in drawn:
        orders.setdefault(sample, set()).add(key)
    assert any(len(keys) == 2 for keys in orders.values())  # a sample trains in both orders across steps

    missing = rows[0].__class__(**{**rows[0].__dict__, "variant_keys": (*rows[0].variant_keys, "0" * 32)})
    with pytest.raises(DataError, match=r"text entry 0{32} of sample .* is not in the store"):
        check_entries([missing], store, adapter, params.encode.text_max_length)


def _noise(seed: int, position: int):
    import torch

    from diffusion_pipe.hashing import hash_json

    return torch.Generator().manual_seed(int(hash_json(["noise", seed, 0, position])[:15], 16))


@pytest.mark.slow
def test_train_runs_on_shuffled_captions(shuffled):
    repo, store, _ = shuffled
    out = repo / "out"
    edits = (repo / "params.yaml").read_text().replace("steps: 120", "steps: 2").replace("eval_every_steps: 40",
                                                                                           "eval_every_steps: 0")
    (repo / "short.yaml").write_text(edits)
    run_checked([sys.executable, "-m", "stages.train", "--params", "short.yaml", "--out", str(out), "--report",
                 str(out / "r.json"), "--loss-plot", str(out / "loss.csv"), "--runs", str(out / "runs")],
                cwd=repo, env=run_env(store))
    assert json.loads((out / "r.json").read_text())["steps"] == 2
