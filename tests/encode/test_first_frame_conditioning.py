"""Image-to-video conditioning made by a family's rule (wan_i2v): each sample's condition latent is a store entry
of its own, keyed by what its bytes depend on (the clip's or the declared control image's bytes, the rule, the
target's frame count, the window's first frame, bucket, VAE), and encoded from exactly that first frame."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from diffusion_pipe.config import ConfigError, from_dict
from diffusion_pipe.example import make_moving_shapes_videos
from diffusion_pipe.encode.encode import latent_sources, plan_samples
from diffusion_pipe.encode.keys import latent_key
from diffusion_pipe.encode.media import RESIZE_SPEC, frames_spec, load_pixels_uint8, to_unit_range
from diffusion_pipe.models import adapter_class, load_adapter
from diffusion_pipe.models.wan_i2v import CONDITION_RULE, WanI2VAdapter
from diffusion_pipe.params import EncodeParams, ModelParams
from diffusion_pipe.store import Store
from diffusion_pipe.weights import component_hash
from tests.conftest import make_pipeline_repo
from tests.encode.helpers import stage_in_process

CLIP = {"dataset": "clips", "path": "a.mp4", "status": "ok", "media": "video", "content_hash": "1" * 32,
        "caption": "a square moving right", "buckets": ["32x32x5", "48x32x9"], "split": "train", "repeats": 1,
        "frame_starts": [0, 4], "frame_stride": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wan_i2v")
    WanI2VAdapter.build_tiny(out, seed=0)
    return out


def plan(model_dir: Path, rows: list[dict], family: str = "wan_i2v"):
    model = from_dict(ModelParams, {"family": family, "path": str(model_dir), "dtype": "float32"}, "model")
    params = from_dict(EncodeParams, {"text_max_length": 16}, "encode")
    return plan_samples(pa.Table.from_pylist(rows), load_adapter(model), model, params)


def test_each_window_is_conditioned_on_its_own_first_frame(model_dir: Path, store_env: Path) -> None:
    samples = plan(model_dir, [CLIP])
    vae = component_hash(model_dir / "vae")
    assert len(samples) == 4  # two buckets x two windows
    for s in samples:
        frames = int(s.bucket.rsplit("x", 1)[1])
        assert s.conditioning_keys == (latent_key(
            content_hash="1" * 32, bucket=s.bucket, resize=RESIZE_SPEC, vae_hash=vae, vae_dtype="float32",
            frames={"count": frames, "condition": CONDITION_RULE,
                    "first_frame": frames_spec("video", 1, s.frame_start)}),)
        assert s.conditioning_keys[0] != s.latent_key
    assert len({k for s in samples for k in s.conditioning_keys}) == 4
    # the stride picks the window's later frames, not its first: the condition keys stay, the latents change
    strided = plan(model_dir, [{**CLIP, "frame_stride": 2}])
    def by_window(plan_):
        return {(s.bucket, s.frame_start): s.conditioning_keys for s in plan_}

    assert by_window(strided) == by_window(samples)
    assert not {s.latent_key for s in strided} & {s.latent_key for s in samples}
    # the sources: the clip itself, each window's start, the rule's frame count
    sources = latent_sources(samples, {"clips": Path("/data")}, {})
    for s in samples:
        src = sources[s.conditioning_keys[0]]
        assert (src.path, src.media, src.frame_start, src.frame_stride) == (Path("/data/a.mp4"), "video",
                                                                            s.frame_start, 1)
        assert src.condition_frames == int(s.bucket.rsplit("x", 1)[1])
        assert sources[s.latent_key].condition_frames == 0


def test_a_declared_first_frame_keys_by_its_own_bytes(model_dir: Path, store_env: Path) -> None:
    rows = [{**CLIP, "control_paths": ["a.png"], "control_hashes": ["c" * 32]}]
    samples = plan(model_dir, rows)
    vae = component_hash(model_dir / "vae")
    for s in samples:
        frames = int(s.bucket.rsplit("x", 1)[1])
        assert s.conditioning_keys == (latent_key(
            content_hash="c" * 32, bucket=s.bucket, resize=RESIZE_SPEC, vae_hash=vae, vae_dtype="float32",
            frames={"count": frames, "condition": CONDITION_RULE, "first_frame": frames_spec("image", 1)}),)
    edited = plan(model_dir, [{**rows[0], "control_hashes": ["d" * 32]}])
    assert [s.latent_key for s in edited] == [s.latent_key for s in samples]
    assert all(a.conditioning_keys != b.conditioning_keys for a, b in zip(edited, samples))
    sources = latent_sources(samples, {"clips": Path("/data")}, {"clips": Path("/first")})
    assert {(sources[s.conditioning_keys[0]].path, sources[s.conditioning_keys[0]].media) for s in samples} == {
        (Path("/first/a.png"), "image")}


@pytest.mark.parametrize("family", ["wan_i2v", "cosmos2"])
def test_an_image_is_refused_with_the_dataset_named(family: str, tmp_path: Path, store_env: Path) -> None:
    """A family that trains on clips only (an image has no frames after its first to generate) refuses an image
    item, naming it, whether its condition is a latent of its own (wan_i2v) or the clip's first frame (cosmos2)."""
    adapter_class(family).build_tiny(tmp_path, seed=0)
    image = {**CLIP, "path": "b.png", "media": "image", "buckets": ["32x32x1"], "frame_starts": [0]}
    with pytest.raises(ConfigError, match=rf"clips/b\.png is an image, but model family '{family}' .*trains on clips"):
        plan(tmp_path, [CLIP, image], family)
    assert plan(tmp_path, [CLIP], family)


def test_a_video_is_refused_by_an_image_family(tmp_path: Path, store_env: Path) -> None:
    adapter_class("cosmos2_image").build_tiny(tmp_path, seed=0)
    image = {**CLIP, "path": "b.png", "media": "image", "buckets": ["32x32x1"], "frame_starts": [0]}
    with pytest.raises(ConfigError, match=r"clips/a\.mp4 is a video, but model family 'cosmos2_image' trains on "
                                          r"images"):
        plan(tmp_path, [image, CLIP], "cosmos2_image")
    assert plan(tmp_path, [image], "cosmos2_image")


def test_the_stored_condition_is_the_rule_over_the_windows_first_frame(tmp_path: Path) -> None:
    """Through the scan and encode stages on the bundled example: every sample's condition entry in the store is
    the VAE's latent of its window's first frame followed by black frames, and editing one clip recomputes its
    windows' latents and conditions and nothing else."""
    store = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store, dvc=False)
    shutil.copy(repo / "examples/wan_i2v-tiny/params.yaml", repo / "params.yaml")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(repo)
        stage_in_process("scan", store)
        stage_in_process("encode", store)
    table = pq.read_table(repo / "data/encoded.parquet").to_pylist()
    assert len(table) == 16 and {r["sample_id"].rsplit("#", 1)[-1] for r in table} >= {"4"}  # 8 clips x 2 windows
    model = from_dict(ModelParams, {"family": "wan_i2v", "path": str(repo / "examples/wan_i2v-tiny/model"),
                                    "dtype": "float32"}, "model")
    adapter = load_adapter(model)
    vae = adapter.load_vae(torch.device("cpu"))
    entries = Store(store)
    for row in table:
        start = int(row["sample_id"].split("#")[1]) if "#" in row["sample_id"] else 0
        first = to_unit_range(load_pixels_uint8(repo / "examples/wan_i2v-tiny/data" / row["path"], "video", 64, 64,
                                                1, start))[None]
        (want,) = adapter.encode_media(vae, adapter.conditioning_pixels(first, 5))
        (key,) = row["conditioning_latent_keys"]
        got = entries.get("latent", key)["latents"]
        torch.testing.assert_close(got, want["latents"], rtol=0, atol=1e-5)
        assert not torch.allclose(got, entries.get("latent", row["latent_key"])["latents"], atol=1e-3)
    # one clip re-encoded by another writer (other bytes): its two windows' latents and conditions, nothing else
    make_moving_shapes_videos(tmp_path / "other", frames=9, fps=4)
    shutil.copy(tmp_path / "other/v0_red.mp4", repo / "examples/wan_i2v-tiny/data/v0_red.mp4")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(repo)
        stage_in_process("scan", store)
        stage_in_process("encode", store)
    report = json.loads((repo / "reports/encode.json").read_text())
    assert (report["latent"]["computed"], report["latent"]["reused_local"]) == (4, 28)
    # 8 captions and the empty negative prompt (the sample prompts are two of the captions)
    assert (report["text"]["computed"], report["text"]["reused_local"]) == (0, 9)


def test_a_declared_first_frame_is_encoded_by_the_rule_and_replaces_the_clips_own(tmp_path: Path) -> None:
    """A dataset with `control`: each clip's condition is its control image (cover-cropped to the clip's bucket)
    followed by black frames through the VAE, not the clip's own first frame; a clip without one is an excluded
    row (missing_control), never trained without its first frame."""
    from PIL import Image

    store = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store, dvc=False)
    data = repo / "examples/wan_i2v-tiny/data"
    control = repo / "first-frames"
    control.mkdir()
    for i, clip in enumerate(sorted(data.glob("*.mp4"))[:-1]):  # the last clip has no declared first frame
        Image.new("RGB", (80, 64), (40 * i, 200, 255 - 30 * i)).save(control / f"{clip.stem}.png")
    params = (repo / "examples/wan_i2v-tiny/params.yaml").read_text()
    params = params.replace("      name: clips\n", "      name: clips\n      control: first-frames\n")
    (repo / "params.yaml").write_text(params)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(repo)
        stage_in_process("scan", store)
        stage_in_process("encode", store)
    manifest = {r["path"]: r for r in pq.read_table(repo / "data/manifest.parquet").to_pylist()}
    last = sorted(data.glob("*.mp4"))[-1].name
    assert manifest[last]["reason"] == "missing_control"
    table = pq.read_table(repo / "data/encoded.parquet").to_pylist()
    assert len(table) == 2 * 7 and last not in {r["path"] for r in table}
    model = from_dict(ModelParams, {"family": "wan_i2v", "path": str(repo / "examples/wan_i2v-tiny/model"),
                                    "dtype": "float32"}, "model")
    adapter = load_adapter(model)
    vae = adapter.load_vae(torch.device("cpu"))
    entries = Store(store)
    windows = {}
    for row in table:
        first = to_unit_range(load_pixels_uint8(control / (Path(row["path"]).stem + ".png"), "image", 64, 64, 1))
        (want,) = adapter.encode_media(vae, adapter.conditioning_pixels(first[None], 5))
        (key,) = row["conditioning_latent_keys"]
        torch.testing.assert_close(entries.get("latent", key)["latents"], want["latents"], rtol=0, atol=1e-5)
        windows.setdefault(row["path"], set()).add(key)
    assert all(len(keys) == 1 for keys in windows.values())  # both windows of a clip start from its one image


@pytest.mark.slow  # about 10 s here: three scan and encode runs of the wan21_i2v example
def test_wan21_i2v_text_entries_read_each_windows_first_frame(tmp_path: Path) -> None:
    """wan21_i2v's text entries are per (caption, window's first frame): the example's 16 windows of 8 captions
    are 16 entries, each holding Wan's UMT5 states of its caption and the CLIP embedding of its window's first
    frame as the adapter reads it; its two sample prompts and their negative prompts, each read with the prompt's
    first frame, are 4 more. An edited caption recomputes its clip's two entries and no latent; a re-encoded
    clip its windows' latents, conditions and entries, nothing else."""
    store = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store, dvc=False)
    shutil.copy(repo / "examples/wan21_i2v-tiny/params.yaml", repo / "params.yaml")
    data = repo / "examples/wan_i2v-tiny/data"

    def scan_and_encode() -> dict[str, tuple[int, int]]:
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(repo)
            stage_in_process("scan", store)
            stage_in_process("encode", store)
        report = json.loads((repo / "reports/encode.json").read_text())
        return {fam: (report[fam]["computed"], report[fam]["reused_local"]) for fam in ("latent", "text")}

    assert scan_and_encode() == {"latent": (32, 0), "text": (20, 0)}  # 16 windows and their 16 conditions
    table = pq.read_table(repo / "data/encoded.parquet").to_pylist()
    assert len(table) == 16 and len({r["text_key"] for r in table}) == 16
    model = from_dict(ModelParams, {"family": "wan21_i2v", "path": str(repo / "examples/wan21_i2v-tiny/model"),
                                    "dtype": "float32"}, "model")
    adapter = load_adapter(model)
    encoders = adapter.load_text_encoders(torch.device("cpu"))
    captions = {p.stem: p.read_text().strip() for p in data.glob("*.txt")}
    entries = Store(store)
    for row in table:
        start = int(row["sample_id"].split("#")[1]) if "#" in row["sample_id"] else 0
        first = to_unit_range(load_pixels_uint8(data / row["path"], "video", 64, 64, 1, start))[None]
        (want,) = adapter.encode_conditioned_text(encoders, [captions[Path(row["path"]).stem]], first, 512)
        got = entries.get("text", row["text_key"])
        torch.testing.assert_close(got["image_embeds"], want["image_embeds"], rtol=0, atol=1e-6)
        assert torch.equal(got["t5"], want["t5"])

    caption = data / "v0_red.txt"
    caption.write_text(caption.read_text().strip() + " slowly\n")
    assert scan_and_encode() == {"latent": (0, 32), "text": (2, 18)}
    make_moving_shapes_videos(tmp_path / "other", frames=9, fps=4)
    shutil.copy(tmp_path / "other/v1_green.mp4", data / "v1_green.mp4")
    assert scan_and_encode() == {"latent": (4, 28), "text": (2, 18)}


def test_wan21_i2v_drops_a_caption_to_the_empty_one_read_with_the_windows_first_frame(store_env: Path) -> None:
    """With caption dropout, each training window also names the empty caption read with its own first frame:
    the very entry a clip captioned "" would train on, encoded from the same frame; eval windows never drop."""
    from diffusion_pipe.encode.encode import LatentSource, TextSource, text_sources
    from tests.conftest import REPO

    model = from_dict(ModelParams, {"family": "wan21_i2v", "path": str(REPO / "examples/wan21_i2v-tiny/model"),
                                    "dtype": "float32"}, "model")
    params = from_dict(EncodeParams, {"text_max_length": 512}, "encode")
    adapter = load_adapter(model)

    def plan21(rows: list[dict], dropout: bool) -> list:
        return plan_samples(pa.Table.from_pylist(rows), adapter, model, params, caption_dropout=dropout)

    held_out = {**CLIP, "path": "b.mp4", "content_hash": "2" * 32, "split": "eval"}
    samples = plan21([CLIP, held_out], True)
    train = [s for s in samples if s.split == "train"]
    uncaptioned = {(s.bucket, s.frame_start): s.text_key for s in plan21([{**CLIP, "caption": ""}], False)}
    assert len(train) == 4 and len({s.empty_text_key for s in train}) == 4  # two buckets x two windows
    for s in train:
        assert s.empty_text_key == uncaptioned[(s.bucket, s.frame_start)] != s.text_key
    assert all(s.empty_text_key == "" for s in samples if s.split == "eval")
    assert all(s.empty_text_key == "" for s in plan21([CLIP, held_out], False))
    sources = text_sources(samples, {"clips": Path("/data")}, {}, True)
    for s in train:
        assert sources[s.empty_text_key] == TextSource("", LatentSource("", Path("/data/a.mp4"), "video", s.bucket,
                                                                        s.frame_start))
