"""Two nodes simulated on this machine: the train stage launched as 2 nodes x 2 processes (torchrun with a static
rendezvous on 127.0.0.1, and the DeepSpeed launcher with a two-host hostfile and --no_ssh), pipeline 2 x data
parallel 2 on gloo, against the one-node 4-process run of the same layout; and which process writes what."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffusion_pipe.config import ConfigError
from diffusion_pipe.train.pipeline import process_placement
from tests.conftest import encoded_example, free_port, run_checked, run_env, torchrun

EDITS = {"steps: 120": "steps: 3", "eval_every_steps: 40": "eval_every_steps: 0",
         "pipeline_stages: 1": "pipeline_stages: 2"}


@pytest.fixture(scope="module")
def encoded(tmp_path_factory) -> tuple[Path, Path]:
    """The bundled example, scanned and encoded, with 2 pipeline stages and 3 steps: its repo and store."""
    root = tmp_path_factory.mktemp("multinode")
    return encoded_example(root, EDITS)


def outputs(out: Path, runs: Path) -> list[str]:
    """The train stage's output options, all under `out` but for the checkpoints under `runs`."""
    return ["--out", str(out), "--report", str(out / "r.json"), "--loss-plot", str(out / "loss.csv"),
            "--runs", str(runs), "--samples", str(out / "samples")]


def two_nodes(launch, repo: Path, store: Path, outs: list[Path], runs: list[Path],
              *extra: str) -> list[subprocess.CompletedProcess]:
    """Start both "nodes" at once (`launch(node_rank, port)`: one node's launcher command, up to the module), each
    with its own output paths and checkpoint directory; wait for both."""
    port = free_port()
    procs = [subprocess.Popen([*launch(node, port), "stages.train", *extra,
                               *outputs(outs[node], runs[node])],
                              cwd=repo, env=run_env(store), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for node in (0, 1)]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
    return results


def torchrun_node(node: int, port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
            "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "-m"]


def deepspeed_node(hostfile: Path):
    def launch(node: int, port: int) -> list[str]:
        # --no_ssh: each node starts its own workers (what pdsh would do over ssh from the first host)
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh",
                "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port), "--module"]
    return launch


@pytest.mark.slow
def test_two_nodes_train_as_one_node_does_and_only_rank_0_writes_outputs(encoded, tmp_path):
    """2 nodes x 2 processes, through torchrun and through the DeepSpeed launcher, give the losses and the LoRA
    of 1 node x 4 processes. Node 1 is given its own output paths (its local disk): it writes nothing there
    (reports, loss plot, LoRA and samples are global rank 0's); both share the checkpoint directory, where rank
    2 (stage 1, on node 1) writes stage 1's files."""
    from safetensors import safe_open

    repo, store = encoded
    run_checked([*torchrun(4), "-m", "stages.train", *outputs(tmp_path / "one", tmp_path / "one/runs")], cwd=repo,
                env=run_env(store))
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")
    for name, launch in (("torchrun", torchrun_node), ("deepspeed", deepspeed_node(hostfile))):
        outs, runs = [tmp_path / f"{name}{node}" for node in (0, 1)], tmp_path / f"{name}-runs"
        for node, result in enumerate(two_nodes(launch, repo, store, outs, [runs, runs])):
            assert result.returncode == 0, f"{name} node {node}:\n{result.stdout[-4000:]}"
        assert (outs[0] / "loss.csv").read_text() == (tmp_path / "one/loss.csv").read_text(), name
        with safe_open(outs[0] / "lora.safetensors", "pt") as a, \
                safe_open(tmp_path / "one/lora.safetensors", "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys())
            for key in a.keys():
                assert a.get_tensor(key).equal(b.get_tensor(key)), (name, key)
        assert not outs[1].exists(), f"{name}: node 1 wrote {sorted(outs[1].rglob('*'))}"
        (step,) = runs.glob("checkpoints/*/step3")
        assert {"stage0.safetensors", "stage1.safetensors", "manifest.json"} <= {p.name for p in step.iterdir()}


@pytest.mark.slow
def test_checkpoints_on_node_local_disks_stop_the_run_with_an_error(encoded, tmp_path):
    """Each node given its own --runs (node-local disks): at the first checkpoint every rank stops with an error
    naming the files it cannot see and the fix, and no manifest vouches for a checkpoint rank 0 cannot read."""
    repo, store = encoded
    params = repo / "local-runs.yaml"
    text = (repo / "params.yaml").read_text()
    params.write_text(text.replace("steps: 3", "steps: 3\n  checkpoint_every_steps: 1"))
    outs, runs = [tmp_path / "out0", tmp_path / "out1"], [tmp_path / "runs0", tmp_path / "runs1"]

    results = two_nodes(torchrun_node, repo, store, outs, runs, "--params", str(params))
    assert all(result.returncode != 0 for result in results)
    results = [result.stdout for result in results]
    assert "checkpoint files written on one node are not visible on another" in results[0]
    assert "stage1.safetensors (written by rank 2" in results[0]
    assert "a filesystem that every node mounts" in results[0]
    assert not list(runs[0].glob("checkpoints/*/step*/manifest.json"))
    assert not (outs[0] / "lora.safetensors").exists()


def test_the_device_is_the_local_rank_s_gpu():
    """On node 1 of 2 x 2, global rank 3 is local rank 1: it takes GPU 1 of its node, never GPU 3."""
    node1 = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node-a"}
    assert process_placement(node1, True, gpus=2) == (3, 4, 1, torch.device("cuda", 1))
    assert process_placement(node1, False, gpus=0) == (3, 4, 1, torch.device("cpu"))
    assert process_placement({}, False, gpus=0) == (0, 1, 0, torch.device("cpu"))


@pytest.mark.parametrize(("env", "gpus", "match"), [
    ({"RANK": "2", "WORLD_SIZE": "4"}, 8, "without LOCAL_RANK: every process of a node would take its GPU 0"),
    ({"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, 8, "RANK=4 is outside WORLD_SIZE=4"),
    ({"RANK": "x", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, 8, "must be integers"),
    ({"SLURM_NTASKS": "8", "SLURM_PROCID": "3"}, 8, "one of 8 Slurm tasks without RANK/WORLD_SIZE.*torchrun"),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2"}, 2, "LOCAL_RANK=2, but this node has 2 GPU"),
])
def test_launcher_mistakes_are_named(env, gpus, match):
    with pytest.raises(ConfigError, match=match):
        process_placement(env, True, gpus)
