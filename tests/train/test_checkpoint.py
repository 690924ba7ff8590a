"""Checkpoints are safetensors + JSON with a manifest of hashes: loading runs no pickle, a damaged checkpoint is
reported and the newest intact one used (and the run still ends exactly as one never stopped), and a diverging
run stops at its first non-finite step without writing a LoRA."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffusion_pipe.fileio import WriteError, naming_write_errors
from diffusion_pipe.hashing import hash_file
from diffusion_pipe.train.checkpoint import CheckpointError, check_step_dir, choose_checkpoint, find_newest_intact
from tests.conftest import REPO, encoded_example, run_checked, run_env, train_cmd

STEPS = 12
PARAMS = {"steps: 120": f"steps: {STEPS}",
          "eval_every_steps: 40": "eval_every_steps: 0\n  checkpoint_every_steps: 3\n  lora_dropout: 0.1"}


@pytest.fixture(scope="module")
def encoded_repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoint")
    return encoded_example(root, PARAMS)


@pytest.fixture(scope="module")
def whole(encoded_repo, tmp_path_factory):
    """A run never stopped, with checkpoints at steps 3, 6, 9 and 12; tests copy it, never modify it."""
    repo, store = encoded_repo
    runs = tmp_path_factory.mktemp("whole")
    run_checked(train_cmd(runs), cwd=repo, env=run_env(store))
    return runs


def run_dir(runs: Path) -> Path:
    (path,) = (runs / "checkpoints").iterdir()
    return path


def copy_run(whole: Path, dest: Path) -> Path:
    """A copy of the whole run's checkpoints (not its outputs): the run dir of the copy."""
    shutil.copytree(whole / "checkpoints", dest / "checkpoints")
    return run_dir(dest)


def flip_optimizer_byte(path: Path) -> None:
    """Flip one bit in the middle of an Adam moment (`exp_avg/...`) of a stage file: still a valid file."""
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_len])
    begin, end = header[next(k for k in sorted(header) if k.startswith("exp_avg/"))]["data_offsets"]
    data[8 + header_len + (begin + end) // 2] ^= 0x01
    path.write_bytes(bytes(data))


class Payload:
    """A pickle that creates a directory when unpickled: what a planted checkpoint could do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def plant_pickles(step_dir: Path, marker: Path) -> None:
    """The files DeepSpeed's load_checkpoint unpickles (torch.load, weights_only=False), as malicious pickles."""
    for name in ("mp_rank_00_model_states.pt", "layer_01-model_states.pt", "layer_02-model_states.pt"):
        torch.save({"module": Payload(marker)}, step_dir / name)


DAMAGE = {
    "flipped optimizer byte": (lambda d: flip_optimizer_byte(d / "stage0.safetensors"),
                               "stage0.safetensors does not match its hash"),
    "truncated file": (lambda d: (d / "stage0.safetensors").write_bytes((d / "stage0.safetensors").read_bytes()[:99]),
                       "stage0.safetensors does not match its hash"),
    "missing weights file": (lambda d: (d / "stage0.safetensors").unlink(), "stage0.safetensors is missing"),
    "damaged manifest": (lambda d: (d / "manifest.json").write_text('{"format": 1'), "manifest.json is unreadable"),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_damage_is_named_and_the_newest_intact_checkpoint_chosen(whole, tmp_path, kind):
    directory = copy_run(whole, tmp_path)
    damage, message = DAMAGE[kind]
    assert check_step_dir(directory / "step12", 12) is None
    damage(directory / "step12")
    assert message in check_step_dir(directory / "step12", 12)
    (directory / "latest").write_text("")  # `latest` is for people; an empty one changes nothing
    found = find_newest_intact(directory)
    assert (found.step, found.path) == (9, directory / "step9")
    ((name, problem),) = found.damaged
    assert name == "step12" and problem.startswith(message)


def test_no_intact_checkpoint_is_an_error_naming_each(whole, tmp_path, capsys):
    directory = copy_run(whole, tmp_path)
    for step in (3, 6, 9, 12):
        (directory / f"step{step}" / "state.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no intact checkpoint to resume from \(step12: state.json does not "
                                              r"match.*step3: state.json.*Delete the damaged step directories"):
        choose_checkpoint(directory, announce=True)
    # a save cut short before its manifest (no other checkpoint) is passed over: the run starts again
    (directory.parent / "fresh" / "step3").mkdir(parents=True)
    assert choose_checkpoint(directory.parent / "fresh", announce=True).step is None
    assert "has no manifest.json and is not used" in capsys.readouterr().err


def intact_step_dir(directory: Path, step: int) -> Path:
    """A step directory that passes `check_step_dir`: one-stage files (any bytes) and a manifest of their hashes."""
    path = directory / f"step{step}"
    path.mkdir(parents=True)
    files = {}
    for name in ("rng.safetensors", "state.json", "stage0.safetensors", "stage0.json"):
        (path / name).write_bytes(f"{name} of step {step}".encode())
        files[name] = hash_file(path / name)
    (path / "manifest.json").write_text(json.dumps({"format": 1, "step": step, "stages": 1, "world": 1,
                                                    "files": files}))
    return path


def test_a_newest_save_cut_short_is_skipped_for_the_previous_intact_one(tmp_path, capsys):
    """A step directory without a manifest (a save cut short, say by a full disk) newer than an intact one: the
    search passes over it and resumes from the intact one, instead of stopping there and starting over."""
    intact = intact_step_dir(tmp_path, 6)
    intact_step_dir(tmp_path, 3)
    (tmp_path / "step9").mkdir()
    (tmp_path / "step9/stage0.safetensors").write_bytes(b"half a file")
    found = choose_checkpoint(tmp_path, announce=True)
    assert (found.step, found.path, found.incomplete, found.damaged) == (6, intact, ["step9"], [])
    err = capsys.readouterr().err
    assert "step9 has no manifest.json and is not used" in err and "resuming from step6" in err


def file_size_limited(limit: int):
    """A `preexec_fn` that caps the size of any file the child writes at `limit` bytes, a real limit rather than
    a mocked write: past it, a write fails with EFBIG (SIGXFSZ, which would kill the child, is ignored)."""
    def limit_files() -> None:
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return limit_files


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_full_disk_is_an_error_naming_the_file_and_enospc():
    """A write to a full device (Linux's /dev/full fails every write with ENOSPC): one WriteError naming the file,
    that the disk is full and the errno, with the room left there."""
    with pytest.raises(WriteError, match=r"^cannot write /dev/full: the disk is full \(ENOSPC: No space left on "
                                         r"device; [\d.]+ MB free there\)\. Free space on that disk"):
        with naming_write_errors("/dev/full"), open("/dev/full", "wb") as fh:
            fh.write(b"a checkpoint")
            fh.flush()


def test_a_disk_that_fills_at_the_end_keeps_the_lora_and_names_the_file(encoded_repo, whole, tmp_path):
    """A file size limit between the LoRA's size and a checkpoint stage file's (a disk with room for the small
    LoRA, not for the large checkpoint): the LoRA is written first, whole and as the run never stopped would
    write it, and the final checkpoint's failure is one error naming the file and the errno, not a traceback.
    The step directory it left has no manifest, so a rerun resumes from the last intact checkpoint (as above)."""
    repo, store = encoded_repo
    runs = tmp_path / "runs"
    directory = copy_run(whole, runs)
    shutil.rmtree(directory / "step12")  # resumes at step 9; its last step's checkpoint is the one that fails
    lora_size = (whole / "out/lora.safetensors").stat().st_size
    stage_size = (directory / "step9/stage0.safetensors").stat().st_size
    assert lora_size * 2 < stage_size
    out = subprocess.run(train_cmd(runs), cwd=repo, env=run_env(store), capture_output=True, text=True,
                         preexec_fn=file_size_limited(lora_size * 2), timeout=600)
    assert out.returncode == 2, out.stderr[-3000:]
    assert (f"error: cannot write {directory / 'step12/stage0.safetensors'}: the file would exceed the file size "
            "limit (ulimit -f) (EFBIG") in out.stderr
    assert f"its LoRA was written to {runs / 'out/lora.safetensors'} before this final checkpoint" in out.stderr
    assert "Traceback" not in out.stderr
    assert (runs / "out/lora.safetensors").read_bytes() == (whole / "out/lora.safetensors").read_bytes()
    assert (runs / "loss.csv").read_text() == (whole / "loss.csv").read_text()
    assert not (directory / "step12/manifest.json").exists() and find_newest_intact(directory).step == 9


def test_damaged_checkpoints_fall_back_and_the_run_ends_as_if_never_stopped(encoded_repo, whole, tmp_path):
    """The three newest checkpoints damaged (a flipped bit in an Adam moment, a truncated file, a missing
    weights file), `latest` emptied and DeepSpeed-named malicious pickles planted in every step directory: the
    run resumes from step 3, says why, runs none of the pickles, and ends with the same losses and a
    byte-identical LoRA."""
    repo, store = encoded_repo
    runs = tmp_path / "runs"
    directory = copy_run(whole, runs)
    marker = tmp_path / "pwned"
    for step in (3, 6, 9, 12):
        plant_pickles(directory / f"step{step}", marker)
    DAMAGE["flipped optimizer byte"][0](directory / "step12")
    DAMAGE["truncated file"][0](directory / "step9")
    DAMAGE["missing weights file"][0](directory / "step6")
    (directory / "latest").write_text("")
    out = run_checked(train_cmd(runs), cwd=repo, env=run_env(store))
    assert not marker.exists(), "a planted pickle ran"
    for step, problem in ((12, "does not match its hash"), (9, "does not match its hash"), (6, "is missing")):
        assert f"{directory / f'step{step}'} is damaged and not used: stage0.safetensors {problem}" in out.stderr
    assert "resuming from step3, the newest intact checkpoint" in out.stderr
    assert json.loads((runs / "report.json").read_text())["resumed_from"] == 3
    assert (runs / "loss.csv").read_text() == (whole / "loss.csv").read_text()
    assert (runs / "out/lora.safetensors").read_bytes() == (whole / "out/lora.safetensors").read_bytes()
    assert find_newest_intact(directory).step == 12  # the damaged steps were written again


def test_a_planted_checkpoint_runs_no_pickle(encoded_repo, whole, tmp_path):
    """--resume-from a directory of pickles under every name DeepSpeed and we read, even with a manifest whose
    hashes match them: a clear error, and the pickles never run."""
    repo, store = encoded_repo
    marker = tmp_path / "pwned"
    planted = tmp_path / "downloaded"
    step_dir = planted / "step3"
    step_dir.mkdir(parents=True)
    shutil.copy(run_dir(whole) / "identity.json", planted / "identity.json")  # the same run: nothing refused
    (planted / "latest").write_text("step3")
    plant_pickles(step_dir, marker)
    files = {}
    for name in ("stage0.safetensors", "stage0.json", "rng.safetensors", "state.json"):
        torch.save(Payload(marker), step_dir / name)
        files[name] = hash_file(step_dir / name)
    (step_dir / "manifest.json").write_text(json.dumps({"format": 1, "step": 3, "stages": 1, "world": 1,
                                                        "files": files}))
    runs = tmp_path / "runs"
    cmd = train_cmd(runs, "--resume-from", str(planted))
    refused = subprocess.run(cmd, cwd=repo, env=run_env(store), capture_output=True, text=True)
    assert not marker.exists(), "a planted pickle ran"
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert f"{step_dir}: not a checkpoint this version of diffusion-pipe can read" in refused.stderr
    assert not (runs / "out/lora.safetensors").exists()


@pytest.mark.parametrize("path", ["params.yaml", *sorted(str(p.relative_to(REPO)) for p in
                                                         (REPO / "examples").glob("*/params*.yaml"))])
def test_shipped_params_checkpoint_every_30_minutes(path):
    """A crash loses at most half an hour: the shipped params, and a params file that leaves the key out, save by
    time; how often a run saves is not part of its identity, so changing it continues the run."""
    from diffusion_pipe.params import TrainParams, load_params
    from diffusion_pipe.train.loop import run_identity

    train = load_params(REPO / path).train
    assert train.checkpoint_every_minutes == 30 and TrainParams().checkpoint_every_minutes == 30
    identity = run_identity(load_params(REPO / "params.yaml").model, train, REPO / "params.yaml", 32, 1)
    assert identity == run_identity(load_params(REPO / "params.yaml").model,
                                    dataclasses.replace(train, checkpoint_every_minutes=1), REPO / "params.yaml", 32, 1)


def test_a_diverging_run_stops_at_its_first_non_finite_step(encoded_repo, tmp_path):
    """Weights blown up each step (a weight decay of 1e9: each AdamW step multiplies them by about -2e5; the
    issue's learning rate of 1e6 did the same, but params validation may refuse a rate above 1): the loss turns
    NaN within a few steps. The run stops there with a message naming the step, the loss and the params to
    change, writes no LoRA, and keeps its last finite checkpoint."""
    repo, store = encoded_repo
    params = (repo / "params.yaml").read_text().replace("learning_rate: 2.0e-3",
                                                        "learning_rate: 2.0e-3\n  weight_decay: 1.0e+9")
    (tmp_path / "diverge.yaml").write_text(params.replace("checkpoint_every_steps: 3", "checkpoint_every_steps: 1"))
    runs = tmp_path / "runs"
    stopped = subprocess.run(train_cmd(runs, "--params", str(tmp_path / "diverge.yaml")), cwd=repo,
                             env=run_env(store), capture_output=True, text=True)
    assert stopped.returncode == 2, stopped.stderr[-3000:]
    assert "training diverged at step " in stopped.stderr and "loss nan" in stopped.stderr
    assert "train.learning_rate (now 0.002)" in stopped.stderr and "train.max_grad_norm" in stopped.stderr
    step = int(stopped.stderr.split("training diverged at step ")[1].split(":")[0])
    assert 1 < step < STEPS
    assert not (runs / "out/lora.safetensors").exists() and not (runs / "report.json").exists()
    found = find_newest_intact(run_dir(runs))
    assert found.step == step - 1 and not found.damaged
    kept = json.loads((found.path / "state.json").read_text())
    assert len(kept["losses"]) == step - 1 and all(map(torch.isfinite, torch.tensor(kept["losses"])))
    assert f"the last checkpoint, step {step - 1} in {run_dir(runs)}, is kept" in stopped.stderr
