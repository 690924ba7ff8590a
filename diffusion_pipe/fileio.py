"""Atomic publication of files: a reader sees the old file or the whole new one, never a part."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


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


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Publish `obj` as stable, human-readable JSON (sorted keys, 2-space indent, trailing newline)."""
    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    write_bytes_atomic(path, text.encode("utf-8"))
