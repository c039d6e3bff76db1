"""The cheap evidence a step takes of its state, held to the walks it stands for.

A step under ``shard(mixed_precision(step, "bf16"))`` finds the state it was given laid out as the step before
left it without walking every tensor: the very dicts, unchanged, by their version tags (`zfunc.tree.dict_tags`:
the fused plan's operands, shard's views of stages 1/2, the compute copy and master `check_copies` compares), and
no in-place write into the compute copy or master, by the versions of the few buffers their views share
(`zfunc.tree.VersionBases`). What tags cannot see, a storage swapped under a tensor (``t.data = other``,
``t.set_(...)``), the plan still reads per tensor (its address).

Each case edits a state between two steps (or the gradients inside a step) in a way such a shortcut could miss,
and runs the same steps twice: as the step runs them (the fused update's plan, on the GPU path driven here on CPU
tensors through Triton's interpreter, with every shortcut) and with every shortcut off (no dict tags: values
compared by id and every version read, as before them; the per-run kernel, which reads every tensor afresh). The
outcome must be the same: the same error, or the same state element for element.
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch

import zfunc as zf
from tests.shard_cases import build, local_batch
from tests.test_fused_plan import device_path  # noqa: F401 (a fixture)
from zfunc import tree
from zfunc.optim import fused
from zfunc.transforms import mixed_precision, shard

quiet = pytest.mark.filterwarnings("ignore::RuntimeWarning")
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="drives the GPU path on CPU tensors")


def _moments(state):
    return state.tx.fused.adam_state(state.opt_state)


def _master(state):
    return state.extras["mixed_precision"].master


def _same_shaped_pair(d: dict) -> tuple[str, str]:
    """Two keys of ``d`` whose tensors have one shape (what a swap of two entries could pass off as the other)."""
    seen: dict = {}
    for k, v in d.items():
        if tuple(v.shape) in seen:
            return seen[tuple(v.shape)], k
        seen[tuple(v.shape)] = k
    raise AssertionError("no two keys of one shape")


def _last(d: dict) -> str:
    return list(d)[-1]


# Edits made between the first and the second step: ``edit(state) -> state`` (the state to step next).
def _replace_moment(state):
    mu = _moments(state).mu
    k = _last(mu)
    mu[k] = mu[k].clone().mul_(0.5)  # (a same-shaped tensor of its own)
    return state


def _swap_moments(state):
    nu = _moments(state).nu
    a, b = _same_shaped_pair(nu)
    nu[a], nu[b] = nu[b], nu[a]
    return state


def _moment_in_place(state):
    _moments(state).mu[_last(_moments(state).mu)].mul_(0.25)
    return state


def _moment_data_swapped(state):
    nu = _moments(state).nu
    k = _last(nu)
    nu[k].data = nu[k].data.clone().fill_(1e-4)  # (the same tensor object, another storage: no tag, no version)
    return state


def _moment_set_(state):
    mu = _moments(state).mu
    k = _last(mu)
    mu[k].set_(torch.full_like(mu[k], 1e-3))
    return state


def _master_data_swapped(state):
    master = _master(state)
    k = _last(master)
    master[k].data = master[k].data.clone().add_(0.5)
    return state


def _fresh_dicts(state):
    """Every dict the shortcuts find by its tag made anew, holding the very tensors."""
    mp = state.extras["mixed_precision"]
    adam = _moments(state)
    opt_state = fused._replace_at(state.opt_state, state.tx.fused.adam_path,
                                  type(adam)(adam.count, dict(adam.mu), dict(adam.nu)))
    return state.replace(params=dict(state.params), opt_state=opt_state,
                         extras={**state.extras, "mixed_precision": mp._replace(master=dict(mp.master))})


def _replace_master(state):
    master = _master(state)
    k = _last(master)
    master[k] = master[k].clone()
    return state


def _swap_masters(state):
    master = _master(state)
    a, b = _same_shaped_pair(master)
    master[a], master[b] = master[b], master[a]
    return state


def _master_in_place(state):
    with torch.no_grad():
        _master(state)[_last(_master(state))].add_(1.0)
    return state


def _master_set_(state):
    master = _master(state)
    k = _last(master)
    master[k].set_(master[k].clone())  # (another storage; in place: the version moves)
    return state


def _compute_copy_in_place(state):
    with torch.no_grad():
        state.params[_last(state.params)].add_(1.0)
    return state


def _deep_copy(state):
    return copy.deepcopy(state)


SAME_RESULT = [_replace_moment, _swap_moments, _moment_in_place, _moment_data_swapped, _moment_set_,
               _master_data_swapped, _fresh_dicts, _deep_copy]
REFUSED = [_replace_master, _swap_masters, _master_in_place, _master_set_, _compute_copy_in_place]


# Edits of the gradients inside the user's step: ``edit(grads, state) -> grads``.
def _grad_replaced(grads, state):
    k = _last(grads)
    grads[k] = grads[k] * 0.5
    return grads


def _grad_in_place(grads, state):
    grads[_last(grads)].mul_(0.5)
    return grads


def _grads_reordered(grads, state):
    return dict(reversed(list(grads.items())))


def _grad_reshaped(grads, state):
    k = _last(grads)
    grads[k] = grads[k].view(1, -1)
    return grads


def _grad_data_reshaped(grads, state):
    k = _last(grads)
    grads[k].data = grads[k].data.view(1, -1)  # (the same object, another shape: no version moves)
    return grads


def _grad_inside_a_moment(grads, state):
    """A gradient that is the bytes of a moment the update writes (of its dtype and size)."""
    k = _last(grads)
    n = grads[k].numel()
    grads[k] = _moments(state).nu[k].view(torch.bfloat16)[:n]
    return grads


def _master_edited_in_the_step(grads, state):
    """Not the gradients: the master, in place, inside the step (what the step returns is stamped as it is)."""
    with torch.no_grad():
        _master(state)[_last(_master(state))].mul_(0.5)
    return grads


GRADS_SAME_RESULT = [_grad_replaced, _grad_in_place, _grads_reordered, _master_edited_in_the_step]
GRADS_REFUSED = [_grad_reshaped, _grad_data_reshaped, _grad_inside_a_moment]


def _outcome(stage: int, edit=None, grads_edit=None, steps: int = 3):
    """``steps`` steps of ``shard(mixed_precision(step, "bf16"), stage)``, ``edit`` between the first two and
    ``grads_edit`` inside each step after the first; the first error as ``(type, message)``, else the state."""
    inner, plain = build("clip+schedule")
    edits = {"grads": None}

    def train_step(state, batch):
        if edits["grads"] is None:
            return inner(state, batch)
        loss, grads = zf.value_and_grad(_loss(inner))(state.params, batch)
        return state.apply_gradients(edits["grads"](grads, state)), {"loss": loss}

    step = shard(mixed_precision(train_step, "bf16"), stage=stage)
    state = step.init(plain)
    try:
        for i in range(steps):
            if i == 1:
                state = edit(state) if edit is not None else state
                edits["grads"] = grads_edit
            state, _ = step(state, local_batch(i, 0, 1))
    except Exception as err:  # noqa: BLE001 (the outcome compared is the error itself)
        return type(err), str(err)
    adam = _moments(state)
    return {name: {k: v.clone() for k, v in d.items()}
            for name, d in (("params", state.params), ("master", _master(state)), ("mu", adam.mu),
                            ("nu", adam.nu))} | {"step": {"step": state.step.clone()}}


def _loss(inner):
    """The loss `tests.models.tiny_lm_step`'s step differentiates (its closure's)."""
    return next(c.cell_contents for c in inner.__closure__ if callable(c.cell_contents))


def _without_shortcuts(monkeypatch):
    """The state walked as before the shortcuts: no dict tags (every caller walks the values), and the per-run
    kernel (every tensor read afresh, no plan)."""
    monkeypatch.setattr(tree, "DICT_TAG", None)
    monkeypatch.setattr(fused, "_device_plan", lambda *a: None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers (equal floats may differ in bits: -0.0, NaNs)."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]) if t.dim() else t


def _assert_same_outcome(got, want):
    if isinstance(want, tuple):
        assert got == want, f"got {got!r}, want the error {want!r}"
        return
    assert isinstance(got, dict), f"got the error {got!r}, want a state"
    for part, tensors in want.items():
        assert got[part].keys() == tensors.keys(), part
        for k, v in tensors.items():
            assert torch.equal(_bits(got[part][k]), _bits(v)), (part, k)


def _compare(monkeypatch, stage: int, edit=None, grads_edit=None):
    got = _outcome(stage, edit, grads_edit)
    with monkeypatch.context() as m:
        _without_shortcuts(m)
        want = _outcome(stage, edit, grads_edit)
    _assert_same_outcome(got, want)
    return got


@cpu_only
@quiet
@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("edit", SAME_RESULT, ids=lambda f: f.__name__.strip("_"))
def test_an_edit_between_steps_trains_as_without_the_shortcuts(device_path, monkeypatch, stage, edit):
    assert isinstance(_compare(monkeypatch, stage, edit), dict)


@cpu_only
@quiet
@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("edit", REFUSED, ids=lambda f: f.__name__.strip("_"))
def test_an_edit_between_steps_is_refused_as_without_the_shortcuts(device_path, monkeypatch, stage, edit):
    err, message = _compare(monkeypatch, stage, edit)
    assert err is ValueError and "was changed (in place or replaced)" in message


@cpu_only
@quiet
@pytest.mark.parametrize("edit", GRADS_SAME_RESULT, ids=lambda f: f.__name__.strip("_"))
def test_gradients_edited_by_the_step_train_as_without_the_shortcuts(device_path, monkeypatch, edit):
    assert isinstance(_compare(monkeypatch, 3, grads_edit=edit), dict)


@cpu_only
@quiet
@pytest.mark.parametrize("edit", GRADS_REFUSED, ids=lambda f: f.__name__.strip("_"))
def test_gradients_edited_by_the_step_are_refused_as_without_the_shortcuts(device_path, monkeypatch, edit):
    err, message = _compare(monkeypatch, 1, grads_edit=edit)
    assert err is ValueError and ("grads do not match params" in message or "share memory" in message), message


@cpu_only
@quiet
def test_two_states_of_one_stack_stepped_in_turn_train_as_without_the_shortcuts(device_path, monkeypatch):
    """Two states of one stack share their optimizer, and so its plan: each step is given the other's dicts."""

    def run():
        inner, plain = build("clip+schedule")
        step = shard(mixed_precision(inner, "bf16"), stage=3)
        a, b = step.init(plain), step.init(plain)
        for i in range(3):
            a, _ = step(a, local_batch(i, 0, 1))
            b, _ = step(b, local_batch(10 + i, 0, 1))
        return {"a": {k: v.clone() for k, v in _master(a).items()}, "b": {k: v.clone() for k, v in _master(b).items()}}

    got = run()
    with monkeypatch.context() as m:
        _without_shortcuts(m)
        want = run()
    _assert_same_outcome(got, want)
    assert not all(torch.equal(got["a"][k], got["b"][k]) for k in got["a"])  # (each trained on its own batches)


def test_a_state_from_another_stack_is_refused():
    inner, plain = build("clip+schedule")
    one = shard(mixed_precision(inner, "bf16"), stage=1)
    state, _ = one(one.init(plain), local_batch(0, 0, 1))
    three = shard(mixed_precision(inner, "bf16"), stage=3)
    with pytest.raises(ValueError, match="laid out for stage 1"):
        three(state, local_batch(1, 0, 1))


# -- the evidence itself --------------------------------------------------------------------------------------


@pytest.mark.skipif(tree.DICT_TAG is None, reason="no dict version tags on this torch/Python")
def test_a_dict_tag_changes_with_every_change_of_what_the_dict_holds():
    t, u = torch.zeros(2), torch.zeros(2)
    d = {"a": t, "b": u}
    (tag,) = tree.dict_tags([d])
    assert tree.dict_tags([d]) == (tag,)
    d["a"] = t  # (the same object again: nothing changed)
    assert tree.dict_tags([d]) == (tag,)
    changes = [lambda: d.__setitem__("a", u), lambda: d.__setitem__("c", t), lambda: d.pop("c"),
               lambda: d.update(a=t)]
    seen = {tag}
    for change in changes:
        change()
        (now,) = tree.dict_tags([d])
        assert now not in seen
        seen.add(now)
    assert tree.dict_tags([dict(d)])[0] not in seen  # (a new dict of the same items: a tag of its own)


def test_dicts_whose_tags_cannot_stand_for_them_have_none():
    from collections import OrderedDict

    assert tree.dict_tags([{}, OrderedDict()]) is None  # (an OrderedDict reorders without a new tag)
    assert tree.dict_tags([{}, zf.transforms.shard_layout.StateViews()]) is None


def test_same_values_without_tags_compares_ids(monkeypatch):
    t, u = torch.zeros(2), torch.zeros(2)
    d = {"a": t, "b": u}
    same = tree.SameValues([d])
    assert same([d]) and same([{"a": t, "b": u}]) and not same([{"a": u, "b": t}])
    monkeypatch.setattr(tree, "DICT_TAG", None)
    same = tree.SameValues([d])
    assert same.tags is None and same([d]) and not same([{"a": t, "b": t}])
    d["a"] = u.clone()
    assert not same([d])


def test_version_bases_see_a_write_through_any_view_and_pin_the_views():
    flat = torch.zeros(10)
    views = [flat[:4], flat[4:], torch.zeros(3)]
    bases = tree.VersionBases.of(views)
    before = bases.versions()
    views[1].add_(1.0)
    assert bases.versions() != before
    before = bases.versions()
    views[0].data = torch.ones(4)  # (a storage swapped under a view: its counter stays its base's)
    views[0].add_(1.0)
    assert bases.versions() != before
    with pytest.raises(RuntimeError, match="weakref"):  # (the one call that gives a view another counter)
        torch.utils.swap_tensors(views[1], torch.zeros(6))
    assert len(bases.firsts) == 2 and all(isinstance(r, weakref.ref) for r in bases.views)
    assert tree.VersionBases.of([torch.zeros(2), torch.zeros(3)]) is None  # (no counter shared: none held)
