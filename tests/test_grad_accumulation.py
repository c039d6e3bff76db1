"""accumulate under bf16: the gradient the optimizer receives after k micro-batches is as accurate as the
whole-batch bf16 gradient (fp32 accumulation), and bad accumulation dtypes are refused.

The gradient the optimizer receives is read back from one SGD step with a learning rate of 1 from the
fp32 master: ``g = p0 - p1`` (the subtraction's rounding, ~1e-8 of the weights, is far below the bf16
errors measured, ~1e-3 of the gradient). Its error is compared, as the issue states it, as the norm of
its difference from the fp32 whole-batch gradient, relative to that of the whole-batch bf16 gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zfunc as zf
from tests.shard_cases import rank_and_world
from zfunc.testing import run_distributed
from zfunc.transforms import accumulate, mixed_precision, shard

EXAMPLES = 512  # over all ranks: at world 2, 256 per rank, so k = 256 still has one example per micro-batch
KS = (1, 4, 16, 64, 256)
BOUND = 1.3  # the issue's: within 1.3x of the whole-batch bf16 gradient's error


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(48, 96), nn.GELU()),
                                     nn.Sequential(nn.Linear(96, 96), nn.GELU())])
        self.head = nn.Linear(96, 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def data() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(EXAMPLES, 48, generator=g), "y": torch.randint(0, 10, (EXAMPLES,), generator=g)}


def setup():
    torch.manual_seed(0)
    model = MLP()
    apply_fn, params = zf.functional(model)

    def train_step(state, batch):
        _, grads = zf.value_and_grad(lambda p, b: F.cross_entropy(apply_fn(p, b["x"]), b["y"]))(state.params, batch)
        return state.apply_gradients(grads), {}

    return train_step, {k: v.detach().clone() for k, v in params.items()}


def received_gradient(wrap, batch) -> dict:
    """The gradient the optimizer of ``wrap(train_step)`` receives on ``batch`` (gathered, fp32 numpy)."""
    step, params = setup()
    stacked = wrap(step)
    state = zf.init(stacked, zf.TrainState.create({k: v.clone() for k, v in params.items()}, zf.optim.sgd(1.0)))
    state, _ = stacked(state, batch)
    after = zf.gather(stacked, state)
    return {k: (params[k].double() - after[k].double()).numpy() for k in params}


def error(got: dict, want: dict) -> float:
    return float(np.sqrt(sum(((got[k] - want[k]) ** 2).sum() for k in want)))


def errors_on_ranks(stage: int | None) -> dict:
    """On each rank: the errors of the whole-batch bf16 gradient and of k micro-batches (fp32 and bf16
    accumulation), against the fp32 whole-batch gradient."""
    rank, world = rank_and_world()
    batch = data()
    exact = received_gradient(lambda s: s, batch)  # fp32, the whole (global) batch
    local = {k: v.chunk(world)[rank] for k, v in batch.items()}
    outer = (lambda s: s) if stage is None else (lambda s: shard(s, stage=stage))
    out = {"whole": error(received_gradient(lambda s: outer(mixed_precision(s, "bf16")), local), exact)}
    for k in KS:
        out[k] = error(received_gradient(lambda s, k=k: outer(mixed_precision(accumulate(s, k), "bf16")), local), exact)
    out["bf16 256"] = error(received_gradient(
        lambda s: outer(mixed_precision(accumulate(s, 256, dtype=torch.bfloat16), "bf16")), local), exact)
    return out


def check(errors: dict) -> None:
    whole = errors["whole"]
    ratios = {k: errors[k] / whole for k in KS}
    assert all(r < BOUND for r in ratios.values()), ratios
    # The bf16 opt-in shows the growth the default avoids (the issue measured 13x at k = 256).
    assert errors["bf16 256"] / whole > 2.0, (errors["bf16 256"] / whole, ratios)


def test_fp32_accumulation_is_as_accurate_as_the_whole_batch_on_one_rank():
    # (In a forked worker: single-threaded, which is faster than the parent's threads for these small ops.)
    check(run_distributed(errors_on_ranks, 1, None)[0])


def test_fp32_accumulation_is_as_accurate_as_the_whole_batch_under_shard():
    for errors in run_distributed(errors_on_ranks, 2, 2):
        check(errors)


def test_accumulation_dtype_narrower_than_compute_is_refused():
    step, _ = setup()
    with pytest.raises(ValueError, match="narrower dtype.*dtype=None"):
        mixed_precision(accumulate(step, 2, dtype=torch.float16), "bf16").stack  # noqa: B018
    with pytest.raises(ValueError, match="narrower dtype"):
        mixed_precision(accumulate(step, 2, dtype=torch.bfloat16), "fp32").stack  # noqa: B018
    # Without mixed_precision the gradients' own dtype (fp32 here) is the compute dtype: refused at the step.
    step, params = setup()
    acc = accumulate(step, 2, dtype=torch.bfloat16)
    state = acc.init(zf.TrainState.create(params, zf.optim.sgd(0.1)))
    with pytest.raises(ValueError, match="narrower dtype"):
        acc(state, data())


@pytest.mark.parametrize("bad", ["fp32", torch.int32, torch.complex64, 32])
def test_accumulation_dtype_must_be_a_float_dtype(bad):
    step, _ = setup()
    with pytest.raises(ValueError, match="floating torch dtype"):
        accumulate(step, 2, dtype=bad)


def test_fp32_accumulation_by_default_and_bf16_opt_in_dtypes():
    """The update receives fp32 gradients by default under bf16 compute, bf16 ones with the opt-in."""
    step, params = setup()
    seen = []

    def recording_step(state, batch):
        _, grads = zf.value_and_grad(lambda p, b: p["head.weight"].float().sum() * 0 + F.cross_entropy(
            torch.zeros(len(b["y"]), 10) + p["head.bias"].float(), b["y"]))(state.params, batch)
        seen.append({g.dtype for g in grads.values()})
        return state.apply_gradients(grads), {}

    for dtype, want in ((None, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)):
        stacked = mixed_precision(accumulate(recording_step, 4, dtype=dtype), "bf16")
        state = stacked.init(zf.TrainState.create({k: v.clone() for k, v in params.items()}, zf.optim.sgd(0.1)))
        stacked(state, data())
        assert seen[-1] == {want}, (dtype, seen[-1])
    assert repr(accumulate(step, 2, dtype=torch.bfloat16)) == "accumulate(train_step, micro_batches=2, dtype=torch.bfloat16)"


def test_parameters_that_autograd_hands_one_gradient_tensor_are_summed_apart():
    """``(a + b)``: autograd returns the same tensor as both gradients; summed in place into one, the other
    would be counted twice. fp32 compute (the accumulator takes the first micro-batch's gradients as its
    buffers): equals the whole batch."""
    def run(k):
        params = {"a": torch.linspace(-1, 1, 6), "b": torch.linspace(0.5, 2, 6)}

        def train_step(state, batch):
            _, grads = zf.value_and_grad(lambda p, x: ((p["a"] + p["b"]) * x).pow(2).mean())(state.params, batch)
            return state.apply_gradients(grads), {}

        step = accumulate(train_step, k) if k > 1 else train_step
        state = zf.init(step, zf.TrainState.create(params, zf.optim.sgd(0.1)))
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
        state, _ = step(state, x)
        return state.params

    whole, split = run(1), run(4)
    for k in whole:
        torch.testing.assert_close(split[k], whole[k], rtol=1e-6, atol=1e-7)


def test_fp16_unscales_the_accumulated_fp32_gradient_in_place():
    """The loss scaler reads accumulate's fp32 sum and unscales it where it is (no copy the size of the
    accumulator): after the update the step's gradients hold the unscaled values, exactly (the scale is a
    power of two)."""
    _, params = setup()
    seen = {}

    def recording_step(state, batch):
        _, grads = zf.value_and_grad(lambda p, b: F.cross_entropy(
            torch.zeros(len(b["y"]), 10) + p["head.bias"].float(), b["y"]))(state.params, batch)
        seen["scaled"] = {k: g.clone() for k, g in grads.items()}
        new = state.apply_gradients(grads)
        seen["after"] = grads
        return new, {}

    stacked = mixed_precision(accumulate(recording_step, 4), "fp16", initial_scale_power=4)
    state = stacked.init(zf.TrainState.create({k: v.clone() for k, v in params.items()}, zf.optim.sgd(0.1)))
    stacked(state, data())
    assert seen["after"]["head.bias"].dtype == torch.float32
    for k, scaled in seen["scaled"].items():
        torch.testing.assert_close(seen["after"][k] * 16, scaled, rtol=0, atol=0)
