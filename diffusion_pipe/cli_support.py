"""What every stage command shares: the --params option, loading and checking params, user-facing errors."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

import click

# Paths that params point at and a stage reads, per stage: (param name, function of Params -> paths). Encode reads
# the media too, but through the manifest's content hashes, so a changed file already re-runs it. Scan's dataset
# directories are deliberately not deps (dvc.yaml says why): scan runs on every repro and notices changes itself.
_PARAM_PATHS: dict[str, tuple[str, Callable]] = {
    "encode": ("model.path", lambda p: [p.model.path]),
    "train": ("model.path", lambda p: [p.model.path]),
    "export": ("model.path", lambda p: [p.model.path]),
    "sample": ("model.path", lambda p: [p.model.path]),
}


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that are the user's to fix: printed as one message, exit status 2, no traceback."""
    from diffusion_pipe.errors import UserError

    return UserError, FileNotFoundError


def stage_command(name: str) -> Callable:
    """A click command for stage `name`: loads and validates params.yaml (all of it), checks that the paths
    params point at are deps of the stage in dvc.yaml, and turns user errors into a message."""
    def wrap(fn: Callable) -> click.Command:
        @click.option("--params", "params_path", type=click.Path(path_type=Path), default="params.yaml",
                      show_default=True, help="The params file.")
        @functools.wraps(fn)
        def run(params_path: Path, **kwargs) -> None:
            os.environ.setdefault("DVC_NO_ANALYTICS", "1")
            from diffusion_pipe.dvcfile import require_deps
            from diffusion_pipe.params import load_params

            try:
                params = load_params(params_path)
                if name in _PARAM_PATHS:
                    param, paths = _PARAM_PATHS[name]
                    require_deps(params_path.parent / "dvc.yaml", name, paths(params), param)
                fn(params, **kwargs)
            except user_errors() as exc:
                click.echo(f"error: {exc}", err=True)
                sys.exit(2)
        return click.command(name)(run)
    return wrap
