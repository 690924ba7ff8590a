"""`diffusion-pipe models`: one row per registered family, and the table of docs/models.md is exactly its output."""

from pathlib import Path

from click.testing import CliRunner

from diffusion_pipe.cli import main
from diffusion_pipe.models import REGISTRY

MODELS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_models_command_lists_every_family():
    result = CliRunner().invoke(main, ["models"])
    assert result.exit_code == 0, result.output
    rows = result.output.strip().splitlines()[2:]
    assert [row.split("|")[1].strip() for row in rows] == sorted(REGISTRY)


def test_models_page_table_is_the_command_output():
    output = CliRunner().invoke(main, ["models"]).output.strip()
    text = MODELS_PAGE.read_text()
    start = text.index("<!-- models-table")
    table = text[text.index("\n", start) + 1:text.index("<!-- /models-table -->")].strip()
    assert table == output, "docs/models.md's models table is stale: run `diffusion-pipe docs`"


def test_tested_names_the_files_that_test_a_family(tmp_path):
    """The "tested" column is what the checkout holds: a family's contract suite and its tiny example, each only
    where its file is there."""
    from diffusion_pipe.models.cli import tested_by

    assert tested_by("wan") == "contract, dvc repro"
    assert tested_by("wan", root=tmp_path) == "-"
    (tmp_path / "tests" / "models").mkdir(parents=True)
    (tmp_path / "tests" / "models" / "test_wan.py").write_text("")
    assert tested_by("wan", root=tmp_path) == "contract"
    (tmp_path / "params.yaml").write_text("model:\n  family: wan\n")  # the bundled example's own params
    assert tested_by("wan", root=tmp_path) == "contract, dvc repro"
    assert tested_by("flux") == "contract, dvc repro"
