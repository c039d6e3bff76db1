"""accumulate (k > 1) under every stack equals the plain step, element-wise: the fp32 accumulator fed unit by
unit (shard stages 2/3), on the tier of each unit's optimizer state (GPU share, host, NVMe), or as one buffer
(plain, stage 1, offload without shard), with checkpoint and with fp16 loss scaling. The model (TinyLM) has
uneven sizes, a frozen parameter and tied weights."""

from __future__ import annotations

import numpy as np
import pytest

import zfunc as zf
from tests.models import make_batch
from tests.shard_cases import build, local_batch, rank_and_world, to_numpy
from zfunc.testing import run_distributed
from zfunc.transforms import accumulate, checkpoint, mixed_precision, offload, shard

STEPS = 3
K = 2


def stacks(nvme_dir: str) -> dict:
    return {
        "plain": lambda s: s,
        "checkpoint": lambda s: checkpoint(s),
        "offload": lambda s: offload(s),
        "shard1": lambda s: shard(s, stage=1),
        "shard2+offload": lambda s: shard(offload(s), stage=2),
        "shard3": lambda s: shard(s, stage=3),
        "shard3+checkpoint": lambda s: shard(checkpoint(s), stage=3),
        "shard3+nvme": lambda s: shard(offload(s, optimizer="nvme", nvme_dir=nvme_dir), stage=3),
        "shard2+device+host+nvme": lambda s: shard(offload(s, device_fraction=0.3, nvme_fraction=0.4,
                                                          nvme_dir=nvme_dir), stage=2),
        "shard3+params-host": lambda s: shard(offload(s, params="host", device_fraction=0.3), stage=3),
    }


def compute(step, precision: str, k: int):
    step = accumulate(step, k) if k > 1 else step
    return step if precision == "fp32" else mixed_precision(step, precision)


def train(wrap, precision: str, k: int, rank: int = 0, world: int = 1):
    step, state = build("clip")
    stacked = wrap(compute(step, precision, k))
    state = zf.init(stacked, state)
    skipped = []
    for i in range(STEPS):
        batch = local_batch(i, rank, world) if world > 1 else make_batch(8, seed=i)
        state, metrics = stacked(state, batch)
        skipped.append(bool(metrics.get("skipped", False)))
    return to_numpy(zf.gather(stacked, state)), skipped


def every_stack(precision: str, nvme_dir: str) -> dict:
    rank, world = rank_and_world()
    return {name: train(wrap, precision, K, rank, world) for name, wrap in stacks(nvme_dir).items()
            if world == 1 or name.startswith("shard")}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("precision, rtol", [("fp32", 1e-5), ("fp16", 1e-2)])
def test_accumulate_under_every_stack_equals_the_plain_step(world, precision, rtol, tmp_path):
    # fp32: against the plain step on the whole batch. fp16: against mixed_precision(accumulate) without
    # shard or offload (the same micro-batches, so the same loss-scale decisions).
    ref, ref_skipped = train(lambda s: s, precision, 1 if precision == "fp32" else K)
    for per_rank in run_distributed(every_stack, world, precision, str(tmp_path)):
        assert per_rank
        for name, (params, skipped) in per_rank.items():
            assert skipped == ref_skipped, (name, skipped, ref_skipped)
            for key in ref:
                scale = np.abs(ref[key]).max() + 1e-12
                err = np.abs(params[key] - ref[key]).max() / scale
                assert err < rtol, f"{precision} world {world} {name} {key}: {err:.2e}"
