"""zfunc.mesh: make_mesh over the world, and shard partitioning over the mesh's "dp" dimension."""

import numpy as np
import pytest
import torch.distributed as dist

from tests.shard_cases import STEPS, build, local_batch, reference_params, to_numpy
from zfunc.mesh import make_mesh
from zfunc.testing import run_distributed
from zfunc.transforms import shard


def mesh_coordinates() -> dict:
    mesh = make_mesh(dp=2, tp=2)
    out = {"names": mesh.mesh_dim_names, "shape": tuple(mesh.shape),
           "dp_group": dist.get_process_group_ranks(mesh["dp"].get_group()),
           "tp_group": dist.get_process_group_ranks(mesh["tp"].get_group())}
    for bad in ({"dp": 3}, {"dp": 2, "tp": 3}, {"tp": 0}):
        try:
            make_mesh(**bad)
        except ValueError as err:
            out[str(bad)] = str(err)
    return out


def test_make_mesh_lays_ranks_out_dp_pp_tp_and_refuses_wrong_sizes():
    for rank, out in enumerate(run_distributed(mesh_coordinates, 4)):
        assert out["names"] == ("dp", "pp", "tp") and out["shape"] == (2, 1, 2)
        assert out["tp_group"] == [rank - rank % 2, rank - rank % 2 + 1]  # tp innermost: neighbours
        assert out["dp_group"] == [rank % 2, rank % 2 + 2]
        assert "the mesh has 3 ranks but the world has 4" in out["{'dp': 3}"]
        assert "make_mesh(dp=4, pp=1, tp=1)" in out["{'dp': 3}"]
        assert "the mesh has 6 ranks" in out["{'dp': 2, 'tp': 3}"]
        assert "tp must be a positive int" in out["{'tp': 0}"]


def shard_over_dp(stage: int, dp: int, tp: int) -> dict:
    mesh = make_mesh(dp=dp, tp=tp)
    dp_rank = mesh["dp"].get_local_rank()
    step, state = build()
    sharded = shard(step, stage=stage, mesh=mesh)
    state = sharded.init(state)
    assert state.extras["shard"].world_size == dp and state.extras["shard"].rank == dp_rank
    for i in range(STEPS):
        state, metrics = sharded(state, local_batch(i, dp_rank, dp))
    return {"params": to_numpy(sharded.gather(state)), "repr": repr(sharded)}


@pytest.mark.parametrize("stage,dp,tp", [(3, 4, 1), (2, 2, 2)])
def test_shard_on_a_mesh_partitions_over_dp_and_equals_the_plain_step(stage, dp, tp):
    # With tp=2 and no tensor_parallel, each tp rank runs its own dp group of 2 over the same batches:
    # both groups must equal the plain step (the collectives ran on the dp groups, not the world).
    ref = to_numpy(reference_params())
    for rank, out in enumerate(run_distributed(shard_over_dp, 4, stage, dp, tp)):
        assert out["repr"] == f"shard(train_step, stage={stage}, mesh='dp{dp}xpp1xtp{tp}')"
        for key in ref:
            np.testing.assert_allclose(out["params"][key], ref[key], rtol=1e-5, atol=1e-6,
                                       err_msg=f"rank {rank} {key}")


def test_shard_refuses_mesh_and_group_together():
    step, _ = build()
    with pytest.raises(TypeError, match="DeviceMesh"):
        shard(step, stage=1, mesh="dp")
