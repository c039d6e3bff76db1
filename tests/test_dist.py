"""zfunc.dist: the collectives' contract (values, gradients, JSON exchange)."""

import pytest
import torch

from zfunc import dist
from zfunc.testing import run_distributed


def exchange():
    group = dist.Group.resolve()
    mine = {"rank": group.rank, "text": "é" * group.rank, "items": (1, None, [group.rank])}
    return dist.all_gather_json(mine, group), dist.all_gather_json(None, group)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_all_gather_json_returns_every_ranks_data_without_pickle(world):
    for gathered, nones in run_distributed(exchange, world):
        assert nones == [None] * world
        assert gathered == [{"rank": r, "text": "é" * r, "items": [1, None, [r]]} for r in range(world)]


def gather_and_reduce():
    group = dist.Group.resolve()
    comm = dist.Comm(group, overlap=False)
    shard = torch.full((3,), float(group.rank + 1), requires_grad=True)
    full = dist.AllGather.apply(shard, comm)
    (full * torch.arange(full.numel(), dtype=torch.float32)).sum().backward()
    return full.detach(), shard.grad, comm.gathered, comm.reduced


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_and_its_gradient_are_the_data_parallel_mean(world):
    for rank, (full, grad, gathered, reduced) in enumerate(run_distributed(gather_and_reduce, world)):
        assert torch.equal(full, torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(3))
        # every rank's loss has the same weights, so the mean over ranks is that gradient
        assert torch.equal(grad, torch.arange(3 * rank, 3 * rank + 3, dtype=torch.float32))
        assert gathered == reduced == 3 * world


def _agree_on_rank_value():
    from zfunc import dist as zdist

    group = zdist.Group.resolve()
    zdist.agree({"keys": ["a", "b"], "stage": 3}, group, "the step")  # equal: returns quietly
    value = {"keys": ["a", "b"], "stage": 3 if group.rank == 0 else 2}
    try:
        zdist.agree(value, group, "the step")
    except zdist.CollectiveError as err:
        return str(err)
    return None


def test_agree_raises_the_same_error_on_every_rank():
    from zfunc.testing import run_distributed

    messages = run_distributed(_agree_on_rank_value, 2)
    assert messages[0] == messages[1]
    assert "ranks disagree on the step" in messages[0] and "[1]" in messages[0] and "stage" in messages[0]


def _one_rank_skips(timeout):
    import os
    import time

    import torch.distributed as tdist

    from zfunc import dist as zdist

    os.environ["ZFUNC_TIMEOUT_S"] = str(timeout)
    group = zdist.Group.resolve()
    if group.rank == 1:
        time.sleep(3 * timeout)
        tdist.destroy_process_group()  # the collective rank 0 started never pairs: leave quietly
        return None
    try:
        zdist.all_gather_json({"step": 3}, group, "saving a checkpoint")
    except zdist.CollectiveError as err:
        tdist.destroy_process_group()
        return str(err)
    return None


def test_a_collective_that_a_rank_skips_ends_in_an_error_not_a_hang():
    from zfunc.testing import run_distributed

    message = run_distributed(_one_rank_skips, 2, 0.5, timeout=60)[0]
    assert "saving a checkpoint" in message and "ZFUNC_TIMEOUT_S" in message


def test_torchrun_environment_without_a_process_group_is_refused(monkeypatch):
    from zfunc import dist as zdist

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(zdist.CollectiveError, match="init_process_group"):
        zdist.Group.resolve()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert zdist.Group.resolve().size == 1


def _host_groups_of_two():
    """World 4 as two dp groups ({0, 1}, {2, 3}) whose collectives 'run on a device' (the group says so): each
    makes its host group with only its own ranks, and exchanges over it."""
    rank = torch.distributed.get_rank()
    pair = [0, 1] if rank < 2 else [2, 3]
    handle = torch.distributed.new_group(ranks=pair, use_local_synchronization=True)
    device_group = dist.Group(handle, rank % 2, 2, torch.device("meta"))  # (as NCCL's would be: not the host)
    host = dist.host_group(device_group)
    same = dist.host_group(dist.Group(handle, rank % 2, 2, torch.device("cpu")))
    return (host.device.type, host.handle is not handle, same.handle is handle,
            dist.exchange_on_host({"rank": rank}, host, "a test"))


def test_host_group_exchanges_within_each_dp_group_on_the_host():
    for rank, (device, fresh, same, got) in enumerate(run_distributed(_host_groups_of_two, 4)):
        pair = [0, 1] if rank < 2 else [2, 3]
        assert (device, fresh, same) == ("cpu", True, True)
        assert got == [{"rank": r} for r in pair]
