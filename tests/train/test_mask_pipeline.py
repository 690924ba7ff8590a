"""Loss masks through DeepSpeed's pipeline (issue 36): a sample's mask travels to the last stage with its target, so
a 2-stage run of a partly masked dataset gives the 1-stage run's losses, and those differ from the unmasked run's."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import make_pipeline_repo, run_stages
from tests.test_pipeline import train_losses

DATA = "examples/flux-tiny/data"


def _params(repo: Path, name: str, stages: int) -> str:
    text = (repo / "params.yaml").read_text()
    text = re.sub(r"\n  samples:.*?\n(?=export:)", "\n", text, flags=re.S)  # no sample renders: faster
    text = text.replace("steps: 120", "steps: 4").replace("eval_every_steps: 40", "eval_every_steps: 0")
    text = text.replace("pipeline_stages: 1", f"pipeline_stages: {stages}\n  mask_min_weight: 0.1")
    (repo / name).write_text(text)
    return name


@pytest.mark.slow  # about 60 s: three training runs, one of them on two processes
def test_two_stages_train_a_masked_dataset_as_one_does(tmp_path: Path) -> None:
    store = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store, {"eval_fraction: 0.15": "eval_fraction: 0.0"}, dvc=False)
    run_stages(repo, store, ("scan", "encode"))
    plain = train_losses(repo, store, _params(repo, "p0.yaml", 1), 1, tmp_path / "p0")

    mask = np.zeros((64, 64), dtype=np.uint8)
    mask[:, :40] = 255
    for image in sorted((repo / DATA).glob("*.png"))[::2]:  # every other item masked, the others weigh 1
        Image.fromarray(mask).save(image.with_name(image.stem + ".mask.png"))
    run_stages(repo, store, ("scan", "encode"))
    one = train_losses(repo, store, _params(repo, "p1.yaml", 1), 1, tmp_path / "p1")
    two = train_losses(repo, store, _params(repo, "p2.yaml", 2), 2, tmp_path / "p2")
    assert len(one) == 4
    assert one == pytest.approx(two, abs=1e-5)
    assert one != pytest.approx(plain, abs=1e-4)  # the masks changed the training
