"""Where a step's gradients go between backward and the update (`zfunc.transforms.grad_accumulator`).

- One micro-batch under ``shard(offload(...), stage=2|3)``: each unit's gradient is handed to a sink as its
  reduction lands (on a GPU it leaves for the host there), every unit exactly once per backward pass, and the
  update gets exactly the plain step's gradients.
- The host buffers an accumulator fills are kept for the next call of the same step (fresh host memory
  costs a page fault per page at first touch), but never while anything outside zfunc still holds them.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from zfunc.testing import run_distributed
from zfunc.transforms import accumulate, mixed_precision, offload, shard
from zfunc.transforms.grad_accumulator import GradAccumulator, HostBuffers


class Uneven(nn.Module):
    """Blocks of uneven sizes, a frozen block and a tied head (the embedding's weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(13, 24)
        self.blocks = nn.ModuleList([nn.Linear(24, 24), nn.Sequential(nn.Linear(24, 40), nn.GELU(),
                                                                      nn.Linear(40, 24)), nn.Linear(24, 24)])
        self.blocks[2].requires_grad_(False)
        self.head = nn.Linear(24, 13, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def build(wrap, returns_grads: bool = False):
    torch.manual_seed(0)
    model = Uneven()
    apply_fn, params = zf.functional(model)

    def loss_fn(p, ids):
        return F.cross_entropy(apply_fn(p, ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())

    def train_step(state, ids):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, ids)
        return state.apply_gradients(grads), ({"loss": loss, "grads": grads} if returns_grads else {"loss": loss})

    step = wrap(train_step)
    state = step.init(zf.TrainState.create(params, zf.optim.adamw(1e-2, weight_decay=0.1)))
    return step, state


def batch(i: int, rank: int = 0) -> torch.Tensor:
    return torch.randint(0, 13, (8, 9), generator=torch.Generator().manual_seed(100 * i + rank))


def train(wrap, steps: int = 3, rank: int = 0) -> dict:
    step, state = build(wrap)
    for i in range(steps):
        state, _ = step(state, batch(i, rank))
    return {k: v.detach().float().clone() for k, v in step.gather(state).items()}


def one_micro_batch_sink(stage: int) -> dict:
    rank = torch.distributed.get_rank()
    fed: list[str] = []
    add_unit = GradAccumulator.add_unit

    def spy(self, unit, r, shard_):
        fed.append(unit.name)
        return add_unit(self, unit, r, shard_)

    GradAccumulator.add_unit = spy  # (in a forked worker: patched there only)
    wrapped = train(lambda s: shard(offload(mixed_precision(s, "bf16")), stage=stage), rank=rank)
    GradAccumulator.add_unit = add_unit
    plain = train(lambda s: shard(mixed_precision(s, "bf16"), stage=stage), rank=rank)
    return {"fed": fed, "wrapped": wrapped, "plain": plain}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [2, 3])
def test_one_micro_batch_hands_every_unit_to_the_sink_once_per_step(world, stage):
    for got in run_distributed(one_micro_batch_sink, world, stage):
        units = set(got["fed"])
        assert len(got["fed"]) == 3 * len(units), got["fed"]  # three steps, each unit once per step
        assert len(units) >= 3  # the blocks with gradients and the root (the frozen block has none)
        for k, v in got["plain"].items():  # the same arithmetic as without offload: equal element-wise
            torch.testing.assert_close(got["wrapped"][k], v, rtol=0, atol=0, msg=k)


def nvme_fp16_sink(nvme_dir: str) -> dict:
    rank = torch.distributed.get_rank()
    directory = f"{nvme_dir}/rank{rank}"
    os.makedirs(directory, exist_ok=True)
    wrapped = train(lambda s: shard(offload(mixed_precision(s, "fp16"), nvme_fraction=0.5, nvme_dir=directory),
                                    stage=3), rank=rank)
    plain = train(lambda s: shard(mixed_precision(s, "fp16"), stage=3), rank=rank)
    return {"wrapped": wrapped, "plain": plain}


def test_one_micro_batch_sink_with_the_nvme_tier_and_fp16_loss_scaling(tmp_path):
    for got in run_distributed(nvme_fp16_sink, 2, str(tmp_path)):
        for k, v in got["plain"].items():
            torch.testing.assert_close(got["wrapped"][k], v, rtol=0, atol=0, msg=k)


def accumulate_step():
    return lambda s: shard(mixed_precision(accumulate(s, 2), "bf16"), stage=3)


def test_host_buffers_are_kept_and_reused_across_calls():
    step, state = build(accumulate_step())
    kept = step.stack.kept
    state, _ = step(state, batch(0))
    pool: HostBuffers = kept["host gradient buffers"]
    assert pool.kept_bytes() > 0  # the fp32 sums of the bf16 gradients, on the host (the CPU here)
    before = {b.data_ptr() for free in pool._free.values() for b in free}
    taken = []
    take = pool.take

    def spy(n, dtype):
        buffer = take(n, dtype)
        taken.append(buffer.data_ptr())
        return buffer

    pool.take = spy
    state, _ = step(state, batch(1))
    assert taken and set(taken) <= before  # the second call summed into the first call's memory
    # ... and trained exactly as fresh buffers would have: the same as a step that never keeps any.
    reference_step, reference = build(accumulate_step())
    for i in range(2):
        reference_step.stack.kept["host gradient buffers"] = HostBuffers()  # a new, empty one each call
        reference, _ = reference_step(reference, batch(i))
    got, want = step.gather(state), reference_step.gather(reference)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)


def test_gradients_a_step_returns_are_never_reused():
    step, state = build(accumulate_step(), returns_grads=True)
    state, metrics = step(state, batch(0))
    held = {k: g.clone() for k, g in metrics["grads"].items()}
    assert step.stack.kept["host gradient buffers"].kept_bytes() == 0  # the step's metrics hold them
    state, _ = step(state, batch(1))
    for k, g in metrics["grads"].items():  # the first step's gradients, as the first step returned them
        torch.testing.assert_close(g, held[k], rtol=0, atol=0, msg=k)
