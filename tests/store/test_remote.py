"""Remote sync through DVC's filesystems, against a local-directory remote (SSH and S3 servers: test_remote_servers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_pipe.store import Remote, Store, StoreError
from tests.store.conftest import ENTRY_BYTES, assert_same, make_entry

KEYS = [f"k{i}" for i in range(6)]


def _fill(store: Store) -> list[str]:
    with store.writer("latent", pack_bytes=2 * ENTRY_BYTES) as w:  # packs {k0,k1} {k2,k3} {k4,k5}
        for i, k in enumerate(KEYS):
            w.add(k, make_entry(i))
    return w.packs


def roundtrip(url: str, tmp_path: Path, **config: object) -> None:
    """Push from one store, pull into another: the shared scenario of every remote kind."""
    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    packs = _fill(a)
    assert a.push(url, "latent", keys=["k0", "k3"], **config) == 2
    assert a.push(url, "latent", **config) == 1  # only the one the remote lacks
    assert a.push(url, "latent", **config) == 0
    with b.writer("latent") as w:  # b already computed k1 itself
        w.add("k1", make_entry(1))
    assert b.pull(url, "latent", [*KEYS, "absent"], **config) == 5
    assert b.missing("latent", [*KEYS, "absent"]) == ["absent"]
    for i, k in enumerate(KEYS):
        assert_same(b.get("latent", k), make_entry(i))
    assert b.pull(url, "latent", KEYS, **config) == 0
    fresh = Store(b.root)
    assert fresh.verify() == [] and fresh.missing("latent", KEYS) == []
    assert set(packs) <= set(fresh.packs("latent"))
    assert not [p for p in (b.root / "latent").iterdir() if p.name.startswith(".")]


def test_local_remote_roundtrip(tmp_path: Path) -> None:
    roundtrip(str(tmp_path / "remote"), tmp_path)
    remote = tmp_path / "remote" / "latent"
    assert len(list(remote.glob("*.safetensors"))) == 3 == len(list(remote.glob("*.json")))
    assert not [p for p in remote.iterdir() if p.name.startswith(".")]


def test_pull_chooses_few_packs(tmp_path: Path) -> None:
    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    _fill(a)
    with a.writer("latent") as w:  # one pack holding all six as well
        for i, k in enumerate(KEYS):
            w.add(k, make_entry(i))
    a.push(str(tmp_path / "r"), "latent")
    assert b.pull(str(tmp_path / "r"), "latent", KEYS) == 6
    assert b.packs("latent").keys() == set(w.packs)


def test_corrupt_remote_pack_is_not_pulled(tmp_path: Path) -> None:
    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    packs = _fill(a)
    a.push(str(tmp_path / "r"), "latent")
    bad = tmp_path / "r" / "latent" / f"{packs[0]}.safetensors"
    raw = bytearray(bad.read_bytes())
    raw[-3] ^= 0xFF
    bad.write_bytes(bytes(raw))
    assert b.pull(str(tmp_path / "r"), "latent", KEYS) == 4
    assert b.missing("latent", KEYS) == ["k0", "k1"]
    assert not [p for p in (b.root / "latent").iterdir() if p.name.startswith(".")]


def test_push_refuses_corrupt_local_pack(tmp_path: Path) -> None:
    a = Store(tmp_path / "a")
    packs = _fill(a)
    path = a.pack_path("latent", packs[1])
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(StoreError, match=rf"latent pack {packs[1]}: pack bytes hash .*not pushed"):
        a.push(str(tmp_path / "r"), "latent")
    assert a.missing("latent", KEYS) == ["k2", "k3"]  # quarantined: encode recomputes them


def test_push_errors(tmp_path: Path) -> None:
    a = Store(tmp_path / "a")
    _fill(a)
    with pytest.raises(StoreError, match="latent entry nope is not in the store .* run encode before pushing"):
        a.push(str(tmp_path / "r"), "latent", keys=["k0", "nope"])
    with pytest.raises(StoreError, match="latent pack abc is not in the store"):
        a.push(str(tmp_path / "r"), "latent", packs=["abc"])
    with pytest.raises(StoreError, match="pass remote options to Remote"):
        a.push(Remote(str(tmp_path / "r")), "latent", port=22)
    with pytest.raises(StoreError, match="cannot use store remote 'nope://x'"):
        a.pull("nope://x", "latent", KEYS)


def test_remote_from_dvc_config(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / ".dvc").mkdir()
    (repo / ".dvc" / "config").write_text("")
    with pytest.raises(StoreError, match="no DVC remote"):
        Remote.from_dvc(repo)
    (repo / ".dvc" / "config").write_text('[core]\n    remote = shared\n[\'remote "shared"\']\n    url = ../../dvc-remote\n')
    remote = Remote.from_dvc(repo)  # relative URLs are relative to .dvc/, as DVC reads them
    assert remote.path == str(tmp_path / "dvc-remote" / "diffusion-pipe-store")
    a = Store(tmp_path / "a")
    _fill(a)
    assert a.push(remote, "latent") == 3
    assert (tmp_path / "dvc-remote" / "diffusion-pipe-store" / "latent").is_dir()


def test_push_by_keys_uploads_only_what_the_remote_lacks_to_hold_them(tmp_path: Path) -> None:
    """A key counts as on the remote when any pack holding it is there: a store holding keys in two packs each
    uploads none of them again, and a key the remote lacks costs one pack."""
    from diffusion_pipe.store.remote import lacking_packs

    a, remote = Store(tmp_path / "a"), Remote(str(tmp_path / "r"))
    pairs = _fill(a)  # {k0,k1} {k2,k3} {k4,k5}
    with a.writer("latent") as w:  # all six in one pack too
        for i, k in enumerate(KEYS):
            w.add(k, make_entry(i))
    assert a.push(remote, "latent", packs=w.packs) == 1
    assert lacking_packs(a, remote, "latent", KEYS) == [] and a.push(remote, "latent", keys=KEYS) == 0
    with a.writer("latent") as w2:
        w2.add("k6", make_entry(6))
    assert lacking_packs(a, remote, "latent", [*KEYS, "k6"]) == w2.packs
    assert a.push(remote, "latent", keys=[*KEYS, "k6"]) == 1
    assert sorted(p.name for p in (tmp_path / "r/latent").glob("*.safetensors")) == sorted(
        f"{p}.safetensors" for p in (*w.packs, *w2.packs))
    assert not set(pairs) & {p.name.split(".")[0] for p in (tmp_path / "r/latent").iterdir()}


def test_a_secret_committed_in_the_dvc_config_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """.dvc/config is tracked by git, .dvc/config.local is not: a password in the former is named, never shown."""
    pytest.importorskip("dvc_ssh", reason="dvc-ssh is not installed")
    repo = tmp_path / "repo"
    (repo / ".dvc").mkdir(parents=True)
    remote = """['remote "shared"']\n    url = ssh://u@127.0.0.1/store\n"""  # nothing connects: no server needed
    (repo / ".dvc" / "config").write_text("[core]\n    remote = shared\n" + remote)
    (repo / ".dvc" / "config.local").write_text(remote + "    password = in-the-local-file\n")
    with caplog.at_level("WARNING", logger="diffusion_pipe.store.remote"):
        Remote.from_dvc(repo)
    assert not caplog.records  # a secret in config.local is where it belongs
    (repo / ".dvc" / "config").write_text("[core]\n    remote = shared\n" + remote + "    password = hunter2\n")
    with caplog.at_level("WARNING", logger="diffusion_pipe.store.remote"):
        Remote.from_dvc(repo)
    assert "DVC remote 'shared' has password in .dvc/config, which git tracks" in caplog.text
    assert "dvc remote modify --local shared" in caplog.text and "hunter2" not in caplog.text
    caplog.clear()
    (repo / ".dvc" / "config").write_text(
        "[core]\n    remote = shared\n" + remote.replace("ssh://u@", "ssh://u:hunter2@"))
    with caplog.at_level("WARNING", logger="diffusion_pipe.store.remote"):
        Remote.from_dvc(repo)
    assert "DVC remote 'shared' has a password in its url in .dvc/config" in caplog.text
    assert "hunter2" not in caplog.text
