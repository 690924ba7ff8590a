"""Encode shares the store through a remote (by default the repo's DVC remote): real SFTP and S3 servers on
127.0.0.1, and two clones of one repo."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from diffusion_pipe.config import ConfigError
from diffusion_pipe.store import Store, StoreError
from diffusion_pipe.store.remote import resolve_remote
from tests.conftest import free_port, make_pipeline_repo
from tests.encode.helpers import dvc, encode_counts, git, reproduce, run_stage, stage_in_process

FAST_TRAIN = {"steps: 120": "steps: 4", "eval_every_steps: 40": "eval_every_steps: 0"}


def _add_dvc_remote(repo: Path, store: Path, url: str, **options: str) -> None:
    dvc(repo, store, "remote", "add", "-d", "shared", url)
    for name, value in options.items():
        dvc(repo, store, "remote", "modify", "shared", name, value)


def _report(repo: Path, name: str = "reports/encode.json") -> dict:
    return json.loads((repo / name).read_text())


# about 30 s each (scan, two encodes); tests/store/test_remote_servers.py runs SFTP sync by default
@pytest.mark.slow
@pytest.mark.parametrize("server", ["sftp", "s3"])
def test_second_machine_fetches_everything_through_the_dvc_remote(server: str, request: pytest.FixtureRequest,
                                                                  tmp_path: Path) -> None:
    store_a, store_b = tmp_path / "store-a", tmp_path / "store-b"
    repo = make_pipeline_repo(tmp_path / "repo", store_a)  # encode.remote defaults to "dvc"
    if server == "sftp":
        port = request.getfixturevalue("sftp")
        _add_dvc_remote(repo, store_a, f"ssh://u@127.0.0.1:{port}/dvc", password="pw")
        on_server = tmp_path / "sftp-root/dvc/diffusion-pipe-store"
    else:
        s3 = request.getfixturevalue("seaweedfs")
        _add_dvc_remote(repo, store_a, "s3://store/dvc", **s3)
        on_server = None
    run_stage(repo, store_a, "scan")

    run_stage(repo, store_a, "encode")
    first = _report(repo)
    assert first["remote"].endswith("/diffusion-pipe-store")
    assert [first[f]["computed"] for f in ("latent", "text")] == [36, 36]
    assert first["latent"]["uploaded_packs"] >= 1 and first["text"]["uploaded_packs"] >= 1
    if on_server is not None:
        assert len(list((on_server / "latent").glob("*.safetensors"))) == first["latent"]["uploaded_packs"]

    # another machine: an empty local store, the same repo and remote
    run_stage(repo, store_b, "encode", "--report", "reports/encode-b.json", "--encoded", "data/encoded-b.parquet")
    second = _report(repo, "reports/encode-b.json")
    for fam in ("latent", "text"):
        assert (second[fam]["computed"], second[fam]["fetched_remote"], second[fam]["uploaded_packs"]) == (0, 36, 0)
    assert (repo / "data/encoded-b.parquet").read_bytes() == (repo / "data/encoded.parquet").read_bytes()


def _scan_and_encode(tmp_path: Path, store: Path, encode_params: str, keep: int,
                     monkeypatch: pytest.MonkeyPatch) -> Path:
    """The flux-tiny pipeline repo with `encode_params` added to its encode section and its first `keep` dataset
    files (image and caption pairs), scanned and encoded in process into `store`."""
    repo = make_pipeline_repo(tmp_path / "repo", store, {"workers: 0": f"workers: 0\n  {encode_params}"}, dvc=False)
    for item in sorted((repo / "examples/flux-tiny/data").iterdir())[keep:]:
        item.unlink()
    monkeypatch.chdir(repo)
    stage_in_process("scan", store)
    stage_in_process("encode", store)
    return repo


def test_encode_uploads_what_it_computed_and_an_empty_store_fetches_it(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The sharing claim with a plain directory as the remote (the SFTP, S3 and two-clone versions above are
    slow): encode uploads every pack it computed, and encode on another machine's empty store computes nothing."""
    remote, store_a, store_b = tmp_path / "remote", tmp_path / "store-a", tmp_path / "store-b"
    repo = _scan_and_encode(tmp_path, store_a, f"remote: {remote}", keep=12, monkeypatch=monkeypatch)  # six images
    first = _report(repo)
    assert first["remote"] == str(remote)
    for fam in ("latent", "text"):
        assert first[fam]["entries"] >= 6 and (first[fam]["computed"], first[fam]["fetched_remote"]) == (
            first[fam]["entries"], 0)
        local = sorted(p.name for p in (store_a / fam).glob("*.safetensors"))
        uploaded = sorted(p.name for p in (remote / fam).glob("*.safetensors"))
        assert first[fam]["uploaded_packs"] == len(local) >= 1 and uploaded == local
        assert sorted(p.name for p in (remote / fam).glob("*.json")) == [n[:-12] + ".json" for n in local]

    stage_in_process("encode", store_b, "--report", "reports/encode-b.json", "--encoded",
                     "data/encoded-b.parquet")
    second = _report(repo, "reports/encode-b.json")
    for fam in ("latent", "text"):
        assert (second[fam]["computed"], second[fam]["fetched_remote"], second[fam]["uploaded_packs"]) == (
            0, first[fam]["entries"], 0)
    assert (repo / "data/encoded-b.parquet").read_bytes() == (repo / "data/encoded.parquet").read_bytes()
    assert Store(store_b).verify() == []


def test_push_false_uploads_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`encode.push: false`: the remote is still read (its report names it), what this run computes stays
    local, and the report and stderr say how many packs the remote lacks and the command that sends them."""
    remote, store = tmp_path / "remote", tmp_path / "store"
    repo = _scan_and_encode(tmp_path, store, f"remote: {remote}\n  push: false", keep=4, monkeypatch=monkeypatch)
    report = _report(repo)
    err = capsys.readouterr().err
    assert report["remote"] == str(remote)
    for fam in ("latent", "text"):
        assert report[fam]["computed"] == report[fam]["entries"] >= 2 and report[fam]["uploaded_packs"] == 0
        local = list((store / fam).glob("*.safetensors"))
        assert local and report[fam]["remote_lacks_packs"] == len(local)
        assert (f"encode: the store remote {remote} lacks {len(local)} {fam} packs of this run's entries "
                "(encode.push is false); `diffusion-pipe store push --all` sends them") in err
    assert not [p for p in remote.rglob("*") if p.is_file()]


def test_a_remote_down_during_upload_is_completed_by_the_next_encode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The upload fails (each family's folder on the remote is a file: the listing shows no packs, and no pack
    can be written there), so encode fails after computing everything. Once the remote is back, the rerun
    computes nothing and still uploads every pack the entries need, instead of only what it computed itself."""
    remote, store = tmp_path / "remote", tmp_path / "store"
    remote.mkdir()
    for fam in ("latent", "text"):
        (remote / fam).write_text("in the way")
    repo = make_pipeline_repo(tmp_path / "repo", store, {"workers: 0": f"workers: 0\n  remote: {remote}"}, dvc=False)
    for item in sorted((repo / "examples/flux-tiny/data").iterdir())[4:]:
        item.unlink()
    monkeypatch.chdir(repo)
    stage_in_process("scan", store)
    with pytest.raises(SystemExit) as exit_:
        stage_in_process("encode", store)
    assert exit_.value.code == 2
    assert f"error: encode.remote: cannot upload to the store remote {remote} " in capsys.readouterr().err
    assert not (repo / "data/encoded.parquet").exists() and list((store / "latent").glob("*.safetensors"))

    for fam in ("latent", "text"):
        (remote / fam).unlink()  # the remote is back
    stage_in_process("encode", store)
    report = _report(repo)
    for fam in ("latent", "text"):
        local = sorted(p.name for p in (store / fam).glob("*.safetensors"))
        assert (report[fam]["computed"], report[fam]["reused_local"]) == (0, report[fam]["entries"])
        assert report[fam]["uploaded_packs"] == len(local) >= 1 and report[fam]["remote_lacks_packs"] == 0
        assert sorted(p.name for p in (remote / fam).glob("*.safetensors")) == local


def test_unreachable_remote_is_an_error_naming_the_param(tmp_path: Path) -> None:
    store = tmp_path / "store"
    port = free_port()  # nothing listens there
    repo = make_pipeline_repo(tmp_path / "repo", store,
                              {"workers: 0": f"workers: 0\n  remote: ssh://u@127.0.0.1:{port}/nowhere"})
    run_stage(repo, store, "scan")
    result = run_stage(repo, store, "encode", check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "error: encode.remote: cannot download from the store remote ssh://" in result.stderr
    assert "set encode.remote to ''" in result.stderr


def test_resolve_remote_specs(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    assert resolve_remote("", repo) is None
    assert resolve_remote("dvc", repo) is None  # not a DVC repo: no remote, nothing to share
    with pytest.raises(StoreError, match=r"encode.remote: no DVC remote missing .* or set encode.remote to ''"):
        resolve_remote("dvc:missing", repo)
    local = resolve_remote("shared/store", repo)
    assert local is not None and local.url == str(repo / "shared/store")


@pytest.mark.parametrize(("value", "match"), [("dvc:", "names no DVC remote"), ("s3://", "no host or path"),
                                              (" dvc", "surrounding spaces")])
def test_remote_param_validation(value: str, match: str) -> None:
    from diffusion_pipe.config import from_dict
    from diffusion_pipe.params import EncodeParams

    with pytest.raises(ConfigError, match=match):
        from_dict(EncodeParams, {"remote": value}, "encode")


@pytest.mark.slow  # about 90 s: a full dvc repro (with a short training) and a second clone that trains
def test_two_clones_share_encodings_through_the_dvc_remote(tmp_path: Path) -> None:
    store_a, store_b, remote = tmp_path / "store-a", tmp_path / "store-b", tmp_path / "dvc-remote"
    a = make_pipeline_repo(tmp_path / "a", store_a, FAST_TRAIN)
    _add_dvc_remote(a, store_a, str(remote))
    git(a, "add", "-A")
    git(a, "commit", "-q", "-m", "pipeline")
    assert reproduce(a, store_a) == ["scan", "encode", "train", "export", "sample"]
    git(a, "add", "-A")
    git(a, "commit", "-q", "-m", "run")
    dvc(a, store_a, "push")
    assert (remote / "diffusion-pipe-store/latent").is_dir()  # encode uploaded its packs

    b = tmp_path / "b"
    git(tmp_path, "clone", "-q", str(a), str(b))
    dvc(b, store_b, "pull")
    assert (b / "data/encoded.parquet").read_bytes() == (a / "data/encoded.parquet").read_bytes()
    assert not store_b.exists() or not list(store_b.rglob("*.safetensors"))
    shutil.rmtree(b / "runs", ignore_errors=True)
    # B re-runs encode and train for real: encode computes nothing, fetching every entry A made
    ran = reproduce(b, store_b, "train", force=True)
    assert ran[-2:] == ["encode", "train"]
    counts = encode_counts(b)
    for fam in ("latent", "text"):
        assert counts[fam] == {"computed": 0, "reused_local": 0, "fetched_remote": 36}
    assert json.loads((b / "reports/train.json").read_text())["steps"] == 4
