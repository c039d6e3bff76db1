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

And the checks every call makes of each parameter (`test_a_forward_adds_no_work_per_parameter`): a
step's forward must cost the host what the model's own forward does, plus what the transforms must
launch; a guard against a user's mistake costs nothing per parameter in the common case.
"""

from __future__ import annotations

import collections
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from tests.models import TinyLM, make_batch, tiny_lm_step
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


# -- the host work of a forward, per block ------------------------------------------------------------

FORWARD_STACKS = {
    "plain": lambda s: s,
    "bf16": lambda s: mixed_precision(s, "bf16"),
    "shard1-bf16": lambda s: shard(mixed_precision(s, "bf16"), stage=1),
    "shard3-bf16": lambda s: shard(mixed_precision(s, "bf16"), stage=3),
    "shard3-checkpoint-bf16": lambda s: shard(checkpoint(mixed_precision(s, "bf16")), stage=3),
}
# Calls per block beyond the model's own forward: (Python functions, built-in functions). A block of TinyLM has
# six parameters. Without per-block work (the model run whole), one Python call and no built-in one: the block's
# routed forward (`zfunc.model_structure.BlockDispatch`); the bounds leave room for a call or two that another
# torch version may add, not for one per parameter. Stage 3 at one rank runs the model on the shards as stage 1
# does (9 / 9 now: the per-block share of the whole call's reshaped views); with checkpoint, each block's
# recompute and its saved-tensor hooks (110 / 116 now). The bounds leave room, so that work per parameter (6 per
# block per call) shows. At 08f8f30, each parameter cost ~26 built-in calls per forward: 13 / 156 for bf16,
# 1 / 90 for the plain step, 93 / 221 for stage 3.
FORWARD_BOUNDS = {"plain": (2, 3), "bf16": (2, 3), "shard1-bf16": (2, 3), "shard3-bf16": (14, 14),
                  "shard3-checkpoint-bf16": (130, 140)}


def _counted(run) -> list[int]:
    """``[Python calls, built-in calls]`` made by ``run()`` (until it returns, or calls ``stop`` it is given)."""
    counts = [0, 0]

    def tally(frame, event, arg) -> None:
        if event == "call":
            counts[0] += 1
        elif event == "c_call":
            counts[1] += 1

    sys.setprofile(tally)
    try:
        run(lambda: sys.setprofile(None))
    finally:
        sys.setprofile(None)
    return counts


def _forward_calls(stack: str, depth: int) -> list[int]:
    """Calls from the start of a steady-state step of ``stack`` until its loss function has its loss."""
    torch.manual_seed(0)
    apply_fn, params = zf.functional(TinyLM(depth=depth))
    stop = [None]

    def loss_fn(p, batch):
        loss = F.cross_entropy(apply_fn(p, batch["x"]).flatten(0, 1), batch["y"].flatten())
        stop[0]()
        return loss

    def train_step(state, batch):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    step = FORWARD_STACKS[stack](train_step)
    box = [zf.init(step, zf.TrainState.create(params, zf.optim.adamw(1e-3))), make_batch()]
    stop[0] = lambda: None
    for _ in range(4):  # (past the first forwards, which zfunc watches more closely: zfunc.data_access)
        box[0], _ = step(*box)

    def one(end):
        stop[0] = end
        box[0], _ = step(*box)

    return _counted(one)


def _model_calls(depth: int) -> list[int]:
    torch.manual_seed(0)
    model, x = TinyLM(depth=depth), make_batch()["x"]
    model(x)
    return _counted(lambda end: model(x))


@pytest.mark.parametrize("stack", list(FORWARD_STACKS))
def test_a_forward_adds_no_work_per_parameter(stack):
    """The calls a forward makes per block (the difference between a model of 6 blocks and one of 2, over 4),
    beyond what the model's own forward makes per block: within `FORWARD_BOUNDS`. The counts are the same at
    every run (unlike a time)."""
    per_block = [(deep - shallow) / 4 for shallow, deep in zip(_forward_calls(stack, 2), _forward_calls(stack, 6))]
    model = [(deep - shallow) / 4 for shallow, deep in zip(_model_calls(2), _model_calls(6))]
    extra = [round(z - m, 2) for z, m in zip(per_block, model)]
    python, builtin = FORWARD_BOUNDS[stack]
    assert extra[0] <= python and extra[1] <= builtin, (
        f"{stack}: a forward makes {extra[0]} Python and {extra[1]} built-in calls per block beyond the model's "
        f"own (at most {python} and {builtin}): per-parameter work crept into the step (host_time.py --count)")
