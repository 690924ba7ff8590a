"""Fixtures of the encode tests: the real SFTP and S3 servers of tests/store/servers.py."""

from tests.store.servers import seaweedfs, seaweedfs_server, sftp, sftp_server  # noqa: F401
