"""zfunc.io across tensor-parallel layouts: a state saved at tp2 x dp2 restores exactly into dp4 and back,
and into one process; training goes on from it as from the original."""

import pytest
import torch

import zfunc as zf
from tests.tp_cases import batch, make_step, reference
from zfunc.mesh import make_mesh
from zfunc.testing import run_distributed
from zfunc.transforms import shard
from zfunc.transforms.tensor_parallel import tensor_parallel
from zfunc.transforms.tp_plans import tp_plan


def build(dp: int, tp: int):
    """(step, fresh state, dp rank) for a tp x dp layout (dp ranks under shard stage 3; tp=1: no tensor_parallel)."""
    apply_fn, step, state = make_step("gpt2")
    if dp * tp == 1:
        return step, state, 0
    mesh = make_mesh(dp=dp, tp=tp)
    inner = tensor_parallel(step, tp_plan(apply_fn), mesh) if tp > 1 else step
    return shard(inner, stage=3, mesh=mesh), state, mesh["dp"].get_local_rank()


def train_and_save(directory: str) -> dict:
    step, state, dp_rank = build(2, 2)
    state = step.init(state)
    state, _ = step(state, batch(0, dp_rank, 2))
    zf.io.save(directory, state)
    return step.gather(state)


def restore_and_go_on(directory: str, dp: int, tp: int, save_to: str | None) -> dict:
    step, state, dp_rank = build(dp, tp)
    state = zf.init(step, state)
    state, _ = zf.io.restore(directory, like=state)
    if save_to:
        zf.io.save(save_to, state)
    restored = zf.gather(step, state)
    state, _ = step(state, batch(1, dp_rank, dp))
    return {"restored": restored, "next": zf.gather(step, state)}


@pytest.mark.slow
def test_tp2_x_dp2_to_dp4_and_back_and_to_one_process_is_exact(tmp_path):
    saved = run_distributed(train_and_save, 4, str(tmp_path / "tp2dp2"))[0]
    dp4 = run_distributed(restore_and_go_on, 4, str(tmp_path / "tp2dp2"), 4, 1, str(tmp_path / "dp4"))
    back = run_distributed(restore_and_go_on, 4, str(tmp_path / "dp4"), 2, 2, None)
    alone = [restore_and_go_on(str(tmp_path / "tp2dp2"), 1, 1, None)]  # (in this process, after the forks)
    two_steps = reference("gpt2", 2)
    from safetensors.torch import load_file

    consolidated = load_file(zf.io.consolidate(str(tmp_path / "tp2dp2"), tmp_path / "full.safetensors",
                                               progress=False))
    for key, want in saved.items():
        torch.testing.assert_close(consolidated[key], want, rtol=0, atol=0, msg=key)
    for out in [*dp4, *back, *alone]:
        for key, want in saved.items():
            torch.testing.assert_close(out["restored"][key], want, rtol=0, atol=0, msg=key)  # bit for bit
            # the optimizer state came along: the next step is the plain step's second one
            torch.testing.assert_close(out["next"][key], two_steps[key], rtol=1e-5, atol=2e-5, msg=key)
