"""Edit datasets through `dvc repro`: control images are latents in the store under their own keys, so editing
one control image recomputes that one latent and nothing else (counted in reports/encode.json), and the encoded
table names each sample's control latent."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image

from tests.conftest import REPO, make_pipeline_repo
from tests.encode.helpers import encode_counts, reproduce

EXAMPLE = "examples/flux_kontext-tiny"
CONTROL = f"{EXAMPLE}/control/000_circle_red_to_green_on_white.png"


def _counts(latent: tuple[int, int], text: tuple[int, int]) -> dict[str, dict[str, int]]:
    return {fam: {"computed": c, "reused_local": r, "fetched_remote": 0}
            for fam, (c, r) in (("latent", latent), ("text", text))}


@pytest.mark.slow  # about 70 s here: three encode runs through dvc repro
def test_editing_one_control_image_recomputes_only_its_latent(tmp_path: Path) -> None:
    store = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store)
    params = (REPO / EXAMPLE / "params.yaml").read_text().replace("workers: 0", "workers: 0\n  remote: ''")
    (repo / "params.yaml").write_text(params)

    assert reproduce(repo, store, "encode") == ["scan", "encode"]
    # 36 targets and 36 control images, 54 distinct: a 64x64 target (a green circle on white) is also another
    # pair's control image, and the same bytes at the same bucket are one entry; 12 distinct captions
    assert encode_counts(repo) == _counts((54, 0), (12, 0))
    table = pq.read_table(repo / "data/encoded.parquet").to_pylist()
    assert len(table) == 36 and all(len(r["conditioning_latent_keys"]) == 1 for r in table)
    before = {r["sample_id"]: r for r in table}

    # one control image edited: its latent alone
    with Image.open(repo / CONTROL) as im:
        edited = im.convert("RGB")
    edited.putpixel((0, 0), (0, 0, 0))
    edited.save(repo / CONTROL)
    assert reproduce(repo, store, "encode") == ["scan", "encode"]
    # (the old control latent is still wanted: a 64x64 target, the red circle on white, has its bytes)
    assert encode_counts(repo) == _counts((1, 54), (0, 12))
    after = {r["sample_id"]: r for r in pq.read_table(repo / "data/encoded.parquet").to_pylist()}
    changed = [sid for sid in after if after[sid] != before[sid]]
    assert changed == ["recolour/000_circle_red_to_green_on_white.png@64x64x1"]
    assert after[changed[0]]["latent_key"] == before[changed[0]]["latent_key"]  # the target's latent is kept

    # a control image removed: its pair is excluded by the scan (missing_control), never trained without it
    (repo / CONTROL).unlink()
    assert reproduce(repo, store, "encode") == ["scan", "encode"]
    rows = {r["path"]: r for r in pq.read_table(repo / "data/manifest.parquet").to_pylist()}
    assert rows[Path(CONTROL).name]["reason"] == "missing_control"
    assert encode_counts(repo) == _counts((0, 53), (0, 12))


def test_a_family_without_conditioning_refuses_a_control_dataset(tmp_path: Path) -> None:
    """Training flux (text-to-image) on an edit dataset is an error naming the param, not pairs silently
    trained as plain images."""
    import subprocess
    import sys

    from tests.conftest import run_env

    store = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store, dvc=False)
    params = (REPO / EXAMPLE / "params.yaml").read_text().replace("family: flux_kontext", "family: flux")
    (repo / "params.yaml").write_text(params)
    for stage in ("scan", "encode"):
        out = subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=repo, env=run_env(store),
                             capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "scan.datasets: dataset 'recolour' has control images (`control`), but model family 'flux' trains on " \
           "none" in out.stderr
    shutil.rmtree(store, ignore_errors=True)


@pytest.mark.slow  # about 60 s here: three encode runs through dvc repro
def test_a_text_encoder_that_reads_the_control_image_recomputes_exactly_its_entries(tmp_path: Path) -> None:
    """qwenimage_edit's text entries are per (caption, control image): 36 pairs give 36 entries (12 captions).
    The example's two sample prompts are two pairs' captions read with their control images at the training size,
    so they share those pairs' entries; their negative prompts, read with the same images, are 2 entries more.
    Editing a control image recomputes its latent, its pair's text entry and the negative prompt of the sample that
    reads it; editing a caption recomputes that pair's text entry and no latent."""
    store = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store)
    params = (REPO / "examples/qwenimage_edit-tiny/params.yaml").read_text().replace(
        "workers: 0", "workers: 0\n  remote: ''")
    (repo / "params.yaml").write_text(params)

    assert reproduce(repo, store, "encode") == ["scan", "encode"]
    assert encode_counts(repo) == _counts((54, 0), (38, 0))
    before = {r["sample_id"]: r for r in pq.read_table(repo / "data/encoded.parquet").to_pylist()}

    with Image.open(repo / CONTROL) as im:
        edited = im.convert("RGB")
    edited.putpixel((0, 0), (0, 0, 0))
    edited.save(repo / CONTROL)
    assert reproduce(repo, store, "encode") == ["scan", "encode"]
    assert encode_counts(repo) == _counts((1, 54), (2, 36))  # the old entries they replace are no longer wanted
    after = {r["sample_id"]: r for r in pq.read_table(repo / "data/encoded.parquet").to_pylist()}
    changed = [sid for sid in after if after[sid] != before[sid]]
    assert changed == ["recolour/000_circle_red_to_green_on_white.png@64x64x1"]
    assert after[changed[0]]["text_key"] != before[changed[0]]["text_key"]

    caption = repo / EXAMPLE / "data/005_circle_green_to_blue_on_gray.txt"
    caption.write_text(caption.read_text() + " please")
    assert reproduce(repo, store, "encode") == ["scan", "encode"]
    assert encode_counts(repo) == _counts((0, 55), (1, 37))
