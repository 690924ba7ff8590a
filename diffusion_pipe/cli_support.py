"""What every stage command shares: the --params option, loading and checking params, user-facing errors."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

import click

from diffusion_pipe.errors import error_text

# Paths that params point at and a stage reads, per stage: (param name, function of Params -> paths). Encode reads
# the media too, but through the manifest's content hashes, so a changed file already re-runs it. Scan's dataset
# directories are deliberately not deps (dvc.yaml says why): scan runs on every repro and notices changes itself.
# Single files (model.transformer, .vae, .text_encoders) count as the stages that read them: encode the VAE and
# text encoders, train the transformer, export and sample every component.
_ENCODERS = [("model.vae", lambda p: [p.model.vae]), ("model.text_encoders", lambda p: list(p.model.text_encoders))]
_TRANSFORMER = [("model.transformer", lambda p: [p.model.transformer])]
# Edit families' sample prompts name control images, which training and the sample stage render from.
_SAMPLE_CONTROLS = [("train.samples.prompts[].control", lambda p: [x.control for x in p.train.samples.prompts])]
EMA_LORA = "runs/train/lora.ema.safetensors"  # train.ema_decay > 0: the train stage's second output
# Outputs that a param turns on, per stage: (param name, the output, function of Params -> whether it is written).
# dvc.yaml must list such an output exactly when it is written: DVC fails on a listed output that is missing, and
# does not track (or restore from its cache) one that is not listed.
_PARAM_OUTS: dict[str, list[tuple[str, str, Callable]]] = {
    "train": [("train.ema_decay", EMA_LORA, lambda p: bool(p.train.ema_decay))],
}
_PARAM_PATHS: dict[str, list[tuple[str, Callable]]] = {
    "encode": [("model.path", lambda p: [p.model.path]), *_ENCODERS],
    "train": [("model.path", lambda p: [p.model.path]), *_TRANSFORMER, *_SAMPLE_CONTROLS,
              ("train.init_lora", lambda p: [p.train.init_lora])],
    "export": [("model.path", lambda p: [p.model.path]), *_TRANSFORMER, *_ENCODERS,
               ("export.ema", lambda p: [EMA_LORA] if p.export.ema != "off" else [])],
    "sample": [("model.path", lambda p: [p.model.path]), *_TRANSFORMER, *_ENCODERS, *_SAMPLE_CONTROLS],
}


def stage_param_paths(stage: str, params) -> list[tuple[str, list[str]]]:
    """(param name, the paths it sets) for every path param that stage `stage` reads; unset params left out."""
    return [(param, [x for x in paths(params) if x]) for param, paths in _PARAM_PATHS.get(stage, [])]


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that are the user's to fix: printed as one message, exit status 2, no traceback."""
    from diffusion_pipe.errors import UserError

    return UserError, FileNotFoundError


def stage_command(name: str) -> Callable:
    """A click command for stage `name`: loads and validates params.yaml (all of it), checks that the paths
    params point at are deps of the stage in dvc.yaml, refuses to end when the params it read were edited while
    it ran, and turns user errors into a message."""
    def wrap(fn: Callable) -> click.Command:
        @click.option("--params", "params_path", type=click.Path(path_type=Path), default="params.yaml",
                      show_default=True, help="The params file.")
        # The DeepSpeed launcher passes --local_rank=N to every worker (unless --no_local_rank); it also sets
        # LOCAL_RANK, which is what the stages read.
        @click.option("--local_rank", "--local-rank", "local_rank", type=int, default=None, hidden=True)
        @functools.wraps(fn)
        def run(params_path: Path, local_rank: int | None, **kwargs) -> None:
            os.environ.setdefault("DVC_NO_ANALYTICS", "1")
            if local_rank is not None:
                os.environ.setdefault("LOCAL_RANK", str(local_rank))
            from diffusion_pipe.dvcfile import check_params_unchanged, require_deps, require_out
            from diffusion_pipe.params import load_params

            try:
                params = load_params(params_path)
                for param, paths in stage_param_paths(name, params):
                    require_deps(params_path.parent / "dvc.yaml", name, paths, param)
                for param, out, written in _PARAM_OUTS.get(name, []):
                    require_out(params_path.parent / "dvc.yaml", name, out, param, written(params))
                fn(params, **kwargs)
                check_params_unchanged(params_path, name, params)
            except user_errors() as exc:
                click.echo(error_text(exc), err=True)
                sys.exit(2)
        return click.command(name)(run)
    return wrap
