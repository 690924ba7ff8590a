"""Atomic publication of files: a reader sees the old file or the whole new one, never a part."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from diffusion_pipe.errors import UserError


def _umask() -> int:
    try:  # Linux says it without changing it (setting it, even briefly, races with other threads creating files)
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere, reading the umask means setting it; restored at once
    os.umask(mask)
    return mask


def published_mode() -> int:
    """The mode of a file we publish: what `open()` would give it under the process's umask (0644 under 022,
    0664 under a group-sharing 002), not the 0600 of a temp file from `mkstemp`."""
    return 0o666 & ~_umask()


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (POSIX needs the directory itself fsynced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: str | Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """Write `path` through a temp file in the same directory, fsync it, then rename it into place.

    If the body raises, the temp file is removed and `path` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, published_mode())  # mkstemp makes 0600; a published file gets the usual mode
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Publish `data` at `path` atomically."""
    with atomic_writer(path, "wb") as fh:
        fh.write(data)


def json_bytes(obj: Any) -> bytes:
    """`obj` as stable, human-readable JSON (sorted keys, 2-space indent, trailing newline), UTF-8."""
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Publish `obj` as `json_bytes`."""
    write_bytes_atomic(path, json_bytes(obj))


class WriteError(UserError):
    """A file could not be written (a full disk, a quota, a file size limit, permissions): the message names the
    file, the errno and the fix."""


# errno -> what it means for a write, in words a person acts on
_NO_ROOM = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
            errno.EFBIG: "the file would exceed the file size limit (ulimit -f)"}


def write_error(path: Path, exc: BaseException) -> WriteError | None:
    """A WriteError for `exc`, raised while writing `path`, if it is an OS error (an OSError, or safetensors' error,
    which carries only the text 'os error N'): what happened (the disk is full, ...), its errno name and, for lack
    of room, how much is free there. None for any other exception."""
    code = getattr(exc, "errno", None) if isinstance(exc, OSError) else None
    if code is None and (match := re.search(r"os error (\d+)", str(exc))):
        code = int(match.group(1))
    if code is None:
        return None
    name = errno.errorcode.get(code, f"errno {code}")
    if code in _NO_ROOM:
        existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
        free = shutil.disk_usage(existing if existing.is_dir() else existing.parent).free
        return WriteError(f"cannot write {path}: {_NO_ROOM[code]} ({name}: {os.strerror(code)}; "
                          f"{free / 2**20:.1f} MB free there). Free space on that disk (or write elsewhere) and "
                          "run again; nothing half-written was left under that name")
    return WriteError(f"cannot write {path}: {os.strerror(code)} ({name}). Fix that and run again")


@contextlib.contextmanager
def naming_write_errors(path: str | Path) -> Iterator[None]:
    """Turn an OS error raised by the body (which writes `path`) into a WriteError naming `path` and the errno
    (`write_error`): a full disk says so, instead of a traceback ending in `OSError: [Errno 28]` on a temp file's
    name. Other exceptions pass unchanged."""
    try:
        yield
    except Exception as exc:
        error = write_error(Path(path), exc)
        if error is None:
            raise
        raise error from exc


@contextlib.contextmanager
def published_together() -> Iterator[Callable[[Path, bytes], None]]:
    """Publish several files as one: the body stages each (`stage(path, data)`: written to a temp file beside
    `path` and fsynced, a WriteError if that fails); they are renamed into place only once the body has
    finished, in the order staged. If the body raises, every staged temp file is removed and no file is
    published, so a reader (and DVC) never sees some of them without the others. Renames need no room on the
    disk: the writing, where a full disk fails, is all done before the first of them."""
    staged: list[tuple[str, Path]] = []

    def stage(path: Path, data: bytes) -> None:
        with naming_write_errors(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            staged.append((tmp, path))
            with os.fdopen(fd, "wb") as fh:
                os.fchmod(fh.fileno(), published_mode())  # mkstemp makes 0600; a published file gets the usual mode
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())

    try:
        yield stage
        for tmp, path in staged:
            os.replace(tmp, path)
        for directory in sorted({path.parent for _, path in staged}):
            fsync_dir(directory)
    finally:
        for tmp, _ in staged:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
