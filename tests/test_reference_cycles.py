"""A steady-state step leaves no reference cycles behind (issue 25: a step's host work).

What a step allocates must be freed when the step's last reference to it goes, not by the garbage
collector: an object in a reference cycle lives until the collector's next pass, and so does every
tensor it reaches. One cycle a step (the recursive closure of primitive dispatch, a finding's
explanation holding the step's context) made the collector run about once a step, kept the step's
context and device scalars alive into the next one, and, on a GPU, moved where the next step's
gradients landed (the caching allocator's small blocks still taken), so the fused update's table of
gradient addresses was sent again at every step. Checked over the stacks of the host-read test.
"""

from __future__ import annotations

import collections
import gc

import pytest

import zfunc as zf
from tests.models import make_batch, tiny_lm_step
from tests.test_host_reads import OFFLOAD, STACKS, _optimizer

WARM_STEPS, COUNTED_STEPS = 2, 2


def _describe(garbage: list) -> str:
    kinds = collections.Counter(type(o).__name__ for o in garbage)
    functions = sorted({f"{o.__code__.co_filename.rsplit('/', 1)[-1]}:{o.__code__.co_firstlineno} {o.__qualname__}"
                        for o in garbage if type(o).__name__ == "function"})
    return f"{len(garbage)} objects: {dict(kinds.most_common(12))}; functions: {functions[:8]}"


def cycles_of_steady_state_steps(name: str, optimizer: str, stacks: dict) -> list:
    """The objects ``COUNTED_STEPS`` steps of a stack left only to the garbage collector, after warm-up steps."""
    _, params, train_step = tiny_lm_step()
    step = stacks[name](train_step)
    state = step.init(zf.TrainState.create({k: v.clone() for k, v in params.items()}, _optimizer(optimizer)))
    for i in range(WARM_STEPS):
        state, _ = step(state, make_batch(8, seed=i))
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()  # (no pass may run inside the counted steps: what they leave is found by the one below)
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for i in range(WARM_STEPS, WARM_STEPS + COUNTED_STEPS):
            state, metrics = step(state, make_batch(8, seed=i))
        del metrics
        gc.collect()
        garbage = list(gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        if enabled:
            gc.enable()
    return garbage


@pytest.mark.parametrize("name", list(STACKS) + list(OFFLOAD))
def test_a_steady_state_step_leaves_no_reference_cycles(name):
    garbage = cycles_of_steady_state_steps(name, "clip", {**STACKS, **OFFLOAD})  # (clip + AdamW: the fused form)
    assert not garbage, f"{name}: steady-state steps left reference cycles: {_describe(garbage)}"


def test_the_check_finds_a_cycle():  # (the test above can fail)
    def leaky(step):
        def run(state, batch):
            box = {"batch": batch}
            box["self"] = box  # a cycle made at every step
            return step(state, batch)
        run.init = step.init
        return run

    garbage = cycles_of_steady_state_steps("leaky", "sgd", {"leaky": lambda s: leaky(STACKS["shard1"](s))})
    assert any(type(o) is dict and "self" in o for o in garbage)
