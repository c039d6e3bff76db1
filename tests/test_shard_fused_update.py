"""shard's fused update: one kernel call per unit, the compute copy written in the same pass.

On this CPU machine `zfunc.optim.fused` picks the numba kernel (the tensors are on the host); on a
GPU the Triton one, through the same dispatcher."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.shard_cases import STEPS, build, local_batch, rank_and_world, reference_params, to_numpy
from zfunc.testing import run_distributed
from zfunc.transforms import mixed_precision, shard

cpu_adam = importlib.import_module("zfunc.kernels.cpu_adam")


def _fused_run(stage: int, policy: str | None, opt_kind: str):
    calls = []
    original = cpu_adam.adamw_

    def counting(*args, **kwargs):
        calls.append(kwargs.get("out_lowp") is not None)
        return original(*args, **kwargs)

    cpu_adam.adamw_ = counting
    try:
        inner, state = build(opt_kind)
        step = shard(mixed_precision(inner, policy) if policy else inner, stage=stage)
        state = step.init(state)
        rank, world = rank_and_world()
        for i in range(STEPS):
            state, _ = step(state, local_batch(i, rank, world))
    finally:
        cpu_adam.adamw_ = original
    units = len(state.extras["shard"].units)
    out = {"calls": calls, "units": units, "params": to_numpy(step.gather(state))}
    if policy:  # the compute copy is the master rounded to nearest even, bit for bit
        master = state.extras["mixed_precision"].master
        shards = state.params if stage == 3 else None
        if shards is not None:
            out["copy_exact"] = all(torch.equal(shards[k], master[k].to(shards[k].dtype)) for k in master)
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("policy", [None, "bf16"])
def test_one_launch_per_unit_and_same_result(stage, policy):
    ref = reference_params("adamw")
    for r in run_distributed(_fused_run, 2, stage, policy, "adamw"):
        # TinyLM's units each hold one weight decay run or fewer: at most one launch per unit
        assert 0 < len(r["calls"]) <= r["units"] * STEPS
        assert all(r["calls"]) == (policy is not None)
        for k, v in r["params"].items():
            tol = 1e-5 if policy is None else 5e-2
            assert abs(v - ref[k].numpy()).max() <= tol * max(1e-3, abs(ref[k].numpy()).max()), k
        if "copy_exact" in r:
            assert r["copy_exact"]


def test_clip_goes_through_the_fused_update():
    r = run_distributed(_fused_run, 2, 2, None, "clip")[0]
    ref = reference_params("clip")
    assert r["calls"]
    for k, v in r["params"].items():
        assert abs(v - ref[k].numpy()).max() <= 1e-5 * max(1e-3, abs(ref[k].numpy()).max()), k


def test_sgd_is_left_to_the_pytree_update():
    r = run_distributed(_fused_run, 1, 3, None, "sgd")[0]
    assert r["calls"] == []
