"""What a run is (train/loop.py `run_identity`, whose hash names its checkpoint directory) and when `--resume-from`
refuses another run's checkpoints (`check_resumable`): a changed encoded table, model or parallel layout is
refused naming each change unless forced; train params may differ; settings that change nothing trained
(samples among them) keep the run's identity, so editing a sample prompt continues the run instead of restarting
it."""

from __future__ import annotations

import dataclasses

import pytest

from diffusion_pipe.fileio import write_json_atomic
from diffusion_pipe.hashing import hash_json
from diffusion_pipe.params import OPTIMIZER_ARGS, ModelParams, SampleParams, SamplePrompt, TrainParams
from diffusion_pipe.train.data import DataError
from diffusion_pipe.train.loop import check_resumable, run_identity


@pytest.fixture
def encoded(tmp_path):
    path = tmp_path / "encoded.parquet"
    path.write_bytes(b"table")
    return path


def _checkpoint(tmp_path, identity: dict):
    source = tmp_path / "runs/checkpoints/abc"
    (source / "step000004").mkdir(parents=True)
    write_json_atomic(source / "identity.json", identity)
    return source


def test_samples_are_not_part_of_the_run_but_what_trains_is(encoded):
    model, train = ModelParams(path="m"), TrainParams()
    base = run_identity(model, train, encoded, 32, 1)
    prompts = SampleParams(prompts=(SamplePrompt("a red cube", seed=3),), every_steps=5)
    assert run_identity(model, dataclasses.replace(train, samples=prompts), encoded, 32, 1) == base
    # a run from before train.attention existed, or from when it had two values (its identity without the key),
    # continues too
    assert "attention" not in base["train"]
    assert run_identity(model, dataclasses.replace(train, learning_rate=train.learning_rate / 2), encoded, 32,
                        1) != base
    assert run_identity(model, train, encoded, 64, 1) != base


# The train params that may change when a run resumes (run_identity leaves them out), and why: each changes when or
# how the run is saved, shown or computed, never what it trains.
MAY_CHANGE_ON_RESUME = {
    "checkpoint_every_steps", "checkpoint_every_minutes", "keep_checkpoints",  # when checkpoints are written
    "samples", "save_lora_every_steps",  # what is rendered and written along the way
    "swap_prefetch",  # whether swapped blocks are copied ahead: the same weights, the same products
    "attention",  # one value left (flash); left out so that runs from when it had two continue
}
# Left out of the identity while they hold today's default (adamw, no args; mse, the whole schedule; no
# init_lora; no EMA, no loss masks, no DoRA, LoKr's options), so that runs from before they existed resume; any
# other value is another run (test_the_optimizer_and_its_args_are_part_of_the_run, tests/train/test_adapters.py).
ABSENT_AT_DEFAULT = {"optimizer", "optimizer_args", "loss", "huber_c", "timestep_range", "init_lora", "ema_decay",
                     "mask_min_weight", "lora_dora", "lokr_factor", "lokr_decompose_both"}
# Another valid value of every other train param: changing any of them must start a new run.
OTHER_VALUE = {
    "seed": 1, "steps": 200, "micro_batch_size": 2, "gradient_accumulation_steps": 2, "learning_rate": 2.0e-4,
    "lr_scheduler": "cosine", "warmup_steps": 5, "weight_decay": 0.01, "adam_betas": (0.9, 0.99),
    "adam_eps": 1.0e-6, "max_grad_norm": 0.5, "adapter": "full", "lora_rank": 8, "lora_alpha": 8.0,
    "lora_dropout": 0.1, "lora_targets": ("to_q",), "timestep_sampling": "uniform", "flow_shift": 3.0,
    "init_lora": "runs/old/lora.safetensors", "guidance": 3.5, "epochs": 2, "noise_offset": 0.05, "min_snr_gamma": 5.0, "pipeline_stages": 2,
    "activation_checkpointing": False, "activation_checkpointing_share": 0.5,
    "activation_checkpointing_keep": "attention", "compile": True, "blocks_to_swap": 2, "max_gpu_memory_gb": 24.0,
    "device": "cpu", "caption_dropout": 0.1, "eval_every_steps": 10, "eval_timesteps": (0.5,),
    "checkpoint_every_steps": 10, "checkpoint_every_minutes": 5.0, "keep_checkpoints": 2,
    "samples": SampleParams(prompts=(SamplePrompt("a red cube"),)), "save_lora_every_steps": 10,
    "swap_prefetch": False, "optimizer": "adafactor",
    "loss": "pseudo_huber", "huber_c": 0.3, "timestep_range": (0.0, 0.5), "ema_decay": 0.999,
    "mask_min_weight": 0.1, "lora_dora": True, "lokr_factor": 4, "lokr_decompose_both": True,
}
# huber_c is read only with a Huber loss (with mse it is refused), the lokr_ options only with adapter: lokr: each
# is walked from a run with one
NEEDS = {"huber_c": {"loss": "huber"}, "lokr_factor": {"adapter": "lokr"}, "lokr_decompose_both": {"adapter": "lokr"}}


def test_every_train_param_is_in_the_run_identity_or_allowed_to_change_on_resume(encoded):
    """A param left out of the identity lets a resumed run silently continue with another value of it (caption
    dropout, say): walk every train param, and each must move the identity unless it is on the commented list."""
    model = ModelParams(path="m")
    base = TrainParams(activation_checkpointing=True)  # the share and keep apply only with checkpointing on
    identity = run_identity(model, base, encoded, 32, 1)
    names = {f.name for f in dataclasses.fields(TrainParams)}
    assert names - set(identity["train"]) == MAY_CHANGE_ON_RESUME | ABSENT_AT_DEFAULT
    for name in sorted(names - {"attention", "optimizer_args"}):  # attention: one value left; args: per optimizer
        assert name in OTHER_VALUE, f"train.{name}: add another value of it to OTHER_VALUE"
        # an optimizer comes with its own args class
        args = {"optimizer_args": OPTIMIZER_ARGS[OTHER_VALUE[name]]()} if name == "optimizer" else {}
        args |= NEEDS.get(name, {})
        start = run_identity(model, dataclasses.replace(base, **args), encoded, 32, 1) if name in NEEDS else identity
        changed = run_identity(model, dataclasses.replace(base, **{name: OTHER_VALUE[name]}, **args), encoded, 32, 1)
        assert (changed == start) == (name in MAY_CHANGE_ON_RESUME), name


def test_the_optimizer_and_its_args_are_part_of_the_run(encoded):
    """Another optimizer, or other args of it, is another run; today's adamw keeps the identity of runs from before
    train.optimizer existed (no optimizer keys), so they resume."""
    from diffusion_pipe.params import ProdigyArgs

    model, train = ModelParams(path="m"), TrainParams()
    base = run_identity(model, train, encoded, 32, 1)
    assert "optimizer" not in base["train"] and "optimizer_args" not in base["train"]
    prodigy = dataclasses.replace(train, optimizer="prodigy", optimizer_args=ProdigyArgs(), learning_rate=1.0)
    muon = dataclasses.replace(train, optimizer="muon", optimizer_args=None, learning_rate=1.0)
    identities = [run_identity(model, t, encoded, 32, 1) for t in (prodigy, muon, dataclasses.replace(
        prodigy, optimizer_args=ProdigyArgs(d_coef=0.5)))]
    assert len({hash_json(i) for i in [base, *identities]}) == 4
    assert identities[0]["train"]["optimizer"] == "prodigy"
    assert identities[0]["train"]["optimizer_args"]["d_coef"] == 1.0


def test_the_same_run_read_back_resumes(tmp_path, encoded):
    identity = run_identity(ModelParams(path="m"), TrainParams(), encoded, 32, 1)
    check_resumable(_checkpoint(tmp_path, identity), identity, force=False)


@pytest.mark.parametrize(("model", "train", "world", "named"), [
    (ModelParams(path="other"), TrainParams(), 1, "the model"),
    (ModelParams(path="m"), TrainParams(), 2, "the parallel layout"),
    (ModelParams(path="m"), TrainParams(pipeline_stages=2), 2, "the parallel layout"),
])
def test_another_model_or_layout_is_refused_unless_forced(tmp_path, encoded, model, train, world, named):
    source = _checkpoint(tmp_path, run_identity(ModelParams(path="m"), TrainParams(), encoded, 32, 1))
    other = run_identity(model, train, encoded, 32, world)
    with pytest.raises(DataError, match=rf"--resume-from .*refusing to resume, since {named} .* changed; "
                                        r"pass --force"):
        check_resumable(source, other, force=False)
    check_resumable(source, other, force=True)


def test_another_encoded_table_is_refused_and_train_params_may_differ(tmp_path, encoded):
    model, train = ModelParams(path="m"), TrainParams()
    source = _checkpoint(tmp_path, run_identity(model, train, encoded, 32, 1))
    check_resumable(source, run_identity(model, dataclasses.replace(train, steps=train.steps * 2), encoded, 32, 1),
                    force=False)
    encoded.write_bytes(b"another table")
    with pytest.raises(DataError, match=r"since the encoded table \(hash \w+ -> \w+\) changed"):
        check_resumable(source, run_identity(model, train, encoded, 32, 1), force=False)


def test_a_directory_without_checkpoints_is_refused(tmp_path, encoded):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no checkpoint there \(no step<N> directory\)"):
        check_resumable(tmp_path / "empty", run_identity(ModelParams(path="m"), TrainParams(), encoded, 32, 1),
                        force=False)
