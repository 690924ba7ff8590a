"""`train.caption_dropout`: encode embeds the empty caption only when it is > 0; training batches take its
embedding with that probability, deterministically; a missing entry is an error naming the fix. A family whose
text encoder reads the sample's image (qwenimage_edit here) drops each sample to the empty caption read with that
sample's image: an entry per image, named in the encoded table."""

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
from tests.conftest import make_pipeline_repo, run_checked, run_env, run_stages


@pytest.fixture(scope="module")
def encoded(tmp_path_factory):
    """The bundled example scanned and encoded with caption_dropout 0, then encoded again with 0.5: the repo,
    the store and both encode reports."""
    root = tmp_path_factory.mktemp("caption-dropout")
    store = root / "store"
    repo = make_pipeline_repo(root / "repo", store, None, dvc=False)  # the bundled params: caption_dropout 0.0
    reports = {}
    run_stages(repo, store)
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


def dropout(probability: float, store: Store, rows) -> CaptionDropout | None:
    """The CaptionDropout train makes for `rows` under the working directory's params.yaml (seed 0)."""
    params = load_params("params.yaml")
    return CaptionDropout.create(probability, 0, load_adapter(params.model), params.model,
                                 params.encode.text_max_length, store, rows)


def assert_dropout_1_gives(repo, store: Store, rows, empty_keys: list[str]) -> None:
    """At dropout 1.0 each micro-batch is, tensor for tensor, the same samples captioned by `empty_keys` (same
    noise, same timesteps), and not the rows' own."""
    dropped = loader(repo, store, rows, dropout(1.0, store, rows))
    uncaptioned = loader(repo, store, [dataclasses.replace(r, text_key=k) for r, k in zip(rows, empty_keys)], None)
    own = loader(repo, store, rows, None)
    for position in range(4):
        assert same(dropped.at(position), uncaptioned.at(position))
        assert not same(dropped.at(position), own.at(position))


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
    assert dropout(0.0, store, rows) is None
    assert_dropout_1_gives(repo, store, rows, [empty] * len(rows))
    # about half drop at 0.5, the same ones every time (a resumed run draws the same)
    half = dropout(0.5, store, rows)
    keys = [r.text_key for r in rows]
    own = [""] * len(keys)  # this family's samples have no empty caption of their own: they share one
    draws = [half.text_keys(0, p, keys, own) for p in range(20)]
    share = sum(k == empty for d in draws for k in d) / (20 * len(keys))
    assert 0.35 < share < 0.65
    assert draws == [dropout(0.5, store, rows).text_keys(0, p, keys, own) for p in range(20)]
    assert len({tuple(d) for d in draws}) == 20  # each position draws anew
    assert half.text_keys(1, 0, keys, own) != draws[0]  # data-parallel ranks draw their own


@pytest.mark.slow  # the fixture scans and encodes twice: about 30 s on 2 shared cores
def test_a_missing_empty_caption_entry_names_the_fix(tmp_path, encoded, monkeypatch):
    repo, _, _ = encoded
    monkeypatch.chdir(repo)
    with pytest.raises(DataError, match=r"train.caption_dropout is 0.5, but the empty caption's text entry .* is not "
                                        r"in the store .* the encode stage embeds it when train.caption_dropout > 0: "
                                        r"run `dvc repro --force --single-item encode`"):
        dropout(0.5, Store(tmp_path / "empty"), read_rows("data/encoded.parquet", "train"))


def test_range():
    assert from_dict(TrainParams, {"caption_dropout": 1.0}, "train").caption_dropout == 1.0
    with pytest.raises(ConfigError, match=r"train.caption_dropout: 1.5 is out of range \[0, 1\]"):
        from_dict(TrainParams, {"caption_dropout": 1.5}, "train")


EDIT_EXAMPLE = "examples/qwenimage_edit-tiny/params.yaml"


@pytest.fixture(scope="module")
def edit_encoded(tmp_path_factory):
    """The qwenimage_edit example scanned and encoded with caption_dropout 0, then 0.5: the repo, the store, both
    reports, both encoded tables' train rows and the text keys in the store after the first."""
    from tests.conftest import REPO

    root = tmp_path_factory.mktemp("caption-dropout-edit")
    store = root / "store"
    repo = make_pipeline_repo(root / "repo", store, None, dvc=False)
    (repo / "params.yaml").write_text((REPO / EDIT_EXAMPLE).read_text())
    reports, rows = {}, {}
    for dropout, stages in ((0.0, ("scan", "encode")), (0.5, ("encode",))):
        params = (repo / "params.yaml").read_text()
        (repo / "params.yaml").write_text(params.replace("caption_dropout: 0.0", f"caption_dropout: {dropout}"))
        for stage in stages:
            run_checked([sys.executable, "-m", f"stages.{stage}"], cwd=repo, env=run_env(store))
        reports[dropout] = json.loads((repo / "reports/encode.json").read_text())
        rows[dropout] = read_rows(repo / "data/encoded.parquet", "train")
        if not dropout:
            before = {k for sidecar in Store(store).packs("text").values() for k in sidecar.entries}
    return repo, store, reports, rows, before


@pytest.mark.slow  # the fixture scans and encodes the edit example twice: about 40 s on 2 shared cores
def test_an_edit_family_embeds_the_empty_caption_read_with_each_samples_image(edit_encoded, monkeypatch):
    import pyarrow.parquet as pq

    from diffusion_pipe.bucket_labels import parse_bucket
    from diffusion_pipe.encode.encode import sample_text_keys
    from diffusion_pipe.sample.render import SampleText

    repo, store_dir, reports, rows, before = edit_encoded
    monkeypatch.chdir(repo)
    params = load_params("params.yaml")
    adapter, store = load_adapter(params.model), Store(store_dir)
    assert all(r.empty_text_key == "" for r in rows[0.0])  # dropout 0: no such column, the table as before
    assert all(r.empty_text_key and r.empty_text_key != r.text_key for r in rows[0.5])
    # the train rows' control images, each read with the empty caption as a sample prompt's text would be
    manifest = {r["path"]: r for r in pq.read_table("data/manifest.parquet").to_pylist()}
    control_dir = params.scan.datasets[0].control
    controls = [manifest[r.sample_id.split("/", 1)[1].split("@")[0]]["control_paths"][0] for r in rows[0.5]]
    expected = sample_text_keys(adapter, params.model, params.encode.text_max_length, tuple(
        SampleText("", f"{control_dir}/{c}", *parse_bucket(r.bucket)[:2]) for c, r in zip(controls, rows[0.5])))
    assert [r.empty_text_key for r in rows[0.5]] == list(expected.values())
    # exactly those entries were computed, once per distinct image (but for the sample prompts' empty negative
    # prompts read with their control images, which are the same entries); the rest reused; no image-less one
    distinct = {r.empty_text_key for r in rows[0.5]}
    off, on = reports[0.0]["text"], reports[0.5]["text"]
    assert on["computed"] == len(distinct - before) > 1 and distinct & before
    assert on["reused_local"] == off["entries"] and on["entries"] == off["entries"] + on["computed"]
    assert not store.contains("text", empty_caption_key(adapter, params.model, params.encode.text_max_length))
    # the image is read: two samples' empty captions differ
    a, b = sorted(distinct)[:2]
    assert not all(torch.equal(x, y) for x, y in zip(store.get("text", a).values(), store.get("text", b).values()))


@pytest.mark.slow  # the fixture scans and encodes the edit example twice: about 40 s on 2 shared cores
def test_an_edit_family_drops_each_sample_to_its_own_empty_caption(edit_encoded, monkeypatch):
    repo, store_dir, _, rows, _ = edit_encoded
    monkeypatch.chdir(repo)
    store = Store(store_dir)
    assert_dropout_1_gives(repo, store, rows[0.5], [r.empty_text_key for r in rows[0.5]])
    # a table encoded without dropout has no such entries: an error naming the fix, before step 1
    with pytest.raises(DataError, match=r"train.caption_dropout is 0.5, but sample .* has no empty-caption entry "
                                        r"read with its image; the encode stage embeds them when "
                                        r"train.caption_dropout > 0: run `dvc repro --force --single-item encode`"):
        dropout(0.5, store, rows[0.0])
