"""The transform protocol and accumulate."""

import pytest
import torch

import zfunc as zf
from tests.models import make_batch
from tests.shard_cases import build
from zfunc.interpret import Transform
from zfunc.step_context import current
from zfunc.transforms import accumulate, offload, shard


def run(step, state, steps=3, batch=8):
    for i in range(steps):
        state, metrics = step(state, make_batch(batch, seed=i))
    return state, metrics


@pytest.mark.parametrize("k", [1, 2, 4])
def test_accumulate_equals_full_batch(k):
    step, state = build()
    ref, ref_metrics = run(step, state)
    step, state = build()
    acc = accumulate(step, micro_batches=k)
    state = acc.init(state)
    out, metrics = run(acc, state)
    torch.testing.assert_close(metrics["loss"], ref_metrics["loss"], rtol=1e-6, atol=1e-7)
    for key, value in ref.params.items():
        torch.testing.assert_close(out.params[key], value, rtol=1e-6, atol=1e-7)
    assert int(out.step) == 3


def test_accumulate_rejects_uneven_batches_and_bad_counts():
    step, state = build()
    with pytest.raises(ValueError, match="multiple of 3"):
        accumulate(step, micro_batches=3)(state, make_batch(8))
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="positive int"):
            accumulate(step, micro_batches=bad)


def test_accumulate_averages_aux():
    _, state = build()
    from tests.models import TinyLM, lm_loss
    torch.manual_seed(0)
    apply_fn, _ = zf.functional(TinyLM())

    def loss_with_aux(p, batch):
        loss = lm_loss(apply_fn)(p, batch)
        return loss, {"twice": 2 * loss, "tokens": batch["x"].shape[0]}

    def step(state, batch):
        (loss, aux), grads = zf.value_and_grad(loss_with_aux, has_aux=True)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss, **aux}

    _, metrics = accumulate(step, micro_batches=2)(state, make_batch(8))
    torch.testing.assert_close(metrics["twice"], 2 * metrics["loss"])
    assert metrics["tokens"] == 4  # non-float aux: the last micro-batch's


def test_stack_is_active_only_during_the_call():
    seen = []

    def step(state, batch):
        seen.append([t.name for t in current().stack.transforms])
        return state, {}

    stacked = shard(offload(accumulate(step, micro_batches=1)), stage=1)
    _, state = build()
    stacked(stacked.init(state), None)
    assert seen == [["shard", "offload", "accumulate"]]
    assert current() is None


def test_init_and_gather_of_plain_steps():
    step, state = build()
    assert zf.init(step, state) is state
    assert zf.gather(step, state).keys() == state.params.keys()


def test_transform_repr_and_type_checks():
    step, _ = build()
    assert repr(accumulate(step, micro_batches=2)) == "accumulate(train_step, micro_batches=2)"
    with pytest.raises(TypeError, match="step function"):
        accumulate(42, micro_batches=2)
    with pytest.raises(ValueError, match="offload must be the outer one"):
        accumulate(offload(step), micro_batches=2)


def test_custom_transform_sees_primitives():
    calls = []

    class count_updates(Transform):  # noqa: N801
        name = "count_updates"

        def apply_gradients(self, next, state, grads, request):
            calls.append(int(state.step))
            return next(state, grads, request)

    step, state = build()
    counted = count_updates(step)
    run(counted, counted.init(state))
    assert calls == [0, 1, 2]


def test_train_state_is_a_pytree_for_optree_and_torch():
    import torch.utils._pytree as torch_pytree

    _, state = build()
    leaves = zf.tree.tree_leaves(state)
    torch_leaves = torch_pytree.tree_leaves(state)
    assert len(leaves) == len(torch_leaves) > len(state.params)
    rebuilt = zf.tree.tree_map(lambda x: x, state)
    assert isinstance(rebuilt, zf.TrainState) and rebuilt.tx is state.tx
    rebuilt = torch_pytree.tree_map(lambda x: x, state)
    assert isinstance(rebuilt, zf.TrainState)


def test_grads_mismatch_is_a_clear_error():
    _, state = build()
    grads = {k: torch.zeros_like(v) for k, v in state.params.items()}
    grads.pop("embed.weight")
    with pytest.raises(ValueError, match="missing from grads: embed.weight"):
        state.apply_gradients(grads)
    grads["embed.weight"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="expected shape"):
        state.apply_gradients(grads)


def test_create_validates_inputs():
    _, state = build()
    with pytest.raises(TypeError, match="optimizer"):
        zf.TrainState.create(state.params, "adam")
    with pytest.raises(TypeError, match="dict of tensors"):
        zf.TrainState.create([1, 2], state.tx)


@pytest.mark.slow
def test_torch_compile_of_a_whole_step_matches_eager():
    """torch.compile sees through a zfunc step (graph breaks only at transform dispatch)."""
    import torch._dynamo

    step, state = build()
    eager = state
    for i in range(3):
        eager, _ = step(eager, make_batch(8, seed=i))
    torch._dynamo.reset()
    step, state = build()
    compiled = torch.compile(step)
    for i in range(3):
        state, metrics = compiled(state, make_batch(8, seed=i))
    for key, value in eager.params.items():
        torch.testing.assert_close(state.params[key], value, rtol=1e-6, atol=1e-7)
    assert int(state.step) == 3
