"""Listing a dataset directory: media files and captions, with their stat keys, and what could not be read.

Subdirectories are walked (names sorted, so the walk is the same everywhere); names starting with '.' are
skipped, files and directories alike. Symlinks are followed; a directory reached a second time (a symlink
loop, or two links to one directory) is skipped with a warning. A media-named symlink that is broken or loops
becomes an entry with a `problem`, so it shows up in the manifest as an excluded row instead of vanishing.
"""

from __future__ import annotations

import errno
import operator
import os
import stat
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from diffusion_pipe.scan.media import IMAGE_EXTS, VIDEO_EXTS

StatKey = tuple[int, int, int]  # (size, mtime_ns, inode): a file whose key is unchanged is not re-probed


class Entry(NamedTuple):
    """One media or caption file found under a dataset root (a tuple: a rescan builds one per file)."""

    rel: str  # POSIX path relative to the dataset root
    path: str  # the path to open (root joined with rel)
    kind: Literal["media", "caption"]
    stat_key: StatKey | None  # None when the file could not be stat'ed (see problem)
    problem: str = ""  # '', 'broken_symlink', 'symlink_loop', 'not_regular_file', 'unreadable'
    detail: str = ""


@dataclass
class Listing:
    """Everything found under one dataset root."""

    entries: list[Entry] = field(default_factory=list)
    ignored_files: int = 0  # neither media nor .txt
    warnings: list[str] = field(default_factory=list)


_KINDS: dict[str, Literal["media", "caption"]] = {
    **{ext: "media" for ext in (*IMAGE_EXTS, *VIDEO_EXTS)}, ".txt": "caption"}


_name = operator.attrgetter("name")


def list_dataset(root: str) -> Listing:
    """Walk `root` and return its media and caption files, sorted by relative path."""
    out = Listing()
    root_st = os.stat(root)
    seen_dirs = {(root_st.st_dev, root_st.st_ino)}
    stack = [""]  # relative directory paths still to walk
    while stack:
        rel_dir = stack.pop()
        abs_dir = os.path.join(root, rel_dir) if rel_dir else root
        try:
            with os.scandir(abs_dir) as it:
                dir_entries = sorted(it, key=_name)
        except OSError as exc:
            out.warnings.append(f"directory {rel_dir or '.'!s} not readable ({exc.strerror}); skipped")
            continue
        subdirs = []
        for de in dir_entries:
            if de.name.startswith("."):
                continue
            rel = f"{rel_dir}/{de.name}" if rel_dir else de.name
            try:
                rel.encode("utf-8")
            except UnicodeEncodeError:
                # The manifest stores paths as UTF-8 strings; a name that is not valid UTF-8 can't be one.
                out.warnings.append(f"file name is not valid UTF-8, skipped: {rel.encode('utf-8', 'replace')!r}")
                continue
            try:
                is_dir = de.is_dir()  # follows symlinks; False for a broken or looping link
            except OSError:
                is_dir = False
            if is_dir:
                try:
                    st = de.stat()
                except OSError as exc:
                    out.warnings.append(f"directory {rel} not readable ({exc.strerror}); skipped")
                    continue
                if (st.st_dev, st.st_ino) in seen_dirs:
                    out.warnings.append(f"directory {rel} was already scanned (symlink loop or second link); skipped")
                    continue
                seen_dirs.add((st.st_dev, st.st_ino))
                subdirs.append(rel)
                continue
            name = de.name
            _, dot, suffix = name.rpartition(".")  # _entry_kind, inlined: this runs for every file of a rescan
            kind = _KINDS.get("." + suffix.lower()) if dot else None
            if kind is None:
                out.ignored_files += 1
                continue
            try:
                st = de.stat()
            except OSError as exc:
                out.entries.append(_problem_entry(de, rel, kind, exc))
                continue
            if st.st_mode & _REGULAR_MASK == stat.S_IFREG:
                out.entries.append(Entry(rel, de.path, kind, (st.st_size, st.st_mtime_ns, st.st_ino)))
            else:  # a FIFO or device named like a media file: opening it could block forever
                out.entries.append(Entry(rel, de.path, kind, None, "not_regular_file", "not a regular file"))
        # Reverse so the stack pops subdirectories in name order.
        stack.extend(reversed(subdirs))
    out.entries.sort()  # by rel, the first field (unique, so the other fields are never compared)
    return out


_REGULAR_MASK = 0o170000  # stat.S_IFMT's mask


def _problem_entry(de: os.DirEntry[str], rel: str, kind: Literal["media", "caption"], exc: OSError) -> Entry:
    """The entry of a file that could not be stat'ed (its target missing, a symlink loop, permissions)."""
    if isinstance(exc, FileNotFoundError):
        return Entry(rel, de.path, kind, None, "broken_symlink", "symlink target does not exist")
    if exc.errno == errno.ELOOP:
        return Entry(rel, de.path, kind, None, "symlink_loop", "too many levels of symbolic links")
    return Entry(rel, de.path, kind, None, "unreadable", f"{type(exc).__name__}: {exc.strerror}")
