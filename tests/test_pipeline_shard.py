"""pipeline composed with what it used to refuse: shard stages 2 and 3 around it on a (dp, pp) mesh, accumulate
and fp16 loss scaling inside it; and its schedules kept per state, not on the transform. Element-wise against
the plain step (fp32), as tests/test_pipeline.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tests.test_pipeline import BATCH, STEPS, assert_equivalent, build, plain
from zfunc.mesh import make_mesh
from zfunc.testing import run_distributed
from zfunc.transforms import accumulate, checkpoint, mixed_precision, pipeline, shard


def pipelined_sharded(model: str, stage: int, opt: str = "clip", micro_batches: int = 2, wrap=None) -> dict:
    """pp2 x dp2 under shard(stage): each dp rank gets its half of the batch."""
    step, state, batch_of = build(model, opt)
    mesh = make_mesh(dp=2, pp=2)
    inner = wrap(step) if wrap is not None else step
    stacked = shard(pipeline(inner, micro_batches=micro_batches, mesh=mesh), stage=stage, mesh=mesh)
    state = stacked.init(state)
    dp_rank = mesh["dp"].get_local_rank()
    losses, comm = [], []
    for i in range(STEPS):
        batch = {k: v.chunk(2)[dp_rank] for k, v in batch_of(i).items()}
        state, metrics = stacked(state, batch)
        losses.append(float(metrics["loss"]))
        comm.append(int(metrics["comm_elements"]))
    full = stacked.gather(state)
    shapes = {k: tuple(v.shape) for k, v in state.params.items()}
    return {"params": {k: v.numpy().copy() for k, v in full.items()}, "losses": losses, "shapes": shapes,
            "comm": comm}


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(model: str, opt: str = "clip", micro_batches: int = 4) -> dict:
        if (model, opt, micro_batches) not in cache:
            cache[model, opt, micro_batches] = run_distributed(plain, 1, model, opt, micro_batches)[0]
        return cache[model, opt, micro_batches]
    return get


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("model", ["gpt2", "llama-tied"])
def test_shard_stage_2_and_3_around_pp2_x_dp2_equal_the_plain_step(model, stage, reference):
    # GPT-2: tied wte across the stages, clipping by the global norm; Llama: grouped-query attention, tied head.
    outs = run_distributed(pipelined_sharded, 4, model, stage)
    assert_equivalent(outs, reference(model), dp=2)
    # Each dp rank's loss is its half batch's (as under shard alone): their mean is the whole batch's. (Ranks 0
    # and 2 are the dp pair of pipeline rank 0: the mesh is (dp, pp).)
    np.testing.assert_allclose(np.mean([outs[0]["losses"], outs[2]["losses"]], axis=0), reference(model)["losses"],
                               rtol=1e-5)
    if stage == 3:  # between steps each rank holds its 1-D shards only
        assert all(len(s) == 1 for s in outs[0]["shapes"].values())
    else:
        assert any(len(s) == 2 for s in outs[0]["shapes"].values())


def test_shard_stage_3_around_pipeline_with_frozen_params_and_checkpoint(reference):
    # The uneven MLP: blocks of very different sizes (padding over dp), a frozen weight, a block without bias.
    wrap = lambda step: checkpoint(mixed_precision(step, "fp32"))  # noqa: E731
    outs = run_distributed(pipelined_sharded, 4, "uneven", 3, "clip", 2, wrap)
    assert_equivalent(outs, reference("uneven"), dp=2)
