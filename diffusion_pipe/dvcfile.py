"""Reading `dvc.yaml`: a stage whose inputs are set by params must list them as deps, or DVC cannot see them
change. The stages check this and say exactly what to add."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from diffusion_pipe.config import ConfigError


def stage_deps(dvc_yaml: Path, stage: str) -> list[str] | None:
    """The `deps` of `stage` in `dvc_yaml` as written; None when there is no dvc.yaml (a run outside DVC)."""
    if not dvc_yaml.is_file():
        return None
    from ruamel.yaml import YAML

    data = YAML(typ="safe", pure=True).load(dvc_yaml.read_text()) or {}
    return [str(d) for d in (data.get("stages", {}).get(stage, {}) or {}).get("deps", []) or []]


def _covers(dep: str, path: str) -> bool:
    dep_parts, path_parts = PurePosixPath(dep).parts, PurePosixPath(path).parts
    return path_parts[:len(dep_parts)] == dep_parts


def require_deps(dvc_yaml: Path, stage: str, paths: list[str], param: str) -> None:
    """Every local path in `paths` (relative to the repo) is covered by a dep of `stage`; else a ConfigError
    naming the path, the param it came from and the line to add."""
    deps = stage_deps(dvc_yaml, stage)
    if deps is None:
        return
    root = dvc_yaml.parent.resolve()
    for raw in paths:
        p = Path(raw)
        if not (root / p).exists():
            continue  # not local (a hub id); the weights hashes in the keys cover it
        try:
            rel = (root / p).resolve().relative_to(root).as_posix()
        except ValueError:
            rel = p.resolve().as_posix()
        if not any(_covers(PurePosixPath(d).as_posix().rstrip("/"), rel) for d in deps):
            raise ConfigError(
                f"{param}: {raw} is not a dependency of stage '{stage}' in {dvc_yaml.name}, so DVC would not "
                f"notice when it changes; add '- {raw}' under stages.{stage}.deps"
            )
