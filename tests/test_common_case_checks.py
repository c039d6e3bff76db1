"""The checks every call makes of each parameter still refuse once earlier calls have passed.

Each check compares, in the common case, what it reads of every parameter (a version, a data pointer,
a shape and dtype, an identity) with what it read before or what passed last, in one comparison of
lists (`zfunc.tree.read_in_c`; issue 25: a forward's host work per parameter); only when they differ
does it look parameter by parameter, to name the culprit. So each case here runs calls that pass
first (the fast path then holds an answer) and then the mistake, which must get the same error as
on a first call; and what passes by name (a reordered dict) still passes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from tests.adversarial import clear_error
from tests.models import TinyLM, make_batch, tiny_lm_step
from zfunc.params_check import other_dtypes
from zfunc.reparametrize import swapped
from zfunc.transforms import mixed_precision, shard

X = make_batch()["x"]


def _warm(apply_fn, params, calls: int = 2) -> None:
    for _ in range(calls):
        apply_fn(params, X)


def test_apply_fn_refuses_another_dtype_or_shape_after_calls_that_passed():
    apply_fn, params = zf.functional(TinyLM())
    _warm(apply_fn, params)
    half = {**params, "embed.weight": params["embed.weight"].half()}
    clear_error(lambda: apply_fn(half, X), "embed.weight", "float16", "float32", exc=ValueError)
    wide = {**params, "blocks.0.up.weight": torch.zeros(22, 10)}
    clear_error(lambda: apply_fn(wide, X), "blocks.0.up.weight", r"\(22, 10\)", r"\(23, 10\)", exc=ValueError)
    _warm(apply_fn, params)  # (and the right ones pass again)


def test_what_passed_under_other_dtypes_is_refused_outside_it():
    """`other_dtypes` decides the outcome with the dtypes: what passed under it is not taken as passed outside."""
    apply_fn, params = zf.functional(TinyLM())
    double = {k: v.double() for k, v in params.items()}
    with other_dtypes():
        _warm(apply_fn, double)
    clear_error(lambda: apply_fn(double, X), "float64", "float32", exc=ValueError)


def test_a_parameter_frozen_after_calls_that_passed_is_refused():
    model = TinyLM()
    apply_fn, params = zf.functional(model)
    _warm(apply_fn, params)
    model.blocks[1].down.weight.requires_grad_(False)
    clear_error(lambda: apply_fn(params, X), "blocks.1.down.weight", "requires_grad", exc=ValueError)


def _assign_data(lin: nn.Linear) -> None:
    lin.weight.data = torch.zeros_like(lin.weight)


def _write_in_place(lin: nn.Linear) -> None:  # (a version bump, no new values)
    with torch.no_grad():
        lin.weight.mul_(1.0)


class _LateWrite(nn.Module):
    """Does ``write(self.lin)`` at its third forward (the calls before it pass the check)."""

    def __init__(self, write) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.write = write
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            self.write(self.lin)
        return self.lin(x)


def test_a_data_assignment_after_calls_that_passed_is_refused():
    apply_fn, params = zf.functional(_LateWrite(_assign_data))
    x = torch.randn(2, 4)
    for _ in range(2):
        apply_fn(params, x)
    clear_error(lambda: apply_fn(params, x), "lin.weight.data", "silently", exc=RuntimeError)


def test_an_in_place_write_to_the_compute_copy_after_steps_that_passed_is_refused():
    apply_fn, params = zf.functional(_LateWrite(_write_in_place))

    def train_step(state, batch):
        loss, grads = zf.value_and_grad(lambda p, x: apply_fn(p, x).float().pow(2).mean())(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    step = mixed_precision(train_step, "bf16")
    state = step.init(zf.TrainState.create(params, zf.optim.sgd(0.1)))
    x = torch.randn(2, 4)
    for _ in range(2):
        state, _ = step(state, x)
    clear_error(lambda: step(state, x), "lin.weight", "in place", "master", exc=RuntimeError)


def test_a_reassigned_slot_after_calls_that_passed_is_refused_and_restored():
    lin = nn.Linear(3, 3)
    original = lin.weight
    new = {"weight": torch.zeros(3, 3), "bias": torch.zeros(3)}
    cache: dict = {}
    for _ in range(2):
        with swapped(lin, new, cache):
            assert lin.weight is new["weight"]
    with pytest.raises(RuntimeError, match="assigns weight"), swapped(lin, new, cache):
        lin.weight = nn.Parameter(torch.ones(3, 3))
    assert lin.weight is original


def test_a_module_at_two_positions_holds_the_later_name_and_is_restored():
    """One slot given under two names (``Sequential(a, a)``): the later tensor in it while the call runs, the
    original after; an assignment to it is still refused."""
    a = nn.Linear(3, 3)
    twice = nn.Sequential(a, a)
    original = a.weight
    new = {f"{i}.{n}": torch.full_like(t, float(i)) for i in (0, 1) for n, t in a.named_parameters()}
    cache: dict = {}
    for _ in range(2):
        with swapped(twice, new, cache):
            assert a.weight is new["1.weight"]
        assert a.weight is original
    with pytest.raises(RuntimeError, match="assigns"), swapped(twice, new, cache):
        a.weight = nn.Parameter(torch.ones(3, 3))
    assert a.weight is original


@pytest.mark.parametrize("stack", ["bf16", "shard1-bf16"])
def test_a_reordered_or_unchanged_state_still_steps_and_an_edit_is_still_refused(stack):
    """The copies' check compares identities and versions in order; by name where the order differs."""
    _, params, train_step = tiny_lm_step()
    stepped = mixed_precision(train_step, "bf16")
    if stack == "shard1-bf16":
        stepped = shard(stepped, stage=1)
    state = stepped.init(zf.TrainState.create(params, zf.optim.sgd(0.1)))
    batch = make_batch()
    for _ in range(2):
        state, _ = stepped(state, batch)
    state = state.replace(params=dict(reversed(list(state.params.items()))))
    state, _ = stepped(state, batch)
    with torch.no_grad():
        state.extras["mixed_precision"].master["blocks.2.down.bias"].add_(1.0)
    # (Under shard the master's views share one buffer, and so one version counter: the first of them is named.)
    key = "blocks.2.down.bias" if stack == "bf16" else "blocks."
    clear_error(lambda: stepped(state, batch), key, "changed", "master", exc=ValueError)


def test_a_state_stamped_without_copies_is_not_checked_by_name():
    """A state recorded with no copies (as `check_copies` found it) is not refused for the copies it has later."""
    _, params, train_step = tiny_lm_step()
    stepped = mixed_precision(train_step, "bf16")
    state = stepped.init(zf.TrainState.create(params, zf.optim.sgd(0.1)))
    from zfunc.interpret import stamp_copies
    plain = state.replace(extras={})
    stamp_copies(plain, stepped)  # (no master: nothing recorded to compare with)
    restamped = plain.replace(extras=state.extras)
    loss = stepped(restamped, make_batch())[1]["loss"]
    assert torch.isfinite(loss)


def test_value_and_grad_refuses_an_integer_leaf_among_floating_ones():
    params = {"w": torch.randn(3), "n": torch.arange(3)}
    clear_error(lambda: zf.value_and_grad(lambda p: (p["w"] * p["n"]).sum())(params), "int64", exc=TypeError)


def test_value_and_grad_of_subclass_leaves_takes_the_careful_route():
    """Leaves of a tensor subclass are read one by one (their attributes may run their own code): the result is
    the plain one."""

    class Marked(torch.Tensor):
        pass

    w = torch.randn(4)
    params = {"w": w.as_subclass(Marked)}
    loss, grads = zf.value_and_grad(lambda p: F.softplus(p["w"]).sum())(params)
    assert torch.allclose(grads["w"], torch.sigmoid(w))
