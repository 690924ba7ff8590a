"""scan.datasets[].frame_extraction: which frames of a longer clip train. `windows` makes several samples of one
clip (a latent each, the first window keeping the key it had), `whole` spans the clip at a lower frame rate;
every window of a clip shares its split. Pure window arithmetic, then the stages on the ltx example's clips."""

import json
import sys

import pyarrow.parquet as pq
import pytest

from diffusion_pipe.scan.buckets import frame_windows
from tests.conftest import make_pipeline_repo, run_checked, run_env


@pytest.mark.parametrize("args, want", [
    ((10, 5, "first"), ((0,), 1)),
    ((10, 5, "windows"), ((0, 5), 1)),  # as many back-to-back windows as fit
    ((12, 5, "windows"), ((0, 5), 1)),  # the rest (frames 10, 11) is left out
    ((10, 5, "windows", 3), ((0, 2, 5), 1)),  # 3 windows spread evenly: they overlap
    ((5, 5, "windows", 3), ((0,), 1)),  # a clip as long as its bucket has one window
    ((10, 5, "whole"), ((0,), 2)),  # frames 0, 2, 4, 6, 8
    ((33, 9, "whole"), ((0,), 4)),  # frames 0, 4, .., 32
    ((10, 1, "windows"), ((0,), 1)),  # a one-frame bucket is a still from the start
])
def test_window_starts_and_stride(args, want):
    starts, stride = frame_windows(*args)
    assert (starts, stride) == want
    num_frames, frames = args[0], args[1]
    assert all(start + (frames - 1) * stride < num_frames for start in starts)  # every frame is in the clip


def _run(repo, store, stage):
    run_checked([sys.executable, "-m", f"stages.{stage}"], cwd=repo, env=run_env(store))
    return json.loads((repo / f"reports/{stage}.json").read_text())


@pytest.mark.slow
def test_windows_are_samples_of_their_own_and_the_first_keeps_its_key(tmp_path):
    """The ltx example's 4 clips of 10 frames at 5-frame buckets: `windows` gives each 2 samples (frames 0-4 and
    5-9) in its own split, the second window's latents are the only new ones after `first`, and `whole` (every
    2nd frame) is a new latent per clip again; images are untouched throughout."""
    store = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store, dvc=False)
    example = (repo / "examples/wan_ti2v-tiny/params.yaml").read_text()
    (repo / "params.yaml").write_text(example)
    _run(repo, store, "scan")
    first = _run(repo, store, "encode")["latent"]

    params = example.replace("      frames: [5]", "      frames: [5]\n      frame_extraction: windows")
    assert params != example
    (repo / "params.yaml").write_text(params)
    assert _run(repo, store, "scan")["video_windows"] == 8
    manifest = pq.read_table(repo / "data/manifest.parquet").to_pylist()
    clips = [r for r in manifest if r["media"] == "video"]
    assert len(clips) == 4 and all(r["frame_starts"] == [0, 5] and r["frame_stride"] == 1 for r in clips)
    assert all(r["frame_starts"] == [0] for r in manifest if r["media"] == "image")
    windows = _run(repo, store, "encode")
    assert windows["latent"]["computed"] == 4 and windows["latent"]["reused_local"] == first["entries"]
    assert windows["samples"] == first["entries"] + 4
    table = pq.read_table(repo / "data/encoded.parquet").to_pylist()
    by_clip = {}
    for row in table:
        by_clip.setdefault(row["path"], []).append(row)
    for clip in clips:
        rows = by_clip[clip["path"]]
        assert len(rows) == 2 and len({r["latent_key"] for r in rows}) == 2
        assert len({r["split"] for r in rows}) == 1  # a clip's windows never straddle train and eval

    (repo / "params.yaml").write_text(params.replace("frame_extraction: windows", "frame_extraction: whole"))
    _run(repo, store, "scan")
    assert all(r["frame_stride"] == 2 for r in pq.read_table(repo / "data/manifest.parquet").to_pylist()
               if r["media"] == "video")
    assert _run(repo, store, "encode")["latent"]["computed"] == 4
