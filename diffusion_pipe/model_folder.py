"""What a diffusers model folder holds, and the one error for a folder that lacks a part a stage loads.

Every place in the adapters, encode and train (training samples included) that reads a component's folder or
file from `model.path` (configs, weights, tokenizers, schedulers, model_index.json) goes through `require_file`,
`require_dir` or `read_model_json`, or raises `model_folder_error`, so a half-downloaded or hand-assembled model
folder gets the same message everywhere, naming what is missing and what the folder should hold, instead of a
bare `[Errno 2]`, a KeyError or a library's traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

from diffusion_pipe.errors import UserError

DIFFUSERS_LAYOUT = ("model_index.json, the denoiser in transformer/ or unet/, vae/, the text encoders and their "
                    "tokenizers (text_encoder/, tokenizer/, text_encoder_2/, ... as the family has them) and "
                    "scheduler/, each component folder with its config and weights")
FIX = ("download the whole model again (a hub id as model.path fetches every part), or point model.path at a "
       "complete diffusers-format folder")


class ModelFolderError(UserError, FileNotFoundError):
    """A model folder lacks a part a stage loads, or holds it unreadable. A FileNotFoundError too, so callers
    (and the stages' error printing) that knew only that keep working."""


class MissingModelKey(ModelFolderError, KeyError):
    """A model file's JSON object lacks a key an adapter reads. A KeyError too, so library code that reads a config
    with a fallback for a missing key (`except KeyError`) keeps working."""


class ModelJson(dict):
    """The JSON object of model file `path`: reading a key it lacks raises MissingModelKey naming the file and the
    key (a config of another model, or of an older format), not a bare KeyError deep in an adapter. `get` and `in`
    work as on any dict."""

    def __init__(self, value: dict, path: Path, model_dir: Path) -> None:
        super().__init__(value)
        self.path, self.model_dir = Path(path), Path(model_dir)

    def __missing__(self, key: object) -> object:
        error = model_folder_error(self.path, f"has no {key!r}: is it this model family's "
                                              f"{self.path.parent.name}, in diffusers format?", self.model_dir)
        raise MissingModelKey(*error.args)


def model_folder_error(path: Path, problem: str, model_dir: Path) -> ModelFolderError:
    """The error for part `path` of model folder `model_dir`: `problem` (e.g. 'missing') and what a diffusers
    folder holds."""
    return ModelFolderError(f"{path}: {problem}. model.path ({model_dir}) must be a diffusers-format model folder, "
                            f"which holds {DIFFUSERS_LAYOUT}; {FIX}")


def require_dir(path: Path, model_dir: Path | None = None) -> Path:
    """Component folder `path` when it is a folder, else a ModelFolderError naming it (`model_dir`: the model
    folder, default `path`'s parent)."""
    path = Path(path)
    if not path.is_dir():
        raise model_folder_error(path, "no such folder" if not path.exists() else "not a folder",
                                 model_dir or path.parent)
    return path


def require_file(path: Path, model_dir: Path | None = None) -> Path:
    """Component file `path` (<model>/<component>/<file>) when it is a file, else a ModelFolderError naming it,
    and its folder when that is missing too (`model_dir`: the model folder, default the one above `path`'s)."""
    path = Path(path)
    if not path.is_file():
        missing = "missing" if path.parent.is_dir() else f"missing, and so is its folder {path.parent.name}/"
        raise model_folder_error(path, missing, model_dir or path.parent.parent)
    return path


def read_model_json(path: Path, model_dir: Path | None = None) -> ModelJson:
    """The JSON object in model file `path` (a component's config.json, scheduler_config.json,
    model_index.json, ...), as a ModelJson; a ModelFolderError when it is missing, unreadable or not a JSON object
    (a download cut short). `model_dir` as for `require_file`."""
    model_dir = model_dir or Path(path).parent.parent
    text = require_file(path, model_dir).read_bytes()
    try:
        value = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise model_folder_error(path, f"not valid JSON ({exc})", model_dir) from None
    if not isinstance(value, dict):
        raise model_folder_error(path, f"holds a JSON {type(value).__name__}, not an object", model_dir)
    return ModelJson(value, path, model_dir)
