"""`DIFFUSION_PIPE_PROFILE=<file> python -m stages.train` (README, Training): a torch.profiler table of steps 4-6
in <file> and a Chrome trace in <file>.trace.json with each step (numbered as the reports number them) and each
pipeline-engine instruction annotated."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import make_pipeline_repo, run_checked, run_env, run_stages


@pytest.mark.slow  # scan, encode and a 7-step train run: about 30 s on 2 shared cores
def test_the_profile_covers_steps_4_to_6_with_engine_instructions_annotated(tmp_path):
    store = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store, {"steps: 120": "steps: 7",
                                                         "eval_every_steps: 40": "eval_every_steps: 0"}, dvc=False)
    env = run_env(store)
    run_stages(repo, store)
    run_checked([sys.executable, "-m", "stages.train"], cwd=repo, env=env | {"DIFFUSION_PIPE_PROFILE": "prof.txt"})
    table = (repo / "prof.txt").read_text()
    assert "train.step4" in table and "pipe.ForwardPass" in table and "aten::mm" in table
    trace = json.loads((repo / "prof.txt.trace.json").read_text())
    steps = sorted(e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("train.step"))
    assert steps == ["train.step4", "train.step5", "train.step6"]
    assert any(e.get("name") == "pipe.BackwardPass" for e in trace["traceEvents"])
