"""`offload(overlap=True)`: the host update started during backward is the update after it, bit for bit."""

from __future__ import annotations

import pytest
import torch

import zfunc as zf
from tests.shard_cases import STEPS, build, local_batch, rank_and_world, to_numpy
from zfunc.testing import run_distributed
from zfunc.transforms import mixed_precision, offload, shard


def _train(stage: int, overlap: bool, policy: str | None, meddle: bool = False, opt_kind: str = "adamw"):
    """``STEPS`` steps of shard(offload(...)); returns params, moments and the per-step offload_ahead flags."""
    inner, state = build(opt_kind)
    step_fn = _meddling() if meddle else inner
    if policy is not None:
        step_fn = mixed_precision(step_fn, policy)
    step = shard(offload(step_fn, overlap=overlap), stage=stage)
    state = step.init(state)
    rank, world = rank_and_world()
    flags = []
    for i in range(STEPS):
        state, metrics = step(state, local_batch(i, rank, world))
        flags.append(bool(metrics["offload_ahead"]))
    moments = state.opt_state[0]
    return to_numpy(step.gather(state)), to_numpy(moments.mu), to_numpy(moments.nu), flags


def _meddling():
    """A step that changes its gradients before the update: the guess must be dropped."""
    from tests.models import TinyLM, lm_loss

    torch.manual_seed(0)
    apply_fn, _ = zf.functional(TinyLM())
    loss_fn = lm_loss(apply_fn)

    def step(st, batch):
        loss, grads = zf.value_and_grad(loss_fn)(st.params, batch)
        grads = {k: g * 0.5 for k, g in grads.items()}  # new tensors: not the ones backward made
        return st.apply_gradients(grads), {"loss": loss}

    return step


def _compare(stage: int, policy: str | None, meddle: bool):
    on = _train(stage, True, policy, meddle)
    off = _train(stage, False, policy, meddle)
    return on, off


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_overlapped_update_is_bitwise_the_update_after_backward(world, stage):
    for on, off in run_distributed(_compare, world, stage, "bf16", False):
        for a, b in zip(on[:3], off[:3]):
            for k in a:
                assert (a[k] == b[k]).all(), k
        # From the second step on (the first one learns how often the step computes gradients);
        # stage 1 reduces after backward, when there is nothing left to overlap with.
        assert on[3] == [False] + [stage > 1] * (STEPS - 1)
        assert off[3] == [False] * STEPS


def test_no_guess_when_the_params_are_their_own_master():
    # fp32 params on the CPU are the master; shard hands the optimizer views of
    # them made at apply_gradients, so there is nothing to update ahead into.
    on, off = run_distributed(_compare, 2, 2, None, False)[0]
    for a, b in zip(on[:3], off[:3]):
        for k in a:
            assert (a[k] == b[k]).all(), k
    assert on[3] == [False] * STEPS


def test_changed_gradients_drop_the_guess():
    on, off = run_distributed(_compare, 2, 3, "bf16", True)[0]
    for a, b in zip(on[:3], off[:3]):
        for k in a:
            assert (a[k] == b[k]).all(), k
    assert on[3] == [False] * STEPS  # guessed from step 2 on, never taken


def _clip_never_guesses():
    inner, state = build("clip")
    step = shard(offload(mixed_precision(inner, "bf16"), overlap=True), stage=2)
    state = step.init(state)
    flags = []
    for i in range(STEPS):
        state, metrics = step(state, local_batch(i, *rank_and_world()))
        flags.append(bool(metrics["offload_ahead"]))
    return flags


def test_clip_needs_every_gradient_first():
    assert run_distributed(_clip_never_guesses, 2) == [[False] * STEPS] * 2


def test_overlap_argument_is_checked():
    with pytest.raises(ValueError, match="overlap"):
        offload(lambda s, b: (s, {}), overlap="yes")


def _accumulated(overlap: bool):
    from zfunc.transforms import accumulate

    inner, state = build("adamw")
    step = shard(offload(mixed_precision(accumulate(inner, micro_batches=2), "bf16"), overlap=overlap), stage=2)
    state = step.init(state)
    flags = []
    for i in range(STEPS):
        state, metrics = step(state, local_batch(i, *rank_and_world()))
        flags.append(bool(metrics["offload_ahead"]))
    return to_numpy(step.gather(state)), flags


def _accumulated_both():
    return _accumulated(True), _accumulated(False)


def test_micro_batches_below_offload_are_never_guessed():
    # accumulate inside offload: one gradient call, two backward passes; each unit is
    # announced twice, so the guess is dropped (and not tried again).
    (on, on_flags), (off, _) = run_distributed(_accumulated_both, 2)[0]
    assert on_flags == [False] * STEPS
    for k in on:
        assert (on[k] == off[k]).all(), k
