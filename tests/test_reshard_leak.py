"""Stage 3's released blocks leave nothing behind once a step is over (no autograd cycles through C++).

Run on two ranks: on one rank a unit's shard is the whole unit, so stage 3 hands the blocks views of the
shards themselves and releases nothing (`Units.whole_shards`); two ranks gather and release.
"""

from __future__ import annotations

import gc
import importlib
import weakref

import pytest

from tests.models import make_batch
from tests.shard_cases import build
from zfunc.testing import run_distributed
from zfunc.transforms import mixed_precision, shard

reshard_module = importlib.import_module("zfunc.transforms.reshard")


def _steps(reshard: str) -> weakref.ref:
    """Three steps of stage 3; returns a weak reference to a moment of the final state."""
    inner, state = build("adamw")
    step = shard(mixed_precision(inner, "bf16"), stage=3, reshard=reshard)
    state = step.init(state)
    for i in range(3):
        state, _ = step(state, make_batch(8, seed=i))
    return weakref.ref(next(iter(state.opt_state[0].mu.values())))


def leaks(reshard: str) -> tuple[bool, int, int]:
    """On one rank: (whether the final state outlived the steps, released blocks made, those still alive)."""
    buffers = []
    original = reshard_module.ReleasedBuffer.__init__

    def tracking(self, full, *args, **kwargs):
        original(self, full, *args, **kwargs)
        buffers.append((weakref.ref(self), weakref.ref(full)))

    reshard_module.ReleasedBuffer.__init__ = tracking
    try:
        state_ref = _steps(reshard)
    finally:
        reshard_module.ReleasedBuffer.__init__ = original
    gc.collect()
    alive = [i for i, (b, full) in enumerate(buffers) if b() is not None or full() is not None]
    return state_ref() is not None, len(buffers), len(alive)


@pytest.mark.parametrize("reshard", ["release", "recompute"])
def test_nothing_of_a_step_outlives_it(reshard):
    for rank, (state_alive, made, alive) in enumerate(run_distributed(leaks, 2, reshard)):
        assert not state_alive, f"rank {rank}: the state of the last step outlived it"
        if reshard == "release":
            assert made, f"rank {rank}: the release path did not run"
        assert not alive, f"rank {rank}: {alive} of {made} released blocks (or their gathered buffers) leaked"


def test_one_rank_releases_nothing():
    """On one rank the blocks run on the shards themselves: no released buffer is made, nothing leaks."""
    state_alive, made, alive = leaks("release")
    assert not state_alive and made == 0 and alive == 0
