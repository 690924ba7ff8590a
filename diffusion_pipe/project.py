"""`diffusion-pipe init`: put one's own dataset (and model) into params.yaml and dvc.yaml in one step.

A dataset directory must be an entry of `scan.datasets` in params.yaml (it is not a dep in dvc.yaml: the scan stage
runs on every repro and notices changes itself, see dvc.yaml); a local model directory must be a dep of every stage
that reads it. Editing two files by hand for that is where new users trip, so this does both, keeping every comment
and key order of the two files (ruamel's round-trip mode), and writes neither unless both edits are valid.
"""

from __future__ import annotations

import io
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from diffusion_pipe.config import ConfigError
from diffusion_pipe.fileio import write_bytes_atomic
from diffusion_pipe.presets import Preset, apply_preset

# Stages that read the model's weights: a local model directory is a dep of each that dvc.yaml has.
MODEL_STAGES = ("encode", "train", "export", "sample")


@dataclass(frozen=True)
class DatasetSurvey:
    """What a first look at a dataset directory finds: media files, and those without a `.txt` caption."""

    images: int
    videos: int
    uncaptioned: tuple[str, ...]


def survey_dataset(directory: Path) -> DatasetSurvey:
    """Count the media files under `directory` (recursively) and list those without a caption file."""
    from diffusion_pipe.scan.media import IMAGE_EXTS, VIDEO_EXTS

    images = videos = 0
    uncaptioned = []
    for path in sorted(directory.rglob("*")):
        ext = path.suffix.lower()
        if not path.is_file() or ext not in (*IMAGE_EXTS, *VIDEO_EXTS):
            continue
        if ext in VIDEO_EXTS:
            videos += 1
        else:
            images += 1
        if not path.with_suffix(".txt").is_file():
            uncaptioned.append(path.relative_to(directory).as_posix())
    return DatasetSurvey(images, videos, tuple(uncaptioned))


def repo_relative(path: Path, repo: Path) -> str:
    """`path` as written into params.yaml and dvc.yaml: relative to the repo (POSIX) when inside it, else
    absolute."""
    resolved, root = path.resolve(), repo.resolve()
    try:
        return resolved.relative_to(root).as_posix()
    except ValueError:
        return resolved.as_posix()


def _covered(deps: list[str], path: str) -> bool:
    parts = PurePosixPath(path).parts
    return any(parts[:len(PurePosixPath(d).parts)] == PurePosixPath(d).parts for d in map(str, deps))


def _add_dep(stage: dict, path: str) -> bool:
    deps = stage.setdefault("deps", [])
    if _covered(deps, path):
        return False
    deps.insert(next((i for i, d in enumerate(deps) if str(d).startswith(("stages/", "diffusion_pipe"))),
                     len(deps)), path)
    return True


def _flow(value: Any) -> Any:
    """Lists written inline (`resolutions: [1024]`), as the shipped params write them."""
    if not isinstance(value, list):
        return value
    from ruamel.yaml.comments import CommentedSeq

    seq = CommentedSeq(value)
    seq.fa.set_flow_style()
    return seq


def add_dataset(params: dict, dvc: dict, dataset_path: str, entry: dict[str, Any], replace: bool) -> list[str]:
    """Add `entry` (with `path: dataset_path`) to params' scan.datasets (in place of the existing ones with
    `replace`), edited in place; `dvc` is only checked to have a scan stage (datasets are not deps: DVC fails
    hashing a directory with a dangling symlink before the scan could report it). Returns what was changed, for
    the user; a ConfigError when the dataset is already listed."""
    scan = params.setdefault("scan", {})
    datasets = scan.setdefault("datasets", [])
    if not replace and any(str(d.get("path")) == dataset_path for d in datasets):
        raise ConfigError(f"scan.datasets: {dataset_path} is already listed in params.yaml; edit its entry there")
    if replace:
        del datasets[:]
    datasets.append({"path": dataset_path, **{k: _flow(v) for k, v in entry.items()}})
    changes = [f"params.yaml: scan.datasets {'is now' if replace else '+='} {dataset_path}"]
    if "scan" not in dvc.get("stages", {}):
        raise ConfigError("dvc.yaml has no stage 'scan'; run `diffusion-pipe init` in a diffusion-pipe repository")
    return changes


def set_model(params: dict, dvc: dict, model_path: str, family: str | None, local: bool) -> list[str]:
    """Point model.path (and model.family) at a model; a local directory also becomes a dep of every stage that
    reads the model."""
    model = params.setdefault("model", {})
    model["path"] = model_path
    changes = [f"params.yaml: model.path = {model_path}"]
    if family:
        from diffusion_pipe.models import adapter_class

        adapter_class(family)  # an unknown family is an error naming the known ones
        model["family"] = family
        changes.append(f"params.yaml: model.family = {family}")
    if local:
        for name in MODEL_STAGES:
            stage = dvc.get("stages", {}).get(name)
            if stage is not None and _add_dep(stage, model_path):
                changes.append(f"dvc.yaml: stages.{name}.deps += {model_path}")
    return changes


def init_project(repo: Path, dataset: Path, entry: dict[str, Any], replace: bool = False,
                 model: str | None = None, family: str | None = None,
                 preset: Preset | None = None) -> tuple[list[str], DatasetSurvey]:
    """Edit `repo`'s params.yaml and dvc.yaml for `dataset` (and `model`, and a GPU `preset`'s sections), keeping
    their comments; returns the changes made and a survey of the dataset. Nothing is written when anything is
    wrong."""
    from ruamel.yaml import YAML

    if not dataset.is_dir():
        raise ConfigError(f"{dataset}: not a directory; give the directory holding your images/videos and their "
                          ".txt captions")
    params_file, dvc_file = repo / "params.yaml", repo / "dvc.yaml"
    for f in (params_file, dvc_file):
        if not f.is_file():
            raise ConfigError(f"{f}: not found; run `diffusion-pipe init` at the root of a diffusion-pipe "
                              "repository (where params.yaml and dvc.yaml are)")
    yaml = YAML()  # round-trip: comments, order and quoting survive
    yaml.width = 4096
    yaml.preserve_quotes = True
    yaml.indent(mapping=2, sequence=4, offset=2)
    params, dvc = yaml.load(params_file.read_text()), yaml.load(dvc_file.read_text())
    survey = survey_dataset(dataset)
    if survey.images + survey.videos == 0:
        raise ConfigError(f"{dataset}: no images or videos found (looked for the extensions the scan reads, in "
                          "every subdirectory)")
    changes = add_dataset(params, dvc, repo_relative(dataset, repo), entry, replace)
    if model is not None:
        local = Path(model).is_dir()
        changes += set_model(params, dvc, repo_relative(Path(model), repo) if local else model, family, local)
    if preset is not None:
        changes += apply_preset(params, yaml.load(preset.path.read_text()))

    texts = {}
    for path, doc in ((params_file, params), (dvc_file, dvc)):
        buf = io.StringIO()
        yaml.dump(doc, buf)
        texts[path] = buf.getvalue()
    _check_params(texts[params_file])  # never write a params file that a stage would then reject
    for path, text in texts.items():
        write_bytes_atomic(path, text.encode())
    return changes, survey


def _check_params(text: str) -> None:
    """Load `text` as a params file, strictly, as the stages will."""
    from diffusion_pipe.params import load_params

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "params.yaml").write_text(text)
        load_params(Path(tmp) / "params.yaml")
