"""The encode stage on two nodes simulated on this machine: each node has its own local store, both share one
store remote (a directory here; SSH or S3 on a cluster), and torchrun's static rendezvous on 127.0.0.1 gives
every worker its RANK. Encode needs no process group: workers meet only through the store and the remote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from diffusion_pipe.store import Store
from tests.conftest import free_port, make_pipeline_repo, run_checked, run_env


@pytest.mark.slow
def test_two_nodes_split_the_keys_and_meet_through_the_remote(tmp_path: Path) -> None:
    """1 worker per node: each computes half of the missing keys into its own store and uploads it; rank 0 (node
    0) pulls the other half from the remote and writes the table and report; node 1 writes neither. Node 1's
    store then lacks node 0's half until `diffusion-pipe store pull`, which is what every node runs before
    training when the stores are node-local."""
    remote = tmp_path / "remote"
    stores = [tmp_path / "store0", tmp_path / "store1"]
    repo = make_pipeline_repo(tmp_path / "repo", stores[0], {"workers: 0": f"workers: 0\n  remote: {remote}"})
    run_checked([sys.executable, "-m", "stages.scan"], cwd=repo, env=run_env(stores[0]))
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "stages.encode",
         "--encoded", str(tmp_path / f"node{node}/encoded.parquet"),
         "--report", str(tmp_path / f"node{node}/e.json")],
        cwd=repo, env=run_env(stores[node]), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    logs = [proc.communicate(timeout=600)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]

    assert not (tmp_path / "node1").exists()
    report = json.loads((tmp_path / "node0/e.json").read_text())
    assert report["workers"] == 2
    table = pq.read_table(tmp_path / "node0/encoded.parquet")
    wanted = {fam: sorted(set(table.column(f"{fam}_key").to_pylist())) for fam in ("latent", "text")}
    node0, node1 = Store(stores[0]), Store(stores[1])
    for fam, keys in wanted.items():
        half = len(keys) // 2
        assert report[fam]["computed"] == len(keys) - half and report[fam]["by_other_workers"] == half
        assert node0.missing(fam, keys) == []  # node 1's half arrived through the remote
        assert len(node1.missing(fam, keys)) == len(keys) - half  # node 1 holds only what it computed
    cli = [sys.executable, "-c", "from diffusion_pipe.cli import main; main()"]
    run_checked([*cli, "store", "pull", "--remote", str(remote), "--encoded", str(tmp_path / "node0/encoded.parquet")],
                cwd=repo, env=run_env(stores[1]))
    node1.refresh()
    assert all(node1.missing(fam, keys) == [] for fam, keys in wanted.items())
