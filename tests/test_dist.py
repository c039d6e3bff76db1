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
    counter = dist.CommCounter(overlap=False)
    shard = torch.full((3,), float(group.rank + 1), requires_grad=True)
    full = dist.AllGather.apply(shard, group, counter)
    (full * torch.arange(full.numel(), dtype=torch.float32)).sum().backward()
    return full.detach(), shard.grad, counter.all_gather, counter.reduce_scatter


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_and_its_gradient_are_the_data_parallel_mean(world):
    for rank, (full, grad, gathered, reduced) in enumerate(run_distributed(gather_and_reduce, world)):
        assert torch.equal(full, torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(3))
        # every rank's loss has the same weights, so the mean over ranks is that gradient
        assert torch.equal(grad, torch.arange(3 * rank, 3 * rank + 3, dtype=torch.float32))
        assert gathered == reduced == 3 * world
