"""The command line: every stage is a command, and user errors are one message with exit status 2."""

import json
import subprocess
import sys

from click.testing import CliRunner

from diffusion_pipe.cli import main


def test_help_lists_every_stage():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for name in ("scan", "encode", "train", "export", "lineage", "make-tiny"):
        assert name in result.output


def test_stage_runs_as_module():
    out = subprocess.run([sys.executable, "-m", "stages.scan", "--help"], capture_output=True, text=True,
                         check=True)
    assert "--manifest" in out.stdout and "--params" in out.stdout


def test_bad_params_is_one_clear_error(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("model: {path: m}\nscan:\n  datasets: [{path: d}]\ntrain: {lerning_rate: 1.0e-4}\n")
    result = CliRunner().invoke(main, ["train", "--params", str(params)])
    assert result.exit_code == 2
    assert "error: train.lerning_rate: unknown key; did you mean 'learning_rate'?" in result.output


def test_local_model_missing_from_dvc_deps_is_named(tmp_path):
    (tmp_path / "photos").mkdir()
    (tmp_path / "model").mkdir()
    (tmp_path / "dvc.yaml").write_text("stages:\n  encode:\n    cmd: x\n    deps: [stages/encode]\n")
    params = tmp_path / "params.yaml"
    params.write_text(f"model: {{path: model}}\nscan:\n  datasets: [{{path: {tmp_path / 'photos'}}}]\n")
    result = CliRunner().invoke(main, ["encode", "--params", str(params)])
    assert result.exit_code == 2
    assert "is not a dependency of stage 'encode'" in result.output and "stages.encode.deps" in result.output


def test_a_file_name_in_an_error_cannot_forge_lines_or_drive_the_terminal(tmp_path):
    """A stage error quoting a path whose name holds an ESC sequence and a newline: printed escaped, on one line."""
    (tmp_path / "photos").mkdir()
    model = tmp_path / "mo\x1b[2Jdel\nerror: all is well"
    model.mkdir()
    (tmp_path / "dvc.yaml").write_text("stages:\n  encode:\n    cmd: x\n    deps: [stages/encode]\n")
    params = tmp_path / "params.yaml"
    params.write_text(f"model: {{path: {json.dumps(str(model))}}}\n"
                      f"scan:\n  datasets: [{{path: {tmp_path / 'photos'}}}]\n")
    result = CliRunner().invoke(main, ["encode", "--params", str(params)])
    assert result.exit_code == 2
    assert "\x1b" not in result.output and result.output.count("\n") == 1, result.output
    assert "mo\\x1b[2Jdel\\nerror: all is well" in result.output
