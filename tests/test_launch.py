"""zfunc.launch: DeepSpeed hostfiles and filters as torchrun commands, and a real two-"node" run on CPU."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zfunc as zf
from tests.models import make_batch, tiny_lm_step
from zfunc import launch
from zfunc.launch import LaunchError, parse_hostfile, parse_node_spec, plan, select
from zfunc.testing import run_distributed
from zfunc.transforms import shard

ROOT = Path(__file__).resolve().parent.parent
HOSTS = {"worker-0": 4, "worker-1": 4, "worker-2": 2}


# --------------------------------------------------------------------------
# Parsing


def test_hostfile_lines_comments_and_order():
    text = "# cluster\nworker-1 slots=4\n\n  worker-0   slots=2   # the small one\nnode.example.org slots=8\n"
    assert list(parse_hostfile(text).items()) == [("worker-1", 4), ("worker-0", 2), ("node.example.org", 8)]


@pytest.mark.parametrize("text, match", [
    ("worker-1 slots=4\nworker-1 slots=2\n", "line 2: host 'worker-1' is listed twice"),
    ("worker-1 4\n", "line 1: 'worker-1 4' is not 'HOST slots=N'"),
    ("worker-1 slots=0\n", "slots must be a positive whole number, got '0'"),
    ("worker-1 slots=four\n", "slots must be a positive whole number, got 'four'"),
    ("worker-1 slots=4 extra\n", "is not 'HOST slots=N'"),
    ("# nothing\n\n", "lists no hosts"),
])
def test_bad_hostfiles_are_refused_with_the_line(text, match):
    with pytest.raises(LaunchError, match=match):
        parse_hostfile(text)


@pytest.mark.parametrize("spec, expected", [
    ("worker-1", {"worker-1": None}),
    ("worker-1:0,2@worker-2", {"worker-1": [0, 2], "worker-2": None}),
    ("worker-1:2,0,2", {"worker-1": [0, 2]}),
    ("worker-1:0@worker-1:3", {"worker-1": [0, 3]}),
])
def test_node_specs(spec, expected):
    assert parse_node_spec(spec) == expected


@pytest.mark.parametrize("spec, match", [
    ("", "is empty"),
    ("worker-1:a", "must be comma-separated GPU indices"),
    ("worker-1:-1", "GPU indices are >= 0"),
    ("@worker-1", "does not name a host"),
    ("worker-1@worker-1:0", "appears twice, once with all its slots"),
])
def test_bad_node_specs(spec, match):
    with pytest.raises(LaunchError, match=match):
        parse_node_spec(spec)


@pytest.mark.parametrize("kwargs, expected", [
    ({}, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}),
    ({"include": "worker-1:0,2@worker-2"}, {"worker-1": [0, 2], "worker-2": [0, 1]}),
    ({"include": "worker-2@worker-0:3"}, {"worker-0": [3], "worker-2": [0, 1]}),    # hostfile order kept
    ({"exclude": "worker-0"}, {"worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}),
    ({"exclude": "worker-1:1,3@worker-2:0"}, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 2], "worker-2": [1]}),
    ({"num_nodes": 2}, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}),
    ({"num_gpus": 2}, {"worker-0": [0, 1], "worker-1": [0, 1], "worker-2": [0, 1]}),
    ({"num_nodes": 1, "num_gpus": 3}, {"worker-0": [0, 1, 2]}),
])
def test_select_follows_deepspeeds_filters(kwargs, expected):
    assert select(HOSTS, **kwargs) == expected


@pytest.mark.parametrize("kwargs, match", [
    ({"include": "worker-9"}, "host 'worker-9' is not in the hostfile"),
    ({"exclude": "worker-9:0"}, "host 'worker-9' is not in the hostfile"),
    ({"include": "worker-2:2"}, r"GPU 2 of 'worker-2' is beyond its slots=2 \(indices 0..1\)"),
    ({"include": "worker-0", "exclude": "worker-1"}, "cannot be combined"),
    ({"include": "worker-0", "num_gpus": 1}, "cannot be combined with --include/--exclude"),
    ({"num_gpus": 3}, r"more than the slots of worker-2 \(slots=2\)"),
    ({"num_nodes": 4}, "the hostfile has 3 hosts"),
    ({"exclude": "worker-0@worker-1@worker-2"}, "leave no GPU"),
])
def test_select_refuses_what_cannot_run(kwargs, match):
    with pytest.raises(LaunchError, match=match):
        select(HOSTS, **kwargs)


@pytest.fixture
def hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("".join(f"{h} slots={n}\n" for h, n in HOSTS.items()))
    return str(path)


def test_plan_for_each_node_of_an_include(hostfile):
    plans = [plan("train.py", ["--lr", "3e-4"], hostfile=hostfile, include="worker-1:0,2@worker-2", node_rank=r,
                  master_addr="10.0.0.1", python="python") for r in (0, 1)]
    assert plans[0].argv == ("python", "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
                             "--node-rank=0", "--master-addr=10.0.0.1", "--master-port=29500",
                             "train.py", "--lr", "3e-4")
    assert plans[0].env == {"CUDA_VISIBLE_DEVICES": "0,2"}   # not all of worker-1's slots
    assert plans[1].env == {}                                # all of worker-2's
    assert plans[1].argv[4:6] == ("--nproc-per-node=2", "--node-rank=1")
    assert plans[0].world_size == 4 and plans[1].nnodes == 2
    assert plans[0].command().startswith("CUDA_VISIBLE_DEVICES=0,2 python -m torch.distributed.run")


def test_plan_c10d_and_module(hostfile):
    p = plan("pkg.train", hostfile=hostfile, num_nodes=2, node_rank=1, master_addr="head", master_port=1234,
             rdzv_backend="c10d", rdzv_id="job7", module=True, python="python")
    assert p.argv[3:] == ("--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=head:1234",
                          "--rdzv-id=job7", "--module", "pkg.train")


def test_plan_without_hostfile_is_one_local_node():
    p = plan("train.py", num_gpus=2, python="python")
    assert p.hosts == (("localhost", (0, 1)),)
    assert "--master-addr=127.0.0.1" in p.argv and "--nproc-per-node=2" in p.argv


@pytest.mark.parametrize("kwargs, match", [
    ({"node_rank": 3}, r"--node-rank must be in 0..2"),
    ({"node_rank": 0}, "3 nodes need --master-addr"),
    ({"node_rank": 0, "master_addr": "h", "master_port": 70000}, "port number in 1..65535"),
    ({"node_rank": 0, "master_addr": "h", "rdzv_backend": "etcd"}, "must be 'static' or 'c10d'"),
    ({"master_addr": "h"}, "pass --node-rank: this machine"),
])
def test_plan_refuses_what_cannot_run(hostfile, kwargs, match):
    with pytest.raises(LaunchError, match=match):
        plan("train.py", hostfile=hostfile, **kwargs)


def test_plan_needs_a_hostfile_for_filters_and_an_existing_file(tmp_path):
    with pytest.raises(LaunchError, match="need a --hostfile"):
        plan("train.py", include="worker-0", num_gpus=1)
    with pytest.raises(LaunchError, match="does not exist"):
        plan("train.py", hostfile=str(tmp_path / "nope"))


def test_node_rank_from_this_machines_name(tmp_path, monkeypatch):
    monkeypatch.setattr(launch.platform, "node", lambda: "worker-1.cluster.local")
    path = tmp_path / "hosts"
    path.write_text("worker-0 slots=1\nworker-1 slots=1\n")
    assert plan("train.py", hostfile=str(path), master_addr="worker-0").node_rank == 1


def test_cli_dry_run_prints_the_command(hostfile, capsys):
    from zfunc.cli import main

    status = main(["launch", "--hostfile", hostfile, "--include", "worker-1:1@worker-2", "--node_rank", "0",
                   "--master_addr", "10.0.0.1", "--dry-run", "train.py", "--dry-run", "--steps", "3"])
    out, err = capsys.readouterr()
    assert status == 0
    assert out.strip().endswith("--master-port=29500 train.py --dry-run --steps 3")
    assert out.startswith("CUDA_VISIBLE_DEVICES=1 ")
    assert "node 0 of 2 (worker-1:1, worker-2:0,1); 1 processes here, 3 in all" in err
    assert main(["launch", "--hostfile", hostfile, "--include", "worker-7", "train.py"]) == 2
    assert "zfunc launch: error: --include: host 'worker-7' is not in the hostfile" in capsys.readouterr().err


# --------------------------------------------------------------------------
# Two torchrun invocations on this machine stand in for two nodes


def train_tiny(steps: int = 3) -> dict:
    """A tiny zfunc step under shard(stage=2); the full parameters afterwards."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    _, params, train_step = tiny_lm_step()
    step = shard(train_step, stage=2)
    state = step.init(zf.TrainState.create({k: v.clone() for k, v in params.items()}, zf.optim.adamw(1e-2)))
    for i in range(steps):
        batch = {k: v.chunk(world)[rank] for k, v in make_batch(8, seed=i).items()}
        state, _ = step(state, batch)
    return {k: v.detach().clone() for k, v in step.gather(state).items()}


def launched_main(out_dir: str) -> None:
    """What each torchrun worker runs (see the script in test_two_torchruns_train_like_two_ranks)."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    try:
        result = {"rank": torch.distributed.get_rank(), "world": torch.distributed.get_world_size(),
                  "local_rank": int(os.environ["LOCAL_RANK"]), "params": train_tiny()}
        torch.save(result, os.path.join(out_dir, f"rank{result['rank']}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:   # the test picks a port; zfunc.launch itself never opens a socket
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_run_adds_the_plans_environment_and_returns_the_status():
    p = launch.LaunchPlan((("localhost", (0,)),), 0, (sys.executable, "-c", "import os, sys; "
                                                     "sys.exit(int(os.environ['CUDA_VISIBLE_DEVICES']))"),
                          {"CUDA_VISIBLE_DEVICES": "3"})
    assert launch.run(p) == 3


@pytest.mark.slow
def test_two_torchruns_train_like_two_ranks(tmp_path):
    """Each torchrun is what `zfunc launch --node-rank R` runs on node R (the CLI itself is tested above
    with --dry-run; starting it here too would add two more torch imports, seconds each)."""
    script = tmp_path / "train.py"
    script.write_text("import sys\nfrom tests.test_launch import launched_main\nlaunched_main(sys.argv[1])\n")
    (tmp_path / "hosts").write_text("node-a slots=1\nnode-b slots=1\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "NUMBA_THREADING_LAYER": "workqueue"}
    port = _free_port()
    plans = [plan(str(script), [str(tmp_path)], hostfile=str(tmp_path / "hosts"), node_rank=r,
                  master_addr="127.0.0.1", master_port=port) for r in (0, 1)]
    nodes = [subprocess.Popen(p.argv, cwd=ROOT, env={**env, **p.env}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for p in plans]
    try:
        outputs = [node.communicate(timeout=150)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)   # torchrun and the worker it started
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [(r["rank"], r["world"], r["local_rank"]) for r in results] == [(0, 2, 0), (1, 2, 0)]
    reference = run_distributed(train_tiny, 2)[0]
    for result in results:
        for key, value in reference.items():
            torch.testing.assert_close(result["params"][key], value, rtol=0, atol=0)
