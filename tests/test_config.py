"""params.yaml loading: strict keys with suggestions, typed values, YAML 1.2 numbers."""

import subprocess
import sys
from pathlib import Path

import pytest

from diffusion_pipe.config import ConfigError
from diffusion_pipe.params import load_params

BASE = "model: {path: some/model}\nscan:\n  datasets: [{path: data}]\n"


def raw(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(text)
    return path


def write(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(BASE + extra)
    return path


def test_repo_params_load():
    params = load_params(Path(__file__).parents[1] / "params.yaml")
    assert params.model.family == "flux"
    assert params.train.learning_rate == pytest.approx(2e-3)
    assert params.scan.datasets[0].name == "shapes"


def test_scientific_notation_is_a_number(tmp_path):
    params = load_params(write(tmp_path, "train: {learning_rate: 1e-4}\n"))
    assert params.train.learning_rate == 1e-4


def test_unknown_key_names_closest(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.lerning_rate: unknown key; did you mean 'learning_rate'"):
        load_params(write(tmp_path, "train: {lerning_rate: 1.0e-4}\n"))


def test_unknown_nested_key(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("model: {path: m}\nscan:\n  datasets: [{path: d, repeat: 2}]\n")
    with pytest.raises(ConfigError, match=r"scan\.datasets\[0\]\.repeat: unknown key; did you mean 'repeats'"):
        load_params(path)


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown section 'trian'; did you mean 'train'"):
        load_params(write(tmp_path, "trian: {steps: 3}\n"))


def test_wrong_type_names_key_value_and_type(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.steps: got 'ten', expected int"):
        load_params(write(tmp_path, "train: {steps: ten}\n"))
    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing: got 'yes please', expected bool"):
        load_params(write(tmp_path, "train: {activation_checkpointing: yes please}\n"))
    with pytest.raises(ConfigError, match=r"train\.steps: got 2\.5, expected int"):
        load_params(write(tmp_path, "train: {steps: 2.5}\n"))


def test_literal_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.lr_scheduler: got 'cosin', expected one of"):
        load_params(write(tmp_path, "train: {lr_scheduler: cosin}\n"))


def test_missing_section_and_required_key(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("scan:\n  datasets: [{path: d}]\n")
    with pytest.raises(ConfigError, match=r"section 'model' is missing"):
        load_params(path)
    path.write_text("model: {path: m}\nscan:\n  datasets: [{repeats: 2}]\n")
    with pytest.raises(ConfigError, match=r"scan\.datasets\[0\]\.path: required key is missing"):
        load_params(path)


def test_invalid_yaml_names_the_file_and_line(tmp_path):
    """A key written twice (easy when adding a param by hand) or broken syntax is a ConfigError naming the file
    and line, not a parser traceback."""
    with pytest.raises(ConfigError, match=r"params.yaml: not valid YAML \(line 3, column 3\): found duplicate key "
                                          r"\"seed\""):
        load_params(raw(tmp_path, "train:\n  seed: 0\n  seed: 1\n"))
    with pytest.raises(ConfigError, match=r"params.yaml: not valid YAML \(line \d+, column \d+\): expected"):
        load_params(raw(tmp_path, "train:\n  seed: [0\n"))


def test_value_validation_names_param(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.pipeline_stages: 0 is out of range \[1, inf\)"):
        load_params(write(tmp_path, "train: {pipeline_stages: 0}\n"))


def test_params_are_frozen(tmp_path):
    params = load_params(write(tmp_path, ""))
    with pytest.raises(AttributeError):
        params.train.steps = 5  # type: ignore[misc]


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "examples").rglob("params*.yaml")),
                         ids=lambda p: p.parent.name + "/" + p.name)
def test_shipped_example_params_load(path):
    params = load_params(path)
    assert params.scan.datasets


@pytest.mark.parametrize("example", ["auraflow-tiny", "chroma-tiny", "flux-tiny", "flux2-tiny", "flux2_klein-tiny",
                                     "ltx-tiny", "lumina2-tiny", "qwenimage-tiny", "sd3-tiny", "sdxl-tiny", "wan-tiny",
                                     "zimage-tiny", "hunyuan_video-tiny", "hunyuan_video15-tiny",
                                     "flux_kontext-tiny", "concept-tiny", "concept-sdxl-tiny", "concept-wan-tiny",
                                     "wan_ti2v-tiny", "wan_i2v-tiny", "skyreels_v2-tiny", "krea2-tiny", "ernie_image-tiny",
                                     "hunyuan_image-tiny", "hidream-tiny", "qwenimage_edit-tiny", "wan21_i2v-tiny",
                                     "kandinsky5-tiny", "kandinsky5_image-tiny",
                                     "ltx2-tiny", "ideogram4-tiny", "qwenimage21-tiny", "cosmos2-tiny",
                                     "cosmos2_image-tiny", "minimax_h3-tiny"])
def test_each_bundled_example_runs_by_copying_its_params(example):
    """Switching examples is a params-only change: every path an example's params point at is a dep of the
    stages that read it in the repository's dvc.yaml."""
    from diffusion_pipe.cli_support import _PARAM_PATHS, stage_param_paths
    from diffusion_pipe.dvcfile import require_deps

    root = Path(__file__).parents[1]
    params = load_params(root / "examples" / example / "params.yaml") if example != "flux-tiny" else \
        load_params(root / "params.yaml")
    for stage in _PARAM_PATHS:
        for param, paths in stage_param_paths(stage, params):
            require_deps(root / "dvc.yaml", stage, paths, param)


def _dvc_yaml_params(dvc_yaml: Path) -> set[str]:
    """The params.yaml keys that dvc.yaml's stages list under `params:` (dotted), whole-file entries left out."""
    import yaml

    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    return {p for stage in stages.values() for p in stage.get("params", []) if isinstance(p, str)}


def _has_key(doc: dict, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(doc, dict) or part not in doc:
            return False
        doc = doc[part]
    return True


@pytest.mark.parametrize("path", [Path(__file__).parents[1] / "params.yaml",
                                  *sorted((Path(__file__).parents[1] / "examples").rglob("params*.yaml"))],
                         ids=lambda p: p.parent.name + "/" + p.name)
def test_shipped_params_hold_every_key_dvc_yaml_reads(path):
    """DVC refuses to run a stage whose `params:` key is missing from params.yaml ("Parameters '...' are missing"),
    even where our own loader has a default: the bundled params.yaml and every example a README tells users to
    copy must hold each key dvc.yaml lists (a new param read by a stage goes into all of them)."""
    import yaml

    keys = _dvc_yaml_params(Path(__file__).parents[1] / "dvc.yaml")
    assert "train.caption_dropout" in keys and "scan.datasets" in keys  # the check reads dvc.yaml's real list
    doc = yaml.safe_load(path.read_text())
    missing = sorted(k for k in keys if not _has_key(doc, k))
    assert not missing, f"{path} lacks {missing}, which dvc.yaml's stages read: dvc repro would fail on it"


def test_single_files_must_be_deps_of_the_stages_reading_them(tmp_path):
    """A local single file (model.vae here) is a dep of encode, which reads it, named by its param."""
    import dataclasses

    from diffusion_pipe.cli_support import stage_param_paths
    from diffusion_pipe.dvcfile import require_deps

    (tmp_path / "model").mkdir()
    (tmp_path / "ae.safetensors").write_bytes(b"")
    (tmp_path / "dvc.yaml").write_text("stages:\n  encode:\n    cmd: x\n    deps: [model]\n"
                                       "  train:\n    cmd: x\n    deps: [model]\n")
    params = load_params(Path(__file__).parents[1] / "params.yaml")
    params = dataclasses.replace(params, model=dataclasses.replace(params.model, path="model",
                                                                   vae=str(tmp_path / "ae.safetensors")))
    for param, paths in stage_param_paths("train", params):  # train does not read the VAE
        require_deps(tmp_path / "dvc.yaml", "train", paths, param)
    with pytest.raises(ConfigError, match=r"model.vae: .*ae.safetensors is not a dependency of stage 'encode'"):
        for param, paths in stage_param_paths("encode", params):
            require_deps(tmp_path / "dvc.yaml", "encode", paths, param)


def test_dataset_manifest_name_is_one_rule_for_scan_and_encode(tmp_path, monkeypatch):
    from diffusion_pipe.params import DatasetParams

    assert DatasetParams(path="data/photos/").manifest_name == "photos"
    assert DatasetParams(path="x", name="mine").manifest_name == "mine"
    (tmp_path / "shoot").mkdir()
    monkeypatch.chdir(tmp_path / "shoot")
    assert DatasetParams(path=".").manifest_name == "shoot"  # the directory's own name, never ""


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_gpu_names_the_param():
    from diffusion_pipe.models.common import resolve_device

    assert resolve_device("auto", "train.device").type == "cpu"
    with pytest.raises(ConfigError, match=r"train.device: 'cuda' asked for but no CUDA GPU is visible"):
        resolve_device("cuda", "train.device")


def test_changed_params_names_each_differing_leaf_under_the_selected_keys():
    from diffusion_pipe.config import changed_params

    old = {"train": {"lr": 0.002, "steps": 10, "samples": {"prompts": [{"text": "a"}]}}, "scan": {"workers": 1}}
    new = {"train": {"lr": 0.001, "steps": 10, "samples": {"prompts": [{"text": "b"}]}}, "scan": {"workers": 2}}
    assert changed_params(old, new, ["train"]) == ["train.lr: 0.002 -> 0.001",
                                                   "train.samples.prompts[0].text: 'a' -> 'b'"]
    assert changed_params(old, new, ["train.steps", "model"]) == []
    assert changed_params(old, new, ["scan.workers"]) == ["scan.workers: 1 -> 2"]


STAGE_SCRIPT = """
from pathlib import Path
from diffusion_pipe.cli_support import stage_command

@stage_command("train")
def command(params):
    p = Path("params.yaml")  # the user's edit, made while the stage runs
    p.write_text(p.read_text().replace("learning_rate: 0.002", "learning_rate: 0.001"))
    Path("out.txt").write_text(str(params.train.learning_rate))

command()
"""


def test_a_stage_whose_params_were_edited_while_it_ran_fails_and_dvc_records_nothing(tmp_path):
    """DVC writes dvc.lock from params.yaml as it stands when a stage ends: a stage must not end successfully
    when a param it read changed meanwhile, or dvc.lock (and every lineage after it) names params the outputs
    were not made with, and `dvc repro` would never redo them."""
    from tests.conftest import run_env

    (tmp_path / "stage.py").write_text(STAGE_SCRIPT)
    (tmp_path / "params.yaml").write_text(
        "model:\n  family: flux\n  path: model\nscan:\n  datasets:\n    - path: items\n"
        "train:\n  learning_rate: 0.002\n")
    (tmp_path / "dvc.yaml").write_text("stages:\n  train:\n    cmd: python stage.py\n    params: [train]\n"
                                       "    outs: [out.txt]\n")
    env = {**run_env(tmp_path / "store"), "PYTHONPATH": str(Path(__file__).parents[1])}
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q", "--no-scm"], cwd=tmp_path, env=env, check=True)
    out = subprocess.run([sys.executable, "-m", "dvc", "repro", "-q"], cwd=tmp_path, env=env, capture_output=True,
                         text=True)
    assert out.returncode != 0
    assert ("params.yaml was edited while stage 'train' ran (train.learning_rate: 0.002 -> 0.001)"
            in out.stdout + out.stderr), out.stderr
    assert "dvc commit train" in out.stderr
    assert not (tmp_path / "dvc.lock").exists()  # nothing recorded: the next `dvc repro` trains again
    assert (tmp_path / "out.txt").read_text() == "0.002"  # the work itself is kept


def test_stage_params_reads_keys_and_the_whole_file_form(tmp_path):
    from diffusion_pipe.config import changed_params
    from diffusion_pipe.dvcfile import stage_params

    (tmp_path / "dvc.yaml").write_text("stages:\n  train:\n    cmd: x\n    params: [model, train.steps]\n"
                                       "  export:\n    cmd: x\n    params:\n      - params.yaml:\n"
                                       "  other:\n    cmd: x\n    params:\n      - other.yaml: [a]\n")
    assert stage_params(tmp_path / "dvc.yaml", "train") == ["model", "train.steps"]
    assert stage_params(tmp_path / "dvc.yaml", "export") == [""]
    assert stage_params(tmp_path / "dvc.yaml", "other") == []
    assert stage_params(tmp_path / "missing.yaml", "train") is None
    assert changed_params({"scan": {"workers": 1}}, {"scan": {"workers": 2}}, [""]) == ["scan.workers: 1 -> 2"]
