"""Listing a dataset directory: media files and captions, with their stat keys, and what could not be read.

Subdirectories are walked (names sorted, so the walk is the same everywhere); names starting with '.' are
skipped, files and directories alike. Symlinks are followed inside the dataset root; a directory reached a
second time (a symlink loop, or two links to one directory) is skipped with a warning. A media-named symlink
that is broken or loops becomes an entry with a `problem`, so it shows up in the manifest as an excluded row
instead of vanishing.

A symlink whose target resolves outside the dataset root is not followed unless the dataset opts in
(`follow_outside_links`): a media or caption link becomes an entry with problem 'outside_root' (an excluded
row: a caption link `leak.txt -> /etc/passwd` must never put that file into the manifest, which DVC pushes), a
directory link is skipped with a warning. Only symlinks pay for the check (one realpath each).

An unchanged rescan does little more than this walk (see snapshot.py), so the walk keeps per-file work to the
stat call and three list appends; `Entry` objects are built only when a scan needs them.
"""

from __future__ import annotations

import errno
import functools
import operator
import os
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from diffusion_pipe.scan.media import IMAGE_EXTS, VIDEO_EXTS

StatKey = tuple[int, int, int]  # (size, mtime_ns, inode): a file whose key is unchanged is not re-probed
Kind = Literal["media", "caption", "mask"]
# An item's loss mask lies beside it: `cat.png` + `cat.mask.png` (any case). Such a file is never an item itself.
MASK_SUFFIX = ".mask.png"


class Entry(NamedTuple):
    """One media, caption or mask file found under a dataset root."""

    rel: str  # POSIX path relative to the dataset root
    path: str  # the path to open (root joined with rel)
    kind: Kind
    stat_key: StatKey | None  # None when the file could not be stat'ed (see problem)
    problem: str = ""  # '', 'broken_symlink', 'symlink_loop', 'outside_root', 'not_regular_file', 'unreadable'
    detail: str = ""


@dataclass
class Listing:
    """Everything found under one dataset root, as columns sorted by relative path: `rels[i]` is a file of
    `kinds[i]` with stat key `stats[i]` (None when it could not be stat'ed: `problems[i]` says why)."""

    root: str = ""
    rels: list[str] = field(default_factory=list)
    kinds: list[Kind] = field(default_factory=list)
    stats: list[StatKey | None] = field(default_factory=list)
    problems: dict[int, tuple[str, str]] = field(default_factory=dict)  # index -> (problem, detail)
    ignored_files: int = 0  # neither media nor captions
    warnings: list[str] = field(default_factory=list)

    def entry(self, i: int) -> Entry:
        """The `i`th file as an `Entry` (as `entries[i]`, without building the others)."""
        return Entry(self.rels[i], os.path.join(self.root, self.rels[i]), self.kinds[i], self.stats[i],
                     *self.problems.get(i, ()))

    @functools.cached_property
    def entries(self) -> list[Entry]:
        """The files as `Entry` tuples, sorted by relative path."""
        prefix, problems = os.path.join(self.root, ""), self.problems  # root with one trailing separator
        return [Entry(rel, prefix + rel, kind, st, *problems[i]) if i in problems else
                Entry(rel, prefix + rel, kind, st)
                for i, (rel, kind, st) in enumerate(zip(self.rels, self.kinds, self.stats))]


_MEDIA_KINDS: dict[str, Kind] = {ext: "media" for ext in (*IMAGE_EXTS, *VIDEO_EXTS)}
_REGULAR_MASK, _REGULAR = 0o170000, 0o100000  # stat.S_IFMT's mask, stat.S_IFREG
_name = operator.attrgetter("name")


def list_dataset(root: str, follow_outside_links: bool = False, caption_extension: str = ".txt") -> Listing:
    """Walk `root` and return its media and caption files (`caption_extension`, any case), sorted by relative path.

    Symlinks resolving outside `root` are followed only with `follow_outside_links` (see the module docstring).
    """
    kinds_by_ext = {**_MEDIA_KINDS, caption_extension.lower(): "caption"}
    out = Listing(root=root)
    rels, kinds, stats, problems = out.rels, out.kinds, out.stats, out.problems
    real_root = os.path.join(os.path.realpath(root), "")  # with a trailing separator: a prefix of inside paths
    root_st = os.stat(root)
    seen_dirs = {(root_st.st_dev, root_st.st_ino)}
    stack = [""]  # relative directory paths still to walk
    while stack:
        rel_dir = stack.pop()
        abs_dir = os.path.join(root, rel_dir) if rel_dir else root
        prefix = f"{rel_dir}/" if rel_dir else ""
        try:
            with os.scandir(abs_dir) as it:
                dir_entries = sorted(it, key=_name)
        except OSError as exc:
            out.warnings.append(f"directory {rel_dir or '.'!s} not readable ({exc.strerror}); skipped")
            continue
        subdirs = []
        for de in dir_entries:
            name = de.name
            if name[0] == ".":
                continue
            rel = prefix + name
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
            outside = ""  # the target of a symlink that leaves the dataset root
            if not follow_outside_links and de.is_symlink():
                target = os.path.realpath(de.path)
                if not os.path.join(target, "").startswith(real_root):
                    outside = target
            if is_dir and outside:
                out.warnings.append(f"directory {rel} is a symlink to {outside}, outside the dataset root; skipped "
                                    "(set follow_outside_links: true on the dataset to scan it)")
                continue
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
            _, dot, suffix = name.rpartition(".")
            kind = kinds_by_ext.get("." + suffix.lower()) if dot else None
            if kind is None:
                out.ignored_files += 1
                continue
            if kind == "media" and name[-9:].lower() == MASK_SUFFIX:
                kind = "mask"
            try:
                st = de.stat()
            except OSError as exc:
                problems[len(rels)] = _stat_problem(exc)
                st = None
            if st is not None and st.st_mode & _REGULAR_MASK != _REGULAR:
                # A FIFO or device named like a media file: opening it could block forever.
                problems[len(rels)] = ("not_regular_file", "not a regular file")
                st = None
            if st is not None and outside:
                problems[len(rels)] = ("outside_root", f"symlink to {outside}, outside the dataset root (set "
                                                       "follow_outside_links: true on the dataset to use it)")
                st = None
            rels.append(rel)
            kinds.append(kind)
            stats.append(None if st is None else (st.st_size, st.st_mtime_ns, st.st_ino))
        # Reverse so the stack pops subdirectories in name order.
        stack.extend(reversed(subdirs))
    if any(rels[i] > rels[i + 1] for i in range(len(rels) - 1)):  # files beside subdirectories: walk order
        order = sorted(range(len(rels)), key=rels.__getitem__)
        out.rels, out.kinds, out.stats = [rels[i] for i in order], [kinds[i] for i in order], [stats[i] for i in order]
        where = {old: new for new, old in enumerate(order)}
        out.problems = {where[i]: p for i, p in problems.items()}
    return out


def _stat_problem(exc: OSError) -> tuple[str, str]:
    """(problem, detail) of a file that could not be stat'ed (its target missing, a symlink loop, permissions)."""
    if isinstance(exc, FileNotFoundError):
        return "broken_symlink", "symlink target does not exist"
    if exc.errno == errno.ELOOP:
        return "symlink_loop", "too many levels of symbolic links"
    return "unreadable", f"{type(exc).__name__}: {exc.strerror}"
