"""The fused update as a CUDA graph's replay (`zfunc.optim.update_graph`, opted into with `zf.optim.cuda_graphed`).

On this CPU the GPU path runs on CPU tensors with the Triton kernel in its interpreter (as in
tests/test_fused_plan.py), and the capture is a stand-in (`FakeCapture`): a "capture" records the body and runs
nothing, a "replay" runs the recorded body on the graph's buffers, and checks first that the graph's plan is the
one the optimizer holds now (a stale graph would fail there). Every case compares, bit for bit and element by
element, the graph route with the eager route of the same optimizer: params, moments, compute copy, counts, rate.

On a GPU (the tests marked ``cuda``, skipped here) the capture is CUDA's, replays run under
``torch.cuda.set_sync_debug_mode("error")``, and the same comparisons hold. One command runs them all:

    python3 -m pytest -q tests/test_update_graph.py
"""

from __future__ import annotations

import collections
import contextlib
import gc

import pytest
import torch

import zfunc as zf
from tests.test_fused_plan import (
    bits,
    device_path,  # noqa: F401 (a fixture, used by name)
    make_state,
    optimizer,
    views,
)
from zfunc.kernels import gpu_adam as ga
from zfunc.optim import fused, update_graph

quiet = pytest.mark.filterwarnings("ignore::RuntimeWarning")
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and ga.triton_available()), reason="needs CUDA + triton")


class FakeCapture:
    """`update_graph.CudaCapture`'s stand-in on the CPU (module docstring); counts what it is asked to do."""

    def __init__(self, device, counts: dict, fail: bool = False) -> None:
        self.device, self.counts, self.fail = device, counts, fail

    def warm_up(self, body) -> None:
        self.counts["warm_ups"] += 1
        body()

    def capture(self, body):
        self.counts["captures"] += 1
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        graph = body.__self__

        def replay() -> None:
            assert graph.spec.tables[fused._PLAN] is graph.plan, "a graph replayed for a plan it was not captured for"
            self.counts["replays"] += 1
            body()

        return replay

    @staticmethod
    def host_buffer(like):
        return torch.empty(like.shape, dtype=like.dtype)

    @staticmethod
    def event():
        return type("Event", (), {"record": lambda self: None, "synchronize": lambda self: None})()


@pytest.fixture
def graphs(device_path, monkeypatch):  # noqa: F811 (the fixture)
    """The GPU path on the CPU (test_fused_plan's ``device_path``), captured by `FakeCapture`."""
    counts = {"warm_ups": 0, "captures": 0, "replays": 0, "fail": False}
    monkeypatch.setattr(update_graph, "capture_for",
                        lambda device: FakeCapture(device, counts, fail=counts["fail"]))
    return counts


def steps(tx, n, grad_dtype=torch.bfloat16, out_dtype=torch.bfloat16, skip_at=(), device="cpu", state=None,
          each=None):
    """``n`` fused updates, fresh gradients each (new buffers: other addresses every step); the last result and
    the rates of each step. ``state``: ``(params, opt_state, compute copy or None)`` to go on from;
    ``skip_at``: the steps skipped (None: no skip flag at all); ``each(t, params, opt_state)`` may change the
    state between steps."""
    params, opt_state, into = state if state is not None else (*make_state(tx, device)[:2], None)
    if into is None and out_dtype is not None:
        into = views({}, dtype=out_dtype, fill=0.0, device=device)
    rates, copy = [], None
    for t in range(n):
        if each is not None:
            params, opt_state = each(t, params, opt_state)
        grads = views({}, dtype=grad_dtype, seed=10 + t, device=device)
        skip = None if skip_at is None else torch.tensor(t in skip_at, device=device)
        params, opt_state, copy = fused.fused_update(tx.fused, params, grads, opt_state, out_dtype, into, skip=skip)
        rates.append(zf.optim.learning_rate(opt_state).clone())
    return params, opt_state, copy, rates


def assert_same(got, want, spec) -> None:
    """Element-wise, bit for bit: params, moments, compute copy, counts, and the rate of every step."""
    (pa, sa, ca, ra), (pb, sb, cb, rb) = got, want
    ma, mb = spec.adam_state(sa), spec.adam_state(sb)
    assert (ca is None) == (cb is None)
    for name, x, y in (("params", pa, pb), ("mu", ma.mu, mb.mu), ("nu", ma.nu, mb.nu)) + \
            ((("copy", ca, cb),) if ca is not None else ()):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(bits(x[k]), bits(y[k])), (name, k)
    la, lb = spec.lr_state(sa), spec.lr_state(sb)
    for name, x, y in (("count", ma.count, mb.count), ("rate count", la.count, lb.count),
                       ("rate", la.learning_rate, lb.learning_rate)):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (name, x, y)
    assert len(ra) == len(rb) and all(torch.equal(bits(x), bits(y)) for x, y in zip(ra, rb)), (ra, rb)


CASES = [("adamw", False, torch.bfloat16, torch.bfloat16, ()),
         ("adamw", True, torch.float32, None, (3,)),
         ("adam", True, torch.float16, torch.float16, (2, 5))]


@quiet
@pytest.mark.parametrize("mode, clip, grad_dtype, out_dtype, skip_at", CASES)
def test_replays_are_the_eager_update_bit_for_bit(graphs, mode, clip, grad_dtype, out_dtype, skip_at):
    """Step 0 eager (a layout seen once), step 1 the warm-up (its update) and the capture, steps 2-6 replays; the
    gradients in new buffers every step (read through the address table: no new capture)."""
    tx = zf.optim.cuda_graphed(optimizer(mode, clip))
    got = steps(tx, 7, grad_dtype, out_dtype, skip_at)
    assert graphs == {"warm_ups": 1, "captures": 1, "replays": 5, "fail": False}
    want = steps(optimizer(mode, clip), 7, grad_dtype, out_dtype, skip_at)
    assert_same(got, want, tx.fused)
    assert int(tx.fused.adam_state(got[1]).count) == 7 - len(skip_at)  # (a skipped step counts nothing)


@quiet
def test_counts_and_rate_are_the_graphs_buffers_updated_in_place(graphs):
    tx = zf.optim.cuda_graphed(optimizer("adamw", False))
    spec = tx.fused
    seen = []

    def each(t, params, opt_state):
        seen.append((spec.adam_state(opt_state).count, spec.lr_state(opt_state).learning_rate))
        return params, opt_state

    got = steps(tx, 5, each=each)
    graph = spec.tables[update_graph._GRAPH].graph
    assert all(c is graph.count and r is graph.rate for c, r in seen[2:])  # given back, read again: no copy in
    assert spec.adam_state(got[1]).count is graph.count and spec.lr_state(got[1]).count is graph.rate_count
    # a state whose counts are other tensors (restored, cloned) is copied in, and the graph kept
    params, opt_state = got[0], got[1]
    adam, rate = spec.adam_state(opt_state), spec.lr_state(opt_state)
    cloned = spec.with_counts(opt_state, adam.mu, adam.nu, adam.count.clone() + 10, rate.count.clone() + 10,
                              rate.learning_rate.clone())
    grads = views({}, dtype=torch.bfloat16, seed=99)
    replays = graphs["replays"]
    _, after, _ = fused.fused_update(spec, params, grads, cloned, torch.bfloat16, got[2], skip=torch.tensor(False))
    assert graphs["replays"] == replays + 1 and int(spec.adam_state(after).count) == 5 + 10 + 1
    assert int(spec.adam_state(cloned).count) == 15  # (the given tensors are not written)


def host_schedule(calls: list):
    def rate(count):  # a user's callable that reads the count on the host
        calls.append(count.device.type)
        return 1e-2 * 0.9 ** float(count)
    return rate


@quiet
def test_a_users_schedule_runs_on_the_host_at_the_count_the_device_has(graphs):
    """A Python schedule is evaluated on the host at every step, at the count the graph left (skipped steps
    included: the count is copied back from the device, not counted on the host)."""
    calls = []
    tx = zf.optim.cuda_graphed(zf.optim.adamw(host_schedule(calls), weight_decay=0.1))
    got = steps(tx, 6, skip_at=(2, 3))
    graph = tx.fused.tables[update_graph._GRAPH].graph
    assert graph.host_rates and graphs["replays"] == 4
    want = steps(zf.optim.adamw(host_schedule([]), weight_decay=0.1), 6, skip_at=(2, 3))
    assert_same(got, want, tx.fused)
    assert len(calls) >= 6
    # one marked as tensor operations only is captured instead: the same numbers
    def decay(count):
        return (1e-2 * 0.9 ** count.to(torch.float64)).to(torch.float32)

    graphs["replays"] = 0
    tx = zf.optim.cuda_graphed(zf.optim.adamw(zf.optim.schedules.tensor_ops_only(decay), weight_decay=0.1))
    got = steps(tx, 6, skip_at=(2, 3))
    assert not tx.fused.tables[update_graph._GRAPH].graph.host_rates and graphs["replays"] == 4
    assert_same(got, steps(zf.optim.adamw(decay, weight_decay=0.1), 6, skip_at=(2, 3)), tx.fused)


@quiet
def test_a_changed_key_drops_the_graph_and_captures_again(graphs):
    """Steps without a skip flag, then with one (another kernel: a new key): the graph is dropped, the step runs
    eagerly, the next captures again; never a replay of the old graph (`FakeCapture` checks), all of it the
    eager route's numbers."""
    def run(tx):
        params, opt_state, copy, rates = steps(tx, 4, skip_at=None)
        params, opt_state, copy, more = steps(tx, 4, skip_at=(1,), state=(params, opt_state, copy))
        return params, opt_state, copy, rates + more

    tx = zf.optim.cuda_graphed(optimizer("adamw", True))
    got = run(tx)
    # 0 eager, 1 capture, 2-3 replays | 4 eager (a skip flag now), 5 capture, 6-7 replays
    assert graphs["captures"] == 2 and graphs["replays"] == 4
    assert_same(got, run(optimizer("adamw", True)), tx.fused)


@quiet
def test_replayed_steps_read_nothing_on_the_host(graphs, monkeypatch):
    """No value goes from the device to the host in a replayed step (tests/test_host_reads.py's recorder; the
    kernel launch stubbed: Triton's interpreter reads its tensors on the host, a GPU does not)."""
    import types

    from tests.test_host_reads import HostReads
    from zfunc.kernels import triton_kernels

    launches = []
    stub = types.SimpleNamespace(adam_multi_kernel=collections.defaultdict(lambda: lambda *a, **k: launches.append(1)))
    monkeypatch.setattr(triton_kernels, "kernels", lambda interpret: stub)
    tx = zf.optim.cuda_graphed(optimizer("adamw", True))
    state = steps(tx, 2, skip_at=(1,))[:3]
    with HostReads() as reads:
        steps(tx, 3, skip_at=(1,), state=state)
    assert graphs["replays"] == 3 and launches and not reads.reads, dict(reads.reads)


@quiet
def test_a_new_plan_is_never_replayed_through_the_old_graph(graphs):
    tx = zf.optim.cuda_graphed(optimizer("adamw", False))
    spec = tx.fused

    def each(t, params, opt_state):
        if t == 4:  # the params moved to new buffers, laid out alike: a new plan, the same key, a new graph
            moved = views({}, seed=1)
            for k, p in moved.items():
                p.copy_(params[k])
            return moved, opt_state
        return params, opt_state

    got = steps(tx, 8, each=each)
    # 0 eager, 1 capture, 2-3 replays | 4 eager (new plan), 5 capture, 6-7 replays
    assert graphs["captures"] == 2 and graphs["replays"] == 4
    assert spec.tables[update_graph._GRAPH].graph.plan is spec.tables[fused._PLAN]
    want = steps(optimizer("adamw", False), 8, each=each)
    assert_same(got, want, spec)
    # another state of the same layout: its own plan, its own graph; the first state left alone
    before = {k: v.clone() for k, v in got[0].items()}
    other = steps(tx, 3)
    assert all(torch.equal(before[k], got[0][k]) for k in before)
    assert_same(other, steps(optimizer("adamw", False), 3), spec)
    del got, other
    gc.collect()


@quiet
def test_a_failed_capture_warns_and_that_layout_stays_eager(graphs):
    graphs["fail"] = True
    tx = zf.optim.cuda_graphed(optimizer("adamw", True))
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        got = steps(tx, 6, skip_at=(4,))
    assert graphs["captures"] == 1 and graphs["replays"] == 0 and graphs["warm_ups"] == 1
    assert_same(got, steps(optimizer("adamw", True), 6, skip_at=(4,)), tx.fused)


@quiet
def test_no_graph_where_no_capture_is_possible(device_path):  # noqa: F811 (the fixture)
    """On a device that cannot capture (here the CPU, unpatched), the graph route stands aside."""
    tx = zf.optim.cuda_graphed(optimizer("adamw", False))
    got = steps(tx, 4)
    assert tx.fused.tables[update_graph._GRAPH].graph is None
    assert_same(got, steps(optimizer("adamw", False), 4), tx.fused)


def test_cuda_graphed_takes_optimizers_with_a_fused_form_only():
    with pytest.raises(ValueError, match="fused form"):
        zf.optim.cuda_graphed(zf.optim.sgd(0.1))
    tx = zf.optim.chain(zf.optim.clip_by_global_norm(1.0), zf.optim.cuda_graphed(zf.optim.adamw(1e-3)))
    assert tx.fused.graph and tx.fused.clip == 1.0
    assert zf.optim.cuda_graphed(zf.optim.chain(zf.optim.clip_by_global_norm(1.0), zf.optim.adam(1e-3))).fused.graph


# ---------------------------------------------------------------------------------------------------- shard


def _shard_run(stage: int, policy: str, graphed: bool, device: str = "cpu", steps: int = 6):
    from tests.models import TinyLM, lm_loss, make_batch
    from tests.shard_cases import optimizer as shard_optimizer
    from tests.shard_cases import rank_and_world
    from zfunc.transforms import mixed_precision, shard

    torch.manual_seed(0)
    apply_fn, params = zf.functional(TinyLM().to(device))
    loss_fn = lm_loss(apply_fn)

    def train_step(state, batch):
        loss, grads = zf.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    tx = shard_optimizer("clip+schedule")
    state = zf.TrainState.create({k: v.clone() for k, v in params.items()},
                                 zf.optim.cuda_graphed(tx) if graphed else tx)
    # (fp16: the scale chosen so that the second step overflows and is skipped)
    knobs = {"initial_scale_power": 15, "hysteresis": 1} if policy == "fp16" else {}
    step = shard(mixed_precision(train_step, policy, **knobs), stage=stage)
    state = step.init(state)
    rank, world = rank_and_world()
    for i in range(steps):
        state, _ = step(state, {k: v.chunk(world)[rank].to(device) for k, v in make_batch(8, seed=i).items()})
    mp = state.extras["mixed_precision"]
    spec = state.tx.fused
    return {"params": {k: v.clone() for k, v in state.params.items()},
            "master": {k: v.clone() for k, v in mp.master.items()}, "scale": float(mp.loss_scale),
            "count": int(spec.adam_state(state.opt_state).count),
            "rate": spec.lr_state(state.opt_state).learning_rate.clone(),
            "graph": getattr(spec.tables.get(update_graph._GRAPH), "graph", None) is not None}


def _assert_shard_same(got, want):
    assert got["graph"] and not want["graph"]
    assert got["scale"] == want["scale"] and got["count"] == want["count"]
    assert torch.equal(got["rate"], want["rate"])
    for part in ("params", "master"):
        assert got[part].keys() == want[part].keys()
        for k, v in want[part].items():
            assert torch.equal(bits(got[part][k]), bits(v)), (part, k)


@pytest.mark.skipif(torch.cuda.is_available(), reason="drives the GPU path on CPU tensors; the CUDA test covers it")
@quiet
@pytest.mark.parametrize("stage, policy", [(1, "bf16"), (3, "fp16")])
def test_shard_through_the_graph_is_shard_without(graphs, stage, policy):
    got = _shard_run(stage, policy, True)
    assert graphs["captures"] == 1 and graphs["replays"] >= 3
    _assert_shard_same(got, _shard_run(stage, policy, False))


@pytest.mark.skipif(torch.cuda.is_available(), reason="drives the GPU path on CPU tensors; the CUDA test covers it")
@quiet
@pytest.mark.slow
@pytest.mark.parametrize("stage, policy", [(1, "bf16"), (3, "fp16")])
def test_shard_at_world_2_through_the_graph_is_shard_without(graphs, stage, policy):
    """Each rank its own graph; the clip norm (a collective) outside them, once per step on every rank."""
    from zfunc.testing import run_distributed

    got = run_distributed(_shard_run, 2, stage, policy, True)
    want = run_distributed(_shard_run, 2, stage, policy, False)
    for g, w in zip(got, want):
        _assert_shard_same(g, w)


# ---------------------------------------------------------------------------------------------------- CUDA


@contextlib.contextmanager
def cuda_route(monkeypatch):
    """The real route on a GPU (Triton compiled, CUDA's capture), captures and replays counted. A step that
    replays a graph whose rate is captured runs its whole graph route under ``set_sync_debug_mode("error")``:
    any host sync there raises. (A user's schedule waits, by design, for the previous update's count.)"""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    counts = {"replays": 0, "captures": 0}
    replay, capture, route = update_graph.UpdateGraph.replay, update_graph.UpdateGraph.capture, fused.graphed_update

    def counted_replay(self):
        counts["replays"] += 1
        replay(self)

    def counted_capture(self):
        counts["captures"] += 1
        capture(self)

    def checked_route(spec, *args):
        slot = spec.tables.get(update_graph._GRAPH)
        replaying = slot is not None and slot.graph is not None and not slot.graph.host_rates
        torch.cuda.set_sync_debug_mode("error" if replaying else 0)
        try:
            return route(spec, *args)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(update_graph.UpdateGraph, "replay", counted_replay)
    monkeypatch.setattr(update_graph.UpdateGraph, "capture", counted_capture)
    monkeypatch.setattr(fused, "graphed_update", checked_route)
    yield counts


@cuda
@pytest.mark.parametrize("mode, clip, grad_dtype, out_dtype, skip_at", CASES)
def test_cuda_replays_are_the_eager_update_bit_for_bit(monkeypatch, mode, clip, grad_dtype, out_dtype, skip_at):
    with cuda_route(monkeypatch) as counts:
        tx = zf.optim.cuda_graphed(optimizer(mode, clip))
        got = steps(tx, 7, grad_dtype, out_dtype, skip_at, device="cuda")
        want = steps(optimizer(mode, clip), 7, grad_dtype, out_dtype, skip_at, device="cuda")
    assert counts == {"captures": 1, "replays": 5}
    assert_same(got, want, tx.fused)


@cuda
def test_cuda_users_schedule_and_new_layouts(monkeypatch):
    def each(t, params, opt_state):
        if t == 4:
            params["u1.b"].data = params["u1.b"].data.clone()
        return params, opt_state

    with cuda_route(monkeypatch) as counts:
        tx = zf.optim.cuda_graphed(zf.optim.adamw(host_schedule([]), weight_decay=0.1))
        got = steps(tx, 9, skip_at=(2, 7), device="cuda", each=each)
        want = steps(zf.optim.adamw(host_schedule([]), weight_decay=0.1), 9, skip_at=(2, 7), device="cuda",
                     each=each)
    assert counts == {"captures": 2, "replays": 5}
    assert_same(got, want, tx.fused)


@cuda
def test_cuda_no_address_table_write_while_capturing():
    runs = ga.AdamRuns.build([(0, 0, 0, 0)], [[(0, 16, 0.0)]], [16], "cuda")
    runs.set_grads([0])
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="while a CUDA graph is being captured"), torch.cuda.graph(graph):
        runs.set_grads([256])


@cuda
@pytest.mark.parametrize("stage, policy", [(1, "bf16"), (3, "fp16")])
def test_cuda_shard_through_the_graph_is_shard_without(monkeypatch, stage, policy):
    with cuda_route(monkeypatch) as counts:
        got = _shard_run(stage, policy, True, device="cuda", steps=8)
        want = _shard_run(stage, policy, False, device="cuda", steps=8)
    assert counts["captures"] == 1 and counts["replays"] >= 5
    _assert_shard_same(got, want)
