"""dvc.yaml is honest: every library file a stage imports is a dep of that stage, so editing code re-runs the
stages that use it (and no hidden input goes unnoticed)."""

import json
import re
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
from ruamel.yaml import YAML

REPO = Path(__file__).resolve().parents[1]
STAGES = ("scan", "encode", "train", "export", "sample")

# Import the stage and everything its run imports lazily, then list the repo files loaded.
PROBE = """
import importlib, json, sys
stage = sys.argv[1]
importlib.import_module(f"stages.{stage}")
lazy = {
    "scan": ["diffusion_pipe.scan.scanner"],
    "encode": ["diffusion_pipe.encode.encode", "diffusion_pipe.store"],
    "train": ["diffusion_pipe.train.loop", "diffusion_pipe.store", "diffusion_pipe.lineage.record"],
    "export": ["diffusion_pipe.export.lora", "diffusion_pipe.export.merge", "diffusion_pipe.lineage.record"],
    "sample": ["diffusion_pipe.sample.stage"],
}[stage]
for name in lazy:
    importlib.import_module(name)
from diffusion_pipe.cli_support import user_errors
user_errors()
from diffusion_pipe.params import load_params
load_params("params.yaml")  # every stage loads all of params.yaml, whose validation imports modules of its own
if stage != "scan":
    from diffusion_pipe.models import REGISTRY, adapter_class
    for family in REGISTRY:
        adapter_class(family)
files = sorted({m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", None)})
print(json.dumps(files))
"""


@pytest.mark.parametrize("stage", STAGES)
def test_stage_imports_are_deps(stage):
    out = subprocess.run([sys.executable, "-c", PROBE, stage], cwd=REPO, capture_output=True, text=True,
                         check=True)
    used = sorted({Path(f).resolve().relative_to(REPO).as_posix() for f in json.loads(out.stdout.splitlines()[-1])
                   if Path(f).is_absolute() and Path(f).resolve().is_relative_to(REPO) and "/.venv/" not in f})
    deps = YAML(typ="safe").load((REPO / "dvc.yaml").read_text())["stages"][stage]["deps"]
    dep_parts = [PurePosixPath(str(d).rstrip("/")).parts for d in deps]
    missing = [f for f in used if not any(PurePosixPath(f).parts[:len(d)] == d for d in dep_parts)]
    assert not missing, f"add to stages.{stage}.deps in dvc.yaml: {missing}"


def test_the_readme_stage_table_names_the_params_each_stage_reads():
    """README's "How it works" table tells users which params re-run which stage: it must say what dvc.yaml says
    (export reads the whole params file: "all")."""
    stages = YAML(typ="safe").load((REPO / "dvc.yaml").read_text())["stages"]
    rows = {}
    for line in (REPO / "README.md").read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]  # "\|" is a pipe in a cell
        if len(cells) == 4 and cells[0].strip("`") in STAGES:
            rows[cells[0].strip("`")] = {p.strip(" `") for p in cells[3].split(",")}
    assert set(rows) == set(STAGES)
    for stage in STAGES:
        declared = stages[stage]["params"]
        wanted = {"all"} if declared == [{"params.yaml": None}] else set(declared)
        assert rows[stage] == wanted, stage
