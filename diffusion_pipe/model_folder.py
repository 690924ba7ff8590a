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


# component classes that hold no weights (importing some of transformers' processors warns of missing extras)
_NOT_MODELS = ("Scheduler", "Processor", "FeatureExtractor", "Tokenizer", "TokenizerFast", "Guidance")


def require_pipeline_components(model_dir: Path, skip: tuple[str, ...] = ()) -> None:
    """Every component model_index.json lists as [library, class] (but those in `skip`) present in `model_dir`:
    its folder, a config file in it, and for a model (a diffusers or transformers model class) its config.json
    and .safetensors (or .bin) weights. A ModelFolderError naming the first part missing."""
    import diffusers
    import transformers

    model_dir = Path(model_dir)
    index = read_model_json(model_dir / "model_index.json", model_dir)
    for name, spec in sorted(index.items()):
        if (name.startswith("_") or name in skip or not isinstance(spec, list) or len(spec) != 2
                or not all(isinstance(part, str) for part in spec)):
            continue  # a setting (Krea 2's text layers), a component left out ([null, null]) or given elsewhere
        folder = require_dir(model_dir / name, model_dir)
        cls = None if spec[1].endswith(_NOT_MODELS) else getattr(
            diffusers if spec[0] == "diffusers" else transformers, spec[1], None)
        if isinstance(cls, type) and issubclass(cls, (diffusers.ModelMixin, transformers.PreTrainedModel)):
            require_file(folder / "config.json", model_dir)
            if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
                raise model_folder_error(folder, f"no .safetensors weights of the {spec[1]}", model_dir)
            for weights in sorted(folder.glob("*.safetensors")):
                require_readable_safetensors(weights, model_dir)
        elif not any(folder.glob("*.json")):
            raise model_folder_error(folder, f"no config of the {spec[1]} (a .json file)", model_dir)


def require_readable_safetensors(path: Path, model_dir: Path) -> None:
    """`path`'s header read (cheap: no tensor is loaded), which also checks the file is as long as the header
    says: a ModelFolderError naming it when it is cut short or not safetensors."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt"):
            pass
    except (SafetensorError, OSError) as exc:
        raise model_folder_error(path, f"not a readable .safetensors file, cut short or damaged ({exc})",
                                 model_dir) from exc
