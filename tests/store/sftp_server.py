"""A throwaway SFTP server on 127.0.0.1 for the remote tests (asyncssh; user 'u', password 'pw').

Usage: python sftp_server.py ROOT_DIR. Prints "PORT <port>" and "HOSTKEY <openssh public key>", then serves
ROOT_DIR as "/" until killed.
"""

from __future__ import annotations

import asyncio
import sys

import asyncssh


class _Server(asyncssh.SSHServer):
    def begin_auth(self, username: str) -> bool:
        return True

    def password_auth_supported(self) -> bool:
        return True

    def validate_password(self, username: str, password: str) -> bool:
        return username == "u" and password == "pw"


async def _serve(root: str) -> None:
    key = asyncssh.generate_private_key("ssh-ed25519")
    server = await asyncssh.listen(
        "127.0.0.1",
        0,
        server_host_keys=[key],
        server_factory=_Server,
        sftp_factory=lambda chan: asyncssh.SFTPServer(chan, chroot=root.encode()),
    )
    port = server.sockets[0].getsockname()[1]
    print(f"PORT {port}", flush=True)
    print(f"HOSTKEY {key.export_public_key().decode().strip()}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(_serve(sys.argv[1]))
