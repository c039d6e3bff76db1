"""A NaN or infinite loss.

Its gradients are NaN, and a transformed step updates the state it was given
in place (donation): applied, the update would overwrite the last good weights
with NaN, on every rank, without a word. In a transformed step
`zf.value_and_grad` checks the loss on the device, without a host read: the
update is skipped there (on every rank under `shard`, when one rank's loss is),
the state the step returns holds the values it was given, and its next use
(the next step, ``gather``) raises naming the step; the run can go on from it
after that. A plain step (no transform) raises at once, before its update;
``allow_nonfinite=True`` differentiates it anyway. Under fp16 loss
scaling the scaler skips such steps instead (tested with mixed_precision).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as tdist

import zfunc as zf
from tests.adversarial import assert_same, clear_error, copies, outcome, single_thread  # noqa: F401 (a fixture)
from tests.models import TinyLM, lm_loss, make_batch
from zfunc.testing import run_distributed
from zfunc.transforms import accumulate, checkpoint, mixed_precision, offload, shard

pytestmark = pytest.mark.usefixtures("single_thread")

STACKS = {
    "plain": lambda s: s,
    "bf16": lambda s: mixed_precision(s, "bf16"),
    "accumulate": lambda s: accumulate(s, 2),
    "checkpoint": checkpoint,
    "offload": offload,
    "shard1": lambda s: shard(s, stage=1),
    "shard3": lambda s: shard(s, stage=3),
    "shard3-offload-bf16": lambda s: shard(offload(mixed_precision(s, "bf16")), stage=3),
}


def poisoned(batch: dict, value: float) -> dict:
    """``batch`` whose loss is ``value`` (NaN or inf): the targets are kept, the loss is scaled by it."""
    return {**batch, "scale": torch.full((batch["x"].shape[0],), value)}  # (split by accumulate as the rest)


def _step(allow_nonfinite: bool = False):
    model = TinyLM()
    apply_fn, params = zf.functional(model)
    loss_fn = lm_loss(apply_fn)

    def scaled(p, b):
        loss = loss_fn(p, {"x": b["x"], "y": b["y"]})
        return loss * b["scale"].mean() if "scale" in b else loss

    def step(state, batch):
        loss, grads = zf.value_and_grad(scaled, allow_nonfinite=allow_nonfinite)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    return params, step


def _raises_at_next_use(stepped, state, before: dict, step_number: int, *words: str) -> None:
    """``state`` came back from a step whose loss was NaN/inf: it holds ``before``'s values; its next use raises
    once, naming the step; then the run goes on from it."""
    if not isinstance(stepped, zf.Transform):
        return
    clear_error(lambda: stepped(state, make_batch(seed=1)), "loss is (nan|inf)", f"step={step_number}",
                "skipped its update", "allow_nonfinite", *words, exc=FloatingPointError)
    assert_same(zf.gather(stepped, state), before)  # unchanged (element-wise), and still usable:
    assert int(state.step) == step_number
    state, _ = stepped(state, make_batch(seed=1))
    assert all(torch.isfinite(v).all() for v in zf.gather(stepped, state).values())


@outcome("clear")
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("stack", list(STACKS))
def test_a_nonfinite_loss_stops_the_step_and_keeps_the_state(stack, value):
    torch.manual_seed(0)
    params, step = _step()
    stepped = STACKS[stack](step)
    state = zf.init(stepped, zf.TrainState.create(copies(params), zf.optim.adamw(1e-2)))
    state, _ = stepped(state, make_batch(seed=0))
    before = zf.gather(stepped, state)
    if not isinstance(stepped, zf.Transform):  # a plain step: raised at once, before its update
        clear_error(lambda: stepped(state, poisoned(make_batch(seed=1), value)), "loss is (nan|inf)",
                    "before any update", "allow_nonfinite", exc=FloatingPointError)
        assert_same(zf.gather(stepped, state), before)
        return
    state, metrics = stepped(state, poisoned(make_batch(seed=1), value))  # no host read: the update is skipped
    assert not torch.isfinite(metrics["loss"])
    _raises_at_next_use(stepped, state, before, 1)


@outcome("right")
def test_allow_nonfinite_differentiates_it_anyway():
    torch.manual_seed(0)
    params, step = _step(allow_nonfinite=True)
    state = zf.TrainState.create(copies(params), zf.optim.sgd(0.1))
    state, metrics = step(state, poisoned(make_batch(seed=0), float("nan")))
    assert torch.isnan(metrics["loss"]) and all(torch.isnan(v).all() for v in state.params.values())


@outcome("right")
def test_fp16_loss_scaling_skips_a_nonfinite_step_instead():
    torch.manual_seed(0)
    params, step = _step()
    stepped = mixed_precision(step, "fp16")
    state = zf.init(stepped, zf.TrainState.create(copies(params), zf.optim.adamw(1e-2)))
    before = zf.gather(stepped, state)
    state, metrics = stepped(state, poisoned(make_batch(seed=0), float("inf")))
    assert bool(metrics["skipped"])
    assert_same(zf.gather(stepped, state), before)


def _nan_on_one_rank(stage: int) -> dict:
    rank = tdist.get_rank()
    torch.manual_seed(0)
    params, step = _step()
    stepped = shard(step, stage=stage)
    state = stepped.init(zf.TrainState.create(copies(params), zf.optim.adamw(1e-2)))
    state, _ = stepped(state, make_batch(seed=rank))
    before = stepped.gather(state)
    bad = poisoned(make_batch(seed=2 + rank), float("nan")) if rank == 1 else make_batch(seed=2 + rank)
    state, _ = stepped(state, bad)  # the update is skipped on every rank, on the device
    try:
        stepped(state, make_batch(seed=4 + rank))
        message = None
    except FloatingPointError as err:
        message = str(err)
    unchanged = all(torch.equal(stepped.gather(state)[k], v) for k, v in before.items())
    state, _ = stepped(state, make_batch(seed=4 + rank))  # the run goes on from the kept state
    return {"message": message, "unchanged": unchanged,
            "finite": all(torch.isfinite(v).all().item() for v in stepped.gather(state).values())}


@outcome("clear")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_nan_loss_on_one_rank_stops_every_rank_and_keeps_the_state(stage):
    for rank, out in enumerate(run_distributed(_nan_on_one_rank, 2, stage, timeout=120)):
        assert out["message"] is not None, f"rank {rank} went on"
        clear_error(lambda: (_ for _ in ()).throw(FloatingPointError(out["message"])), "loss is", "1 rank",
                    "step=1", "skipped its update", exc=FloatingPointError)
        assert out["unchanged"] and out["finite"], (rank, out)


@outcome("clear")
@pytest.mark.parametrize("stack", ["bf16", "shard1", "shard3"])
def test_a_nonfinite_loss_of_an_eager_step_is_raised_by_the_compiled_step_after_it(stack):
    """A run that steps eagerly, then compiles its step (warm-up steps before the compile, say): the eager
    step's finding is still raised, once, by the compiled step given its state (read while dynamo traces:
    the finding was copied to the host by the eager step; dynamo raises it as an exception it observed, with
    the message), and the run goes on compiled from that state. Before, any state an eager step returned
    stopped the trace at the host copy's read ("Tensor.tolist() with non-integer tensor")."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    params, step = _step()
    stepped = STACKS[stack](step)
    state = zf.init(stepped, zf.TrainState.create(copies(params), zf.optim.adamw(1e-2)))
    state, _ = stepped(state, make_batch(seed=0))
    before = zf.gather(stepped, state)
    state, _ = stepped(state, poisoned(make_batch(seed=1), float("nan")))  # eager: the update skipped
    twin = copy.deepcopy(state)  # (stepped on eagerly, for the compiled run's values)
    compiled = torch.compile(stepped, fullgraph=True, backend="eager")
    clear_error(lambda: compiled(state, make_batch(seed=1)), "loss is nan", "step=1", "skipped its update",
                exc=Exception)
    assert_same(zf.gather(stepped, state), before)
    state, _ = compiled(state, make_batch(seed=1))  # (the finding was raised once)
    clear_error(lambda: stepped(twin, make_batch(seed=1)), "loss is nan", exc=FloatingPointError)
    twin, _ = stepped(twin, make_batch(seed=1))
    assert int(state.step) == 2
    # (close, not bitwise: at one rank the compiled step updates each unit's flat buffer in one piece)
    assert_same(zf.gather(stepped, state), zf.gather(stepped, twin), rtol=1e-6, atol=1e-7)
