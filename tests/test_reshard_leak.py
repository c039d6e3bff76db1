"""Stage 3's released blocks leave nothing behind once a step is over (no autograd cycles through C++)."""

from __future__ import annotations

import gc
import importlib
import weakref

import pytest
import torch

import zfunc as zf
from tests.models import TinyLM, lm_loss, make_batch
from zfunc.transforms import mixed_precision, shard

reshard_module = importlib.import_module("zfunc.transforms.reshard")


def _steps(reshard: str, buffers: list) -> weakref.ref:
    torch.manual_seed(0)
    apply_fn, params = zf.functional(TinyLM(width=32, hidden=64, depth=3, vocab=97))
    loss_fn = lm_loss(apply_fn)

    def train_step(state, batch):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    step = shard(mixed_precision(train_step, "bf16"), stage=3, reshard=reshard)
    state = step.init(zf.TrainState.create({k: v.clone() for k, v in params.items()}, zf.optim.adamw(1e-3)))
    for i in range(3):
        state, _ = step(state, make_batch(8, seq=7, vocab=97, seed=i))
    return weakref.ref(next(iter(state.opt_state[0].mu.values())))


@pytest.mark.parametrize("reshard", ["release", "recompute"])
def test_nothing_of_a_step_outlives_it(reshard, monkeypatch):
    buffers = []
    original = reshard_module.ReleasedBuffer.__init__

    def tracking(self, full, *args, **kwargs):
        original(self, full, *args, **kwargs)
        buffers.append((weakref.ref(self), weakref.ref(full)))

    monkeypatch.setattr(reshard_module.ReleasedBuffer, "__init__", tracking)
    state_ref = _steps(reshard, buffers)
    gc.collect()
    assert state_ref() is None
    if reshard == "release":
        assert buffers, "the release path did not run"
    alive = [i for i, (b, full) in enumerate(buffers) if b() is not None or full() is not None]
    assert not alive, f"{len(alive)} of {len(buffers)} released blocks (or their gathered buffers) leaked"
