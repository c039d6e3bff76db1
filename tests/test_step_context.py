"""The step context: per-call state in one object, facts declared once, transforms that hold only config."""

from __future__ import annotations

import ast
import copy
import importlib
import pathlib
import threading

import numpy as np
import pytest
import torch

import zfunc as zf
from tests.models import make_batch
from tests.shard_cases import build, local_batch, rank_and_world, to_numpy
from zfunc.facts import Facts
from zfunc.testing import run_distributed
from zfunc.transforms import accumulate, checkpoint, mixed_precision, offload, shard

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _stack(step):
    return shard(offload(checkpoint(mixed_precision(accumulate(step, micro_batches=2), "bf16"))), stage=3)


def _config(transform) -> dict:
    """What a transform object holds (its cached `stack` aside), deep-copied for comparison."""
    return {k: (v if callable(v) else copy.deepcopy(v)) for k, v in vars(transform).items() if k != "stack"}


def test_facts_are_declared_by_the_transforms_once():
    step, _ = build()
    stacked = _stack(step)
    facts = stacked.stack.facts
    assert facts == Facts(compute_dtype=torch.bfloat16, master_dtype=torch.float32, reduce_dtype=torch.bfloat16,
                          loss_scaling="none", stage=3, optimizer_tier="host", optimizer_split=(0.0, 1.0, 0.0),
                          params_tier="device", micro_batches=2, accumulates=True, recompute=True,
                          fused_update=True)
    assert stacked.stack is stacked.stack  # built once
    assert offload(step, optimizer="cpu-pytree").stack.facts.fused_update is False
    assert shard(offload(step, optimizer="cpu-pytree"), stage=1).stack.facts.fused_update is False
    assert mixed_precision(step, "bf16").stack.facts.fused_update is None  # nothing owns the buffers: pure


def test_running_a_stack_does_not_change_its_transforms():
    step, state = build()
    stacked = _stack(step)
    before = [_config(t) for t in zf.interpret.transforms_of(stacked)]
    state = stacked.init(state)
    for i in range(2):
        state, _ = stacked(state, make_batch(8, seed=i))
    after = [_config(t) for t in zf.interpret.transforms_of(stacked)]
    assert [sorted(b) for b in before] == [sorted(a) for a in after]
    for b, a in zip(before, after):
        for key in b:
            assert type(b[key]) is type(a[key]) and repr(b[key]) == repr(a[key]), key


def test_two_threads_run_steps_of_one_stack_at_once():
    step, _ = build()
    stacked = checkpoint(mixed_precision(accumulate(step, micro_batches=2), "fp16", initial_scale_power=4))

    states = {key: stacked.init(build()[1]) for key in ("a", "b", "c", "d")}  # built serially: torch's RNG

    def train(seed_offset: int, out: dict, key: str):
        try:
            state = states[key]
            for i in range(3):
                state, metrics = stacked(state, make_batch(8, seed=i + seed_offset))
            out[key] = (to_numpy(stacked.gather(state)), float(metrics["loss_scale"]))
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            out[key] = err

    serial: dict = {}
    train(0, serial, "a")
    train(10, serial, "b")
    parallel: dict = {}
    threads = [threading.Thread(target=train, args=(off, parallel, key)) for off, key in ((0, "c"), (10, "d"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for twin in ("c", "d"):
        if isinstance(parallel[twin], BaseException):
            raise parallel[twin]
    for key, twin in (("a", "c"), ("b", "d")):
        assert parallel[twin][1] == serial[key][1]
        for name, value in serial[key][0].items():
            np.testing.assert_allclose(parallel[twin][0][name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def _waits_under_checkpoint(stage: int) -> list:
    """The order of reductions issued and waited in one step of shard(checkpoint(step))."""
    from zfunc import dist as zdist

    rank, world = rank_and_world()
    events = []
    issue, finish = zdist.Comm.reduce_scatter, zdist.Comm.finish_pending

    def issued(self, full, tag=None, **kwargs):
        events.append(("issue", tag))
        return issue(self, full, tag, **kwargs)

    def finished(self):
        events.append(("wait", len(self.pending)))
        return finish(self)

    zdist.Comm.reduce_scatter, zdist.Comm.finish_pending = issued, finished
    try:
        step, state = build()
        stacked = shard(checkpoint(step), stage=stage)
        state = stacked.init(state)
        stacked(state, local_batch(0, rank, world))
    finally:
        zdist.Comm.reduce_scatter, zdist.Comm.finish_pending = issue, finish
    return events


@pytest.mark.parametrize("stage", [2, 3])
def test_reductions_overlap_backward_under_checkpoint(stage):
    """Under checkpoint every block's backward runs inside a nested backward (its recompute); the
    reductions must still all be waited once, when the outer backward returns, not after each block."""
    for events in run_distributed(_waits_under_checkpoint, 2, stage):
        issues = [e for e in events if e[0] == "issue"]
        waits = [e for e in events if e[0] == "wait"]
        assert len(issues) == 4  # 3 blocks and the root, one reduction each
        assert waits == [("wait", 4)] and events[-1] == ("wait", 4), events


def _top_level_imports(path: pathlib.Path, package: str) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body:  # module level only: imports inside functions are deliberate and lazy
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zfunc"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if importlib.util.find_spec(node.module) and _is_module(full) else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("zfunc"))
    return found


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, AttributeError, ValueError):
        return False


def test_no_import_circles():
    modules = {}
    for path in (ROOT / "zfunc").rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        modules[name] = path
    graph = {name: {m for m in _top_level_imports(path, name) if m in modules and m != name}
             for name, path in modules.items()}
    # A package's __init__ re-exporting its submodules is not a circle through them.
    for name in graph:
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    state: dict[str, int] = {}

    def visit(node, trail):
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join([*trail, node, nxt]))
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])


ALIASES = {
    "adam": lambda lr: zf.optim.adam(lr, weight_decay=0.01),
    "adamw": lambda lr: zf.optim.adamw(lr, weight_decay=0.1),
    "adamw+mask": lambda lr: zf.optim.adamw(lr, weight_decay=0.1, mask=lambda n: n.endswith("weight")),
}


@pytest.mark.parametrize("alias", list(ALIASES))
@pytest.mark.parametrize("clipped", [False, True])
def test_every_fusable_alias_reaches_the_kernel(alias, clipped, monkeypatch):
    """Each alias a kernel runs declares its fused form, alone and in chain(clip_by_global_norm, ...)
    with a schedule; the fused update equals the pure one."""
    cpu_adam = importlib.import_module("zfunc.kernels.cpu_adam")
    calls = []
    real = cpu_adam.adamw_
    monkeypatch.setattr(cpu_adam, "adamw_", lambda *a, **k: calls.append(1) or real(*a, **k))

    def make():
        tx = ALIASES[alias](zf.optim.warmup_cosine(1e-2, 2, 10))
        return zf.optim.chain(zf.optim.clip_by_global_norm(0.05), tx) if clipped else tx

    results = []
    for wrap in (lambda s: s, offload):
        step, state = build()
        state = zf.TrainState.create(state.params, make())
        step = wrap(step)
        state = zf.init(step, state)
        for i in range(3):
            state, _ = step(state, make_batch(8, seed=i))
        results.append(zf.gather(step, state))
    assert calls, "the fused kernel was never called"
    for key, value in results[0].items():
        torch.testing.assert_close(results[1][key], value, rtol=1e-6, atol=1e-7)


def test_optimizers_without_a_kernel_declare_none():
    assert zf.optim.sgd(0.1, momentum=0.9).fused is None
    assert zf.optim.lamb(1e-3).fused is None
    assert zf.optim.chain(zf.optim.adamw(1e-3), zf.optim.clip_by_global_norm(1.0)).fused is None
    assert zf.optim.chain(zf.optim.clip_by_global_norm(1.0), zf.optim.sgd(0.1)).fused is None
