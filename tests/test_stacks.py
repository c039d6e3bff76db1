"""Whole stacks: mixed_precision and checkpoint under shard and offload, world sizes 1 and 2.

Each stack must train like the same compute transforms without shard/offload
on the concatenated batch. fp32 compute must agree to fp32 rounding; bf16 and
fp16 compute are compared with the unsharded step of the same precision
(reductions in another order round differently in low precision, so the bound
is looser, and the fp16 skip decisions must be identical).
"""

import numpy as np
import pytest
import torch

from tests import shard_cases
from tests.models import make_batch
from tests.shard_cases import rank_and_world, to_numpy
from zfunc.testing import run_distributed
from zfunc.transforms import checkpoint, mixed_precision, offload, shard

STEPS = 3


def build(dropout: float = 0.1):
    return shard_cases.build("clip+schedule", dropout)


def compute(step, precision):
    step = checkpoint(step)
    return step if precision == "fp32" else mixed_precision(step, precision)


def run(wrap, precision, rank=0, world=1, dropout=0.1):
    step, state = build(dropout)
    stacked = wrap(compute(step, precision))
    state = stacked.init(state)
    skipped = []
    for i in range(STEPS):
        torch.manual_seed(100 + i)
        batch = {k: v.chunk(world)[rank] for k, v in make_batch(8, seed=i).items()}
        state, metrics = stacked(state, batch)
        skipped.append(bool(metrics.get("skipped", False)))
    return to_numpy(stacked.gather(state)), skipped


STACKS = {
    "shard1": lambda s: shard(s, stage=1),
    "shard2+offload": lambda s: shard(offload(s), stage=2),
    "shard3": lambda s: shard(s, stage=3),
    "shard3+offload": lambda s: shard(offload(s), stage=3),
}


def stacks_on_ranks(precision, dropout):
    rank, world = rank_and_world()
    return {name: run(wrap, precision, rank, world, dropout) for name, wrap in STACKS.items()}


@pytest.mark.parametrize("precision, rtol", [("fp32", 1e-5), ("bf16", 5e-2), ("fp16", 1e-2)])
@pytest.mark.parametrize("world", [1, 2])
def test_stacks_train_like_the_unsharded_compute_transforms(world, precision, rtol):
    # Dropout masks are drawn per rank over its own rows, so they match the
    # full batch's only on one rank: dropout is on at world 1, off at world 2.
    dropout = 0.1 if world == 1 else 0.0
    ref, ref_skipped = run(lambda s: s, precision, dropout=dropout)
    for rank_results in run_distributed(stacks_on_ranks, world, precision, dropout):
        for name, (params, skipped) in rank_results.items():
            assert skipped == ref_skipped, (name, skipped, ref_skipped)
            for key in ref:
                scale = np.abs(ref[key]).max() + 1e-12
                err = np.abs(params[key] - ref[key]).max() / scale
                assert err < rtol, f"{precision} world {world} {name} {key}: {err:.2e}"


def test_offload_under_shard_keeps_master_and_moments_on_host_shards():
    step, state = build()
    stacked = shard(offload(mixed_precision(step, "bf16")), stage=3)
    state = stacked.init(state)
    master = state.extras["mixed_precision"].master
    assert all(t.dtype == torch.float32 and t.dim() == 1 for t in master.values())
    assert all(t.dtype == torch.bfloat16 and t.dim() == 1 for t in state.params.values())


def reduce_in_fp32():
    import zfunc.dist as zdist
    from zfunc.transforms import Policy

    rank, world = rank_and_world()
    seen = []
    original = zdist.dist.all_reduce  # gloo: gradients are reduced by an all-reduce (see Comm.reduce_scatter)

    def spy(tensor, *args, **kwargs):
        if tensor.numel() > 1:  # not a psum of a norm or an overflow count
            seen.append(tensor.dtype)
        return original(tensor, *args, **kwargs)

    zdist.dist.all_reduce = spy
    try:
        out = {}
        for stage in (1, 2, 3):
            step, state = build(0.0)
            policy = Policy("fp32", "bf16", "fp32", "fp32")
            stacked = shard(mixed_precision(step, policy), stage=stage)
            state = stacked.init(state)
            for i in range(STEPS):
                batch = {k: v.chunk(world)[rank] for k, v in make_batch(8, seed=i).items()}
                state, _ = stacked(state, batch)
            out[stage] = to_numpy(stacked.gather(state))
    finally:
        zdist.dist.all_reduce = original
    return out, sorted({str(d) for d in seen})


def test_gradients_are_reduced_in_the_policys_reduce_dtype():
    ref, _ = run(lambda s: s, "bf16", dropout=0.0)
    for per_stage, dtypes in run_distributed(reduce_in_fp32, 2):
        assert dtypes == ["torch.float32"]  # bf16 gradients, reduced in fp32
        for stage, params in per_stage.items():
            for key in ref:
                err = np.abs(params[key] - ref[key]).max() / (np.abs(ref[key]).max() + 1e-12)
                assert err < 5e-2, (stage, key, err)
