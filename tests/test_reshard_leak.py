"""Stage 3's released blocks leave nothing behind once a step is over (no autograd cycles through C++)."""

from __future__ import annotations

import gc
import importlib
import weakref

import pytest

from tests.models import make_batch
from tests.shard_cases import build
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


@pytest.mark.parametrize("reshard", ["release", "recompute"])
def test_nothing_of_a_step_outlives_it(reshard, monkeypatch):
    buffers = []
    original = reshard_module.ReleasedBuffer.__init__

    def tracking(self, full, *args, **kwargs):
        original(self, full, *args, **kwargs)
        buffers.append((weakref.ref(self), weakref.ref(full)))

    monkeypatch.setattr(reshard_module.ReleasedBuffer, "__init__", tracking)
    state_ref = _steps(reshard)
    gc.collect()
    assert state_ref() is None
    if reshard == "release":
        assert buffers, "the release path did not run"
    alive = [i for i, (b, full) in enumerate(buffers) if b() is not None or full() is not None]
    assert not alive, f"{len(alive)} of {len(buffers)} released blocks (or their gathered buffers) leaked"
