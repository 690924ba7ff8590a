"""Hashes of model weights and tokenizers, the inputs of encode keys.

A 10 GB encoder is hashed once: file hashes are cached by (absolute path, size, mtime_ns, inode), one small JSON
file per path under <store root>/hash-cache/, each published atomically, so concurrent processes never read a
half-written entry (the worst race is two processes hashing the same file once each).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from diffusion_pipe.fileio import write_json_atomic
from diffusion_pipe.hashing import hash_bytes, hash_file, hash_json
from diffusion_pipe.model_folder import model_folder_error, require_dir

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# In a model view (diffusion_pipe.models.checkpoints), a component given as one single file is a folder holding
# the skeleton's config.json and this marker, which names the file.
SINGLE_FILE_MARKER = "single_file.json"


def _default_cache_dir() -> Path:
    # Imported here: the store package pulls in torch, which weights hashing does not need.
    from diffusion_pipe.store.store import default_root

    return default_root() / "hash-cache"


def _stamp(st: os.stat_result) -> dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


_ANNOUNCE_BYTES = 1 << 30  # weights files this large get a line when they are hashed


def file_hash_cached(path: Path, cache_dir: Path | None = None) -> str:
    """xxh3-128 of the file's bytes, reused while its (absolute path, size, mtime_ns, inode) are unchanged.

    `cache_dir` defaults to <Store.default() root>/hash-cache.
    """
    path = Path(path).resolve()  # symlinks (e.g. the Hugging Face cache's snapshots) resolve to the real file
    cache_dir = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    entry_path = cache_dir / f"{hash_bytes(str(path).encode('utf-8'))}.json"
    before = path.stat()
    stamp = _stamp(before)
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError):
        entry = json.loads(entry_path.read_bytes())
        if entry["path"] == str(path) and all(entry[k] == v for k, v in stamp.items()):
            return str(entry["xxh3_128"])
    if before.st_size >= _ANNOUNCE_BYTES:  # seconds to minutes, once per file: say what the wait is
        print(f"hashing {path} ({before.st_size / 2**30:.1f} GiB; once, then cached while the file is unchanged)",
              file=sys.stderr)
    digest = hash_file(path)
    # A file rewritten while we read it gives a hash of neither version: return it, but do not cache it.
    if _stamp(path.stat()) == stamp:
        write_json_atomic(entry_path, {"path": str(path), **stamp, "xxh3_128": digest})
    return digest


def _listing(directory: Path) -> list[Path]:
    directory = require_dir(directory)
    # Hidden files and folders are skipped: download tools keep timestamps and locks there
    # (e.g. .cache/huggingface/), which say nothing about the weights.
    return sorted(
        p
        for p in directory.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )


def component_hash(directory: Path, cache_dir: Path | None = None) -> str:
    """Hash of a diffusers component directory (e.g. model/vae): every weights file and config.json; of a model
    view's single-file component: its config.json and the single file.

    Combines relative POSIX name -> file hash with hash_json, so renaming the directory changes nothing while
    any changed weight or config value changes the hash.
    """
    directory = Path(directory)
    marker = directory / SINGLE_FILE_MARKER
    if marker.is_file():
        # The same content gives the same hash wherever the file lies and whatever it is called.
        single = Path(json.loads(marker.read_text())["file"])
        if not single.is_file():
            raise FileNotFoundError(f"{single}: the single file of component {directory.name} is missing; "
                                    "restore it or change the model.* param that names it")
        return hash_json({"kind": "single_file", "config": file_hash_cached(directory / "config.json", cache_dir),
                          "file": file_hash_cached(single, cache_dir)})
    files = {
        p.relative_to(directory).as_posix(): file_hash_cached(p, cache_dir)
        for p in _listing(directory)
        if p.name == "config.json" or p.name.endswith(WEIGHT_SUFFIXES)
    }
    if not any(name.endswith(WEIGHT_SUFFIXES) for name in files):
        raise model_folder_error(directory, f"no weights file ({', '.join('*' + s for s in WEIGHT_SUFFIXES)}) "
                                            "in it", directory.parent)
    return hash_json({"kind": "component", "files": files})


def has_weights(directory: Path) -> bool:
    """Whether `directory` is a model component with weights: a diffusers component folder with a weights file,
    or a model view's single-file component."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        return False
    return (directory / SINGLE_FILE_MARKER).is_file() or any(
        f.name.endswith(WEIGHT_SUFFIXES) for f in directory.iterdir())


def tokenizer_hash(directory: Path) -> str:
    """Hash of every (non-hidden) file in a tokenizer directory, by relative POSIX name."""
    directory = Path(directory)
    files = {p.relative_to(directory).as_posix(): hash_file(p) for p in _listing(directory)}
    if not files:
        raise model_folder_error(directory, "empty: no tokenizer files in it", directory.parent)
    return hash_json({"kind": "tokenizer", "files": files})
