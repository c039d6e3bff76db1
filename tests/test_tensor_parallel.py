"""tensor_parallel: tp2 and tp2 x dp2 (with shard over dp) equal the plain step element-wise for tiny
Hugging Face GPT-2 (tied embedding / head), Llama (grouped-query attention) and BERT (masked LM), with
frozen parameters and clipping by the global norm; bad plans and meshes refused before the first step."""

import pytest
import torch

from tests.tp_cases import batch, make_step, reference
from zfunc.mesh import make_mesh
from zfunc.testing import run_distributed
from zfunc.transforms import checkpoint, mixed_precision, shard
from zfunc.transforms.tensor_parallel import tensor_parallel
from zfunc.transforms.tp_plans import tp_plan

STEPS = 2


def train(kind: str, dp: int, tp: int, stage: int, opt: str = "clip", compose=None) -> dict:
    mesh = make_mesh(dp=dp, tp=tp)
    dp_rank = mesh["dp"].get_local_rank()
    apply_fn, step, state = make_step(kind, opt)
    inner = tensor_parallel(compose(step) if compose else step, tp_plan(apply_fn), mesh)
    outer = shard(inner, stage=stage, mesh=mesh) if stage else inner
    state = outer.init(state)
    local_shapes = {k: tuple(v.shape) for k, v in state.params.items()} if not stage else None
    for i in range(STEPS):
        state, metrics = outer(state, batch(i, dp_rank, dp))
    return {"params": outer.gather(state), "local_shapes": local_shapes, "loss": float(metrics["loss"])}


def check(results: list, ref: dict, atol: float = 2e-5) -> None:
    # (Adam divides by sqrt(v): a gradient element near zero summed in another order moves by ~1e-6; a wrong
    # split moves weights by the learning rate, 1e-2.)
    for rank, out in enumerate(results):
        assert set(out["params"]) == set(ref)
        for key, want in ref.items():
            torch.testing.assert_close(out["params"][key], want, rtol=1e-5, atol=atol,
                                       msg=lambda m: f"rank {rank} {key}: {m}")


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_tp2_equals_the_plain_step(kind):
    ref = reference(kind, STEPS)
    results = run_distributed(train, 2, kind, 1, 2, 0)
    check(results, ref)
    shapes = results[0]["local_shapes"]
    if kind == "gpt2":  # the tied embedding/head split over the vocabulary, c_attn's q|k|v part by part
        assert shapes["transformer.wte.weight"] == (32, 16) and "lm_head.weight" not in shapes
        assert shapes["transformer.h.0.attn.c_attn.weight"] == (16, 24)
        assert shapes["transformer.h.0.attn.c_proj.weight"] == (8, 16)
        assert shapes["transformer.h.0.ln_1.weight"] == (16,)
    if kind == "llama":  # 4 heads and 2 kv heads: 2 and 1 per rank
        assert shapes["model.layers.0.self_attn.k_proj.weight"] == (4, 16)
        assert shapes["model.layers.0.self_attn.o_proj.weight"] == (16, 8)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_tp2_x_dp2_under_shard_equals_the_plain_step(kind):
    ref = reference(kind, STEPS)
    check(run_distributed(train, 4, kind, 2, 2, 3, "clip", checkpoint), ref)


def test_tp2_x_dp2_stage2_gpt2_without_clipping():
    ref = reference("gpt2", STEPS, "adamw")
    check(run_distributed(train, 4, "gpt2", 2, 2, 2, "adamw"), ref)
