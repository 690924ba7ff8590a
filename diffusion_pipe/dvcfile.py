"""Reading `dvc.yaml`: a stage whose inputs are set by params must list them as deps, or DVC cannot see them
change. The stages check this and say exactly what to add."""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from diffusion_pipe.config import ConfigError

if TYPE_CHECKING:
    from diffusion_pipe.params import Params


def _stage_entry(dvc_yaml: Path, stage: str, field: str) -> list | None:
    if not dvc_yaml.is_file():
        return None
    from ruamel.yaml import YAML

    data = YAML(typ="safe", pure=True).load(dvc_yaml.read_text()) or {}
    return list((data.get("stages", {}).get(stage, {}) or {}).get(field, []) or [])


def stage_deps(dvc_yaml: Path, stage: str) -> list[str] | None:
    """The `deps` of `stage` in `dvc_yaml` as written; None when there is no dvc.yaml (a run outside DVC)."""
    deps = _stage_entry(dvc_yaml, stage, "deps")
    return None if deps is None else [str(d) for d in deps]


def stage_params(dvc_yaml: Path, stage: str) -> list[str] | None:
    """The keys of params.yaml that `stage` lists under `params:` in `dvc_yaml` (sections or dotted keys; "" for
    the whole file, as `- params.yaml:` reads it; entries of other params files are left out); None when there is
    no dvc.yaml."""
    params = _stage_entry(dvc_yaml, stage, "params")
    if params is None:
        return None
    whole = any(isinstance(p, dict) and not p.get("params.yaml", True) for p in params)
    return [""] if whole else [str(p) for p in params if isinstance(p, str)]


def check_params_unchanged(params_path: Path, stage: str, used: Params) -> None:
    """Refuse to end stage `stage` when params.yaml now differs from `used` (what the stage ran with) on a key the
    stage lists in dvc.yaml: DVC writes dvc.lock from the file as it stands when the stage ends, so an edit made
    while the stage ran would be recorded as what produced its outputs (and a later `dvc repro` would not redo
    them). Outside DVC (no dvc.yaml) there is no record to protect."""
    from diffusion_pipe.config import changed_params, to_dict
    from diffusion_pipe.params import load_params

    keys = stage_params(params_path.parent / "dvc.yaml", stage)
    if not keys:
        return
    fix = (f"put the values it ran with back and run `dvc commit {stage}` to keep these outputs, or run "
           f"`dvc repro {stage}` to redo it with the new ones")
    try:
        now = load_params(params_path)
    except (ConfigError, OSError) as exc:
        raise ConfigError(f"{params_path} was edited while stage '{stage}' ran and no longer loads ({exc}); "
                          f"{fix}") from None
    changes = changed_params(to_dict(used), to_dict(now), keys)
    if changes:
        raise ConfigError(f"{params_path} was edited while stage '{stage}' ran ({'; '.join(changes)}): its outputs "
                          f"were made with the values on the left, and DVC would record the ones on the right; {fix}")


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


def require_out(dvc_yaml: Path, stage: str, path: str, param: str, written: bool) -> None:
    """`path` (relative to the repo) is an out of `stage` exactly when the stage writes it (`written`, as `param`
    says); else a ConfigError naming the param and the line to add or remove. DVC fails on a listed output that
    is not written, and neither tracks nor restores one that is not listed."""
    outs = _stage_entry(dvc_yaml, stage, "outs")
    if outs is None:
        return
    listed = path in [str(next(iter(o))) if isinstance(o, dict) else str(o) for o in outs]
    if written and not listed:
        raise ConfigError(f"{param}: stage '{stage}' writes {path}, which is not an output of it in {dvc_yaml.name}, "
                          f"so DVC would neither track nor restore it; add '- {path}' under stages.{stage}.outs "
                          "(and under the deps of the stages that read it: export, for export.ema)")
    if listed and not written:
        raise ConfigError(f"{param}: {path} is listed under stages.{stage}.outs in {dvc_yaml.name}, and with "
                          f"{param} as it is stage '{stage}' does not write it (DVC would fail on the missing "
                          "output); remove that line (and its line under other stages' deps)")
