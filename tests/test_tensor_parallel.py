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


def test_a_plan_naming_no_module_is_refused_with_similar_names():
    apply_fn, _, _ = make_step("gpt2")
    with pytest.raises(ValueError, match=r"'h\.\*\.attn\.c_atn' names no module of GPT2LMHeadModel"):
        tp_plan(apply_fn, {"h.*.attn.c_atn": "colwise"})
    with pytest.raises(ValueError, match="LayerNorm; ColwiseParallel splits an nn.Linear"):
        tp_plan(apply_fn, {"h.*.ln_1": "colwise"})
    with pytest.raises(ValueError, match="matched by two patterns"):
        tp_plan(apply_fn, {"h.*.mlp.c_fc": "colwise", "transformer.h.0.mlp.c_fc": "rowwise"})
    assert len(tp_plan(apply_fn, {"h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"}).styles) == 4


def refusals() -> dict:
    mesh = make_mesh(tp=2)
    out = {}
    cases = {"kv_heads": ("llama", {"kv_heads": 1}), "heads": ("gpt2", {"heads": 1}),
             "vocab": ("gpt2", {"vocab": 63})}
    for name, (kind, kwargs) in cases.items():
        apply_fn, step, state = make_step(kind, **kwargs)
        try:
            tensor_parallel(step, tp_plan(apply_fn), mesh)
        except ValueError as err:
            out[name] = str(err)
    apply_fn, step, state = make_step("gpt2")
    tp_step = tensor_parallel(step, tp_plan(apply_fn), mesh)
    for name, make in {"mp_outside": lambda: mixed_precision(tp_step, "bf16"),
                       "checkpoint_outside": lambda: checkpoint(tp_step),
                       "shard_inside": lambda: tensor_parallel(shard(step, stage=1), tp_plan(apply_fn), mesh)}.items():
        try:
            make()
        except ValueError as err:
            out[name] = str(err)
    try:
        tensor_parallel(step, tp_plan(apply_fn), mesh)
    except ValueError as err:
        out["twice"] = str(err)
    return out


def test_bad_dimensions_and_orders_are_refused_before_the_first_step():
    for out in run_distributed(refusals, 2):
        assert "tp=2 does not divide the 1 key/value heads (num_key_value_heads)" in out["kv_heads"]
        assert "tp=2 does not divide the 1 attention heads (n_head)" in out["heads"]
        assert "tp=2 does not divide dim 0 (63) of transformer.wte.weight" in out["vocab"]
        for name in ("mp_outside", "checkpoint_outside"):
            assert "tensor_parallel must be the outer one" in out[name], out[name]
            assert "shard(offload(pipeline(tensor_parallel(" in out[name]
        assert "shard must be the outer one" in out["shard_inside"]
        assert "already prepared" in out["twice"]


@pytest.mark.slow
def test_the_full_stack_with_offload_and_mixed_precision_master_equals_the_plain_step():
    # shard(offload(tensor_parallel(checkpoint(mixed_precision(step))))): the master and the moments are cut
    # by tp and then by dp, and updated on the host. (An fp32 policy, so the comparison is exact: the same
    # code paths as bf16, without bf16's rounding of sums taken in another order.)
    from zfunc.transforms import Policy, offload

    ref = reference("llama", STEPS)

    def run():
        mesh = make_mesh(dp=2, tp=2)
        dp_rank = mesh["dp"].get_local_rank()
        apply_fn, step, state = make_step("llama")
        stacked = shard(offload(tensor_parallel(checkpoint(mixed_precision(step, Policy())), tp_plan(apply_fn),
                                                mesh)), stage=3, mesh=mesh)
        state = stacked.init(state)
        assert set(state.extras) == {"shard", "tensor_parallel", "mixed_precision"}
        for i in range(STEPS):
            state, _ = stacked(state, batch(i, dp_rank, 2))
        return {"params": stacked.gather(state), "repr": repr(stacked)}

    results = run_distributed(run, 4)
    check(results, ref)
    assert results[0]["repr"].startswith("shard(offload(tensor_parallel(checkpoint(mixed_precision(train_step")


def saving() -> str:
    import zfunc as zf

    mesh = make_mesh(tp=2)
    apply_fn, step, state = make_step("gpt2")
    tp_step = tensor_parallel(step, tp_plan(apply_fn), mesh)
    state = tp_step.init(state)
    try:
        zf.io.save("/nonexistent-zfunc-dir", state)
    except ValueError as err:
        return str(err)
    return "saved"


def test_checkpoints_of_a_tp_state_are_refused_not_saved_wrong():
    for out in run_distributed(saving, 2):
        assert "split by tensor_parallel" in out and "step.gather(state)" in out


def count_collectives(kind: str, loss_parallel: bool) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = make_mesh(tp=2)
    apply_fn, step, state = make_step(kind)
    tp_step = tensor_parallel(step, tp_plan(apply_fn, loss_parallel=loss_parallel), mesh)
    state = tp_step.init(state)
    mode = CommDebugMode()
    with mode:
        tp_step(state, batch(0))
    return {str(k): v for k, v in mode.get_comm_counts().items()}


# column-parallel modules per layer fed by the replicated residual stream (their input gradients are summed)
COLUMN_PARALLEL = {"gpt2": 2, "llama": 5, "bert": 4}


def count_all() -> dict:
    return {(kind, lp): count_collectives(kind, lp) for kind in COLUMN_PARALLEL for lp in (True, False)}


@pytest.mark.slow
def test_collectives_per_step_follow_the_documented_formula():
    layers, row_parallel = 2, 2
    for (kind, loss_parallel), counts in run_distributed(count_all, 2)[0].items():
        activations = 1 + layers * (row_parallel + COLUMN_PARALLEL[kind]) + 1  # embedding, layers, head input grad
        assert counts.get("c10d_functional.all_reduce") == activations + (3 if loss_parallel else 0), (kind, counts)
        assert counts.get("c10d_functional.all_gather_into_tensor", 0) == (0 if loss_parallel else 1), (kind, counts)
        assert counts.get("c10d.allreduce_") == 2, (kind, counts)  # zfunc's psum: the NaN-loss count, the clip norm


def planned() -> dict:
    import zfunc as zf

    mesh = make_mesh(dp=2, tp=2)
    apply_fn, step, state = make_step("llama")
    full = dict(state.params)
    plain_plan = zf.plan(shard(step, stage=3, mesh=mesh), None, None, full, measure=False)
    stacked = shard(tensor_parallel(step, tp_plan(apply_fn), mesh), stage=3, mesh=mesh)
    tp_plan_ = zf.plan(stacked, None, None, full, measure=False)
    local = stacked.init(state)
    layout = local.extras["tensor_parallel"]
    local_numel = sum(int(torch.Size(dict(layout.splits)[k].local_shape(2)).numel()) if k in dict(layout.splits)
                      else v.numel() for k, v in full.items())
    return {"plain": (plain_plan.parameters, plain_plan.world_size, plain_plan.tiers["gpu"].peak),
            "tp": (tp_plan_.parameters, tp_plan_.world_size, tp_plan_.tiers["gpu"].peak),
            "local_numel": local_numel, "full_numel": sum(v.numel() for v in full.values())}


def test_the_plan_counts_per_rank_bytes_of_tp_shards_over_dp():
    out = run_distributed(planned, 4)[0]
    assert out["plain"][0] == out["full_numel"] and out["plain"][1] == 2
    assert out["tp"][0] == out["local_numel"] < out["full_numel"] and out["tp"][1] == 2  # dp = 4 ranks / tp 2
    assert out["tp"][2] < out["plain"][2]
