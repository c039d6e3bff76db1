"""Donated input state: a transformed step consumes the state it is given.

Transformed steps update their state's buffers in place (that is how they keep
ZeRO's memory), so the state a step was given is dead afterwards: using it again
through zfunc (a step, ``gather``, ``init``, ``zfunc.io.save`` or ``restore``)
raises an error that says so and how to keep a copy. What must *not* happen: a
dead state quietly trained or saved (its buffers hold the new parameters beside
the old step count), a state killed by a step that never touched it, or a
``gather`` result that later steps change.
"""

from __future__ import annotations

import copy

import pytest
import torch

import zfunc as zf
from tests.adversarial import assert_same, clear_error, copies, outcome, single_thread  # noqa: F401 (single_thread: a fixture)
from tests.models import lm_loss, make_batch, tiny_lm_step
from zfunc.io import CheckpointError
from zfunc.transforms import accumulate, checkpoint, mixed_precision, offload, shard

pytestmark = pytest.mark.usefixtures("single_thread")

STACKS = {
    "mixed_precision": lambda s: mixed_precision(s, "bf16"),
    "shard1": lambda s: shard(s, stage=1),
    "shard2": lambda s: shard(mixed_precision(s, "bf16"), stage=2),
    "shard3": lambda s: shard(s, stage=3),
    "offload": offload,
    "checkpoint": checkpoint,
    "accumulate": lambda s: accumulate(s, 2),
    "shard3-offload": lambda s: shard(offload(checkpoint(s)), stage=3),
}
# The stacks whose update writes into the state's own buffers (the others consume it by contract).
IN_PLACE = ("shard1", "shard2", "shard3", "offload", "shard3-offload")
BATCH = make_batch()
DEAD = ("already consumed", "donation", "Use the state the step returned", "copy")


def _made(stack: str, step=None):
    _, params, train_step = tiny_lm_step()
    stepped = STACKS[stack](step or train_step)
    return stepped, stepped.init(zf.TrainState.create(copies(params), zf.optim.adamw(1e-2)))


def _use_again(use: str, stack: str, stepped, dead, tmp_path):
    if use == "step":
        return stepped(dead, BATCH)
    if use == "gather":
        return stepped.gather(dead)
    if use == "init":
        return stepped.init(dead)
    if use == "save":
        return zf.io.save(tmp_path / "ck", dead)
    _, live = _made(stack)  # restore needs a checkpoint of this stack: save a live state
    zf.io.save(tmp_path / "live", live)
    return zf.io.restore(tmp_path / "live", like=dead)


@outcome("clear")
@pytest.mark.parametrize("use", ["step", "gather", "init", "save", "restore"])
@pytest.mark.parametrize("stack", list(STACKS))
def test_a_consumed_state_is_refused_everywhere(stack, use, tmp_path):
    stepped, state = _made(stack)
    new, _ = stepped(state, BATCH)
    kept = copies(stepped.gather(new))
    exc = CheckpointError if use in ("save", "restore") else ValueError
    clear_error(lambda: _use_again(use, stack, stepped, state, tmp_path), *DEAD, exc=exc)
    assert not (tmp_path / "ck" / "step_000000").exists()  # nothing was written under the dead state's step
    assert_same(stepped.gather(new), kept)  # and the live state that shares its buffers is untouched


@outcome("right")
@pytest.mark.parametrize("stack", list(STACKS))
def test_a_deep_copy_taken_before_the_step_is_a_live_snapshot(stack):
    """``copy.deepcopy(state)`` keeps the buffers the layout shares (the flat per-unit buffers of shard
    stages 1 and 2): stepping the snapshot gives exactly what stepping the original gave."""
    stepped, state = _made(stack)
    snapshot = copy.deepcopy(state)
    new, _ = stepped(state, BATCH)
    again, _ = stepped(snapshot, BATCH)
    assert_same(stepped.gather(again), stepped.gather(new))


@outcome("clear")
@pytest.mark.parametrize("stack", ["shard1", "shard2"])
def test_the_copy_the_donation_error_advises_can_be_stepped(stack):
    stepped, state = _made(stack)
    stepped(state, BATCH)
    clear_error(lambda: stepped(state, BATCH), *DEAD, r"copy\.deepcopy\(state\)", exc=ValueError)


@outcome("clear")
@pytest.mark.parametrize("stack", ["shard1", "shard2"])
def test_a_copy_that_loses_the_flat_layout_is_refused(stack):
    """A per-tensor clone (what the donation error once advised), on stages 1/2: refused when stepped, clearly."""
    stepped, state = _made(stack)
    clear_error(lambda: stepped(zf.tree.tree_map(torch.clone, state), BATCH), "not in shard's flat layout",
                "use the state that step.init or the step returned", exc=RuntimeError)


@outcome("right")
@pytest.mark.parametrize("stack", list(STACKS))
def test_gather_returns_tensors_that_later_steps_do_not_change(stack):
    stepped, state = _made(stack)
    gathered = stepped.gather(state)
    kept = copies(gathered)
    for i in range(2):
        state, _ = stepped(state, make_batch(seed=i))
    assert_same(gathered, kept)
    assert not torch.equal(stepped.gather(state)["embed.weight"], kept["embed.weight"])  # it did train


def _returns_its_input(state, batch):
    return state, {}


@outcome("right")
@pytest.mark.parametrize("stack", list(STACKS))
def test_a_step_that_returns_its_input_unchanged_does_not_kill_it(stack):
    stepped, state = _made(stack, _returns_its_input)
    out, _ = stepped(state, BATCH)
    assert out is state
    stepped(state, BATCH)  # still alive
    stepped.gather(state)


class Failure(Exception):
    pass


def _failing_step(where: str):
    model, _, _ = tiny_lm_step()
    loss_fn = lm_loss(zf.functional(model)[0])

    def step(state, batch):
        if where == "before":
            raise Failure("before the update")

        def loss(p, b):
            value = loss_fn(p, b)
            if where == "in-loss":
                raise Failure("inside the loss")
            return value

        _, grads = zf.value_and_grad(loss)(state.params, batch)
        new = state.apply_gradients(grads)
        if where == "after":
            raise Failure("after the update")
        return new, {}

    return step


@outcome("right")
@pytest.mark.parametrize("where", ["before", "in-loss"])
@pytest.mark.parametrize("stack", list(STACKS))
def test_a_step_that_fails_before_updating_leaves_its_input_usable(stack, where):
    stepped, state = _made(stack, _failing_step(where))
    before = copies(zf.gather(stepped, state))
    with pytest.raises(Failure):
        stepped(state, BATCH)
    assert_same(stepped.gather(state), before)
    # The very same state trains exactly like an untouched one.
    good, fresh = _made(stack)
    trained, _ = good(state, BATCH)
    reference, _ = good(fresh, BATCH)
    assert_same(good.gather(trained), good.gather(reference))


@outcome("clear")
@pytest.mark.parametrize("stack", IN_PLACE)
def test_a_step_that_fails_after_it_began_updating_marks_its_input_dead(stack):
    stepped, state = _made(stack, _failing_step("after"))
    with pytest.raises(Failure):
        stepped(state, BATCH)
    clear_error(lambda: stepped.gather(state), *DEAD, "failed after it began updating", exc=ValueError)


@outcome("right")
@pytest.mark.parametrize("stack", ["mixed_precision", "checkpoint", "accumulate"])
def test_a_pure_update_that_fails_afterwards_leaves_its_input_intact(stack):
    """Stacks whose update builds new tensors do not touch the input even when the step fails after it."""
    stepped, state = _made(stack, _failing_step("after"))
    before = copies(stepped.gather(state))
    with pytest.raises(Failure):
        stepped(state, BATCH)
    assert_same(stepped.gather(state), before)


@outcome("right")
def test_the_plain_step_consumes_nothing():
    _, params, step = tiny_lm_step()
    state = zf.TrainState.create(copies(params), zf.optim.adamw(1e-2))
    first, _ = step(state, BATCH)
    second, _ = step(state, BATCH)
    assert_same(second.params, first.params)
    assert_same(zf.gather(step, state), params)
