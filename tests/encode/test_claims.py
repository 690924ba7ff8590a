"""Two encodes into one store at once share the work (diffusion_pipe.store.claims): the later one waits for the
entries the earlier one claimed instead of computing them too."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from diffusion_pipe.store import Store, live_leases
from tests.conftest import make_pipeline_repo
from tests.encode.helpers import stage_in_process


def test_encode_waits_for_latents_another_encode_claimed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Another encode (a lease claiming every latent key, on a thread) publishes the latents once this encode has
    claimed its own work; this encode computes the text entries and none of the latents."""
    done, shared = Store(tmp_path / "done"), tmp_path / "shared"
    repo = make_pipeline_repo(tmp_path / "repo", done.root, dvc=False)  # no DVC remote: the local store only
    for item in sorted((repo / "examples/flux-tiny/data").iterdir())[4:]:
        item.unlink()
    monkeypatch.chdir(repo)
    stage_in_process("scan", done.root)
    stage_in_process("encode", done.root)  # the latents the other encode will publish, computed beforehand
    latent_keys = sorted(set(pq.read_table(repo / "data/encoded.parquet").column("latent_key").to_pylist()))

    def other_encode(own: str) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(
                "claims" in r and r["file"] != own for r in live_leases(shared)):
            time.sleep(0.05)  # publish only once this encode has claimed its work, or there is nothing to share
        with Store(shared).writer("latent") as w:
            for key in latent_keys:
                w.add(key, done.get("latent", key))

    with Store(shared).lease("encode") as lease:
        lease.claim({"latent": latent_keys})
        thread = threading.Thread(target=other_encode, args=(lease.path.name,), daemon=True)
        thread.start()
        stage_in_process("encode", shared, "--report", "reports/encode-shared.json")
        thread.join(10)
    report = json.loads((repo / "reports/encode-shared.json").read_text())
    assert (report["latent"]["computed"], report["latent"]["by_other_encoders"]) == (0, len(latent_keys))
    assert report["text"]["computed"] == report["text"]["entries"] >= 2 and report["text"]["by_other_encoders"] == 0
    assert f"waiting for {len(latent_keys)} entries another encode into {shared} is computing" in capsys.readouterr().err
