"""`train.caption_dropout`: encode embeds the empty caption only when it is > 0; training batches take its
embedding with that probability, deterministically; a missing entry is an error naming the fix."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

from diffusion_pipe.config import ConfigError, from_dict
from diffusion_pipe.models import load_adapter
from diffusion_pipe.params import TrainParams, load_params
from diffusion_pipe.store import Store
from diffusion_pipe.train.caption_dropout import CaptionDropout, empty_caption_key
from diffusion_pipe.train.data import DataError, MicroBatches, read_rows
from tests.conftest import make_pipeline_repo, run_checked, run_env


@pytest.fixture(scope="module")
def encoded(tmp_path_factory):
    """The bundled example scanned and encoded with caption_dropout 0, then encoded again with 0.5: the repo,
    the store and both encode reports."""
    root = tmp_path_factory.mktemp("caption-dropout")
    store = root / "store"
    repo = make_pipeline_repo(root / "repo", store, None, dvc=False)  # the bundled params: caption_dropout 0.0
    reports = {}
    for stage in ("scan", "encode"):
        run_checked([sys.executable, "-m", f"stages.{stage}"], cwd=repo, env=run_env(store))
    reports[0.0] = json.loads((repo / "reports/encode.json").read_text())
    params = (repo / "params.yaml").read_text()
    (repo / "params.yaml").write_text(params.replace("caption_dropout: 0.0", "caption_dropout: 0.5"))
    run_checked([sys.executable, "-m", "stages.encode"], cwd=repo, env=run_env(store))
    reports[0.5] = json.loads((repo / "reports/encode.json").read_text())
    return repo, store, reports


def loader(repo, store: Store, rows, dropout: CaptionDropout | None) -> MicroBatches:
    train = load_params(repo / "params.yaml").train
    return MicroBatches(rows, store, load_adapter(load_params(repo / "params.yaml").model),
                        micro_batch_size=train.micro_batch_size, seed=train.seed, dp_rank=0, dp_world=1,
                        timestep_sampling=train.timestep_sampling, flow_shift=train.flow_shift,
                        guidance=train.guidance, caption_dropout=dropout)


def flat(batch) -> list[torch.Tensor]:
    """Every tensor of an (inputs, labels) micro-batch, in order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    return [t for part in batch for t in flat(part)]


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(flat(a), flat(b), strict=True))


@pytest.mark.slow  # the fixture scans and encodes twice: about 30 s on 2 shared cores
def test_encode_embeds_the_empty_caption_only_when_dropout_is_on(encoded, monkeypatch):
    repo, store_dir, reports = encoded
    off, on = reports[0.0]["text"], reports[0.5]["text"]
    assert on["entries"] == off["entries"] + 1 and on["computed"] == 1 and on["reused_local"] == off["entries"]
    monkeypatch.chdir(repo)
    params = load_params("params.yaml")
    key = empty_caption_key(load_adapter(params.model), params.model, params.encode.text_max_length)
    assert key not in {r.text_key for r in read_rows("data/encoded.parquet", "train")}  # not a row: an extra entry
    assert Store(store_dir).contains("text", key)


@pytest.mark.slow  # the fixture scans and encodes twice: about 30 s on 2 shared cores
def test_dropout_1_gives_every_sample_the_empty_caption(encoded, monkeypatch):
    """Dropout 1.0: each micro-batch is, tensor for tensor, the same samples captioned '' (same noise, same
    timesteps); dropout 0 makes no dropout object at all, so batches are the rows' own."""
    repo, store_dir, _ = encoded
    monkeypatch.chdir(repo)
    params = load_params("params.yaml")
    adapter, store = load_adapter(params.model), Store(store_dir)
    rows = read_rows("data/encoded.parquet", "train")
    empty = empty_caption_key(adapter, params.model, params.encode.text_max_length)
    create = lambda p: CaptionDropout.create(p, 0, adapter, params.model, params.encode.text_max_length, store)  # noqa: E731
    assert create(0.0) is None
    dropped = loader(repo, store, rows, create(1.0))
    uncaptioned = loader(repo, store, [dataclasses.replace(r, text_key=empty) for r in rows], None)
    own = loader(repo, store, rows, None)
    for position in range(4):
        assert same(dropped.at(position), uncaptioned.at(position))
        assert not same(dropped.at(position), own.at(position))
    # about half drop at 0.5, the same ones every time (a resumed run draws the same)
    half = create(0.5)
    keys = [r.text_key for r in rows]
    draws = [half.text_keys(0, p, keys) for p in range(20)]
    share = sum(k == empty for d in draws for k in d) / (20 * len(keys))
    assert 0.35 < share < 0.65
    assert draws == [create(0.5).text_keys(0, p, keys) for p in range(20)]
    assert len({tuple(d) for d in draws}) == 20  # each position draws anew
    assert half.text_keys(1, 0, keys) != draws[0]  # data-parallel ranks draw their own


@pytest.mark.slow  # the fixture scans and encodes twice: about 30 s on 2 shared cores
def test_a_missing_empty_caption_entry_names_the_fix(tmp_path, encoded, monkeypatch):
    repo, _, _ = encoded
    monkeypatch.chdir(repo)
    params = load_params("params.yaml")
    with pytest.raises(DataError, match=r"train.caption_dropout is 0.5, but the empty caption's text entry .* is not "
                                        r"in the store .* the encode stage embeds it when train.caption_dropout > 0: "
                                        r"run `dvc repro --force --single-item encode`"):
        CaptionDropout.create(0.5, 0, load_adapter(params.model), params.model, params.encode.text_max_length,
                              Store(tmp_path / "empty"))


def test_range():
    assert from_dict(TrainParams, {"caption_dropout": 1.0}, "train").caption_dropout == 1.0
    with pytest.raises(ConfigError, match=r"train.caption_dropout: 1.5 is out of range \[0, 1\]"):
        from_dict(TrainParams, {"caption_dropout": 1.5}, "train")
