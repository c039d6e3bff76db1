"""Gradients that cannot flow.

A loss that calls the module itself instead of ``apply_fn``, a loss that does
not depend on the params, detached params, a forward under ``torch.no_grad()``:
``value_and_grad`` would return zeros (or drop the module path's gradients) and
training would silently not move. Each is refused with an error that says what
to call instead, under every stack. And a gradient autograd hands back as a
broadcast view (``p.sum()``) is accumulated like any other.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zfunc as zf
from tests.adversarial import assert_same, clear_error, copies, outcome, says, single_thread  # noqa: F401 (a fixture)
from tests.models import TinyLM, lm_loss, make_batch
from zfunc.testing import run_distributed
from zfunc.transforms import accumulate, checkpoint, mixed_precision, shard

pytestmark = pytest.mark.usefixtures("single_thread")

STACKS = {
    "plain": lambda s: s,
    "bf16": lambda s: mixed_precision(s, "bf16"),
    "shard1": lambda s: shard(s, stage=1),
    "shard3": lambda s: shard(s, stage=3),
    "checkpoint": checkpoint,
    "accumulate": lambda s: accumulate(s, 2),
}


def _losses(model, apply_fn):
    task = lm_loss(apply_fn)

    def module(p, batch):  # the module itself: its own nn.Parameters, never the params given
        return F.cross_entropy(model(batch["x"]).flatten(0, 1), batch["y"].flatten())

    return {
        "calls-the-module": (module, [r"apply_fn\(params", "not the module itself"]),
        "calls-the-module-plus-a-penalty-on-params": (
            lambda p, b: module(p, b) + 1e-4 * p["embed.weight"].square().sum(),
            ["module's own parameter", r"apply_fn\(params, x\)"]),
        "constant": (lambda p, b: torch.tensor(1.0), ["does not depend on the params", r"apply_fn\(params"]),
        "detached-params": (lambda p, b: task({k: v.detach() for k, v in p.items()}, b),
                            ["does not depend on the params", "do not detach"]),
        "under-no_grad": (lambda p, b: _no_grad(task, p, b), ["does not depend on the params"]),
    }


def _no_grad(task, p, b):
    with torch.no_grad():
        return task(p, b)


CASES = list(_losses(None, None))


def _one_step(stack: str, loss: str):
    """One step of ``stack`` with loss ``loss`` on TinyLM, to run: a function of no arguments."""
    torch.manual_seed(0)
    model = TinyLM()
    apply_fn, params = zf.functional(model)
    fn, _ = _losses(model, apply_fn)[loss]

    def step(state, batch):
        value, grads = zf.value_and_grad(fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": value}

    stepped = STACKS[stack](step)
    state = zf.init(stepped, zf.TrainState.create(copies(params), zf.optim.sgd(0.1)))
    return lambda: stepped(state, make_batch())


@outcome("clear")
@pytest.mark.parametrize("loss", CASES)
@pytest.mark.parametrize("stack", list(STACKS))
def test_a_loss_gradients_cannot_reach_is_refused(stack, loss):
    words = _losses(None, None)[loss][1]
    clear_error(_one_step(stack, loss), "value_and_grad", *words, exc=ValueError)


def refusal_on_a_rank(stack: str, loss: str) -> str | None:
    """What ``stack`` says on this rank to loss ``loss`` (None: nothing refused)."""
    try:
        _one_step(stack, loss)()
    except ValueError as err:
        return str(err)
    return None


@outcome("clear")
@pytest.mark.parametrize("loss", CASES)
def test_a_loss_gradients_cannot_reach_is_refused_by_stage_3_on_two_ranks(loss):
    """(One rank runs stage 3's blocks on the shards themselves; two gather them and reduce per unit.)"""
    words = _losses(None, None)[loss][1]
    for rank, message in enumerate(run_distributed(refusal_on_a_rank, 2, "shard3", loss)):
        assert message is not None, f"rank {rank}: not refused"
        says(message, "value_and_grad", *words)


def _with_a_loss_only_parameter():
    torch.manual_seed(0)
    model = TinyLM()
    model.bonus = torch.nn.Parameter(torch.linspace(-1, 1, 7))  # used by the loss only, through a sum
    return model


def _bonus_loss(logits, bonus, batch):
    return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten()) + 1e-2 * bonus.sum()


@outcome("right")
@pytest.mark.parametrize("stack", ["plain", "accumulate", "shard3"])
def test_a_parameter_used_through_a_reduction_trains_like_eager(stack):
    """The gradient of ``bonus.sum()`` comes back as ``ones`` expanded to the parameter's shape (one memory
    location for every element); accumulating micro-batches into it must neither fail nor alias."""
    model = _with_a_loss_only_parameter()
    apply_fn, params = zf.functional(model)

    def step(state, batch):
        value, grads = zf.value_and_grad(lambda p, b: _bonus_loss(apply_fn(p, b["x"]), p["bonus"], b))(
            state.params, batch)
        return state.apply_gradients(grads), {"loss": value}

    batches = [make_batch(seed=i) for i in range(2)]
    eager = _with_a_loss_only_parameter()
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    for batch in batches:
        opt.zero_grad()
        _bonus_loss(eager(batch["x"]), eager.bonus, batch).backward()
        opt.step()
    stepped = STACKS[stack](step)
    state = zf.init(stepped, zf.TrainState.create(copies(params), zf.optim.sgd(0.1)))
    for batch in batches:
        state, _ = stepped(state, batch)
    want = {k: v.detach() for k, v in eager.named_parameters() if k in params}
    assert_same(zf.gather(stepped, state), want, rtol=1e-5, atol=1e-6)


@outcome("right")
def test_a_model_with_an_unused_parameter_still_trains():
    """The module-parameter check runs only when some gradient is missing: a genuinely unused parameter
    gets a zero gradient, as before, and nothing is refused."""
    torch.manual_seed(0)
    model = TinyLM()
    model.unused = torch.nn.Linear(2, 2)
    apply_fn, params = zf.functional(model)

    def step(state, batch):
        value, grads = zf.value_and_grad(lm_loss(apply_fn))(state.params, batch)
        assert torch.equal(grads["unused.weight"], torch.zeros(2, 2))
        return state.apply_gradients(grads), {"loss": value}

    state = zf.TrainState.create(copies(params), zf.optim.sgd(0.1))
    step(state, make_batch())
