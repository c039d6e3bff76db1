"""What runs one pipeline stage inside torch's schedule: the module torch's `PipelineStage` wraps (the user's
loss function on one micro-batch, with the stage's parameters as its own), the intercepts that skip the
other stages' blocks and end the stage's forward after its own, and the step's transfer counters.
`zfunc.transforms.pipeline` builds them per step."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed import pipelining

from zfunc.autodiff import split_loss
from zfunc.transforms.pipeline_layout import SCHEDULES_ATTRIBUTE, PipelineLayout
from zfunc.tree import tree_leaves


class StageEnd(BaseException):
    """Ends a stage's forward after its last block (a BaseException: model code catching Exception must not
    swallow it), carrying the tensors to send to the next stage."""

    def __init__(self, tensors: tuple) -> None:
        super().__init__()
        self.tensors = tensors


class Counters:
    """Point-to-point transfers of one step: counts of micro-batch activations and gradients sent and
    received over stage boundaries, and elements moved (tied weights included)."""

    def __init__(self) -> None:
        self.activations_sent = self.activations_received = 0
        self.gradients_sent = self.gradients_received = 0
        self.tied_sent = self.tied_received = 0
        self.elements = 0

    def metrics(self) -> dict[str, int]:
        return {"pp_activations_sent": self.activations_sent, "pp_activations_received": self.activations_received,
                "pp_gradients_sent": self.gradients_sent, "pp_gradients_received": self.gradients_received,
                "pp_tied_sent": self.tied_sent, "pp_tied_received": self.tied_received,
                "pp_elements": self.elements}


class Active:
    """The stage forward running now: its stage, the activation it received, and whether its first block
    has started (root parameters it does not hold are zeros only before that)."""

    def __init__(self, stage: int, received: tuple) -> None:
        self.stage, self.received = stage, received
        self.started = False
        self.last_block = -1


class Run:
    """One ``value_and_grad`` under pipeline: the loss function, the micro-batches, what the stages return."""

    def __init__(self, fn: Callable, micro_batches: list, has_aux: bool, counters: Counters) -> None:
        self.fn, self.micro_batches, self.has_aux, self.counters = fn, micro_batches, has_aux, counters
        self.active: Active | None = None
        self.inferring = False  # torch's shape inference (first use of a schedule): not counted
        self.aux: dict[int, Any] = {}


class StageModule(nn.Module):
    """What torch's `PipelineStage` runs for one stage: the user's loss function on one micro-batch, with
    this stage's parameters as the module's own (so torch's schedules differentiate and scale them)."""

    def __init__(self, stage: int, keys: list[str], layout: PipelineLayout) -> None:
        super().__init__()
        self.stage, self.layout = stage, layout
        self.keys = list(keys)
        self.run: Run | None = None

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """This step's parameters, as fresh leaves sharing their memory."""
        for i, k in enumerate(self.keys):
            self._parameters[f"p{i}"] = nn.Parameter(tensors[k].detach(), requires_grad=True)

    def param(self, key: str) -> nn.Parameter:
        return self._parameters[f"p{self.keys.index(key)}"]

    def grads(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, k in enumerate(self.keys):
            p = self._parameters[f"p{i}"]
            out[k] = torch.zeros_like(p) if p.grad is None else p.grad
        return out

    def forward(self, *received: torch.Tensor, micro_batch: torch.Tensor) -> Any:
        run = self.run
        index = int(micro_batch.reshape(-1)[0])  # (a CPU tensor: no device sync)
        args, kwargs = run.micro_batches[index]
        mine = {k: self._parameters[f"p{i}"] for i, k in enumerate(self.keys)}
        # Every key, as apply_fn wants: other stages' parameters as empty stand-ins (`pipeline.apply`).
        sample = next_tensor(mine)
        params = {k: mine[k] if k in mine else sample.new_empty(0) for k, _ in self.layout.owner}
        counters = run.counters
        if received and not run.inferring:
            counters.activations_received += 1
            counters.elements += sum(t.numel() for t in received)
            hook_once(received, lambda: _count_gradient_sent(counters, received))
        outer, run.active = run.active, Active(self.stage, received)
        try:
            out = run.fn(params, *args, **kwargs)
        except StageEnd as end:
            sent = end.tensors
            if not run.inferring:
                counters.activations_sent += 1
                counters.elements += sum(t.numel() for t in sent)
                hook_once(sent, lambda: _count_gradient_received(counters, sent))
            return sent if len(sent) > 1 else sent[0]
        finally:
            run.active = outer
        if self.stage != self.layout.stages - 1:
            raise RuntimeError(f"pipeline: stage {self.stage}'s forward ended without running its last block "
                               f"({self.layout.stage_blocks[self.stage][-1]!r}): the loss function must run the "
                               "whole model on every micro-batch")
        loss, aux = split_loss(out, run.has_aux)
        if run.has_aux and not run.inferring:
            run.aux[index] = aux
        return loss


def hook_once(tensors: tuple, fn: Callable[[], None]) -> None:
    """Call ``fn`` once, when backward first reaches one of ``tensors`` (that need a gradient)."""
    fired = []

    def hook(grad):
        if not fired:
            fired.append(True)
            fn()
        return grad

    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(hook)
            return


def _count_gradient_sent(counters: Counters, received: tuple) -> None:
    counters.gradients_sent += 1
    counters.elements += sum(t.numel() for t in received)


def _count_gradient_received(counters: Counters, sent: tuple) -> None:
    counters.gradients_received += 1
    counters.elements += sum(t.numel() for t in sent)


class TorchStage(pipelining.PipelineStage):
    """torch's stage, telling its module when a forward is torch's shape inference (not a micro-batch)."""

    def _compute_outputs(self, *args, module, **kwargs):
        run = module.run
        run.inferring = True
        try:
            return super()._compute_outputs(*args, module=module, **kwargs)
        finally:
            run.inferring = False


class Built:
    """torch's stages and schedule for one layout and one shape of micro-batches (built on first use: torch
    infers the shapes crossing stages by running one micro-batch, which is worth doing once)."""

    def __init__(self, modules: list[StageModule], schedule: Any) -> None:
        self.modules, self.schedule = modules, schedule


class Schedules:
    """torch's built stages and schedules for one pipeline state, by the shapes of its micro-batches.

    Structure built once, not per-call scratch: torch infers the shapes crossing stages by running one
    micro-batch when a schedule is first used, which is worth doing once per state and batch shape. It lives
    with the state's `PipelineLayout` (`schedules_of`: made at the state's first step, left out of copies of
    the layout), never on the transform, which holds configuration only. A built schedule holds mutable
    state while it runs (torch's buffers, the stage modules' parameters and micro-batches), so a step takes
    one out (`take`) and puts it back when done (`give`): two steps running at once (two threads, or two
    states that share a layout) never share one; the second builds its own.
    """

    def __init__(self) -> None:
        self._free: dict[Any, list[Built]] = {}
        self._lock = threading.Lock()

    def take(self, key: Any) -> Built | None:
        """A built schedule for ``key`` that no step is using, taken out of the cache (None: build one)."""
        with self._lock:
            free = self._free.get(key)
            return free.pop() if free else None

    def give(self, key: Any, built: Built) -> None:
        """``built`` is free again (kept one per key: a second, built while the first was in use, is dropped)."""
        with self._lock:
            free = self._free.setdefault(key, [])
            if not free:
                free.append(built)


def schedules_of(layout: PipelineLayout) -> Schedules:
    """The built schedules of the state whose layout is ``layout`` (see `Schedules`)."""
    found = layout.__dict__.get(SCHEDULES_ATTRIBUTE)
    if found is None:  # (setdefault: atomic, so two threads' first steps agree on one cache)
        found = layout.__dict__.setdefault(SCHEDULES_ATTRIBUTE, Schedules())
    return found


def block_intercept(block: str, position: int, stage: int, active: Active, mine: tuple, last_stage: bool):
    """What replaces block ``block``'s call in the forward of stage ``active.stage``."""

    def intercept(run, args, kwargs):
        if position <= active.last_block:
            raise RuntimeError(
                f"pipeline: block {block!r} ran out of order (after a later block, or twice): a pipelined model "
                "must call each of its blocks once per forward, in order")
        active.last_block = position
        if stage != active.stage:  # another stage's block: the activation received stands for its output
            if stage > active.stage or not active.received:
                raise RuntimeError(f"pipeline: block {block!r} of stage {stage} ran in stage {active.stage}'s "
                                   "forward before that stage's own blocks ended")
            return active.received[0] if len(active.received) == 1 else active.received
        if block == mine[0]:
            active.started = True
            if active.received and not (args and any(args[0] is t for t in active.received)):
                raise RuntimeError(
                    f"pipeline: the first block of stage {active.stage} ({block!r}) was not given the activation "
                    "the previous stage's last block returned: the model computes on it between blocks (e.g. a "
                    "residual added outside the blocks), which a stage that skipped those blocks cannot "
                    "reproduce. Pipelining needs models whose blocks take the previous block's output as their "
                    "first argument (hidden = block(hidden, ...)), as Hugging Face transformers do.")
        out = run(*args, **kwargs)
        if block == mine[-1] and not last_stage:
            tensors = tuple(x for x in tree_leaves(out) if isinstance(x, torch.Tensor))
            if not tensors:
                raise RuntimeError(f"pipeline: block {block!r} returned no tensor to send to the next stage")
            raise StageEnd(tensors)
        return out

    return intercept


def identity_loss(output, target):
    """The last stage's module already returns the micro-batch's loss (the user's loss function)."""
    return output


def next_tensor(params: dict) -> torch.Tensor:
    return next(t for t in params.values() if isinstance(t, torch.Tensor))
