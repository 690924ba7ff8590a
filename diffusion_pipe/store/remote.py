"""Sharing the store across machines through a remote: a local or network path, SSH/SFTP, or S3(-compatible).

The remote holds the same layout as a local store (``<remote>/<family>/<packhash>.safetensors`` and ``.json``),
reached through DVC's filesystem layer (dvc-objects; dvc-ssh and dvc-s3 for those schemes), so every protocol
detail and credential option is DVC's. Transfers move whole packs, pack first and sidecar last, each made
visible atomically (temp name + rename, or a single object PUT on object stores), so a remote, like a local
store, never shows a sidecar whose pack is incomplete. Downloaded packs are hashed before they are published
locally: a corrupt remote pack is reported and skipped, never used.

Remote sidecars are immutable like local ones, so each is downloaded once and cached under
``<store root>/remote-index/<hash of the remote url, password masked>/<family>/``.

A remote never waits on a person or forever: SSH never prompts for a password or passphrase (a wrong or missing
credential fails at once, naming the remote), and SSH and S3 connections, logins and reads time out after
`timeout_s` without an answer (SSH keepalives catch a peer that stops answering mid-transfer). Every failure to
reach the remote is a RemoteError naming it, with its password masked.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffusion_pipe.fileio import fsync_dir, published_mode, write_bytes_atomic
from diffusion_pipe.hashing import hash_bytes
from diffusion_pipe.redact import redact
from diffusion_pipe.store.pack import (
    PACK_ID_RE,
    PACK_SUFFIX,
    REPAIR_HINT,
    SIDECAR_SUFFIX,
    TEMP_PREFIX,
    TEMP_SUFFIX,
    Sidecar,
    StoreError,
    check_family,
    check_pack,
    read_sidecar,
    temp_prefix,
)

if TYPE_CHECKING:
    from dvc_objects.fs.base import FileSystem

    from diffusion_pipe.store.store import Store

log = logging.getLogger(__name__)

# Object stores make a single PUT visible atomically; everywhere else we upload to a temp name and rename.
_OBJECT_STORE_PROTOCOLS = frozenset({"s3", "gs", "gcs", "azure", "oss"})
# How long a remote may stay silent (connect, login, a read, a keepalive) before the operation fails, unless the DVC
# remote sets its own. dvc-ssh's own default is 30 minutes for the connection alone and none at all once connected.
REMOTE_TIMEOUT_S = 60.0
# DVC options that make dvc-ssh prompt on standard input: a pipeline stage has nobody to answer.
_PROMPT_OPTIONS = ("ask_password", "ask_passphrase")
_CREDENTIAL_HINT = (
    "check the URL, the credentials (for SSH a key file, or `dvc remote modify --local NAME password ...`, which "
    "keeps it out of git; for S3 the AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY environment variables or "
    "`dvc remote modify --local`) and the network"
)


class RemoteError(StoreError):
    """The store remote could not be reached, refused the credentials or stopped answering; the message names the
    remote (password masked) and what to check."""


def _ssh_without_prompts(base: type, timeout_s: float) -> type:
    """dvc-ssh's filesystem class, minus its prompts and plus timeouts.

    dvc-ssh's client asks for a password on stdin when the configured one is refused (or none is given), and for
    key passphrases: under a scheduler with stdin open that waits forever. asyncssh's plain client never asks:
    authentication with what is configured (password, key file, agent, default keys) succeeds or fails.
    Keepalives every timeout_s / 3, three unanswered, close a connection whose peer froze after answering; the
    connection and login are bounded by dvc-ssh's own `timeout` option, which Remote sets.
    """
    import asyncssh

    class SSHWithoutPrompts(base):  # type: ignore[misc, valid-type]
        def _prepare_credentials(self, **config: Any) -> dict[str, Any]:
            args = super()._prepare_credentials(**config)
            args.update(client_factory=asyncssh.SSHClient, keepalive_interval=timeout_s / 3, keepalive_count_max=2)
            return args

    return SSHWithoutPrompts


def _s3_without_retry_storms(base: type) -> type:
    """dvc-s3's filesystem class with botocore's retries off: s3fs already retries each call (5 attempts, with
    back-off), and botocore's own retries inside each of those multiply a silent endpoint's wait to some 40
    timeouts; without them it is about 5."""

    class S3WithoutRetryStorms(base):  # type: ignore[misc, valid-type]
        def _prepare_credentials(self, **config: Any) -> dict[str, Any]:
            args = super()._prepare_credentials(**config)
            args.setdefault("config_kwargs", {}).setdefault("retries", {"total_max_attempts": 1})
            return args

    return S3WithoutRetryStorms


class Remote:
    """A store remote at `url`; `config` holds DVC remote options (e.g. endpointurl, access_key_id, keyfile, port).

    SSH and S3 operations fail after `timeout_s` without an answer, unless the DVC options set their own timeouts
    (ssh: timeout; s3: connect_timeout, read_timeout); s3fs retries an S3 call up to 5 times, so a silent S3
    endpoint fails after about 5 x timeout_s.
    """

    def __init__(self, url: str, *, timeout_s: float = REMOTE_TIMEOUT_S, **config: Any) -> None:
        from dvc.fs import get_cloud_fs  # imported on use: DVC's import is heavy

        # What we print and record (errors, reports, lineage, the remote-index folder's name): never a password.
        self.url = redact(url)
        # a timeout given to the DVC remote (SSH's `timeout`, S3's `read_timeout`) is the one every wait here uses:
        # the keepalives, the connection and what an error says
        given = config.get("timeout") or config.get("read_timeout")
        self.timeout_s = timeout_s = float(given) if given else timeout_s
        prompting = [o for o in _PROMPT_OPTIONS if config.get(o)]
        if prompting:
            raise StoreError(
                f"store remote {self.url!r} has {prompting[0]} set, which prompts on standard input, where a "
                f"pipeline stage has nobody to answer: remove it (`dvc remote modify NAME --unset {prompting[0]}`) "
                "and give the credential with `dvc remote modify --local NAME password ...` (or passphrase), "
                "which stays out of git, or a key file"
            )
        try:
            cls, fs_config, self.path = get_cloud_fs({}, url=url, **config)
        except Exception as exc:  # DVC raises its own config and missing-plugin errors
            raise StoreError(
                f"cannot use store remote {self.url!r} ({redact(str(exc))}): check the URL and options; ssh:// "
                "needs dvc-ssh and s3:// needs dvc-s3 installed"
            ) from None
        if cls.protocol == "ssh":
            cls = _ssh_without_prompts(cls, timeout_s)
            fs_config.setdefault("timeout", max(1, round(timeout_s)))  # connection setup, in whole seconds
        elif cls.protocol == "s3":
            cls = _s3_without_retry_storms(cls)
            fs_config.setdefault("connect_timeout", timeout_s)
            fs_config.setdefault("read_timeout", timeout_s)
        self.fs: FileSystem = cls(**fs_config)

    @contextlib.contextmanager
    def answering(self, what: str) -> Iterator[None]:
        """Turn any failure to `what` ("download from", "upload to", ...) the remote into a RemoteError naming it.

        Each filesystem (ssh, s3, ...) raises its own exception types; StoreErrors pass through unchanged.
        """
        try:
            yield
        except StoreError:
            raise
        except Exception as exc:
            message = redact(str(exc)) or "no message"
            if isinstance(exc, TimeoutError) or "timeout" in type(exc).__name__.lower() or "keepalive" in message:
                message += (f"; it did not answer within {self.timeout_s:.0f} s (to wait longer, set the DVC "
                            "remote's `timeout` option for SSH, `read_timeout` for S3)")
            raise RemoteError(
                f"cannot {what} the store remote {self.url} ({type(exc).__name__}: {message}): {_CREDENTIAL_HINT}"
            ) from None  # the chained traceback would print the unredacted message

    @classmethod
    def from_dvc(cls, repo_root: str | Path, name: str | None = None, subdir: str = "diffusion-pipe-store") -> Remote:
        """The store remote inside a DVC remote of the repo (`name`, else the default remote), under `subdir`.

        Packs live beside DVC's own objects (``files/md5/``), in a folder DVC never touches.
        """
        from dvc.config import Config

        config = Config(dvc_dir=str(Path(repo_root).resolve() / ".dvc"))
        name = name or config.get("core", {}).get("remote")
        if not name or name not in config.get("remote", {}):
            raise StoreError(
                f"no DVC remote {name or '(default)'} in {repo_root}/.dvc/config: add one with "
                "`dvc remote add -d NAME URL`, or pass the store remote's URL"
            )
        options = dict(config["remote"][name])
        warning = committed_secret_warning(config.load_one("repo").get("remote", {}).get(name, {}), name)
        if warning:
            log.warning(warning)
        url = options.pop("url").rstrip("/") + "/" + subdir
        return cls(url, **options)

    def __repr__(self) -> str:
        return f"Remote({self.url!r})"

    def _join(self, *parts: str) -> str:
        return self.fs.join(self.path, *parts)

    def pack_ids(self, family: str) -> list[str]:
        """Ids of the packs of `family` on the remote that have a sidecar (the visible ones), sorted."""
        try:
            names = self.fs.ls(self._join(family), detail=False)
        except FileNotFoundError:
            return []
        ids = []
        for name in names:
            base = name.rstrip("/").rsplit("/", 1)[-1]
            stem = base[: -len(SIDECAR_SUFFIX)]
            if base.endswith(SIDECAR_SUFFIX) and PACK_ID_RE.match(stem):
                ids.append(stem)
        return sorted(ids)

    def _publish(self, local: Path, family: str, name: str) -> None:
        """Upload `local` as <remote>/<family>/<name>, visible only once complete."""
        final = self._join(family, name)
        if self.fs.protocol in _OBJECT_STORE_PROTOCOLS or (
            isinstance(self.fs.protocol, tuple) and set(self.fs.protocol) & _OBJECT_STORE_PROTOCOLS
        ):
            self.fs.put_file(os.fspath(local), final)
            return
        self.fs.makedirs(self._join(family), exist_ok=True)
        tmp = self._join(family, f"{TEMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}{TEMP_SUFFIX}")
        try:
            self.fs.put_file(os.fspath(local), tmp)
            self.fs.mv(tmp, final)
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm_file(tmp)
            raise


def _index_dir(store: Store, remote: Remote, family: str) -> Path:
    return store.root / "remote-index" / hash_bytes(remote.url.encode("utf-8")) / family


def remote_sidecars(store: Store, remote: Remote, family: str) -> dict[str, Sidecar]:
    """Pack id -> sidecar of every visible pack of `family` on the remote, downloading only unseen sidecars."""
    with remote.answering("list"):
        return _remote_sidecars(store, remote, family)


def _remote_sidecars(store: Store, remote: Remote, family: str) -> dict[str, Sidecar]:
    cache = _index_dir(store, remote, family)
    out: dict[str, Sidecar] = {}
    for pack_id in remote.pack_ids(family):
        path = cache / (pack_id + SIDECAR_SUFFIX)
        if not path.exists():
            data = remote.fs.cat_file(remote._join(family, pack_id + SIDECAR_SUFFIX))
            write_bytes_atomic(path, data)
        try:
            out[pack_id] = read_sidecar(path)
        except StoreError as exc:
            path.unlink(missing_ok=True)
            log.warning("skipping remote %s pack %s of %s: %s", family, pack_id, remote.url, exc)
    return out


def pull(store: Store, remote: Remote, family: str, keys: list[str]) -> int:
    """Download the packs that hold the requested keys the store lacks; return how many of those keys it gained.

    Chooses few packs greedily (most wanted keys first). Each pack is downloaded to a temp file beside the store's
    packs, hashed against its id, renamed into place, and only then its sidecar is written.
    """
    check_family(family)
    wanted = set(store.missing(family, keys))
    if not wanted:
        return 0
    with remote.answering("download from"):
        return _pull(store, remote, family, wanted)


def _pull(store: Store, remote: Remote, family: str, wanted: set[str]) -> int:
    sidecars = _remote_sidecars(store, remote, family)
    holders = sorted(
        ((len(wanted & sc.entries.keys()), pack_id) for pack_id, sc in sidecars.items()), key=lambda t: (-t[0], t[1])
    )
    gained = 0
    directory = store.root / family
    directory.mkdir(parents=True, exist_ok=True)
    for _, pack_id in holders:
        sidecar = sidecars[pack_id]
        new = wanted & sidecar.entries.keys()
        if not new:
            continue
        fd, tmp_name = tempfile.mkstemp(prefix=temp_prefix(), suffix=TEMP_SUFFIX, dir=directory)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            remote.fs.get_file(remote._join(family, pack_id + PACK_SUFFIX), tmp_name)
            reason = check_pack(tmp, sidecar, full_hash=True)
            if reason is not None:
                log.warning(
                    "remote %s pack %s of %s is corrupt (%s): not pulled, its entries will be recomputed",
                    family,
                    pack_id,
                    remote.url,
                    reason,
                )
                continue
            with open(tmp, "rb+") as fh:
                os.fchmod(fh.fileno(), published_mode())  # as a pack written here: the umask's mode, not 0600
                os.fsync(fh.fileno())
            os.replace(tmp, directory / (pack_id + PACK_SUFFIX))
            fsync_dir(directory)
        except FileNotFoundError:
            log.warning("remote %s pack %s of %s vanished (remote gc?): skipped", family, pack_id, remote.url)
            continue
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        cached = _index_dir(store, remote, family) / (pack_id + SIDECAR_SUFFIX)
        write_bytes_atomic(directory / (pack_id + SIDECAR_SUFFIX), cached.read_bytes())
        store._register(sidecar)
        gained += len(new)
        wanted -= new
        if not wanted:
            break
    return gained


def lacking_packs(store: Store, remote: Remote, family: str, keys: Iterable[str]) -> list[str]:
    """The local packs to upload for the remote to hold every one of `keys`, all of which the store must hold.

    A key counts as on the remote when a pack holding it (by its local sidecar) is listed there: one listing, no
    download. The keys it lacks are covered by few local packs, chosen greedily (most such keys first).
    """
    check_family(family)
    with remote.answering("list"):
        on_remote = set(remote.pack_ids(family))
    return _lacking(store, family, set(keys), on_remote)


def _lacking(store: Store, family: str, keys: set[str], on_remote: set[str]) -> list[str]:
    absent = store.missing(family, sorted(keys))
    if absent:
        raise StoreError(
            f"{family} entry {absent[0]} is not in the store at {store.root / family}: run encode before pushing"
        )
    local = store.packs(family)
    needed = keys - {k for pid in on_remote & local.keys() for k in local[pid].entries}
    chosen: list[str] = []
    while needed:
        best = min(local, key=lambda pid: (-len(needed & local[pid].entries.keys()), pid))
        chosen.append(best)
        needed -= local[best].entries.keys()
    return sorted(chosen)


def push(store: Store, remote: Remote, family: str, keys: list[str] | None = None, packs: list[str] | None = None) -> int:
    """Upload local packs the remote lacks; return how many were uploaded.

    Uploads `packs`, or what the remote lacks to hold every one of `keys` (as `lacking_packs` chooses), or
    (neither given) every pack of `family`. Each pack is verified against its sidecar first, so corruption never
    spreads; the sidecar is uploaded after its pack.
    """
    check_family(family)
    local = store.packs(family)
    if packs is not None:
        unknown = [p for p in packs if p not in local]
        if unknown:
            raise StoreError(f"{family} pack {unknown[0]} is not in the store at {store.root / family}: nothing pushed")
    with remote.answering("upload to"):
        on_remote = set(remote.pack_ids(family))
        if packs is not None:
            chosen = list(dict.fromkeys(packs))
        elif keys is not None:
            chosen = _lacking(store, family, set(keys), on_remote)
        else:
            chosen = sorted(local)
        uploaded = 0
        for pack_id in chosen:
            if pack_id in on_remote:  # same id, same bytes
                continue
            sidecar = local[pack_id]
            pack_path = store.pack_path(family, pack_id)
            reason = check_pack(pack_path, sidecar, full_hash=True)
            if reason is not None:
                problem = store._reject(sidecar, reason)
                raise StoreError(f"{problem}: not pushed; its entries are now missing: {REPAIR_HINT}")
            remote._publish(pack_path, family, pack_id + PACK_SUFFIX)
            remote._publish(store.sidecar_path(family, pack_id), family, pack_id + SIDECAR_SUFFIX)
            uploaded += 1
    return uploaded


def resolve_remote(spec: str, repo_root: str | Path = ".", param: str = "encode.remote") -> Remote | None:
    """The store remote that `spec` (the value of `param`) names, or None for none.

    "dvc": the repo's default DVC remote, or None when the repo has none (or is not a DVC repo); "dvc:NAME": DVC
    remote NAME, an error if absent; "": none; anything else: a URL or path, relative paths from `repo_root`.
    Packs live in the DVC remote under `diffusion-pipe-store/`, beside DVC's objects.
    """
    if not spec:
        return None
    root = Path(repo_root).resolve()
    if spec == "dvc" or spec.startswith("dvc:"):
        name = spec[4:] or None
        if name is None:
            if not (root / ".dvc").is_dir():
                return None
            from dvc.config import Config

            if not Config(dvc_dir=str(root / ".dvc")).get("core", {}).get("remote"):
                return None
        try:
            return Remote.from_dvc(root, name)
        except StoreError as exc:
            raise StoreError(f"{param}: {exc}; or set {param} to '' for none") from exc
    if "://" not in spec and not Path(spec).is_absolute():
        spec = str(root / spec)
    return Remote(spec)


# DVC remote options that hold a secret: kept in .dvc/config.local (git-ignored), never in .dvc/config.
_SECRET_OPTIONS = ("password", "passphrase", "secret_access_key", "session_token", "sse_customer_key",
                   "account_key", "sas_token", "client_secret")


def committed_secret_warning(options: dict[str, Any], name: str) -> str | None:
    """A warning when the options of DVC remote `name` in the repo's .dvc/config (which git tracks, unlike
    .dvc/config.local) hold a secret: a secret option, or a password in the URL; else None."""
    held = [o for o in _SECRET_OPTIONS if options.get(o)]
    if redact(str(options.get("url", ""))) != str(options.get("url", "")):
        held.insert(0, "a password in its url")
    if not held:
        return None
    return (
        f"DVC remote {name!r} has {held[0]} in .dvc/config, which git tracks: move it to the git-ignored "
        f".dvc/config.local with `dvc remote modify --local {name} OPTION VALUE` (and `dvc remote modify {name} "
        "--unset OPTION`), or for S3 use the AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY environment variables"
    )


def secret_warning(spec: str, param: str = "encode.remote") -> str | None:
    """A warning when `spec`, the value of `param`, holds a credential (a URL's password, a secret query value),
    else None: DVC copies a stage's params into dvc.lock, which is committed, and into its run-cache, which
    `dvc push --run-cache` uploads, so a password written there leaves the machine."""
    if redact(spec) == spec:
        return None
    return (
        f"{param} {redact(spec)!r} holds a credential, and DVC records params in dvc.lock (committed to git) and in "
        "its run-cache (pushed with `dvc push --run-cache`): move it out of params.yaml, e.g. add the remote with "
        "`dvc remote add NAME URL-without-password` and `dvc remote modify --local NAME password ...` (kept in the "
        "git-ignored .dvc/config.local), or for S3 set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the "
        f"environment, then set {param} to 'dvc:NAME'"
    )
