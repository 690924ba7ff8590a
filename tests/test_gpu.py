"""The CUDA paths the CPU suite cannot reach: the bundled example encoded and trained on a GPU in bfloat16 and in
float16 (dynamic loss scaling), with per-layer torch.compile, time-based checkpoints and pruning. Run with
`pytest -m gpu` on a machine with a CUDA GPU (DVC need not be installed); skipped elsewhere."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import train_example

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = 40


@pytest.mark.parametrize("dtype,compile_layers", [("bfloat16", False), ("float16", False), ("bfloat16", True)])
def test_example_trains_on_gpu(tmp_path, dtype, compile_layers):
    repo, report, rows = train_example(tmp_path, {
        "dtype: float32": f"dtype: {dtype}", "steps: 120": f"steps: {STEPS}",
        # a save whenever 6 ms have passed since the last one: about every step; only the newest 2 are kept
        "checkpoint_every_minutes: 30": "checkpoint_every_minutes: 0.0001",
        "eval_every_steps: 40": "eval_every_steps: 0\n  device: cuda\n"
                                f"  keep_checkpoints: 2\n  compile: {str(compile_layers).lower()}"}, dvc=False)
    losses = [float(r["loss"]) for r in rows]
    # unscaled losses of the size the fp32 CPU run reports (about 1), which fall; finite gradient norms
    assert len(losses) == STEPS and all(0.05 < x < 5 for x in losses)
    assert sum(losses[-10:]) < sum(losses[:10])
    assert all(0 < float(r["grad_norm"]) < 1e3 for r in rows)
    assert report["eval_loss_end"] < report["eval_loss_start"]
    assert report["lora_dtype"] == dtype and report["max_memory_gb"] > 0
    # time-based checkpoints were written through the run (the final one alone would leave one) and pruned to 2
    run_dir = repo / "runs/checkpoints" / report["run_id"]
    kept = sorted(int(p.name[4:]) for p in run_dir.glob("step*"))
    assert len(kept) == 2 and kept[-1] == STEPS


@pytest.mark.parametrize("compile_layers", [False, True])
def test_swapped_blocks_train_as_blocks_kept_on_the_gpu(tmp_path, compile_layers):
    """Swapped blocks' weights copy ahead on a stream of their own while the block before computes: the losses are
    those of the run that keeps every block on the GPU (a weight read before its copy landed would change them)."""
    def losses(name: str, swap: int) -> list[float]:
        _, _, rows = train_example(tmp_path / name, {
            "steps: 120": "steps: 12", "eval_every_steps: 40": "eval_every_steps: 0\n  device: cuda\n"
            f"  activation_checkpointing: true\n  blocks_to_swap: {swap}\n  compile: {str(compile_layers).lower()}"},
            dvc=False)
        return [float(r["loss"]) for r in rows]

    kept = losses("kept", 0)
    assert len(kept) == 12
    assert losses("swapped", 2) == pytest.approx(kept, rel=1e-5)


def flux_blocks_pass(compiled: bool) -> tuple[dict, set]:
    """bench_attention's Flux double then single block (4 heads x 64, 512 image + 64 text tokens, bf16) forward +
    backward under the SDPA kernels the train stage allows (`use_attention_kernel`): output and gradients, and the
    attention ops that ran."""
    from bench_attention import flux_blocks_setup

    from diffusion_pipe.train.pipeline import use_attention_kernel

    torch.backends.cuda.enable_cudnn_sdp(True)  # as torch starts on recent GPUs: the train stage must turn it off
    use_attention_kernel()
    blocks = flux_blocks_setup(1, 4, 64, 512, 64)
    torch._dynamo.reset()
    fn = torch.compile(blocks.forward) if compiled else blocks.forward
    for profiled in (False, True):  # the first compiles
        blocks.zero_grad()
        x, c = blocks.image.detach().requires_grad_(), blocks.text.detach().requires_grad_()
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with profiler if profiled else contextlib.nullcontext():
            out = fn(x, c)
            out.backward(blocks.grad)
    ops = {e.name for e in profiler.events() if "scaled_dot_product" in e.name}
    return {"out": out.detach(), **blocks.gradients(x, c)}, ops


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_train_stage_attention_runs_flash_and_never_cudnn(compiled):
    """The train stage's attention runs torch's flash kernel, eager and compiled, and never cuDNN's: cuDNN's
    backward gave gradients a relative 5.9 away from flash's on an H100 and crashed on an H200, so
    `train.attention: cudnn` was removed (`python bench/bench_attention.py --flux-blocks` re-measures cuDNN)."""
    tensors, ops = flux_blocks_pass(compiled)
    assert any("flash" in op for op in ops) and not any("cudnn" in op for op in ops), ops
    assert all(torch.isfinite(t).all() for t in tensors.values())


def test_safetensors_reach_the_gpu_through_pinned_buffers_unchanged(tmp_path):
    """load_safetensors_to_device's CUDA path (pinned double buffer, side stream, chunks smaller than a tensor, a
    tensor copied out of the file's bytes on the default stream): every tensor equal to safetensors' own load."""
    from safetensors.torch import load_file, save_file

    from diffusion_pipe.models.device_load import load_safetensors_to_device
    from tests.models.test_device_load import write_by_hand

    gen = torch.Generator().manual_seed(0)
    files = []
    for i in range(2):
        files.append(tmp_path / f"model-{i}.safetensors")
        save_file({f"{i}.w": torch.randn(512, 1000, generator=gen).bfloat16(), f"{i}.b": torch.randn(3, generator=gen),
                   f"{i}.n": torch.arange(5, dtype=torch.int8)}, files[-1])
    weight = torch.randn(300, 70, generator=gen).bfloat16()  # at an odd offset: copied on the device, not viewed
    files.append(tmp_path / "odd.safetensors")
    write_by_hand(files[-1], [("ids", "I8", [3], bytes([1, 2, 255])),
                              ("weight", "BF16", [300, 70], weight.view(torch.uint8).numpy().tobytes())])
    loaded = load_safetensors_to_device(files, torch.device("cuda"), chunk_bytes=100_000)
    for file in files:
        for name, want in load_file(file).items():
            assert loaded[name].is_cuda and torch.equal((loaded[name] * 1).cpu(), want * 1), name


def test_a_large_text_encoder_loaded_through_pinned_memory_is_the_one_from_pretrained_loads(tmp_path, monkeypatch):
    """load_component's pinned path (every size let through) gives the model from_pretrained gives: same weights,
    tied embedding, same output on the GPU."""
    from transformers import T5Config, T5EncoderModel

    from diffusion_pipe.models import common

    torch.manual_seed(0)
    config = T5Config(vocab_size=64, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
    T5EncoderModel(config).bfloat16().save_pretrained(tmp_path, max_shard_size="100KB")
    monkeypatch.setattr(common, "PINNED_LOAD_MIN_BYTES", 0)
    assert len(common.pinned_load_shards(T5EncoderModel, tmp_path, torch.bfloat16, torch.device("cuda"))) > 1
    pinned = common.load_component(T5EncoderModel, tmp_path, torch.bfloat16, torch.device("cuda"))
    reference = T5EncoderModel.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda().eval()
    assert pinned.dtype == torch.bfloat16 and not pinned.training
    assert pinned.shared.weight.data_ptr() == pinned.encoder.embed_tokens.weight.data_ptr()
    for (name, got), (_, want) in zip(pinned.state_dict().items(), reference.state_dict().items(), strict=True):
        assert got.is_cuda and torch.equal(got, want), name
    ids = torch.randint(0, 64, (2, 9), device="cuda")
    assert torch.equal(pinned(ids).last_hidden_state, reference(ids).last_hidden_state)


def test_adamw8bit_state_through_a_checkpoint_continues_exactly(tmp_path):
    """bitsandbytes' AdamW8bit (CUDA only, so never run by the CPU suite) steps our fp32 masters, its 8-bit state
    (uint8 moments, their absmax and quantile maps) goes through our checkpoint format, and a fresh optimizer
    loaded from it takes the unbroken optimizer's next steps bit for bit."""
    pytest.importorskip("bitsandbytes", reason="adamw8bit's bitsandbytes is optional: install it to test it")
    from diffusion_pipe.config import from_dict
    from diffusion_pipe.params import TrainParams
    from diffusion_pipe.train.optim import LossScaler, build_optimizer
    from tests.train.test_optimizers import _checkpoints

    cuda = torch.device("cuda")
    shapes = ((64, 96), (96, 64), (8, 8))  # the last under min_8bit_size: it keeps 32-bit state

    def params(seed: int) -> list[torch.nn.Parameter]:
        g = torch.Generator().manual_seed(seed)
        return [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16().to(cuda)) for s in shapes]

    def step(opt, ps, n: int) -> None:
        g = torch.Generator().manual_seed(100 + n)
        for p, s in zip(ps, shapes):
            p.grad = torch.randn(s, generator=g).bfloat16().to(cuda)
        opt.step()
        opt.zero_grad()

    train = from_dict(TrainParams, {"optimizer": "adamw8bit", "max_grad_norm": 0.0, "learning_rate": 1e-2,
                                    "optimizer_args": {"min_8bit_size": 4096}}, "train")

    def build(ps):
        opt = build_optimizer(ps, train, cuda, LossScaler(False))
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0)

    ps = params(0)
    opt, scheduler = build(ps)
    start = [m.clone() for m in opt.masters]
    for n in range(2):
        step(opt, ps, n)
        scheduler.step()
    assert all(not torch.equal(a, b) for a, b in zip(start, opt.masters))  # it stepped the masters
    state = opt.state[opt.masters[0]]
    assert any(t.dtype == torch.uint8 for t in state.values() if torch.is_tensor(t)), state.keys()
    _checkpoints(tmp_path, ps, opt, scheduler, cuda).save({"step": 2})
    fresh_ps = params(1)
    fresh, fresh_scheduler = build(fresh_ps)
    _checkpoints(tmp_path, fresh_ps, fresh, fresh_scheduler, cuda).load(tmp_path / "run" / "step2")
    for n in (2, 3):
        step(opt, ps, n)
        step(fresh, fresh_ps, n)
    assert all(torch.equal(a, b) for a, b in zip(opt.masters, fresh.masters))
    assert all(torch.equal(a, b) for a, b in zip(ps, fresh_ps))


def test_adamw8bit_trains_the_example_in_bfloat16(tmp_path):
    pytest.importorskip("bitsandbytes", reason="adamw8bit's bitsandbytes is optional: install it to test it")
    _, report, rows = train_example(tmp_path, {
        "dtype: float32": "dtype: bfloat16", "steps: 120": f"steps: {STEPS}",
        "  optimizer: adamw ": "  optimizer: adamw8bit ",
        "eval_every_steps: 40": "eval_every_steps: 0\n  device: cuda\n  optimizer_args: {min_8bit_size: 256}"},
        dvc=False)
    losses = [float(r["loss"]) for r in rows]
    assert len(losses) == STEPS and all(0.05 < x < 5 for x in losses)
    assert report["eval_loss_end"] < report["eval_loss_start"], report
