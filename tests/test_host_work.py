"""Structure found once, not at every step (issue 25, item 2).

A steady-state step of stage 3 (with and without `checkpoint`) must not derive
again what depends only on the model and the state's layout: which blocks gather
which unit (`shard_blocks.BlockPlan`), the modules a recomputed block holds
(its buffers and frozen parameters, read at every forward for the recompute's
check), the blocks `checkpoint` recomputes; and it finds each unit's flat shard
once per call, though a block asks for it when it is gathered, when the block
before prefetches it and when its recompute gathers it again. Each of these,
recomputed per block, made the host time of a step grow with the blocks
(benchmarks/host_time.py measures it). The counts are of calls into the code
that derives them, made during one step after two warm-up steps.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import zfunc as zf
from tests.models import make_batch, tiny_lm_step
from zfunc.testing import run_distributed
from zfunc.transforms import checkpoint, mixed_precision, shard
from zfunc.transforms.shard_blocks import BlockPlan
from zfunc.transforms.shard_layout import UnitLayout

STACKS = {
    "shard3": lambda s: shard(mixed_precision(s, "bf16"), stage=3),
    "shard3-checkpoint": lambda s: shard(checkpoint(mixed_precision(s, "bf16")), stage=3),
    "shard3-recompute": lambda s: shard(mixed_precision(s, "bf16"), stage=3, reshard="recompute"),
}
DEPTH = 4


def _counting(monkeypatch, counts: collections.Counter, owner, name: str, static: bool = False) -> None:
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        counts[f"{owner.__name__}.{name}"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, staticmethod(counted) if static else counted)


def steady_step_counts(stack: str) -> tuple[dict, int]:
    """Calls into the structure-deriving code during the third step of ``stack``, and the number of units."""
    _, params, train_step = tiny_lm_step(depth=DEPTH)
    step = STACKS[stack](train_step)
    state = step.init(zf.TrainState.create(params, zf.optim.adamw(1e-3)))
    batch = make_batch()
    for _ in range(2):
        state, _ = step(state, batch)
    counts: collections.Counter = collections.Counter()
    with pytest.MonkeyPatch.context() as monkeypatch:
        _counting(monkeypatch, counts, BlockPlan, "build", static=True)
        _counting(monkeypatch, counts, UnitLayout, "shard_data")
        for walk in ("named_modules", "named_buffers", "named_parameters", "get_submodule"):
            _counting(monkeypatch, counts, nn.Module, walk)
        state, metrics = step(state, batch)
    assert torch.isfinite(metrics["loss"])
    return dict(counts), len(state.extras["shard"].units)  # (units: the blocks' and the root's)


def _check_counts(counts: dict, units: int, world: int) -> None:
    assert counts.get("BlockPlan.build", 0) == 0, counts
    walks = {k: v for k, v in counts.items() if k.startswith("Module.")}
    assert not walks, f"a steady-state step walked the model's modules: {walks}"
    if world == 1:  # one rank: the blocks run on the shards themselves, nothing is gathered
        assert counts.get("UnitLayout.shard_data", 0) == 0, counts
    else:
        assert 0 < counts.get("UnitLayout.shard_data", 0) <= units, counts


@pytest.mark.parametrize("stack", list(STACKS))
def test_a_steady_state_step_derives_no_structure(stack):
    _check_counts(*steady_step_counts(stack), world=1)


@pytest.mark.parametrize("stack", list(STACKS))
def test_a_steady_state_step_derives_no_structure_on_two_ranks(stack):
    for counts, units in run_distributed(steady_step_counts, 2, stack):
        _check_counts(counts, units, world=2)


def plans_built_for_two_layouts() -> int:
    """BlockPlan builds over two steps each of stage 3 on two state layouts (other units)."""
    _, params, train_step = tiny_lm_step(depth=DEPTH)
    batch = make_batch()
    counts: collections.Counter = collections.Counter()
    with pytest.MonkeyPatch.context() as monkeypatch:
        _counting(monkeypatch, counts, BlockPlan, "build", static=True)
        for units in (None, ["blocks.0", "blocks.2"]):
            step = shard(train_step, stage=3, units=units)
            state = step.init(zf.TrainState.create(dict(params), zf.optim.adamw(1e-3)))
            for _ in range(2):
                state, _ = step(state, batch)
    return counts["BlockPlan.build"]


@pytest.mark.filterwarnings("ignore:shard.stage=3.. the root unit holds")
def test_a_new_state_layout_is_planned_anew():
    """The plan is kept per layout: a state laid out again (here: for other units) gets its own. (Two ranks:
    at one the model runs on the shards, given whole, and no block is routed or planned.)"""
    assert run_distributed(plans_built_for_two_layouts, 2) == [2, 2]
