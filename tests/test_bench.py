"""The benchmarks' own plumbing, checked on the CPU so that a GPU session does not find it broken: every family
the family benchmark lists has a published shape to build and a plain loop to run (its contract test's unsplit
forward), and the tiny run of one edit family (conditioning latents, a contract test with a variant subclass)
goes through both runners."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from diffusion_pipe.models import REGISTRY
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import bench_engine_chores  # noqa: E402
import bench_family  # noqa: E402
from family_shapes import REAL  # noqa: E402

# flux is bench_train.py's (the Flux-dev shape against the trainer we replace); sdxl has no plain row (UNet)
OWN_BENCHMARK = {"flux", "sdxl"}


def test_every_family_but_those_with_their_own_benchmark_is_listed_with_a_real_shape():
    assert set(bench_family.PRIORITY) == set(REGISTRY) - OWN_BENCHMARK
    assert len(bench_family.PRIORITY) == len(set(bench_family.PRIORITY))
    assert set(bench_family.PRIORITY) <= set(REAL)


@pytest.mark.parametrize("family", bench_family.PRIORITY)
def test_the_plain_loop_finds_the_familys_unsplit_forward(family):
    contract = bench_family.contract_forward(family)
    assert callable(contract.unsplit_forward)


@pytest.mark.parametrize("family", sorted(bench_engine_chores.DEPTH))
def test_the_engine_chores_bench_builds_the_published_depth(family):
    """The chores' cost follows the module count, so that bench keeps each family's published depth (its widths
    are the tiny ones): every depth it sets is the real shape's."""
    depth = {k: v for k, v in bench_engine_chores.DEPTH[family].items() if k != "llama_layers"}
    assert depth and depth == {k: REAL[family]["transformer"][k] for k in depth}
    layers = bench_engine_chores.DEPTH[family].get("llama_layers")
    if layers:  # one text layer per block, as the real model reads
        assert len(layers) == len(REAL[family]["transformer"]["llama_layers"])


@pytest.mark.slow  # two fresh train-stage processes: about 20 s
def test_the_tiny_run_of_an_edit_family_gives_both_rows(tmp_path):
    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, "bench/bench_family.py", "--family", "qwenimage_edit", "--shape", "tiny",
                    "--steps", "3", "--device", "cpu", "--work", str(tmp_path / "work"), "--json", str(out)],
                   cwd=REPO, check=True, capture_output=True, text=True, timeout=600)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["family"] == "qwenimage_edit"
    assert row["plain"]["step_seconds"] > 0 and row["ours"]["step_seconds"] > 0


def test_a_failed_runs_row_names_the_exception_not_the_warnings_after_it():
    """A train stage's stderr ends in what it printed at exit (NCCL's destroy_process_group warning); the row
    names the exception above it, and a memory failure in one word."""
    stderr = ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1, in forward\n"
              "[rank0]: RuntimeError: Autograd not support dtype: Int\n"
              "[rank0]:[W1206 ProcessGroupNCCL.cpp:1575] Warning: WARNING: destroy_process_group() was not called\n")
    assert bench_family._reason(stderr) == "RuntimeError: Autograd not support dtype: Int"
    assert bench_family._reason(stderr.replace("RuntimeError: Autograd", "torch.OutOfMemoryError: CUDA")) == "OOM"
    assert bench_family._reason("no exception here\nlast line") == "last line"


def test_the_gradient_comparison_of_the_attention_check_is_relative_and_ignores_noise():
    """bench_attention.relative_differences, with which `--flux-blocks` measures cuDNN's kernel against flash:
    |a - b| / |b| per tensor, leaving out a reference whose norm is noise next to the largest (a key bias's gradient)."""
    import torch
    from bench_attention import relative_differences

    reference = {"out": torch.ones(4) * 10, "dq": torch.ones(4), "key bias": torch.full((4,), 1e-5)}
    other = {"out": torch.ones(4) * 10, "dq": torch.ones(4) * 1.1, "key bias": torch.full((4,), -1e-5)}
    differences = relative_differences(reference, other)
    assert differences.keys() == {"out", "dq"}
    assert differences["out"] == 0 and differences["dq"] == pytest.approx(0.1)


def test_the_flux_blocks_of_the_attention_check_build_and_backpropagate_on_the_cpu():
    import torch
    from bench_attention import flux_blocks_setup

    blocks = flux_blocks_setup(1, 2, 16, 16, 4, device="cpu")
    x, c = blocks.image.detach().requires_grad_(), blocks.text.detach().requires_grad_()
    out = blocks.forward(x, c)
    assert out.shape == blocks.image.shape == blocks.grad.shape
    out.backward(blocks.grad)
    grads = blocks.gradients(x, c)
    assert grads["d image"].shape == x.shape and grads["d text"].shape == c.shape
    assert len(grads) > 20 and all(g is not None for g in grads.values())
    blocks.zero_grad()
    assert all(g is None for name, g in blocks.gradients(x, c).items() if not name.startswith("d "))


def test_the_lora_fusion_bench_computes_one_function_three_ways_and_sees_what_bf16_drops():
    import bench_lora_fusion as fusion

    torch = pytest.importorskip("torch")
    x, w, bias, a, b = fusion.operands(48, 40, 6, 4, "cpu", torch.float64, 0.5)
    results = {}
    for name, fn in fusion.ways(0.75).items():
        x_, a_, b_ = (t.detach().requires_grad_() for t in (x, a, b))
        out = fn(x_, w, bias, a_, b_)
        out.pow(2).sum().backward()
        results[name] = (out, x_.grad, a_.grad, b_.grad)
    for name in ("fused", "addmm"):  # the same forward and the same gradients as peft's, in float64
        for got, want in zip(results[name], results["peft"]):
            torch.testing.assert_close(got, want)
    assert results["base"][2] is None and not torch.allclose(results["base"][0], results["peft"][0])
    # in bf16, an adapter at 0.03% of W is mostly rounded away by a sum after the rounded base product, and kept
    # by a product that adds it in its accumulator; at 3% every way keeps it
    small, large = (fusion.retained(256, 256, 64, 4, ratio, "cpu") for ratio in (3e-4, 3e-2))
    assert small["peft"] < 0.5 and small["fused"] < 0.5 and small["addmm"] > 0.9
    assert all(0.97 < share < 1.03 for share in large.values())


def test_the_train_bench_refuses_ratios_against_a_plain_loop_that_compiling_did_not_speed_up():
    """Issue 35: the bench's compiled plain loop gained 1.00x and every "x plain" figure rested on it. On a GPU a
    compile gain under MIN_COMPILE_GAIN refuses the ratios (the bench exits 1); a sound pair gives them."""
    from bench_train import MIN_COMPILE_GAIN, check_baselines

    def run(plain_eager: float, plain_compiled: float) -> dict:
        return {"eager": {"plain": {"step_seconds": plain_eager}, "plain-diffusers": {"step_seconds": 0.70}},
                "compile": {"plain": {"step_seconds": plain_compiled}, "plain-diffusers": {"step_seconds": 0.46},
                            "ours": {"step_seconds": 0.40}}}

    broken = check_baselines(run(0.579, 0.582), "cuda")
    assert not broken["ok"] and not broken["ratios"]
    assert "REFUSED: plain gained less than 1.2x" in broken["lines"][-1]
    assert check_baselines(run(0.579, 0.579 / (MIN_COMPILE_GAIN * 1.001)), "cuda")["ok"]
    sound = check_baselines(run(0.60, 0.45), "cuda")
    assert sound["ok"] and sound["ratios"] == pytest.approx({"plain": 0.45 / 0.40, "plain-diffusers": 0.46 / 0.40})
    assert sound["gains"]["plain-diffusers"] == pytest.approx(0.70 / 0.46)
    cpu = check_baselines(run(0.579, 0.582), "cpu")
    assert cpu["ok"] and not cpu["ratios"] and cpu["lines"][-1].startswith("no ratio on the CPU")


def test_every_table_benchmarks_quotes_from_a_result_file_is_that_file_rendered():
    """A figure in BENCHMARKS.md is the figure in the committed JSON: each `<!-- table: FILE -->` marker is followed
    by exactly `bench/results_table.py FILE`'s output, and every result file is quoted somewhere."""
    from results_table import train_table

    text = (REPO / "BENCHMARKS.md").read_text()
    marked = re.findall(r"<!-- table: (bench/results/[^ ]+\.json) -->\n", text)
    assert marked and set(marked) == {f"bench/results/{p.name}" for p in (REPO / "bench/results").glob("*.json")}
    for name in marked:
        rendered = train_table(json.loads((REPO / name).read_text()))
        assert f"<!-- table: {name} -->\n{rendered}" in text, f"BENCHMARKS.md's table of {name} differs from " \
                                                              f"`python bench/results_table.py {name}`"
