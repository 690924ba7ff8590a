"""`diffusion-pipe init`: one's own dataset (and model) into params.yaml and dvc.yaml in one step, comments kept,
nothing written when anything is wrong, and the scan stage then accepts it."""

from __future__ import annotations

import shutil
import sys

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from diffusion_pipe.cli import main
from tests.conftest import REPO, make_pipeline_repo, run_checked, run_env


@pytest.fixture
def repo_and_data(tmp_path):
    repo = make_pipeline_repo(tmp_path / "repo", tmp_path / "store", dvc=False)
    data = tmp_path / "my data"
    (data / "sub").mkdir(parents=True)
    for name in ("000_red_circle_on_white", "013_red_square_on_black"):
        for ext in (".png", ".txt"):
            shutil.copy(REPO / "examples/flux-tiny/data" / (name + ext), data / (name + ext))
    shutil.copy(REPO / "examples/flux-tiny/data/030_blue_triangle_on_white.png", data / "sub/uncaptioned.png")
    return repo, data


def init(repo, *args):
    return CliRunner().invoke(main, ["init", *map(str, args), "--repo", str(repo)])


def test_init_adds_dataset_to_params_and_dvc_yaml_and_scan_accepts_it(repo_and_data):
    repo, data = repo_and_data
    comment = "# One section per stage, plus `model`."
    assert comment in (repo / "params.yaml").read_text()
    result = init(repo, data, "--replace", "--resolution", "64", "--caption-policy", "skip")
    assert result.exit_code == 0, result.output
    assert "3 images, 0 videos, 1 without a caption" in result.output
    params, dvc = (repo / "params.yaml").read_text(), (repo / "dvc.yaml").read_text()
    assert comment in params and "resolutions: [64]" in params and "examples/flux-tiny/data\n" not in params
    assert data.resolve().as_posix() not in dvc  # not a dep: scan runs on every repro (dvc.yaml says why)
    run_checked([sys.executable, "-m", "stages.scan"], cwd=repo, env=run_env(repo / "store"))
    rows = pq.read_table(repo / "data/manifest.parquet").to_pylist()
    assert {r["path"] for r in rows} == {"000_red_circle_on_white.png", "013_red_square_on_black.png",
                                          "sub/uncaptioned.png"}
    assert [r["status"] for r in rows if r["path"] == "sub/uncaptioned.png"] == ["excluded"]


def test_init_writes_every_option_and_warns_naming_the_uncaptioned_files(repo_and_data):
    """With the default caption policy (error) the scan would stop on an uncaptioned file: init says which; each
    option lands in the dataset's entry as the scan reads it."""
    from diffusion_pipe.params import load_params

    repo, data = repo_and_data
    result = CliRunner().invoke(main, ["init", str(data), "--repo", str(repo), "--name", "cats", "--repeats", "3",
                                       "--resolution", "64", "--resolution", "128", "--eval-fraction", "0.25"])
    assert result.exit_code == 0, result.output
    assert "warning: the scan will stop on the uncaptioned files (sub/uncaptioned.png)" in result.output
    dataset = next(d for d in load_params(repo / "params.yaml").scan.datasets if d.name == "cats")
    assert (dataset.repeats, tuple(dataset.resolutions), dataset.eval_fraction, dataset.caption_policy) == (
        3, (64, 128), 0.25, "error")

    result = init(repo, data, "--replace", "--caption-policy", "default", "--default-caption", "a photo")
    assert result.exit_code == 0 and "warning" not in result.output, result.output
    dataset, = load_params(repo / "params.yaml").scan.datasets
    assert (dataset.caption_policy, dataset.default_caption) == ("default", "a photo")


def test_init_sets_a_local_model_as_a_dep_of_every_stage_that_reads_it(repo_and_data, tiny_flux_dir):
    repo, data = repo_and_data
    result = init(repo, data, "--model", tiny_flux_dir, "--family", "flux")
    assert result.exit_code == 0, result.output
    dvc = (repo / "dvc.yaml").read_text()
    assert dvc.count(f"- {tiny_flux_dir.resolve().as_posix()}\n") >= 3  # encode, train, export
    assert f"path: {tiny_flux_dir.resolve().as_posix()}" in (repo / "params.yaml").read_text()
    # appended beside the example's dataset, not in place of it
    assert "examples/flux-tiny/data" in (repo / "params.yaml").read_text()


@pytest.mark.parametrize("args,match", [
    (("{missing}",), "not a directory"),
    (("{data}", "--family", "nope", "--model", "some/model"), "unknown family 'nope'"),
    (("{data}", "--resolution", "-8"), "resolutions[0]: -8 is out of range [16, 16384]"),
    (("{empty}",), "no images or videos found"),
])
def test_init_refuses_bad_input_and_writes_nothing(repo_and_data, tmp_path, args, match):
    repo, data = repo_and_data
    (tmp_path / "empty").mkdir()
    before = {f: (repo / f).read_bytes() for f in ("params.yaml", "dvc.yaml")}
    paths = {"missing": tmp_path / "missing", "data": data, "empty": tmp_path / "empty"}
    result = init(repo, *(a.format(**paths) for a in args))
    assert result.exit_code != 0 and match in result.output, result.output
    assert {f: (repo / f).read_bytes() for f in before} == before


def test_init_twice_is_refused(repo_and_data):
    repo, data = repo_and_data
    assert init(repo, data).exit_code == 0
    result = init(repo, data)
    assert result.exit_code != 0 and "already listed" in result.output


def test_presets_are_found_by_their_own_family_and_the_largest_that_fits_is_chosen():
    from diffusion_pipe.config import ConfigError
    from diffusion_pipe.presets import choose_preset, family_presets

    flux = family_presets("flux")
    assert [(p.vram_gb, p.variant) for p in flux] == [(16, "fp8"), (24, ""), (24, "fp8"), (48, ""), (80, "")]
    assert all(p.path.parent.name == "flux-dev" for p in flux)
    assert choose_preset(flux, 25.8, "flux").path.name == "params-24gb.yaml"  # a "24 GB" card reports 25.8
    assert choose_preset(flux, 17.2, "flux").path.name == "params-16gb-fp8.yaml"
    assert choose_preset(flux, 47.9, "flux").path.name == "params-24gb.yaml"
    assert choose_preset(flux, 85.5, "flux").path.name == "params-80gb.yaml"
    assert "0.91 s/step" in choose_preset(flux, 17.2, "flux").header  # what it measured, for the user
    with pytest.raises(ConfigError, match=r"--vram: a 12 GB card is smaller than every flux preset \(16 GB, 24 GB"):
        choose_preset(flux, 12, "flux")
    with pytest.raises(ConfigError, match=r"--family sdxl: no GPU presets ship for it"):
        choose_preset(family_presets("sdxl"), 24, "sdxl")
    assert {p.vram_gb for p in family_presets("wan_i2v")} == {24, 80}


def test_init_with_a_family_writes_its_preset_for_the_card_comments_and_all(repo_and_data, tiny_flux_dir):
    from diffusion_pipe.params import load_params

    repo, data = repo_and_data
    result = init(repo, data, "--model", tiny_flux_dir, "--family", "flux", "--vram", "24")
    assert result.exit_code == 0, result.output
    assert "preset: flux-dev/params-24gb.yaml, for 24 GB cards (--vram: 24.0 GB)" in result.output
    assert "  Flux.1-dev LoRA for a GPU with 24 GB (proven by" in result.output
    params = load_params(repo / "params.yaml")
    assert (params.train.blocks_to_swap, params.train.compile, params.train.lora_rank) == (20, True, 32)
    assert params.model.path == str(tiny_flux_dir) and params.model.family == "flux"
    assert params.scan.datasets[-1].path == str(data)  # the user's dataset, not the preset's placeholder
    assert "# frozen weights of 20 blocks wait in CPU memory" in (repo / "params.yaml").read_text()
    none = init(repo_and_data[0], data, "--model", tiny_flux_dir, "--family", "flux", "--vram", "8", "--replace")
    assert none.exit_code != 0 and "smaller than every flux preset" in none.output


def test_init_family_needs_a_model(repo_and_data):
    repo, data = repo_and_data
    result = init(repo, data, "--family", "flux")
    assert result.exit_code == 2 and "--family goes with --model" in result.output
