"""A remote URL's password never reaches what we print or record: errors, reports/encode.json, lineage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffusion_pipe.redact import redact, redact_obj
from diffusion_pipe.store import Store, StoreError
from diffusion_pipe.store.remote import Remote, secret_warning
from tests.conftest import free_port, make_pipeline_repo
from tests.encode.helpers import run_stage


@pytest.mark.parametrize("raw, shown", [
    ("ssh://user:hunter2@host:22/store", "ssh://user:***@host:22/store"),
    ("ssh://user:p@ss:w@host/store", "ssh://user:***@host/store"),
    # S3 secret keys often hold '/' (and '+'): everything between "user:" and the last '@' is the secret
    ("s3://AKIAEXAMPLE:wJal/rXUt+nFEMI/K7MDENG@bucket/prefix", "s3://AKIAEXAMPLE:***@bucket/prefix"),
    ("ssh://u:a/b@c?d#e@host:22/store", "ssh://u:***@host:22/store"),
    ("cannot use 'ssh://u:x/y@h/p' (refused)", "cannot use 'ssh://u:***@h/p' (refused)"),
    ("s3://key:secret@bucket/prefix", "s3://key:***@bucket/prefix"),
    ("https://host/x?X-Amz-Signature=abc&part=1", "https://host/x?X-Amz-Signature=***&part=1"),
    ("error from ssh://u:pw@h/p: refused", "error from ssh://u:***@h/p: refused"),
    ("ssh://user@host:22/store", "ssh://user@host:22/store"),  # no secret: unchanged
    ("s3://bucket/prefix", "s3://bucket/prefix"),
    ("/mnt/share/store", "/mnt/share/store"),
])
def test_redact_masks_passwords_and_secret_query_values_only(raw, shown):
    assert redact(raw) == shown
    assert redact_obj({"a": [raw, 1], "b": (raw,)}) == {"a": [shown, 1], "b": (shown,)}


def test_a_remote_prints_and_errors_without_its_password(tmp_path):
    from diffusion_pipe.encode.encode import _remote_call

    port = free_port()  # nothing listens there: the connection is refused
    remote = Remote(f"ssh://u:hunter2@127.0.0.1:{port}/store")
    assert remote.url == f"ssh://u:***@127.0.0.1:{port}/store" and "hunter2" not in repr(remote)
    store = Store(tmp_path / "store")
    with pytest.raises(StoreError, match=r"cannot download from the store remote ssh://u:\*\*\*@") as err:
        _remote_call(remote, "download from", lambda: store.pull(remote, "latent", ["k" * 32]))
    assert "hunter2" not in str(err.value)
    assert err.value.__cause__ is None and err.value.__context__ is None or "hunter2" not in str(err.value.__context__)


@pytest.mark.slow  # about 35 s (scan, encode over SFTP); the fast test above guards the URL every message uses
def test_encode_report_and_lineage_carry_no_password(sftp: int, tmp_path: Path):
    """Through the stage command against a real SFTP server that takes the password from the URL."""
    from diffusion_pipe.lineage.record import checkpoint_lineage
    from diffusion_pipe.params import load_params

    store = tmp_path / "store"
    url = f"ssh://u:pw@127.0.0.1:{sftp}/shared"
    repo = make_pipeline_repo(tmp_path / "repo", store, {"  batch_size: 8": f"  batch_size: 8\n  remote: {url}"},
                              dvc=False)
    run_stage(repo, store, "scan")
    out = run_stage(repo, store, "encode")
    report_text = (repo / "reports" / "encode.json").read_text()
    assert json.loads(report_text)["remote"] == f"ssh://u:***@127.0.0.1:{sftp}/shared"
    assert "u:pw@" not in report_text and "u:pw@" not in out.stderr + out.stdout
    assert f"encode: warning: encode.remote 'ssh://u:***@127.0.0.1:{sftp}/shared' holds a credential" in out.stderr
    assert json.loads(report_text)["latent"]["computed"] > 0  # the password did reach the server: it worked

    record = checkpoint_lineage(load_params(repo / "params.yaml"), repo, repo / "data" / "encoded.parquet",
                                {"latent": [], "text": []}, None, manifest_path=repo / "data" / "manifest.parquet")
    assert "u:pw@" not in json.dumps(record)
    assert record["params"]["encode"]["remote"] == f"ssh://u:***@127.0.0.1:{sftp}/shared"


def test_a_credential_in_encode_remote_is_warned_about_without_being_shown():
    """DVC copies params into dvc.lock and its run-cache: a password in encode.remote leaves the machine."""
    warning = secret_warning("s3://AKIA:wJal/rXUt@bucket/prefix")
    assert warning is not None and "wJal" not in warning and "rXUt" not in warning
    assert "encode.remote 's3://AKIA:***@bucket/prefix' holds a credential" in warning
    assert "dvc.lock" in warning and "run-cache" in warning and "AWS_SECRET_ACCESS_KEY" in warning
    assert "dvc remote modify --local NAME password" in warning
    assert secret_warning("https://host/x?token=abc") is not None
    for clean in ("ssh://u@host/store", "s3://bucket/prefix", "dvc", "dvc:shared", "", "/mnt/share"):
        assert secret_warning(clean) is None, clean
