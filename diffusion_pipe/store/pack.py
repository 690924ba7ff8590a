"""Packs and their sidecars: the on-disk format of the store, and the writer that publishes them.

A pack is an immutable safetensors file holding many entries of one family. Tensor `name` of entry `key` is
stored under the safetensors name ``f"{key}/{name}"`` (keys never contain "/", names may). The pack's file name is
the xxh3-128 of its own bytes, so a pack can always be checked against its name.

Its sidecar ``<packhash>.json`` (compact JSON) lists every entry: ``specs`` holds each distinct layout (tensor
name -> shape, dtype) once and ``entries`` maps key -> index into ``specs``; plus the pack's hash and size. The
sidecar is written last: a pack without its sidecar is invisible, so a crash at any point publishes nothing
partial. Temp files start with "." and end with ".tmp"; readers never look at them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from diffusion_pipe.fileio import fsync_dir, published_mode, write_bytes_atomic
from diffusion_pipe.hashing import canonical_json, hash_file
from diffusion_pipe.errors import UserError

if TYPE_CHECKING:
    from diffusion_pipe.store.store import Store

SIDECAR_FORMAT = 1
PACK_SUFFIX = ".safetensors"
SIDECAR_SUFFIX = ".json"
TEMP_PREFIX = ".pack-"
TEMP_SUFFIX = ".tmp"
PACK_ID_RE = re.compile(r"^[0-9a-f]{32}$")
FAMILY_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
# Directories under the store root that are not families.
RESERVED_DIRS = frozenset({"quarantine", "hash-cache", "remote-index", "leases", "verified"})
# What every store error that loses entries tells the user to run. Plain `dvc repro encode` does nothing here:
# encode's inputs did not change, so DVC skips it; --force runs it, and it recomputes only what is missing.
REPAIR_HINT = ("run `dvc repro --force --single-item encode` to recompute them (plain `dvc repro` skips encode, whose "
               "inputs did not change; outside DVC: `python -m stages.encode`)")

# safetensors header dtype codes -> torch dtype names as the sidecar records them.
_ST_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
# A safetensors header larger than this is not one we wrote: treat it as corruption instead of allocating it.
_MAX_HEADER = 256 << 20


class StoreError(UserError):
    """A user-facing store problem; the message names the key, pack or path and what to do about it."""


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def temp_prefix() -> str:
    """The name prefix of this process's temp files in the store: `.pack-<host>-<pid>-`, so the temp files of a
    writer that was killed can be recognised (its pid is gone) and removed without waiting for a grace period."""
    return f"{TEMP_PREFIX}{_host()}-{os.getpid()}-"


def owner_dead(host: str, pid: int) -> bool:
    """Whether process `pid` on `host` is known to be gone (only this host's processes can be asked)."""
    if host != _host() and host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists, owned by someone else
        return False
    return False


def temp_owner(name: str) -> tuple[str, int] | None:
    """(host, pid) of a temp file named by `temp_prefix`; None for other names (older writers, atomic_writer)."""
    if not (name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX)):
        return None
    parts = name[len(TEMP_PREFIX):-len(TEMP_SUFFIX)].rsplit("-", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def space_error(directory: Path, needed: int, exc: BaseException) -> StoreError | None:
    """A StoreError naming the store and the space a write needed, if `exc` is a full disk, a quota or a file
    size limit (an OSError, or safetensors' error, which carries only the text 'os error N'); else None."""
    code = getattr(exc, "errno", None)
    if code is None:
        match = re.search(r"os error (\d+)", str(exc))
        code = int(match.group(1)) if match else None
    if code not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return None
    return _no_room(directory, needed, os.strerror(code))


def _no_room(directory: Path, needed: int, why: str) -> StoreError:
    free = shutil.disk_usage(directory).free
    return StoreError(
        f"the store at {directory.parent} cannot take a pack of {needed / 2**20:.1f} MB in {directory.name}/: {why} "
        f"({free / 2**20:.1f} MB free there). Free space (`diffusion-pipe store gc` deletes packs no encoded table "
        f"needs) or point DIFFUSION_PIPE_STORE at a disk with room, then run encode again"
    )


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the dtype spelling used in sidecars and spec()."""
    return str(dtype).removeprefix("torch.")


def tensor_name(key: str, name: str) -> str:
    """The safetensors name of tensor `name` of entry `key` inside a pack."""
    return f"{key}/{name}"


def check_family(family: str) -> str:
    """Return `family` if it is a valid family name, else raise StoreError."""
    if not isinstance(family, str) or not FAMILY_RE.match(family) or family in RESERVED_DIRS:
        raise StoreError(
            f"invalid store family {family!r}: use a short lowercase name such as 'latent' or 'text' "
            f"(not one of {sorted(RESERVED_DIRS)})"
        )
    return family


def check_key(key: str) -> str:
    """Return `key` if it can name an entry (non-empty, no '/', no whitespace), else raise StoreError."""
    if not isinstance(key, str) or not key or "/" in key or key != key.strip() or len(key) > 200:
        raise StoreError(
            f"invalid store key {key!r}: keys are non-empty strings without '/' or surrounding whitespace, "
            "such as the hex digests from diffusion_pipe.encode.keys"
        )
    return key


@dataclass(frozen=True)
class Sidecar:
    """The index of one pack: which entries it holds and what the pack's bytes must hash to.

    Entries of one pack mostly share one layout (same bucket, same encoder), so the sidecar lists each distinct
    layout once in `specs` (tensor name -> {"shape": [...], "dtype": "float32"}) and maps every key to the
    index of its layout: a sidecar of thousands of keys stays small and parses fast.
    """

    family: str
    pack_id: str
    size: int
    specs: list[dict[str, dict[str, Any]]]
    entries: dict[str, int]  # key -> index into specs

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to ``<pack_id>.json``."""
        return {
            "format": SIDECAR_FORMAT,
            "family": self.family,
            "pack": self.pack_id + PACK_SUFFIX,
            "xxh3_128": self.pack_id,
            "size": self.size,
            "specs": self.specs,
            "entries": self.entries,
        }

    @classmethod
    def from_json(cls, obj: Any, where: Path) -> Sidecar:
        """Parse a sidecar object read from `where`; raise StoreError if it is not one we wrote."""
        try:
            if obj["format"] != SIDECAR_FORMAT:
                raise StoreError(
                    f"sidecar {where} has format {obj['format']!r}, this code reads format {SIDECAR_FORMAT}: "
                    "upgrade diffusion-pipe or move the store aside"
                )
            sidecar = cls(
                family=str(obj["family"]),
                pack_id=str(obj["xxh3_128"]),
                size=int(obj["size"]),
                specs=list(obj["specs"]),
                entries=dict(obj["entries"]),
            )
            n = len(sidecar.specs)
            if not all(isinstance(i, int) and 0 <= i < n for i in sidecar.entries.values()):
                raise ValueError("an entry points outside specs")
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, StoreError):
                raise
            raise StoreError(f"sidecar {where} is malformed ({exc!r}): run store verify to quarantine it") from exc
        if sidecar.pack_id != where.stem:
            raise StoreError(f"sidecar {where} does not describe pack {where.stem}: run store verify to quarantine it")
        return sidecar

    @classmethod
    def build(
        cls, family: str, pack_id: str, size: int, layouts: dict[str, dict[str, dict[str, Any]]]
    ) -> Sidecar:
        """A sidecar from key -> tensor name -> {"shape", "dtype"}, sharing equal layouts."""
        specs: list[dict[str, dict[str, Any]]] = []
        index: dict[str, int] = {}
        entries: dict[str, int] = {}
        for key, layout in layouts.items():
            text = canonical_json(layout)
            if text not in index:
                index[text] = len(specs)
                specs.append(layout)
            entries[key] = index[text]
        return cls(family=family, pack_id=pack_id, size=size, specs=specs, entries=entries)

    def spec(self, key: str) -> dict[str, tuple[tuple[int, ...], str]]:
        """Tensor name -> (shape, dtype name) of entry `key`."""
        return {name: (tuple(t["shape"]), t["dtype"]) for name, t in self.specs[self.entries[key]].items()}


def read_sidecar(path: Path) -> Sidecar:
    """Load and parse one sidecar file."""
    try:
        obj = json.loads(path.read_bytes())
    except json.JSONDecodeError as exc:
        raise StoreError(f"sidecar {path} is not valid JSON ({exc}): run store verify to quarantine it") from exc
    return Sidecar.from_json(obj, path)


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The safetensors header of `path` (without __metadata__) and the byte offset where tensor data starts."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ValueError("file shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise ValueError(f"header length {n} is implausible")
        text = fh.read(n)
        if len(text) < n:
            raise ValueError("header truncated")
    header = json.loads(text)
    header.pop("__metadata__", None)
    return header, 8 + n


def check_pack(path: Path, sidecar: Sidecar, *, full_hash: bool) -> str | None:
    """Why the pack at `path` does not match `sidecar`, or None when it does.

    Always: the file exists, its size is the sidecar's, and its safetensors header lists exactly the sidecar's
    tensors with their shapes and dtypes and offsets inside the file (a few KB read). With `full_hash`: the
    xxh3-128 of all bytes equals the pack id (a full read, ~6 GB/s from page cache).
    """
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "pack file is missing"
    if size != sidecar.size:
        return f"pack is {size} bytes, its sidecar says {sidecar.size} (truncated or overwritten)"
    try:
        header, data_start = read_header(path)
        expected = {
            tensor_name(key, name): t for key, i in sidecar.entries.items() for name, t in sidecar.specs[i].items()
        }
        if set(header) != set(expected):
            return "pack header lists different tensors than its sidecar"
        for tname, t in expected.items():
            h = header[tname]
            dtype = _ST_DTYPES.get(h["dtype"], h["dtype"])
            if list(h["shape"]) != list(t["shape"]) or dtype != t["dtype"]:
                return f"tensor {tname} is {dtype}{h['shape']} in the pack, {t['dtype']}{t['shape']} in the sidecar"
            if data_start + int(h["data_offsets"][1]) > size:
                return f"tensor {tname} extends past the end of the pack"
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        return f"pack header is unreadable ({exc})"
    if full_hash:
        actual = hash_file(path)
        if actual != sidecar.pack_id:
            return f"pack bytes hash to {actual}, not {sidecar.pack_id} (corrupted on disk or in transfer)"
    return None


def sidecar_from_pack(path: Path, family: str) -> Sidecar:
    """Rebuild the sidecar of an orphan pack (one whose sidecar was lost) from its own bytes: its hash must be its
    name, and its safetensors header lists every entry's tensors. Raises StoreError when it is not a whole pack."""
    pack_id = path.name[: -len(PACK_SUFFIX)]
    actual = hash_file(path)
    if actual != pack_id:
        raise StoreError(f"orphan pack {path} hashes to {actual}, not its name (truncated or damaged)")
    try:
        header, _ = read_header(path)
        layouts: dict[str, dict[str, dict[str, Any]]] = {}
        for tname in sorted(header):
            key, _, name = tname.partition("/")
            h = header[tname]
            layouts.setdefault(key, {})[name] = {"shape": list(h["shape"]), "dtype": _ST_DTYPES.get(h["dtype"], h["dtype"])}
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreError(f"orphan pack {path} has an unreadable header ({exc})") from None
    if not layouts or any(not name for layout in layouts.values() for name in layout):
        raise StoreError(f"orphan pack {path} does not hold store entries")
    return Sidecar.build(family, pack_id, path.stat().st_size, layouts)


class PackWriter:
    """Buffers entries of one family and publishes them as packs of about `pack_bytes` each.

    Use as a context manager. A normal exit publishes what is still buffered; an exception (or a kill) publishes
    nothing still buffered, while packs already flushed stay: each is complete and indexed by its sidecar.
    """

    def __init__(self, store: Store, family: str, pack_bytes: int = 256 << 20) -> None:
        if pack_bytes <= 0:
            raise StoreError(f"pack_bytes must be positive, got {pack_bytes}")
        self._store = store
        self.family = check_family(family)
        self.pack_bytes = pack_bytes
        self._buffer: dict[str, dict[str, torch.Tensor]] = {}
        self._buffered_bytes = 0
        self.written = 0
        self.packs: list[str] = []

    def __enter__(self) -> PackWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.flush()
        else:
            # A failed run must not publish a half-made batch; flushed packs are whole and stay.
            self._buffer.clear()
            self._buffered_bytes = 0

    def add(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        """Buffer entry `key`; publish a pack once the buffer holds `pack_bytes` or more.

        Tensors are copied to contiguous CPU memory, so the caller may reuse its buffers. A key added twice
        to one writer is kept once: equal keys mean equal content by construction.
        """
        check_key(key)
        if not isinstance(tensors, dict) or not tensors:
            raise StoreError(f"entry {key}: tensors must be a non-empty dict of name -> torch.Tensor")
        if key in self._buffer:
            return
        stored: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if not isinstance(name, str) or not name:
                raise StoreError(f"entry {key}: tensor names must be non-empty strings, got {name!r}")
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                raise StoreError(f"entry {key}: {name!r} must be a dense torch.Tensor, got {type(t).__name__}")
            stored[name] = t.detach().to(device="cpu", memory_format=torch.contiguous_format, copy=True)
        self._buffer[key] = stored
        self._buffered_bytes += sum(t.numel() * t.element_size() for t in stored.values())
        if self._buffered_bytes >= self.pack_bytes:
            self.flush()

    def flush(self) -> str | None:
        """Publish the buffered entries as one pack now; return its id (None if nothing was buffered)."""
        if not self._buffer:
            return None
        directory = self._store.root / self.family
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {tensor_name(k, n): t for k, entry in self._buffer.items() for n, t in entry.items()}
        layouts = {
            k: {n: {"shape": list(t.shape), "dtype": dtype_name(t.dtype)} for n, t in entry.items()}
            for k, entry in self._buffer.items()
        }
        # Tensor bytes plus the header (names, shapes, offsets): checked before writing, so a full disk is a clear
        # error and not a half-written temp file.
        needed = sum(t.numel() * t.element_size() for t in tensors.values()) + 256 * len(tensors) + 4096
        if shutil.disk_usage(directory).free < needed:
            raise _no_room(directory, needed, "not enough free space")
        fd, tmp_name = tempfile.mkstemp(prefix=temp_prefix(), suffix=TEMP_SUFFIX, dir=directory)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            # One metadata key with canonical JSON: safetensors writes a metadata map in arbitrary order, and
            # equal content should give equal bytes (hence the same pack id) across writers.
            save_file(tensors, tmp, metadata={"diffusion_pipe": canonical_json({"family": self.family, "format": 1})})
            with open(tmp, "rb+") as fh:
                os.fchmod(fh.fileno(), published_mode())  # mkstemp's 0600 would lock out a group sharing the store
                os.fsync(fh.fileno())
            pack_id = hash_file(tmp)
            size = tmp.stat().st_size
            # Replacing an existing pack of the same id is harmless: same id, same bytes.
            os.replace(tmp, directory / (pack_id + PACK_SUFFIX))
            fsync_dir(directory)
        except BaseException as exc:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            full = space_error(directory, needed, exc)
            if full is not None:
                raise full from None
            raise
        sidecar = Sidecar.build(self.family, pack_id, size, layouts)
        # Compact JSON: sidecars of thousands of keys are parsed on every store open.
        text = canonical_json(sidecar.to_json()).encode("utf-8")
        try:
            write_bytes_atomic(directory / (pack_id + SIDECAR_SUFFIX), text)
        except OSError as exc:
            full = space_error(directory, len(text), exc)
            if full is not None:  # the pack stays invisible without its sidecar; `store verify` adopts it
                raise full from None
            raise
        self._store._register(sidecar)
        self.written += len(self._buffer)
        self.packs.append(pack_id)
        self._buffer.clear()
        self._buffered_bytes = 0
        return pack_id
