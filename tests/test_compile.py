"""torch.compile(step, fullgraph=True) of whole transformed steps, against the eager step.

Each case runs the same stack eagerly and compiled from the same state on the same
batches and compares the gathered parameters element-wise after a few steps. The
compiled step uses the pure optimizer update (the eager one a fused kernel, exact to
the ulp) and functional collectives, so the comparison allows a few ulps. Backends:
"aot_eager" (dynamo and AOTAutograd, no code generation) keeps this file fast on a
2-core box; one slow case runs Inductor. Recompiles are counted with dynamo's
counters and refused with ``error_on_recompile``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import zfunc as zf
from tests.models import make_batch
from tests.shard_cases import build, local_batch, rank_and_world
from zfunc.transforms import accumulate, checkpoint, mixed_precision, offload, shard

STEPS = 3

STACKS = {
    "s1": lambda s: shard(mixed_precision(s, "bf16"), stage=1),
    "s2_offload_accumulate": lambda s: shard(offload(accumulate(mixed_precision(s, "bf16"), 2)), stage=2),
    "s3_checkpoint": lambda s: shard(checkpoint(mixed_precision(s, "bf16")), stage=3),
}


def _gathered(step, state) -> dict:
    return {k: v.float().clone() for k, v in step.gather(state).items()}


def eager_and_compiled(make, backend: str = "aot_eager", steps: int = STEPS, batch=None) -> dict:
    """Run ``make(plain_step)`` eagerly and compiled (fullgraph) on this rank; both final params,
    the compiled metrics, the number of graphs compiled and of recompiles."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    rank, world = rank_and_world()
    batch = batch or (lambda i: local_batch(i, rank, world))
    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        plain, state = build()
        step = make(plain)
        state = step.init(state)
        run = torch.compile(step, fullgraph=True, backend=backend) if compiled else step
        with torch._dynamo.config.patch(error_on_recompile=compiled):
            for i in range(steps):
                state, metrics = run(state, batch(i))
        out["compiled" if compiled else "eager"] = _gathered(step, state)
        out["metrics_compiled" if compiled else "metrics_eager"] = {k: float(v) for k, v in metrics.items()}
    out["graphs"] = counters["stats"]["unique_graphs"]
    out["recompiles"] = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
    return out


def check(result: dict, rtol: float = 1e-6, atol: float = 1e-6, metrics_rel: float = 1e-6) -> None:
    eager, compiled = result["eager"], result["compiled"]
    assert eager.keys() == compiled.keys()
    for key in eager:
        torch.testing.assert_close(compiled[key], eager[key], rtol=rtol, atol=atol, msg=key)
    assert result["graphs"] == 1 and result["recompiles"] == 0, result
    for name in ("loss", "loss_scale", "skipped"):
        if name in result["metrics_eager"]:
            assert result["metrics_compiled"][name] == pytest.approx(result["metrics_eager"][name], rel=metrics_rel)


@pytest.mark.slow  # compiles (10-75 s each on 2 cores; the file: ~4 min)
def test_compute_stack_world_1(dist):
    """accumulate(checkpoint(mixed_precision)) on one rank: one graph, equal to eager."""
    make = lambda s: accumulate(checkpoint(mixed_precision(s, "bf16")), 2)  # noqa: E731
    check(dist(eager_and_compiled, 1, make, timeout=600)[0])


@pytest.mark.slow  # compiles (10-75 s each on 2 cores; the file: ~4 min)
@pytest.mark.parametrize("name", list(STACKS))
def test_shard_world_2(dist, name):
    """shard stages 1-3 (with mixed precision, checkpoint, accumulate, offload) on 2 gloo ranks."""
    results = dist(eager_and_compiled, 2, STACKS[name], timeout=900)
    for result in results:
        check(result)


# Stages 1/2 at one rank: with the compute copy of mixed precision written into the parameters, without it (the
# update writes the parameters themselves), and around accumulate and offload.
WORLD_1 = {
    "bf16": lambda stage: lambda s: shard(mixed_precision(s, "bf16"), stage=stage),
    "fp32": lambda stage: lambda s: shard(s, stage=stage),
    "offload_accumulate": lambda stage: lambda s: shard(offload(accumulate(mixed_precision(s, "bf16"), 2)),
                                                        stage=stage),
}


@pytest.mark.slow  # compiles (10-75 s each on 2 cores; the file: ~4 min)
@pytest.mark.parametrize("name", list(WORLD_1))
@pytest.mark.parametrize("stage", [1, 2])
def test_shard_stages_1_and_2_world_1(dist, stage, name):
    """At one rank the update writes the whole parameters in place (the shards are views of them): nothing is
    gathered after it, and the traced step differentiates each unit's flat buffer, compiled as eager."""
    check(dist(eager_and_compiled, 1, WORLD_1[name](stage), timeout=600)[0])


def _gathers_after_the_update(stage: int) -> int:
    """How often a compiled step of ``stage`` on this rank traced the gather of the updated parameters."""
    import importlib

    import torch._dynamo

    shard_module = importlib.import_module("zfunc.transforms.shard")  # (the module: the package exports the class)
    calls, gather = [], shard_module.gather_updated
    shard_module.gather_updated = lambda *a: (calls.append(1), gather(*a))[1]  # (this forked rank's module)
    torch._dynamo.reset()
    plain, state = build()
    step = shard(mixed_precision(plain, "bf16"), stage=stage)
    torch.compile(step, fullgraph=True, backend="eager")(step.init(state), local_batch(0, 0, 1))
    return len(calls)


@pytest.mark.parametrize("stage", [1, 2])
def test_one_rank_gathers_nothing_after_the_update(dist, stage):
    """(The gather at one rank was an identity that cost the graph a concatenation and a copy per parameter.)"""
    assert dist(_gathers_after_the_update, 1, stage, timeout=300)[0] == 0


def _same_shaped_pair(layout) -> tuple[str, str]:
    """Two keys of one unit (views of one buffer) of one shape, whose shards are of one size on every rank: the
    pair every rank swaps alike."""
    for unit in layout.units:
        for i, j in itertools.combinations(range(len(unit.keys)), 2):
            sizes = [[b - a for a, b in (unit.local_range(i, r), unit.local_range(j, r))]
                     for r in range(layout.world_size)]
            if unit.shapes[i] == unit.shapes[j] and all(x == y for x, y in sizes):
                return unit.keys[i], unit.keys[j]
    raise AssertionError("no two parameters of one shape in one unit")


def _swapped(tree: dict, a: str, b: str, fresh_views: bool = False) -> dict:
    """``tree`` with its tensors under ``a`` and ``b`` exchanged (``fresh_views``: as new views, which record nothing,
    as a user's ``view_as`` makes them)."""
    moved = {a: tree[b], b: tree[a]}
    return {**tree, **({k: v.view_as(v) for k, v in moved.items()} if fresh_views else moved)}


def _on_swapped(stage: int, compiled: bool, what: str = "params"):
    """One step, then a state whose two same-shaped tensors of one unit were swapped under their keys (``what``:
    "params"; "fresh views" of them; the Adam "moments", set apart first), stepped STEPS - 1 more times at
    ``stage``, eager or compiled (the same compiled step: the swapped state fails its guards and is traced anew).
    The error's message, or the full parameters and the number of graphs compiled."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rank, world = rank_and_world()
    plain, state = build()
    step = shard(plain, stage=stage)
    state = step.init(state)
    a, b = _same_shaped_pair(state.extras["shard"])
    run = torch.compile(step, fullgraph=True, backend="eager") if compiled else step
    try:
        state, _ = run(state, local_batch(0, rank, world))
        if what == "moments":
            adam = state.opt_state[0]
            with torch.no_grad():  # (the two set further apart, so that the swap shows)
                adam.mu[a].mul_(3.0)
                adam.nu[a].mul_(5.0)
            state = state.replace(opt_state=(adam._replace(mu=_swapped(adam.mu, a, b), nu=_swapped(adam.nu, a, b)),
                                             *state.opt_state[1:]))
        else:
            state = state.replace(params=_swapped(state.params, a, b, fresh_views=what == "fresh views"))
        for i in range(1, STEPS):
            state, _ = run(state, local_batch(i, rank, world))
    except Exception as e:  # noqa: BLE001 - the message is the result
        return str(e)
    full = _gathered(step, state) if stage == 3 else {k: v.float().clone() for k, v in state.params.items()}
    return {"params": full,  # (stages 1/2: the full parameters; eager `gather` refuses fresh views as a step does)
            "graphs": counters["stats"]["unique_graphs"]}


def _swapped_reference() -> dict:
    """The plain step's parameters after one step and STEPS - 1 more with the same pair swapped (the keys followed:
    what a step that takes the state as given computes)."""
    plain, state = build()
    a, b = _same_shaped_pair(shard(plain, stage=3).init(state).extras["shard"])  # (at one rank: the same pair)
    state, _ = plain(state, local_batch(0, 0, 1))
    state = state.replace(params=_swapped(state.params, a, b))
    for i in range(1, STEPS):
        state, _ = plain(state, local_batch(i, 0, 1))
    return {k: v.float().clone() for k, v in state.params.items()}


def _assert_equal(result, expected: dict, rtol: float = 1e-6) -> None:
    assert isinstance(result, dict), result
    assert result["params"].keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(result["params"][key], value, rtol=rtol, atol=1e-6, msg=key)


_REFUSED = "not in shard's flat layout (were they replaced, or moved between keys?)"


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [1, 2])
def test_a_state_with_params_moved_between_keys_is_refused_eagerly(dist, stage, world):
    """Stages 1/2 keep the full parameters as views of one buffer per unit, in the layout's order: two of one
    shape swapped under their keys share that storage, and were updated as each other (silently; stage 3's eager
    step follows the keys). `ShardUnit.full_flat_of` now checks each view's place, once per state."""
    for message in dist(_on_swapped, world, stage, False, timeout=300):
        assert _REFUSED in message, message


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])  # (2 ranks compiling: ~10 s)
@pytest.mark.parametrize("stage", [1, 2])
def test_a_state_with_params_moved_between_keys_is_refused_compiled(dist, stage, world):
    """The compiled step refuses it too, with the eager message and the keys. A trace cannot read a storage offset:
    each view records at init the key it was made for (`shard_init._recording_owner`), which dynamo reads as a
    guarded constant, so the swapped state fails the guards of the step compiled for the first and is traced anew
    into the refusal. (At one rank the traced step took each unit's buffer whole and trained as if the two had not
    been swapped; at two it followed the keys where eager refuses.)"""
    for message in dist(_on_swapped, world, stage, True, timeout=300):
        assert _REFUSED in message and "found under another key: ['" in message, message


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_stage_3_state_with_params_moved_between_keys_compiled_follows_the_keys(dist, world):
    """Stage 3 follows the keys, eager and compiled alike: the compiled step takes a unit's buffer whole only where
    every view sits under the key it was made for (`zfunc.optim.flat.owner_of`), else key by key, as eager does.
    (It took the buffers whole, at one rank and in the update at two, as if the two had not been swapped.)"""
    eager = dist(_on_swapped, world, 3, False, timeout=300)
    compiled = dist(_on_swapped, world, 3, True, timeout=300)
    for e, c in zip(eager, compiled):
        # (The first state's graph and the swapped one's, where this rank holds elements of the two; no more.)
        assert isinstance(c, dict) and c["graphs"] <= 2, c
        _assert_equal(c, e["params"])
    if world == 1:  # the keys followed: the plain step on the swapped parameters
        _assert_equal(eager[0], _swapped_reference(), rtol=1e-5)


@pytest.mark.parametrize("stage", [1, 3])
def test_new_views_moved_between_keys_compiled_are_taken_key_by_key(dist, stage):
    """Views the user made anew (no record of a buffer or a key) are taken key by key, never as their buffer: the
    compiled step on two of them swapped trains as the plain step on the swapped parameters."""
    _assert_equal(dist(_on_swapped, 1, stage, True, "fresh views", timeout=300)[0], _swapped_reference(), rtol=1e-5)


@pytest.mark.parametrize("stage", [1, 3])
def test_moments_moved_between_keys_compiled_follow_the_keys(dist, stage):
    """The moments are views of a buffer too, and record their keys: swapped, the compiled update takes them key by
    key, as the eager one does (taken whole, it updated each parameter with the other's moments)."""
    eager = dist(_on_swapped, 1, stage, False, "moments", timeout=300)[0]
    _assert_equal(dist(_on_swapped, 1, stage, True, "moments", timeout=300)[0], eager["params"])


@pytest.mark.slow  # compiles (10-75 s each on 2 cores; the file: ~4 min)
def test_shard_stage_3_world_1(dist):
    check(dist(eager_and_compiled, 1, STACKS["s3_checkpoint"], timeout=600)[0])


def _fp16_overflowing(s):
    # 2**40 overflows fp16 at once: the first steps are skipped while the scale halves.
    return shard(mixed_precision(s, "fp16", initial_scale_power=40, hysteresis=1), stage=2)


@pytest.mark.slow  # compiles (10-75 s each on 2 cores; the file: ~4 min)
def test_fp16_skip_is_branch_free(dist):
    """The skip of an overflowing fp16 step traces (torch.where on the update) and skips exactly the
    steps eager skips: same scale, same params."""
    result = dist(eager_and_compiled, 2, _fp16_overflowing, steps=4, timeout=900)[0]
    check(result)
    assert result["metrics_compiled"]["loss_scale"] < 2.0 ** 40  # the scale moved: steps were skipped


def _hundred_steps() -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    plain, state = build("clip+schedule")
    step = mixed_precision(plain, "bf16")
    state = step.init(state)
    run = torch.compile(step, fullgraph=True, backend="eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(100):
            state, _ = run(state, make_batch(8, seed=i % 7))
    return {"graphs": counters["stats"]["unique_graphs"], "steps": int(state.step),
            "recompiles": sum(counters["recompiles"].values()) if "recompiles" in counters else 0}


@pytest.mark.slow  # compiles (10-75 s each on 2 cores; the file: ~4 min)
def test_a_hundred_steps_compile_once(dist):
    """Step counter, learning-rate schedule and clip are tensors: 100 steps, one graph, no recompile."""
    assert dist(_hundred_steps, 1, timeout=600)[0] == {"graphs": 1, "steps": 100, "recompiles": 0}


def test_eager_steps_do_not_touch_the_trace_slot(dist):
    """The dispatch of an eager step reads only the ContextVar; the slot dynamo traces stays empty.
    (In a forked rank: a backward in the test process would start autograd's threads, after which
    torch 2.11's CUDA build refuses to fork the ranks of the tests that follow.)"""
    assert dist(_trace_slot_after_an_eager_step, 1, timeout=300)[0] is None


def _trace_slot_after_an_eager_step():
    from zfunc.step_context import TRACED

    plain, state = build()
    step = mixed_precision(plain, "bf16")
    state = step.init(state)
    state, _ = step(state, make_batch(8))
    return TRACED.context


@pytest.mark.slow
def test_inductor_shard_stage_1_world_2(dist):
    """The real backend: Inductor's generated code, functional collectives over gloo.

    Inductor fuses the bf16 stack's pointwise ops and by default keeps their intermediates in fp32, where
    eager rounds each to bf16: after Adam (whose normalised step is ~lr whatever the gradient's size) that
    moves parameters by up to ~lr. With ``emulate_precision_casts`` it rounds where eager does; what is
    left is the order of bf16 reductions, a few 1e-4 here (a wrong reduction would be ~the weights'
    size, 0.1-1). Inductor 2.11 does not round this graph's intermediates under that setting: its
    parameters differ from eager's by up to 5e-3 and its loss by 2.3e-3 relative after the 3 steps, as
    2.13's do with the setting off (measured 2026-12-02; with ``aot_eager`` 2.11's are eager's to 1.2e-7,
    which ``test_shard_world_2`` holds), so there the bound is the unrounded one, still well under a
    wrong reduction's."""
    import torch._inductor.config as inductor_config

    rounds = torch.__version__ >= (2, 13)  # (TorchVersion compares as numbers)
    with inductor_config.patch(emulate_precision_casts=True):  # (the ranks fork inside: they inherit it)
        results = dist(eager_and_compiled, 2, STACKS["s1"], "inductor", timeout=1200)
    for result in results:
        if rounds:
            check(result, rtol=1e-3, atol=5e-4, metrics_rel=1e-3)
        else:
            check(result, rtol=1e-2, atol=1e-2, metrics_rel=1e-2)
