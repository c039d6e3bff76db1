"""pipeline composed with what it used to refuse: shard stages 2 and 3 around it on a (dp, pp) mesh, accumulate
and fp16 loss scaling inside it; and its schedules kept per state, not on the transform. Element-wise against
the plain step (fp32), as tests/test_pipeline.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import zfunc as zf
from tests.test_pipeline import STEPS, UnevenMLP, assert_equivalent, build, hf_config, pipelined, plain
from zfunc.mesh import make_mesh
from zfunc.testing import run_distributed
from zfunc.transforms import accumulate, checkpoint, mixed_precision, pipeline, shard


def pipelined_sharded(model: str, stage: int, opt: str = "clip", micro_batches: int = 2, wrap=None,
                      schedule: str = "1F1B") -> dict:
    """pp2 x dp2 under shard(stage): each dp rank gets its half of the batch."""
    step, state, batch_of = build(model, opt)
    mesh = make_mesh(dp=2, pp=2)
    inner = wrap(step) if wrap is not None else step
    stacked = shard(pipeline(inner, schedule=schedule, micro_batches=micro_batches, mesh=mesh), stage=stage,
                    mesh=mesh)
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
    padded = sum(u.padded for u in state.extras["shard"].units)  # the stage's parameters, padded over dp
    return {"params": {k: v.numpy().copy() for k, v in full.items()}, "losses": losses, "shapes": shapes,
            "comm": comm, "padded": padded}


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(model: str, opt: str = "clip", micro_batches: int = 4) -> dict:
        if (model, opt, micro_batches) not in cache:
            cache[model, opt, micro_batches] = run_distributed(plain, 1, model, opt, micro_batches)[0]
        return cache[model, opt, micro_batches]
    return get


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("model", ["gpt2", pytest.param("llama-tied", marks=pytest.mark.slow)])
def test_shard_stage_2_and_3_around_pp2_x_dp2_equal_the_plain_step(model, stage, reference):
    # GPT-2: tied wte across the stages, clipping by the global norm; Llama: grouped-query attention, tied head.
    outs = run_distributed(pipelined_sharded, 4, model, stage)
    assert_equivalent(outs, reference(model), dp=2)
    # Each dp rank's loss is its half batch's (as under shard alone): their mean is the whole batch's. (Ranks 0
    # and 2 are the dp pair of pipeline rank 0: the mesh is (dp, pp).)
    np.testing.assert_allclose(np.mean([outs[0]["losses"], outs[2]["losses"]], axis=0), reference(model)["losses"],
                               rtol=1e-5)
    for out in outs:  # per step 2 Ψ_s over dp (stage 2: reduce + all-gather; 3: all-gather + reduce), + psums
        assert all(2 * out["padded"] <= c <= 2 * out["padded"] + 8 for c in out["comm"]), (out["comm"], out["padded"])
    if stage == 3:  # between steps each rank holds its 1-D shards only
        assert all(len(s) == 1 for s in outs[0]["shapes"].values())
    else:
        assert any(len(s) == 2 for s in outs[0]["shapes"].values())


def test_shard_stage_3_around_pipeline_with_frozen_params_and_checkpoint(reference):
    # The uneven MLP: blocks of very different sizes (padding over dp), a frozen weight, a block without bias.
    wrap = lambda step: checkpoint(mixed_precision(step, "fp32"))  # noqa: E731
    outs = run_distributed(pipelined_sharded, 4, "uneven", 3, "clip", 2, wrap)
    assert_equivalent(outs, reference("uneven"), dp=2)


@pytest.mark.parametrize(("schedule", "stage"), [("interleaved", 3), ("zero_bubble", 2)])
def test_shard_around_two_stages_per_rank(schedule, stage, reference):
    # Two pipeline stages per rank: shard's units span both (gathered and reduced together, once per schedule);
    # zero bubble computes the weights' gradients apart from the inputs'.
    outs = run_distributed(pipelined_sharded, 4, "tiny", stage, "clip", 4, None, schedule)
    assert_equivalent(outs, reference("tiny", "clip", 8), dp=2)


def test_bf16_under_stage_3_around_pipeline_is_stage_1_bit_for_bit():
    # mixed_precision("bf16") inside (the fp32 master partitioned over dp, the bf16 compute copy gathered for
    # the schedule): the same gradients, reduced in the same dtype, as stage 1 (tested against the plain step).
    wrap = lambda step: mixed_precision(step, "bf16")  # noqa: E731
    one = run_distributed(pipelined_sharded, 4, "tiny", 1, "clip", 2, wrap)
    three = run_distributed(pipelined_sharded, 4, "tiny", 3, "clip", 2, wrap)
    for a, b in zip(one, three):
        for key, want in a["params"].items():
            np.testing.assert_array_equal(b["params"][key], want, err_msg=key)


# -- accumulate inside pipeline ---------------------------------------------------------------------------------
def test_accumulate_inside_pipeline_runs_k_schedules_per_update(reference):
    # k = 2 schedules of M = 2 micro-batches each: the mean over the 4 micro-batches, summed in accumulate's fp32.
    wrap = lambda step: accumulate(step, 2)  # noqa: E731
    outs = run_distributed(pipelined, 2, "tiny", "1F1B", 2, "adamw", 1, 2, wrap)
    assert_equivalent(outs, reference("tiny", "adamw", 4))
    # Counters add over the k schedules: 2 x 2 activations sent from stage 0.
    assert outs[0]["counters"]["pp_activations_sent"] == 4


def test_accumulate_inside_pipeline_under_shard_stage_3_sums_the_reduced_shards(reference):
    # Each schedule's unit gradients are reduce-scattered over dp into accumulate's fp32 accumulator (its sink).
    wrap = lambda step: accumulate(step, 2)  # noqa: E731
    outs = run_distributed(pipelined_sharded, 4, "uneven", 3, "clip", 2, wrap)
    assert_equivalent(outs, reference("uneven", "clip", 8), dp=2)


# -- fp16 loss scaling inside pipeline ------------------------------------------------------------------------------
class InfGrad(torch.autograd.Function):
    """The identity, whose gradient is inf: overflows the gradient of the one parameter it is applied to."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g + float("inf")


def step_of(loss_fn):
    """The train step of ``loss_fn``: its gradients, one update."""
    def train_step(state, batch):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    return train_step


def mlp_batch(i: int) -> dict:
    """Batch ``i`` of 8 rows for `UnevenMLP`."""
    g = torch.Generator().manual_seed(i)
    return {"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 3, generator=g)}


def fp16_run(pp: int) -> dict:
    """fp16 with dynamic loss scaling, 3 steps; at the first, the head's gradient (the last stage's only)
    overflows."""
    torch.manual_seed(0)
    net = UnevenMLP()
    apply_fn, params = zf.functional(net)
    poison = [True]

    def loss_fn(p, batch):
        if poison[0]:  # (on stage 0, p["head.weight"] is an empty stand-in: the overflow is the last stage's)
            p = {**p, "head.weight": InfGrad.apply(p["head.weight"])}
        return F.mse_loss(apply_fn(p, batch["x"]), batch["y"])

    train_step, batch_of = step_of(loss_fn), mlp_batch

    state = zf.TrainState.create({k: v.clone() for k, v in params.items()}, zf.optim.sgd(0.1, momentum=0.9))
    if pp == 1:
        step = mixed_precision(accumulate(train_step, 2), "fp16", initial_scale_power=8, hysteresis=1)
    else:
        step = pipeline(mixed_precision(train_step, "fp16", initial_scale_power=8, hysteresis=1), micro_batches=2)
    state = step.init(state)
    before = step.gather(state)
    out = {"skipped": [], "scale": [], "losses": []}
    for i in range(3):
        state, metrics = step(state, batch_of(i))
        poison[0] = False
        out["skipped"].append(bool(metrics["skipped"]))
        out["scale"].append(float(metrics["loss_scale"]))
        out["losses"].append(float(metrics["loss"]))
        if i == 0:
            out["unchanged"] = all(torch.equal(v, before[k]) for k, v in step.gather(state).items())
    out["params"] = {k: v.numpy().copy() for k, v in step.gather(state).items()}
    return out


def test_fp16_loss_scaling_inside_pipeline_skips_an_overflow_on_every_stage():
    ref = run_distributed(fp16_run, 1, 1)[0]
    outs = run_distributed(fp16_run, 2, 2)
    assert ref["skipped"] == [True, False, False] and ref["scale"] == [128.0, 128.0, 128.0]
    for rank, out in enumerate(outs):
        # The overflow was in the last stage's gradient only; the first stage skipped too (psum over pp), and
        # nothing moved anywhere.
        assert out["skipped"] == ref["skipped"] and out["scale"] == ref["scale"], rank
        assert out["unchanged"], rank
        # The loss is unscaled from the broadcast scaled mean: exactly while the weights are the same (the first
        # two steps: the first was skipped).
        np.testing.assert_allclose(out["losses"][:2], ref["losses"][:2], rtol=1e-7)
        np.testing.assert_allclose(out["losses"], ref["losses"], rtol=1e-4)
        for key, want in ref["params"].items():
            # (fp16 compute: torch's schedule sums the micro-batches' fp16 gradients in fp16, accumulate in fp32)
            np.testing.assert_allclose(out["params"][key], want, rtol=1e-3, atol=1e-4, err_msg=f"rank {rank} {key}")


# -- the built schedules: structure per state, never shared by two running steps ---------------------------------
def two_threads() -> dict:
    torch.manual_seed(0)
    net = UnevenMLP()
    apply_fn, params = zf.functional(net)
    meet = {"barrier": None}

    def loss_fn(p, batch):
        if meet["barrier"] is not None:  # both threads inside a schedule at once, forward by forward
            meet["barrier"].wait(timeout=30)
        return F.mse_loss(apply_fn(p, batch["x"]), batch["y"])

    train_step, batch_of = step_of(loss_fn), mlp_batch

    stacked = pipeline(train_step, micro_batches=2)
    fresh = lambda: stacked.init(zf.TrainState.create({k: v.clone() for k, v in params.items()},  # noqa: E731
                                                      zf.optim.adamw(1e-2)))

    def train(state, seed: int, out: dict, key: str) -> None:
        try:
            for i in range(3):
                state, _ = stacked(state, batch_of(seed + i))
            out[key] = {k: v.numpy().copy() for k, v in stacked.gather(state).items()}
            out[key + "_state"] = state
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            out[key] = err

    serial: dict = {}
    train(fresh(), 0, serial, "a")
    train(fresh(), 10, serial, "b")
    parallel: dict = {}
    meet["barrier"] = threading.Barrier(2)
    threads = [threading.Thread(target=train, args=(fresh(), seed, parallel, key))
               for seed, key in ((0, "a"), (10, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    meet["barrier"] = None
    for key in ("a", "b"):
        if isinstance(parallel[key], BaseException):
            raise parallel[key]
    layouts = [parallel["a_state"].extras["pipeline"], parallel["b_state"].extras["pipeline"]]
    copied = __import__("copy").deepcopy(parallel["a_state"])
    stacked(copied, batch_of(20))  # a copy of a state builds its own schedules at its first step
    return {"serial": {k: serial[k] for k in "ab"}, "parallel": {k: parallel[k] for k in "ab"},
            "caches": [id(vars(layout)["_built_schedules"]) if "_built_schedules" in vars(layout) else None
                       for layout in layouts],
            "copy_cache": "_built_schedules" in vars(copied.extras["pipeline"]) and
            vars(copied.extras["pipeline"])["_built_schedules"] is not vars(layouts[0])["_built_schedules"],
            "transform": sorted(vars(stacked))}


def test_two_states_in_two_threads_build_their_own_schedules():
    out = run_distributed(two_threads, 1)[0]
    for key in ("a", "b"):
        for name, want in out["serial"][key].items():
            np.testing.assert_array_equal(out["parallel"][key][name], want, err_msg=f"{key} {name}")
    assert None not in out["caches"] and out["caches"][0] != out["caches"][1]
    assert out["copy_cache"]
    # The transform holds its configuration only.
    assert out["transform"] == sorted(["step", "mesh", "group", "timeout", "schedule", "micro_batches", "stages",
                                       "stack"])


# -- what still cannot work ----------------------------------------------------------------------------------------
def bad_compositions() -> dict:
    step, state, batch_of = build("tiny")
    out = {}
    mesh = make_mesh(dp=2, pp=2)
    try:
        shard(pipeline(step, mesh=mesh), stage=3, reshard="recompute", mesh=mesh)
    except ValueError as err:
        out["recompute"] = str(err)
    stacked = pipeline(accumulate(step, 2), micro_batches=3, mesh=mesh)
    try:
        stacked(stacked.init(state), {k: v[:6] for k, v in batch_of(0).items()})  # 6 = 2 x 3 rows, split 2 x 3
        out["six"] = "ran"
        stacked = pipeline(accumulate(step, 2), micro_batches=3, mesh=mesh)
        stacked(stacked.init(build("tiny")[1]), batch_of(0))  # 8 rows: accumulate's 4 do not split in 3
    except ValueError as err:
        out["batch"] = str(err)
    # (here for the cost of one world of 4: the plan of stages 2 and 3 around a pipeline)
    _, params = zf.functional(hf_config("gpt2")[0](hf_config("gpt2")[1]))
    step = build("gpt2")[0]
    for stage in (2, 3):
        stacked = shard(pipeline(step, micro_batches=2, mesh=mesh), stage=stage, mesh=mesh)
        p = zf.plan(stacked, lambda p, b: None, batch_of(0), params, measure=False, pp_rank=1, baseline=0)
        out[f"plan{stage}"] = (p.parameters, p.tiers["gpu"].params, p.tiers["gpu"].buffers)
    out["wte"] = params["transformer.wte.weight"].numel()
    return out


def test_what_cannot_work_is_refused_clearly():
    for out in run_distributed(bad_compositions, 4):
        assert "reshard='recompute'" in out["recompute"] and "checkpoint(...) inside the pipeline" in out["recompute"]
        assert out["six"] == "ran"
        assert "one of accumulate's 2 slices of the batch" in out["batch"]
        assert "make the batch size a multiple of 6" in out["batch"]
        # The last stage's parameters (psi, fp32): stage 2 keeps them whole; stage 3 keeps half (dp2) between
        # steps and holds them whole, with their full gradient, during the schedule; both borrow wte.
        psi, params2, buffers2 = out["plan2"]
        assert out["plan3"][0] == psi
        assert params2 >= psi * 4 and out["plan3"][1] == pytest.approx(psi * 4 / 2, rel=0.01)
        assert buffers2 >= psi * 4 + 2 * out["wte"] * 4
        assert out["plan3"][2] >= params2 + buffers2


# -- no host reads --------------------------------------------------------------------------------------------------
def steady_state_reads() -> dict:
    from tests.test_host_reads import HostReads

    mesh = make_mesh(dp=2, pp=2)
    step, state, batch_of = build("tiny", "clip")
    step = shard(pipeline(mixed_precision(step, "fp16"), micro_batches=2, mesh=mesh), stage=3, mesh=mesh)
    state = step.init(state)
    rank = mesh["dp"].get_local_rank()
    recorder = HostReads()
    for i in range(4):  # two steps to warm up (torch's shape inference), two counted
        batch = {k: v.chunk(2)[rank] for k, v in batch_of(i).items()}
        if i < 2:
            state, _ = step(state, batch)
            continue
        with recorder:
            state, _ = step(state, batch)
    return dict(recorder.reads)


def test_fp16_under_stage_3_around_pipeline_reads_nothing_on_the_host():
    # The fp16 loss comes back unscaled from the broadcast loss (no aux: that is a pickled broadcast, a host read);
    # the overflow check and the skip stay on the device; shard's gathers and reductions read nothing. Left out:
    # the stage module reading the micro-batch's index, a CPU tensor the schedule hands it (no device sync).
    for rank, reads in enumerate(run_distributed(steady_state_reads, 4)):
        device = {r: n for r, n in reads.items() if not r.startswith("_local_scalar_dense at transforms/"
                                                                      "pipeline_stage.py")}
        assert not device, f"rank {rank}: host reads in steady-state steps: {device}"
