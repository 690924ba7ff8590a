"""The content-addressed store: packs of named tensors per family, indexed by their sidecars.

Layout under the root (an absolute path, by default ~/.cache/diffusion-pipe)::

    <root>/<family>/<packhash>.safetensors     immutable pack, named by the xxh3-128 of its bytes
    <root>/<family>/<packhash>.json            sidecar: key -> tensor names, shapes, dtypes; pack hash, size
    <root>/<family>/.pack-*.tmp, .*.json.*.tmp temp files of running (or crashed) writers; never read
    <root>/quarantine/<family>/                packs that failed verification, moved out of sight
    <root>/hash-cache/                         weights hash cache (diffusion_pipe.weights)
    <root>/remote-index/                       cached sidecars of remotes (diffusion_pipe.store.remote)
    <root>/leases/                             one file per running writer (encode): gc spares what it writes
    <root>/verified/<family>/<packhash>        the pack's (size, mtime, inode) when its bytes last hashed right

Read-path verification: when a sidecar is loaded, the pack's size is checked (one stat). On the first open of a
pack in a process, its safetensors header is checked against the sidecar (a few KB) and, with
``verify_reads=True`` (the default), its bytes are hashed: one sequential read of the pack at ~6 GB/s from page
cache, paid once per pack per process (bench/bench_store.py measures it). Every get() checks each tensor's
shape and dtype against the sidecar. A pack failing any check is quarantined and its entries become missing,
so encode recomputes them; get() raises a StoreError naming the pack and key unless another pack holds the key.

Encode checks the packs it reuses (`check_reused`): size, header and sidecar always, and the full hash once per
pack per machine, remembered under verified/ for as long as the pack's stat is unchanged; a pack that fails is
quarantined and its entries are recomputed in the same run. `verify` adopts an orphan pack (sidecar lost) whose
bytes still hash to its name, and quarantines it otherwise. `leftovers` lists what killed writers left behind
(temp files, leases); gc removes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from diffusion_pipe.store.pack import (
    PACK_ID_RE,
    PACK_SUFFIX,
    REPAIR_HINT,
    RESERVED_DIRS,
    SIDECAR_SUFFIX,
    TEMP_SUFFIX,
    PackWriter,
    Sidecar,
    StoreError,
    check_family,
    check_pack,
    dtype_name,
    owner_dead,
    read_sidecar,
    sidecar_from_pack,
    temp_owner,
    tensor_name,
)

ENV_VAR = "DIFFUSION_PIPE_STORE"
# Open safetensors handles kept per Store: each holds an mmap and a file descriptor.
_MAX_OPEN_PACKS = 64
# A running writer's lease file is touched this often; one untouched for LEASE_TTL_S belongs to a dead process.
LEASE_HEARTBEAT_S = 30.0
LEASE_TTL_S = 600.0
# Clock skew between machines sharing a store over a network filesystem, allowed for in lease times.
_LEASE_SLACK_S = 60.0
# A pack without a sidecar for this long belongs to no running writer (they write it right after the pack).
ORPHAN_AGE_S = 60.0


def default_root() -> Path:
    """$DIFFUSION_PIPE_STORE, else ~/.cache/diffusion-pipe, as an absolute path (not created)."""
    env = os.environ.get(ENV_VAR)
    return Path(env).expanduser().resolve() if env else (Path.home() / ".cache" / "diffusion-pipe").resolve()


@dataclass(frozen=True)
class Problem:
    """One pack or sidecar that failed verification."""

    family: str
    pack: str
    reason: str
    keys: tuple[str, ...] = ()
    quarantined_to: str | None = None
    adopted: bool = False  # an orphan pack whose sidecar was rebuilt from its verified bytes: repaired, not lost

    def __str__(self) -> str:
        where = f"; moved to {self.quarantined_to}" if self.quarantined_to else ""
        where += "; adopted (sidecar rebuilt from its header)" if self.adopted else ""
        return f"{self.family} pack {self.pack}: {self.reason} ({len(self.keys)} entries{where})"


@dataclass
class GcReport:
    """What gc() deleted and what it kept on purpose."""

    deleted_packs: list[str] = field(default_factory=list)
    deleted_bytes: int = 0
    deleted_temp_files: list[str] = field(default_factory=list)
    deleted_leases: list[str] = field(default_factory=list)  # of writers that died without releasing them
    kept_packs: int = 0
    mixed_packs: list[str] = field(default_factory=list)  # kept: hold kept and unkept keys
    unkept_entries_in_mixed_packs: int = 0
    young_packs: list[str] = field(default_factory=list)  # unkept but within the grace period
    in_use_packs: list[str] = field(default_factory=list)  # unkept, but written since a running writer started
    live_leases: int = 0  # running writers (encode) seen when gc ran


@dataclass
class _FamilyIndex:
    sidecars: dict[str, Sidecar] = field(default_factory=dict)  # pack id -> sidecar
    by_key: dict[str, list[str]] = field(default_factory=dict)  # key -> pack ids holding it
    problems: dict[str, str] = field(default_factory=dict)  # pack id -> why its sidecar was not indexed

    def add(self, sidecar: Sidecar) -> None:
        if sidecar.pack_id in self.sidecars:
            return
        self.sidecars[sidecar.pack_id] = sidecar
        for key in sidecar.entries:
            self.by_key.setdefault(key, []).append(sidecar.pack_id)

    def remove(self, pack_id: str) -> None:
        sidecar = self.sidecars.pop(pack_id, None)
        if sidecar is None:
            return
        for key in sidecar.entries:
            packs = self.by_key.get(key, [])
            if pack_id in packs:
                packs.remove(pack_id)
            if not packs:
                self.by_key.pop(key, None)


class _CorruptPack(Exception):
    pass


class Lease:
    """A running writer's claim on the store: gc keeps every file written since `started` while it lives.

    A daemon thread touches the lease file every LEASE_HEARTBEAT_S; a process killed with SIGKILL stops touching
    it, and gc ignores leases untouched for LEASE_TTL_S. Use `Store.lease()`.
    """

    def __init__(self, path: Path, purpose: str) -> None:
        self.path = path
        self.started = time.time()
        self.claimed_at: float | None = None
        self._stop = threading.Event()
        self._body = {"purpose": purpose, "host": socket.gethostname(), "pid": os.getpid(), "started": self.started}
        from diffusion_pipe.fileio import write_json_atomic

        write_json_atomic(path, self._body)
        self._thread = threading.Thread(target=self._beat, name=f"store-lease-{path.name}", daemon=True)
        self._thread.start()

    def claim(self, keys: dict[str, list[str]]) -> None:
        """Record the keys (family -> keys) this writer is about to compute, so that another writer starting on
        the same keys waits for them instead of computing them twice (`diffusion_pipe.store.claims`)."""
        from diffusion_pipe.fileio import write_json_atomic

        self.claimed_at = time.time()
        write_json_atomic(self.path, {**self._body, "claimed_at": self.claimed_at,
                                      "claims": {fam: sorted(k) for fam, k in keys.items()}})

    def _beat(self) -> None:
        while not self._stop.wait(LEASE_HEARTBEAT_S):
            with contextlib.suppress(FileNotFoundError):
                os.utime(self.path)

    def release(self) -> None:
        """End the claim: stop the heartbeat and remove the lease file."""
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def live_leases(root: Path, now: float | None = None) -> list[dict[str, Any]]:
    """The lease records under `root`/leases touched within LEASE_TTL_S (running writers)."""
    now = time.time() if now is None else now
    out = []
    try:
        entries = list(os.scandir(root / "leases"))
    except FileNotFoundError:
        return []
    for entry in entries:
        if not entry.name.endswith(".json") or entry.name.startswith("."):
            continue
        try:
            if now - entry.stat().st_mtime > LEASE_TTL_S:
                continue
            record = json.loads(Path(entry.path).read_bytes())
            if owner_dead(str(record.get("host")), int(record.get("pid", 0))):
                continue  # killed on this host (SIGKILL, OOM): it protects nothing, whatever its age
            out.append({**record, "file": entry.name})
        except (FileNotFoundError, json.JSONDecodeError, OSError):
            continue
    return out


class Store:
    """A content-addressed store of entries (named tensors) in immutable packs; see the module docstring."""

    def __init__(self, root: str | Path, *, verify_reads: bool = True) -> None:
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.verify_reads = verify_reads
        self._lock = threading.RLock()
        self._families: dict[str, _FamilyIndex] = {}
        self._verified: set[tuple[str, str]] = set()  # (family, pack id) fully checked in this process
        self._bad: set[tuple[str, str]] = set()  # failed a check but could not be moved (read-only store)
        self._handles: OrderedDict[tuple[str, str], Any] = OrderedDict()

    @classmethod
    def default(cls) -> Store:
        """The store at $DIFFUSION_PIPE_STORE, else ~/.cache/diffusion-pipe."""
        return cls(default_root())

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers receive a pickled Store: open handles and locks do not travel; the index and the
        # set of verified packs do (a pack verified by the parent needs no second full read).
        state = self.__dict__.copy()
        state["_lock"] = None
        state["_handles"] = OrderedDict()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    # ---------------------------------------------------------------- index

    def _family_dir(self, family: str) -> Path:
        return self.root / check_family(family)

    def _index(self, family: str) -> _FamilyIndex:
        index = self._families.get(family)
        if index is None:
            with self._lock:
                index = self._families.get(family)
                if index is None:
                    index = _FamilyIndex()
                    self._scan(family, index)
                    self._families[family] = index
        return index

    def _scan(self, family: str, index: _FamilyIndex) -> None:
        """Bring `index` up to date with the sidecars on disk. Sidecars are immutable: only new ones are parsed."""
        directory = self._family_dir(family)
        try:
            names = [e.name for e in os.scandir(directory) if e.name.endswith(SIDECAR_SUFFIX)]
        except FileNotFoundError:
            names = []
        on_disk = {n[: -len(SIDECAR_SUFFIX)] for n in names if PACK_ID_RE.match(n[: -len(SIDECAR_SUFFIX)])}
        for pack_id in list(index.sidecars):
            if pack_id not in on_disk:  # deleted by gc or quarantined by another process
                index.remove(pack_id)
                self._drop_handle(family, pack_id)
        index.problems = {p: r for p, r in index.problems.items() if p in on_disk}
        for pack_id in sorted(on_disk - set(index.sidecars) - set(index.problems)):
            if (family, pack_id) in self._bad:
                continue
            try:
                sidecar = read_sidecar(directory / (pack_id + SIDECAR_SUFFIX))
            except FileNotFoundError:
                continue
            except StoreError as exc:
                index.problems[pack_id] = str(exc)
                continue
            # The cheap check on every load: a missing or truncated pack never becomes visible.
            try:
                size = (directory / (pack_id + PACK_SUFFIX)).stat().st_size
            except FileNotFoundError:
                index.problems[pack_id] = "sidecar references a missing pack file"
                continue
            if size != sidecar.size:
                index.problems[pack_id] = f"pack is {size} bytes, its sidecar says {sidecar.size} (truncated)"
                continue
            index.add(sidecar)

    def refresh(self) -> None:
        """Re-read the sidecars of every loaded family, picking up packs published by other writers."""
        with self._lock:
            for family, index in self._families.items():
                self._scan(family, index)

    def _register(self, sidecar: Sidecar) -> None:
        """Index a pack this process just published. Its bytes were hashed on the way in (written here, or pulled
        and checked), so it is remembered as verified on this machine: the next run's `check_reused` does not read
        it all again (a 9 GB store of T5-XXL embeddings took 1.5 s of every incremental encode)."""
        with self._lock:
            self._bad.discard((sidecar.family, sidecar.pack_id))
            self._index(sidecar.family).add(sidecar)
        self._remember_verified(sidecar.family, sidecar.pack_id)

    def _remember_verified(self, family: str, pack_id: str) -> None:
        """The pack's bytes hashed right: remember it in this process and, by its stat, on this machine."""
        from diffusion_pipe.fileio import write_bytes_atomic

        self._verified.add((family, pack_id))
        with contextlib.suppress(OSError):  # a read-only store: hashed again next time, no harm
            write_bytes_atomic(self._marker(family, pack_id), self._stat_text(self.pack_path(family, pack_id)).encode())

    def families(self) -> list[str]:
        """The family directories present under the root."""
        try:
            entries = sorted(os.scandir(self.root), key=lambda e: e.name)
        except FileNotFoundError:
            return []
        return [e.name for e in entries if e.is_dir() and e.name not in RESERVED_DIRS and not e.name.startswith(".")]

    # ---------------------------------------------------------------- queries

    def contains(self, family: str, key: str) -> bool:
        """Whether a visible pack holds entry `key` (no pack is read)."""
        return key in self._index(family).by_key

    def missing(self, family: str, keys: Iterable[str]) -> list[str]:
        """The keys of `keys` that the store lacks, in their first-seen order, without duplicates."""
        by_key = self._index(family).by_key
        return [k for k in dict.fromkeys(keys) if k not in by_key]

    def spec(self, family: str, key: str) -> dict[str, tuple[tuple[int, ...], str]]:
        """Tensor name -> (shape, dtype name like 'float32') of entry `key`, from its sidecar; no tensor is read."""
        index = self._index(family)
        packs = index.by_key.get(key)
        if not packs:
            raise self._not_found(family, key)
        return index.sidecars[packs[0]].spec(key)

    def keys(self, family: str) -> list[str]:
        """Every key of `family` the store holds, sorted."""
        return sorted(self._index(family).by_key)

    def _not_found(self, family: str, key: str) -> StoreError:
        return StoreError(
            f"{family} entry {key} is not in the store at {self.root / family}: run the encode stage "
            "(or pull from the store's remote) to compute it"
        )

    def get(self, family: str, key: str) -> dict[str, torch.Tensor]:
        """The tensors of entry `key`, each checked against the sidecar's shape and dtype.

        A pack failing a check is quarantined and the next pack holding `key` is tried; with none left, a
        StoreError names the key and the pack.
        """
        index = self._index(family)
        packs = index.by_key.get(key)
        if not packs:
            raise self._not_found(family, key)
        failures: list[str] = []
        for pack_id in list(packs):
            sidecar = index.sidecars.get(pack_id)
            if sidecar is None:
                continue
            try:
                return self._read(sidecar, key)
            except _CorruptPack as exc:
                problem = self._reject(sidecar, str(exc))
                failures.append(str(problem))
            except FileNotFoundError:
                # Deleted by gc in another process after we indexed it: forget it, try another copy.
                with self._lock:
                    index.remove(pack_id)
                    self._drop_handle(family, pack_id)
                failures.append(f"{family} pack {pack_id}: deleted while in use (store gc?)")
        raise StoreError(
            f"{family} entry {key} cannot be read: {'; '.join(failures)}. Its entries are now missing: {REPAIR_HINT}"
        )

    def _read(self, sidecar: Sidecar, key: str) -> dict[str, torch.Tensor]:
        handle = self._open(sidecar)
        out: dict[str, torch.Tensor] = {}
        for name, (shape, dtype) in sidecar.spec(key).items():
            try:
                t = handle.get_tensor(tensor_name(key, name))
            except Exception as exc:  # safetensors raises its own SafetensorError for bad names and bytes
                raise _CorruptPack(f"tensor {name!r} of entry {key} is unreadable ({exc})") from exc
            if tuple(t.shape) != shape or dtype_name(t.dtype) != dtype:
                raise _CorruptPack(
                    f"tensor {name!r} of entry {key} is {dtype_name(t.dtype)}{list(t.shape)}, "
                    f"the sidecar says {dtype}{list(shape)}"
                )
            out[name] = t
        return out

    def _open(self, sidecar: Sidecar) -> Any:
        ident = (sidecar.family, sidecar.pack_id)
        with self._lock:
            handle = self._handles.get(ident)
            if handle is not None:
                self._handles.move_to_end(ident)
                return handle
            path = self.pack_path(sidecar.family, sidecar.pack_id)
            if not path.exists():
                raise FileNotFoundError(path)
            full = self.verify_reads and ident not in self._verified
            reason = check_pack(path, sidecar, full_hash=full)
            if reason is not None:
                raise _CorruptPack(reason)
            if full:
                self._verified.add(ident)
            handle = safe_open(str(path), framework="pt", device="cpu")
            self._handles[ident] = handle
            while len(self._handles) > _MAX_OPEN_PACKS:
                self._handles.popitem(last=False)
            return handle

    def _drop_handle(self, family: str, pack_id: str) -> None:
        self._handles.pop((family, pack_id), None)

    def _marker(self, family: str, pack_id: str) -> Path:
        return self.root / "verified" / family / pack_id

    @staticmethod
    def _stat_text(path: Path) -> str:
        st = path.stat()
        return f"{st.st_size} {st.st_mtime_ns} {st.st_ino}"

    def check_reused(self, family: str, keys: Iterable[str]) -> list[Problem]:
        """Check the packs holding `keys` before their entries are reused; quarantine those that fail.

        Always: size, header and sidecar (a few KB). The full hash once per pack per machine: a pack whose bytes
        hashed right is remembered by its (size, mtime_ns, inode) under verified/, and hashed again only when its
        stat changes (rewriting a byte changes it; `store verify` re-hashes everything regardless). Returns the
        packs quarantined; their entries are then missing (`missing()`), for the caller to recompute.
        """
        index = self._index(family)
        pack_ids = sorted({p for k in dict.fromkeys(keys) for p in index.by_key.get(k, ())})
        problems = []
        for pack_id, reason in sorted(index.problems.items()):  # failed the cheap check when indexed (truncated)
            problems.append(Problem(family, pack_id, reason, (), str(self.quarantine(family, pack_id))))
        for pack_id in pack_ids:
            sidecar = index.sidecars.get(pack_id)
            if sidecar is None:
                continue
            path, marker = self.pack_path(family, pack_id), self._marker(family, pack_id)
            try:
                known = marker.read_text() == self._stat_text(path)
            except OSError:
                known = False
            reason = check_pack(path, sidecar, full_hash=not known)
            if reason is not None:
                problems.append(self._reject(sidecar, reason))
                with contextlib.suppress(OSError):
                    marker.unlink()
            elif not known:
                self._remember_verified(family, pack_id)
        return problems

    def check_keys(self, family: str, keys: Iterable[str]) -> None:
        """Fail before training starts if any key is missing or its pack fails the read-path checks.

        Opens (and, with verify_reads, hashes) every pack holding one of `keys`, once per process.
        """
        keys = list(dict.fromkeys(keys))
        absent = self.missing(family, keys)
        if absent:
            raise StoreError(
                f"{len(absent)} of {len(keys)} {family} entries are not in the store at {self.root / family} "
                f"(first: {absent[0]}): {REPAIR_HINT}, or pull them from the store's remote"
            )
        index = self._index(family)
        for pack_id in sorted({index.by_key[k][0] for k in keys}):
            sidecar = index.sidecars[pack_id]
            try:
                self._open(sidecar)
            except _CorruptPack as exc:
                problem = self._reject(sidecar, str(exc))
                raise StoreError(
                    f"{problem}. Entries such as {next(iter(sidecar.entries))} are now missing: {REPAIR_HINT}"
                ) from None

    # ---------------------------------------------------------------- paths

    def pack_path(self, family: str, pack_id: str) -> Path:
        """Where pack `pack_id` of `family` lives."""
        return self._family_dir(family) / (pack_id + PACK_SUFFIX)

    def sidecar_path(self, family: str, pack_id: str) -> Path:
        """Where the sidecar of pack `pack_id` lives."""
        return self._family_dir(family) / (pack_id + SIDECAR_SUFFIX)

    def packs(self, family: str) -> dict[str, Sidecar]:
        """Pack id -> sidecar of every visible pack of `family`."""
        return dict(self._index(family).sidecars)

    # ---------------------------------------------------------------- writing

    def writer(self, family: str, pack_bytes: int = 256 << 20) -> PackWriter:
        """A PackWriter publishing `family` packs of about `pack_bytes` each; use it as a context manager."""
        return PackWriter(self, family, pack_bytes)

    @contextlib.contextmanager
    def lease(self, purpose: str) -> Iterator[Lease]:
        """Hold a Lease while writing: gc deletes nothing written since it began until it is released."""
        name = f"{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}.json"
        lease = Lease(self.root / "leases" / name, purpose)
        try:
            yield lease
        finally:
            lease.release()

    # ---------------------------------------------------------------- verification

    def quarantine(self, family: str, pack_id: str) -> Path:
        """Move a pack and its sidecar out of sight to <root>/quarantine/<family>/; its entries become missing.

        The sidecar moves first, so the pack is invisible before it moves. Safe to call concurrently.
        """
        src_dir = self._family_dir(family)
        dest = self.root / "quarantine" / family
        dest.mkdir(parents=True, exist_ok=True)
        for suffix in (SIDECAR_SUFFIX, PACK_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                os.replace(src_dir / (pack_id + suffix), dest / (pack_id + suffix))
        with self._lock:
            index = self._index(family)
            index.remove(pack_id)
            index.problems.pop(pack_id, None)
            self._drop_handle(family, pack_id)
            self._verified.discard((family, pack_id))
        return dest

    def _reject(self, sidecar: Sidecar, reason: str) -> Problem:
        """Take a pack that failed a check out of use: quarantine it, or at least hide it in this process."""
        family, pack_id = sidecar.family, sidecar.pack_id
        try:
            where: str | None = str(self.quarantine(family, pack_id))
        except OSError as exc:  # e.g. a read-only shared store
            with self._lock:
                self._bad.add((family, pack_id))
                self._index(family).remove(pack_id)
                self._drop_handle(family, pack_id)
            reason += f"; could not quarantine it ({exc}): delete {self.pack_path(family, pack_id)} and its sidecar"
            where = None
        return Problem(family, pack_id, reason, tuple(sidecar.entries), where)

    def verify(self, family: str | None = None, *, quarantine: bool = True) -> list[Problem]:
        """Re-hash every pack (of `family`, or all) and check it against its sidecar.

        Returns the problems found; with `quarantine`, failing packs and orphan sidecars are moved to
        <root>/quarantine/ so their entries become missing and the next encode recomputes them.
        """
        families = [family] if family is not None else self.families()
        problems: list[Problem] = []
        for fam in families:
            problems += self._adopt_orphans(fam, quarantine)
            index = self._index(fam)
            with self._lock:
                self._scan(fam, index)
            for pack_id, reason in sorted(index.problems.items()):
                where = str(self.quarantine(fam, pack_id)) if quarantine else None
                problems.append(Problem(fam, pack_id, reason, (), where))
            for pack_id, sidecar in sorted(index.sidecars.items()):
                reason = check_pack(self.pack_path(fam, pack_id), sidecar, full_hash=True)
                if reason is None:
                    self._verified.add((fam, pack_id))
                elif quarantine:
                    problems.append(self._reject(sidecar, reason))
                else:
                    problems.append(Problem(fam, pack_id, reason, tuple(sidecar.entries)))
        return problems

    def _orphans(self, family: str) -> list[Path]:
        """Packs of `family` without a sidecar (a writer died between publishing the pack and its sidecar, or the
        sidecar was deleted): invisible, so their entries would be recomputed and the pack never reported."""
        directory = self._family_dir(family)
        try:
            names = {e.name for e in os.scandir(directory)}
        except FileNotFoundError:
            return []
        out, now = [], time.time()
        for n in sorted(names):
            if not (n.endswith(PACK_SUFFIX) and PACK_ID_RE.match(n[: -len(PACK_SUFFIX)])
                    and n[: -len(PACK_SUFFIX)] + SIDECAR_SUFFIX not in names):
                continue
            with contextlib.suppress(FileNotFoundError):
                # A running writer publishes the sidecar milliseconds after the pack: only a pack left alone
                # for ORPHAN_AGE_S is an orphan.
                if now - (directory / n).stat().st_mtime >= ORPHAN_AGE_S:
                    out.append(directory / n)
        return out

    def _adopt_orphans(self, family: str, quarantine: bool) -> list[Problem]:
        """Give each orphan pack back its sidecar when its bytes hash to its name (adopted), else quarantine it."""
        from diffusion_pipe.fileio import write_bytes_atomic
        from diffusion_pipe.hashing import canonical_json

        out = []
        for path in self._orphans(family):
            pack_id = path.name[: -len(PACK_SUFFIX)]
            try:
                sidecar = sidecar_from_pack(path, family)
            except StoreError as exc:
                where = str(self.quarantine(family, pack_id)) if quarantine else None
                out.append(Problem(family, pack_id, f"orphan pack without sidecar: {exc}", (), where))
                continue
            except FileNotFoundError:
                continue
            if quarantine:  # "report only" leaves the store as it is
                write_bytes_atomic(self.sidecar_path(family, pack_id), canonical_json(sidecar.to_json()).encode())
                self._register(sidecar)
            out.append(Problem(family, pack_id, "orphan pack without sidecar", tuple(sidecar.entries),
                               adopted=quarantine))
        return out

    def leftovers(self) -> dict[str, Any]:
        """What writers that died left behind: temp files (count, bytes, how many of a process known dead),
        lease files no running writer holds, and orphan packs. `gc` removes temp files and leases; `verify`
        adopts or quarantines orphans."""
        now = time.time()
        live = {lease["file"] for lease in live_leases(self.root, now)}
        temp: list[tuple[str, int, bool]] = []
        for fam in self.families():
            with contextlib.suppress(FileNotFoundError):
                for entry in os.scandir(self._family_dir(fam)):
                    if entry.name.startswith(".") and entry.name.endswith(TEMP_SUFFIX):
                        owner = temp_owner(entry.name)
                        with contextlib.suppress(FileNotFoundError):
                            temp.append((f"{fam}/{entry.name}", entry.stat().st_size,
                                         owner is not None and owner_dead(*owner)))
        leases = []
        with contextlib.suppress(FileNotFoundError):
            leases = sorted(e.name for e in os.scandir(self.root / "leases")
                            if e.name.endswith(".json") and not e.name.startswith(".") and e.name not in live)
        return {"temp_files": [t[0] for t in temp], "temp_bytes": sum(t[1] for t in temp),
                "temp_files_of_dead_writers": sum(t[2] for t in temp), "dead_leases": leases,
                "orphan_packs": [f"{fam}/{p.name}" for fam in self.families() for p in self._orphans(fam)]}

    # ---------------------------------------------------------------- remote sync

    def pull(self, remote_url: Any, family: str, keys: Iterable[str], **remote_config: Any) -> int:
        """Download from a remote the packs holding those of `keys` this store lacks; return how many keys it gained.

        `remote_url` is a path, ``ssh://user@host:port/path``, ``s3://bucket/prefix`` (S3-compatible servers via
        ``endpointurl=``), or a diffusion_pipe.store.remote.Remote; `remote_config` takes DVC remote options.
        """
        from diffusion_pipe.store import remote as sync

        return sync.pull(self, _as_remote(remote_url, remote_config), family, list(keys))

    def push(
        self,
        remote_url: Any,
        family: str,
        keys: Iterable[str] | None = None,
        packs: Iterable[str] | None = None,
        **remote_config: Any,
    ) -> int:
        """Upload to a remote the packs holding `keys` (or `packs`, or all) that it lacks; return packs uploaded."""
        from diffusion_pipe.store import remote as sync

        return sync.push(
            self,
            _as_remote(remote_url, remote_config),
            family,
            keys=None if keys is None else list(keys),
            packs=None if packs is None else list(packs),
        )

    # ---------------------------------------------------------------- accounting and gc

    def status(self) -> dict[str, dict[str, int]]:
        """Per family: visible packs, distinct entries, and pack bytes."""
        self.refresh()
        out: dict[str, dict[str, int]] = {}
        for fam in self.families():
            index = self._index(fam)
            out[fam] = {
                "packs": len(index.sidecars),
                "entries": len(index.by_key),
                "bytes": sum(s.size for s in index.sidecars.values()),
            }
        return out

    def gc(self, keep: set[tuple[str, str]], grace_seconds: float, *, dry_run: bool = False) -> GcReport:
        """Delete packs none of whose entries are in `keep` ((family, key) pairs) and that are older than the grace.

        A pack holding both kept and unkept entries is kept whole: packs are immutable, and rewriting the kept
        part would cost a full read and write for little space (the report counts such packs). Temp files and
        orphan packs (no sidecar: a writer crashed between rename and sidecar) are deleted only when older than
        `grace_seconds`. Nothing written since a running writer (a live `lease()`) started is deleted, whatever
        its age, so a running encode's packs and temp files are never touched. Sidecars go before packs, so a
        reader never sees a sidecar whose pack is gone.
        """
        report = GcReport()
        now = time.time()
        leases = live_leases(self.root, now)
        report.live_leases = len(leases)
        # Lease files of writers that died without releasing them (SIGKILL, power loss): a process known dead on
        # this host at once, any other once untouched for LEASE_TTL_S.
        live = {lease["file"] for lease in leases}
        with contextlib.suppress(FileNotFoundError):
            for entry in list(os.scandir(self.root / "leases")):
                if entry.name in live or not entry.name.endswith(".json") or entry.name.startswith("."):
                    continue
                report.deleted_leases.append(entry.name)
                if not dry_run:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
        # Files written since the oldest running writer started may belong to it (packs it published but has not
        # yet recorded in an encoded table, temp files it is writing): spared whatever the grace period.
        protect_from = min((float(lease["started"]) for lease in leases), default=float("inf")) - _LEASE_SLACK_S

        def in_use(path: Path) -> bool:
            try:
                return path.stat().st_mtime >= protect_from
            except FileNotFoundError:
                return False

        def old(path: Path) -> bool:
            try:
                return now - path.stat().st_mtime >= grace_seconds and not in_use(path)
            except FileNotFoundError:
                return False

        for fam in self.families():
            directory = self._family_dir(fam)
            index = self._index(fam)
            with self._lock:
                self._scan(fam, index)
            for pack_id, sidecar in sorted(index.sidecars.items()):
                kept = sum((fam, k) in keep for k in sidecar.entries)
                if kept:
                    report.kept_packs += 1
                    if kept < len(sidecar.entries):
                        report.mixed_packs.append(pack_id)
                        report.unkept_entries_in_mixed_packs += len(sidecar.entries) - kept
                    continue
                pack, side = directory / (pack_id + PACK_SUFFIX), directory / (pack_id + SIDECAR_SUFFIX)
                if in_use(pack) or in_use(side):
                    report.in_use_packs.append(pack_id)
                    continue
                if not (old(pack) and old(side)):
                    report.young_packs.append(pack_id)
                    continue
                report.deleted_packs.append(pack_id)
                report.deleted_bytes += sidecar.size
                if not dry_run:
                    with contextlib.suppress(FileNotFoundError):
                        side.unlink()
                    with contextlib.suppress(FileNotFoundError):
                        pack.unlink()
                    with contextlib.suppress(FileNotFoundError):
                        self._marker(fam, pack_id).unlink()
                    with self._lock:
                        index.remove(pack_id)
                        self._drop_handle(fam, pack_id)
            for entry in list(os.scandir(directory)):
                path = Path(entry.path)
                stem = entry.name.split(".")[0]
                is_temp = entry.name.startswith(".") and entry.name.endswith(TEMP_SUFFIX)
                orphan_pack = (
                    entry.name.endswith(PACK_SUFFIX)
                    and PACK_ID_RE.match(stem) is not None
                    and not (directory / (stem + SIDECAR_SUFFIX)).exists()
                )
                orphan_sidecar = stem in index.problems and entry.name.endswith(SIDECAR_SUFFIX)
                owner = temp_owner(entry.name) if is_temp else None
                if is_temp and owner is not None and owner_dead(*owner):  # its writer is gone: no grace needed
                    report.deleted_temp_files.append(entry.name)
                    if not dry_run:
                        with contextlib.suppress(FileNotFoundError):
                            path.unlink()
                    continue
                if (is_temp or orphan_pack or orphan_sidecar) and old(path):
                    report.deleted_temp_files.append(entry.name)
                    if not dry_run:
                        with contextlib.suppress(FileNotFoundError):
                            path.unlink()
        return report


def _as_remote(remote: Any, config: dict[str, Any]) -> Any:
    from diffusion_pipe.store.remote import Remote

    if isinstance(remote, Remote):
        if config:
            raise StoreError("pass remote options to Remote(...) when giving a Remote object, not to pull/push")
        return remote
    return Remote(str(remote), **config)
