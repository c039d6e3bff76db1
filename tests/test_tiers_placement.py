"""Every placement of the state (GPU / host / NVMe shares of the optimizer state, parameters on the host)
computes what the plain step computes, with clipping and fp16 loss scaling; NVMe files leave no trace."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import zfunc as zf
from tests.models import make_batch
from tests.shard_cases import build, local_batch, rank_and_world, to_numpy
from zfunc.testing import run_distributed
from zfunc.tiers.placement import Placement
from zfunc.transforms import mixed_precision, offload, shard

STEPS = 3

PLACEMENTS = {
    "host": dict(),
    "half-device": dict(device_fraction=0.5),
    "nvme": dict(optimizer="nvme"),
    "device+host+nvme": dict(device_fraction=0.3, nvme_fraction=0.4),
    "params-host": dict(params="host", device_fraction=0.3),
}


def _train(kind: str, stage: int, placement: dict, precision: str, nvme_dir: str):
    rank, world = rank_and_world()
    step, state = build(kind)
    compute = mixed_precision(step, precision) if precision != "fp32" else step
    if placement.get("params") == "host" and stage != 3:
        return None
    extra = {"nvme_dir": nvme_dir} if "nvme" in str(placement) else {}
    stacked = shard(offload(compute, **placement, **extra), stage=stage)
    state = stacked.init(state)
    skipped = []
    for i in range(STEPS):
        state, metrics = stacked(state, local_batch(i, rank, world))
        skipped.append(bool(metrics.get("skipped", False)))
    return to_numpy(stacked.gather(state)), skipped


def _reference(kind: str, precision: str):
    step, state = build(kind)
    stacked = mixed_precision(step, precision) if precision != "fp32" else step
    state = zf.init(stacked, state)
    skipped = []
    for i in range(STEPS):
        state, metrics = stacked(state, make_batch(8, seed=i))
        skipped.append(bool(metrics.get("skipped", False)))
    return to_numpy(zf.gather(stacked, state)), skipped


def _matrix(precision: str, nvme_dir: str):
    out = {}
    for stage in (1, 2, 3):
        for name, placement in PLACEMENTS.items():
            got = _train("clip", stage, placement, precision, nvme_dir)
            if got is not None:
                out[(stage, name)] = got
    return out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("precision, rtol", [("fp32", 1e-5), ("fp16", 1e-2)])
def test_every_placement_equals_the_plain_step(world, precision, rtol, tmp_path):
    ref, ref_skipped = _reference("clip", precision)
    for per_rank in run_distributed(_matrix, world, precision, str(tmp_path)):
        for (stage, name), (params, skipped) in per_rank.items():
            assert skipped == ref_skipped, (stage, name)
            for k in ref:
                scale = np.abs(ref[k]).max() + 1e-12
                err = np.abs(params[k] - ref[k]).max() / scale
                assert err < rtol, f"{precision} stage {stage} {name} {k}: {err:.2e}"
    # The NVMe tier's files are unlinked as soon as they are mapped: nothing is left in the directory.
    leftovers = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files]
    assert leftovers == [], leftovers


def test_units_fill_the_tiers_in_order():
    units = [(f"u{i}", 100) for i in range(10)]
    p = Placement(units, (0.3, 0.3, 0.4), torch.device("cpu"))
    assert [p.tiers[f"u{i}"] for i in range(10)] == ["device"] * 3 + ["host"] * 3 + ["nvme"] * 4
    p = Placement(units, (0.0, 1.0, 0.0), torch.device("cpu"))
    assert set(p.tiers.values()) == {"host"}
    p = Placement(units, (1.0, 0.0, 0.0), torch.device("cpu"))
    assert set(p.tiers.values()) == {"device"}


def test_nvme_state_lives_in_mapped_files(tmp_path):
    step, state = build()
    stacked = shard(offload(step, optimizer="nvme", nvme_dir=str(tmp_path)), stage=3)
    state = stacked.init(state)
    mu = state.opt_state[0].mu
    # A file-backed tensor: its storage is a shared mapping, not the heap (torch reports it via filename).
    storages = {t.untyped_storage().data_ptr() for t in mu.values() if t.numel()}
    assert storages and all(t.device.type == "cpu" for t in mu.values())
    state, _ = stacked(state, make_batch(8))
    assert int(state.step) == 1


def test_placement_arguments_are_checked():
    step, _ = build()
    with pytest.raises(ValueError, match="nvme_dir"):
        offload(step, optimizer="nvme")
    with pytest.raises(ValueError, match="exceed 1"):
        offload(step, device_fraction=0.7, nvme_fraction=0.5, nvme_dir="/tmp")
    with pytest.raises(ValueError, match="needs shard"):
        shard(offload(step, params="host"), stage=2)
    with pytest.raises(ValueError, match="needs shard"):
        offload(step, device_fraction=0.5).stack  # noqa: B018
    with pytest.raises(ValueError, match="number in \\[0, 1\\]"):
        offload(step, device_fraction=1.5)
    with pytest.raises(ValueError, match="params must be"):
        offload(step, params="nvme")
