"""Weights and tokenizer hashing, and the stat cache that spares re-hashing large files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from diffusion_pipe.hashing import hash_file
from diffusion_pipe.model_folder import ModelFolderError
from diffusion_pipe.weights import component_hash, file_hash_cached, tokenizer_hash


def _rewrite_keeping_stat(path: Path, data: bytes) -> None:
    """Change the bytes but not size or mtime: the cache cannot tell, by design."""
    st = path.stat()
    assert len(data) == st.st_size
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_cache_returns_stored_hash_until_stat_changes(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"A" * 1000)
    first = file_hash_cached(f, cache)
    assert first == hash_file(f)
    (entry,) = cache.glob("*.json")
    assert json.loads(entry.read_text())["xxh3_128"] == first

    _rewrite_keeping_stat(f, b"B" * 1000)
    assert file_hash_cached(f, cache) == first  # served from the cache: not re-hashed

    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    second = file_hash_cached(f, cache)
    assert second == hash_file(f) != first
    assert json.loads(entry.read_text())["xxh3_128"] == second


def test_hashing_a_large_file_says_so_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture) -> None:
    """Hashing a multi-GiB weights file takes seconds to minutes: a line names the file the first time, none once
    the hash is cached."""
    import diffusion_pipe.weights as weights

    monkeypatch.setattr(weights, "_ANNOUNCE_BYTES", 10)
    big, small = tmp_path / "big.safetensors", tmp_path / "small.json"
    big.write_bytes(b"x" * 100)
    small.write_bytes(b"{}")
    weights.file_hash_cached(big, tmp_path / "cache")
    weights.file_hash_cached(small, tmp_path / "cache")
    assert capsys.readouterr().err.splitlines() == [
        f"hashing {big.resolve()} (0.0 GiB; once, then cached while the file is unchanged)"]
    weights.file_hash_cached(big, tmp_path / "cache")
    assert capsys.readouterr().err == ""


def test_cache_keys_by_inode(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    f = tmp_path / "w.bin"
    f.write_bytes(b"A" * 100)
    first = file_hash_cached(f, cache)
    st = f.stat()
    other = tmp_path / "new.bin"
    other.write_bytes(b"C" * 100)
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, f)  # same path, size and mtime; new inode
    assert file_hash_cached(f, cache) == hash_file(f) != first


def test_default_cache_lives_under_the_store_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIFFUSION_PIPE_STORE", str(tmp_path / "store"))
    f = tmp_path / "w.pt"
    f.write_bytes(b"x")
    assert file_hash_cached(f) == hash_file(f)
    assert len(list((tmp_path / "store" / "hash-cache").glob("*.json"))) == 1


def _component(root: Path) -> Path:
    (root / "vae").mkdir(parents=True)
    (root / "vae" / "config.json").write_text('{"latent_channels": 4}')
    (root / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"weights" * 10)
    (root / "vae" / "README.md").write_text("ignored")
    (root / "vae" / ".cache").mkdir()
    (root / "vae" / ".cache" / "x.safetensors").write_bytes(b"ignored")
    return root / "vae"


def test_component_hash_ignores_location_and_non_weights(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    a, b = _component(tmp_path / "a"), _component(tmp_path / "b")
    base = component_hash(a, cache)
    assert component_hash(b, cache) == base
    (a / "README.md").write_text("changed")
    (a / ".cache" / "x.safetensors").write_bytes(b"changed too")
    assert component_hash(a, cache) == base
    (a / "config.json").write_text('{"latent_channels": 16}')
    assert component_hash(a, cache) != base
    (b / "diffusion_pytorch_model.safetensors").write_bytes(b"weights" * 11)
    assert component_hash(b, cache) != base


def test_component_hash_depends_on_file_names(tmp_path: Path) -> None:
    a = _component(tmp_path / "a")
    base = component_hash(a, tmp_path / "cache")
    os.rename(a / "diffusion_pytorch_model.safetensors", a / "model.safetensors")
    assert component_hash(a, tmp_path / "cache") != base


def test_component_hash_errors(tmp_path: Path) -> None:
    # a UserError the stages print as one line (a NotADirectoryError was a traceback)
    with pytest.raises(ModelFolderError, match=r"nope: no such folder\. model\.path .* must be a diffusers-format"):
        component_hash(tmp_path / "nope", tmp_path / "cache")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no weights file"):
        component_hash(tmp_path / "empty", tmp_path / "cache")


def test_tokenizer_hash(tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "vocab.json").write_text('{"a": 0}')
    (tok / "merges.txt").write_text("a b\n")
    base = tokenizer_hash(tok)
    moved = tmp_path / "elsewhere"
    tok.rename(moved)
    assert tokenizer_hash(moved) == base
    (moved / "special_tokens_map.json").write_text("{}")
    assert tokenizer_hash(moved) != base
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFolderError, match="empty: no tokenizer files in it"):
        tokenizer_hash(tmp_path / "empty")
