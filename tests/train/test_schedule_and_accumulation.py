"""The learning-rate schedule (`train.lr_scheduler`, `train.warmup_steps`), the steps `train.epochs` comes to, and
`train.gradient_accumulation_steps` > 1 in a real run (README, params.yaml: train).

A run with gradient_accumulation_steps 2 and micro_batch_size 1 does not train the LoRA of a run with 1 and 2 on
the same data and seed, by design: micro-batches are formed per micro_batch_size (data.epoch_order) and each
micro-batch draws its noise and timesteps from a generator seeded by its position in the sequence
(MicroBatches.at), so the two runs see other batches and other noise. What is tested instead: each optimizer step
consumes two micro-batches, its loss is their mean, the schedule counts optimizer steps (not micro-batches), and
a run resumed from a mid-run checkpoint ends with the uninterrupted run's LoRA."""

from __future__ import annotations

import csv
import json
import math
import shutil
import sys
from pathlib import Path

import pytest

from diffusion_pipe.params import TrainParams
from diffusion_pipe.train.data import DataError, Row, steps_for_epochs
from diffusion_pipe.train.loop import lr_lambda
from tests.conftest import make_pipeline_repo, run_checked, run_env, run_stages


def expected_factor(kind: str, step: int, steps: int, warmup: int) -> float:
    """The README's schedule, written out: the multiplier of the base learning rate for optimizer step `step`
    (0-based). Warmup: the k-th step (k = step + 1) of `warmup` takes k / warmup of the base rate, so the rate
    climbs in equal steps from base / warmup to the base rate at step `warmup`; then a fraction p of the
    remaining steps has passed, and linear takes 1 - p, cosine the half cosine (1 + cos(pi p)) / 2, constant 1."""
    if step < warmup:
        return (step + 1) / warmup
    p = (step - warmup) / (steps - warmup)
    return {"constant": 1.0, "linear": 1.0 - p, "cosine": (1.0 + math.cos(math.pi * p)) / 2}[kind]


def factors(kind: str, steps: int, warmup: int) -> list[float]:
    """lr_lambda's multipliers for steps 0..steps (the last one: after the last optimizer step)."""
    factor = lr_lambda(TrainParams(steps=steps, lr_scheduler=kind, warmup_steps=warmup))
    return [factor(s) for s in range(steps + 1)]


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_every_schedule_matches_the_formula(kind):
    for steps, warmup in ((10, 2), (7, 0), (12, 5), (3, 1)):
        want = [expected_factor(kind, s, steps, warmup) for s in range(steps + 1)]
        assert factors(kind, steps, warmup) == pytest.approx(want, abs=1e-12), (steps, warmup)


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_warmup_ramps_linearly_up_to_the_base_rate(kind):
    got = factors(kind, steps=20, warmup=4)
    assert got[:5] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0], abs=1e-12)


def test_constant_stays_at_the_base_rate():
    assert factors("constant", steps=10, warmup=3)[3:] == [1.0] * 8
    assert factors("constant", steps=5, warmup=0) == [1.0] * 6


def test_linear_decays_to_zero_at_the_end():
    # 10 steps, 2 of warmup: 8 steps of decay, 1/8 of the base rate each
    got = factors("linear", steps=10, warmup=2)
    assert got[2:] == pytest.approx([1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125, 0.0], abs=1e-12)


def test_cosine_follows_the_half_cosine():
    got = factors("cosine", steps=10, warmup=2)
    # p = 0, 1/4, 1/2, 7/8, 1 of the decay: (1 + cos(pi p)) / 2
    assert [got[i] for i in (2, 4, 6, 9, 10)] == pytest.approx(
        [1.0, 0.8535533905932737, 0.5, 0.03806023374435663, 0.0], abs=1e-12)
    # above the line in the first half of the decay, below it in the second
    line = factors("linear", steps=10, warmup=2)
    assert all(got[s] > line[s] for s in (3, 4, 5)) and all(got[s] < line[s] for s in (7, 8, 9))


# ---- train.epochs -> steps ----------------------------------------------------------------------------------

def rows(buckets: dict[str, int], repeats: int = 1) -> list[Row]:
    """`buckets[b]` rows of bucket b, each `repeats` times."""
    return [Row(f"{b}-{i}", b, repeats, f"lat-{b}-{i}", f"txt-{b}-{i}") for b, n in buckets.items()
            for i in range(n)]


def epochs_to_steps(data: list[Row], epochs: int, micro: int, accumulation: int = 1, dp: int = 1) -> int:
    train = TrainParams(epochs=epochs, micro_batch_size=micro, gradient_accumulation_steps=accumulation)
    return steps_for_epochs(data, train, dp)


def test_epochs_round_a_partial_last_step_up():
    # 18 samples (9 items x 2 repeats) in micro-batches of 3 = 6 micro-batches; 4 per optimizer step: 1.5 steps
    assert epochs_to_steps(rows({"64x64": 9}, repeats=2), epochs=1, micro=3, accumulation=4) == 2
    # 10 samples / 2 per step = 5 micro-batches; with accumulation 2: 2.5 -> 3 steps, 3 epochs: 7.5 -> 8
    data = rows({"64x64": 10})
    assert epochs_to_steps(data, epochs=1, micro=2, accumulation=2) == 3
    assert epochs_to_steps(data, epochs=3, micro=2, accumulation=2) == 8
    assert epochs_to_steps(data, epochs=3, micro=2, accumulation=1) == 15  # exact: nothing to round


def test_epochs_divide_by_every_factor_of_the_step():
    # 24 samples: micro-batch 2 x accumulation 3 x 2 data-parallel ranks = 12 samples a step
    data = rows({"64x64": 12}, repeats=2)
    assert epochs_to_steps(data, epochs=1, micro=2, accumulation=3, dp=2) == 2
    assert epochs_to_steps(data, epochs=5, micro=2, accumulation=3, dp=2) == 10
    # 24 samples a step: one epoch of 24 is 1 step, 5 epochs 5
    assert epochs_to_steps(data, epochs=5, micro=4, accumulation=3, dp=2) == 5
    # 5 epochs of 24 samples at 36 a step: 3.33 -> 4
    assert epochs_to_steps(data, epochs=5, micro=2, accumulation=9, dp=2) == 4


def test_epochs_count_the_micro_batches_each_bucket_fills():
    """A micro-batch holds one bucket, and a bucket's incomplete last micro-batch is left out of the epoch
    (data.epoch_order): 3 x 2 = 6 samples of one bucket fill one micro-batch of 4, 5 x 2 = 10 of another two; 3
    micro-batches at 2 a step: 1.5 -> 2 steps."""
    data = rows({"64x64": 3, "64x48": 5}, repeats=2)
    assert epochs_to_steps(data, epochs=1, micro=4, accumulation=2) == 2
    assert epochs_to_steps(data, epochs=3, micro=4, accumulation=2) == 5  # 9 micro-batches: 4.5 -> 5


def test_epochs_with_too_few_samples_for_a_micro_batch_are_refused():
    with pytest.raises(DataError, match=r"^train\.epochs: "):
        epochs_to_steps(rows({"64x64": 3}), epochs=1, micro=4)


# ---- a real run with gradient_accumulation_steps 2 ------------------------------------------------------------

STEPS, WARMUP, BASE_LR = 6, 2, 2.0e-3
PARAMS = {"steps: 120": f"steps: {STEPS}", "micro_batch_size: 2": "micro_batch_size: 1",
          "gradient_accumulation_steps: 1": "gradient_accumulation_steps: 2",
          "learning_rate: 2.0e-3": f"learning_rate: {BASE_LR}",
          "warmup_steps: 10": f"warmup_steps: {WARMUP}",
          "eval_every_steps: 40": "eval_every_steps: 0\n  checkpoint_every_steps: 1"}


def train_cmd(runs: Path, params: Path | None = None) -> list[str]:
    return [sys.executable, "-m", "stages.train", "--runs", str(runs), "--out", str(runs / "out"),
            "--report", str(runs / "report.json"), "--loss-plot", str(runs / "loss.csv"),
            *(["--params", str(params)] if params else [])]


def losses(runs: Path) -> list[float]:
    with open(runs / "loss.csv") as fh:
        return [float(r["loss"]) for r in csv.DictReader(fh)]


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory):
    """The bundled example, encoded, and trained for 6 steps of 2 micro-batches of 1 (a checkpoint every step):
    (repo, store, runs directory, the run's checkpoint directory)."""
    root = tmp_path_factory.mktemp("accumulation")
    store = root / "store"
    repo = make_pipeline_repo(root / "repo", store, PARAMS, dvc=False)
    run_stages(repo, store)
    runs = root / "runs"
    run_checked(train_cmd(runs), cwd=repo, env=run_env(store))
    (run_dir,) = (runs / "checkpoints").iterdir()
    return repo, store, runs, run_dir


def checkpoint(run_dir: Path, step: int) -> tuple[dict, dict]:
    """(the loop's state, stage 0's optimizer / scheduler / engine record) of the checkpoint of `step`."""
    path = run_dir / f"step{step}"
    return json.loads((path / "state.json").read_text()), json.loads((path / "stage0.json").read_text())


def test_each_optimizer_step_consumes_two_micro_batches(accumulated):
    _, _, runs, run_dir = accumulated
    assert json.loads((runs / "report.json").read_text())["steps"] == STEPS
    assert len(losses(runs)) == STEPS
    for step in range(1, STEPS + 1):
        state, stage = checkpoint(run_dir, step)
        assert state["step"] == step
        assert state["position"] == 2 * step  # the next micro-batch of the sequence to train on
        assert stage["engine"]["global_steps"] == step
        assert stage["engine"]["global_samples"] == 2 * step


def test_optimizer_steps_with_the_scheduled_rate(accumulated):
    """After optimizer step k the optimizer holds the rate of step k (0-based) of the cosine schedule: the
    schedule counts optimizer steps, not micro-batches. The first step moved each LoRA B (zero at init) by
    AdamW's first update, lr * g / (|g| + eps): the largest entry is the first step's scheduled rate."""
    from safetensors.torch import load_file

    _, _, _, run_dir = accumulated
    for step in range(1, STEPS + 1):
        _, stage = checkpoint(run_dir, step)
        assert stage["scheduler"]["last_epoch"] == step
        (group,) = stage["param_groups"]
        assert group["lr"] == pytest.approx(BASE_LR * expected_factor("cosine", step, STEPS, WARMUP), rel=1e-9,
                                            abs=1e-15), step
    masters = load_file(run_dir / "step1" / "stage0.safetensors")
    lora_b = [t for k, t in masters.items() if k.startswith("master/") and "lora_B" in k]
    assert lora_b
    first_rate = BASE_LR * expected_factor("cosine", 0, STEPS, WARMUP)  # base / warmup
    assert max(float(t.abs().max()) for t in lora_b) == pytest.approx(first_rate, rel=1e-4)


@pytest.mark.slow  # another run (about 10 s)
def test_accumulated_step_loss_is_the_mean_of_its_micro_batches(accumulated, tmp_path):
    """The first step's loss of the accumulated run is the mean of the losses of micro-batches 0 and 1 at the
    initial weights: a run of micro-batches of 1 without accumulation (the same micro-batch sequence and noise)
    with a learning rate so small that its first step leaves the weights as they were gives those two."""
    repo, store, runs, _ = accumulated
    params = (repo / "params.yaml").read_text()
    for old, new in (("gradient_accumulation_steps: 2", "gradient_accumulation_steps: 1"),
                     (f"learning_rate: {BASE_LR}", "learning_rate: 1.0e-12"), (f"steps: {STEPS}", "steps: 2")):
        assert old in params
        params = params.replace(old, new)
    (tmp_path / "plain.yaml").write_text(params)
    plain = tmp_path / "plain"
    run_checked(train_cmd(plain, tmp_path / "plain.yaml"), cwd=repo, env=run_env(store))
    first, second = losses(plain)
    assert abs(first - second) > 1e-3  # two different micro-batches, else the mean proves nothing
    assert losses(runs)[0] == pytest.approx((first + second) / 2, abs=2e-6)  # loss.csv: 6 decimals


@pytest.mark.slow  # another run (about 10 s)
def test_resumed_accumulated_run_matches_uninterrupted(accumulated, tmp_path):
    """A run that has only the checkpoint of step 3 of the run above continues from it (the optimizer state,
    scheduler, and micro-batch position 6) and ends with the same losses and the same LoRA bytes."""
    repo, store, runs, run_dir = accumulated
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir / "step3", resumed / "checkpoints" / run_dir.name / "step3")
    run_checked(train_cmd(resumed), cwd=repo, env=run_env(store))
    assert json.loads((resumed / "report.json").read_text())["resumed_from"] == 3
    assert losses(resumed) == losses(runs)
    assert (resumed / "out" / "lora.safetensors").read_bytes() == (runs / "out" / "lora.safetensors").read_bytes()
