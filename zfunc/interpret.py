"""How transforms rewrite a step: primitives, handlers and the transform stack.

A step is an ordinary function ``(state, batch) -> (state, metrics)`` written
with zfunc's primitives. Each primitive is a small function that, when no
transform is active, runs its plain implementation, and otherwise hands the
call to the active transforms first, outermost first, each of which may
rewrite the arguments, call ``next`` (the rest of the stack, ending in the
plain implementation) and rewrite the result. This is JAX's interpreter idea
reduced to what zfunc needs:

===================  ==================================================  ==================
primitive            what it means                                       called by
===================  ==================================================  ==================
``apply``            run the model on some parameters (`ModelCall`)      `functional`'s apply_fn
``value_and_grad``   loss and first-order gradients w.r.t. params        `value_and_grad`
``apply_gradients``  one optimizer update of a state                     `TrainState.apply_gradients`
``psum``             sum a per-shard partial quantity over shards        norms, overflow checks
``update_params``    the optimizer arithmetic on (params, grads, state)  the plain apply_gradients
``compute_copy``     the compute-dtype copy of the fp32 master          mixed_precision
``watch_gradients``  be told of gradient parts as backward makes them   offload (shard answers)
===================  ==================================================  ==================

Why outermost first: ``shard(offload(mixed_precision(step)))`` must partition
the gradients (shard) before they are moved to the host (offload) and
unscaled against the fp32 master (mixed_precision); results flow back the
other way (master -> compute copy -> device -> all-gather).

The stack lives in a `contextvars.ContextVar` that is set only while a
transformed step runs, so nothing persists between calls and concurrent
threads do not see each other's transforms. It is the one piece of dynamic
state in zfunc besides the process group.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, ClassVar, Iterator

import torch

_ACTIVE: contextvars.ContextVar[tuple["Transform", ...]] = contextvars.ContextVar(
    "zfunc_active_transforms", default=()
)


def active_transforms() -> tuple["Transform", ...]:
    """The transforms of the step running now, outermost first."""
    return _ACTIVE.get()


@contextlib.contextmanager
def activate(transform: "Transform") -> Iterator[None]:
    """Push ``transform`` onto the stack for the duration of the block."""
    token = _ACTIVE.set(_ACTIVE.get() + (transform,))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def dispatch(primitive: str, plain: Callable, *args: Any) -> Any:
    """Run ``primitive`` through the active transforms, outermost first.

    Each transform that defines a method named ``primitive`` is called as
    ``transform.<primitive>(next, *args)``; ``next(*args)`` continues with the
    next transform, and after the innermost with ``plain(*args)``.
    """
    handlers = [getattr(t, primitive) for t in _ACTIVE.get() if hasattr(t, primitive)]

    def call(index: int, *call_args: Any) -> Any:
        if index == len(handlers):
            return plain(*call_args)
        return handlers[index](lambda *a: call(index + 1, *a), *call_args)

    return call(0, *args)


def psum(x: torch.Tensor) -> torch.Tensor:
    """Σ over data-parallel shards of a per-shard partial quantity.

    Under `shard` every rank holds a slice of each parameter, gradient and
    optimizer state, so a sum over their elements (a squared norm, a count of
    non-finite values) is partial; ``psum`` adds the partial sums of all ranks.
    Without `shard` it returns ``x`` unchanged. Use it only for sums over
    parameter-shaped data, never for replicated values (those would be counted
    N times).
    """
    return dispatch("psum", lambda t: t, x)


# --------------------------------------------------------------------------
# The protocol every transform follows.


class Transform:
    """Base class of step transforms (`accumulate`, `mixed_precision`, ...).

    A transform wraps a step (a plain function or another transform) and is
    itself a step: ``transform(state, batch) -> (state, metrics)``. It also has

    - ``init(state)``: the plain state from `TrainState.create`, rewritten into
      this stack's layout (inner transforms first, then this one),
    - ``gather(state)``: a dict of full parameters in the master dtype, keyed
      like `functional`'s params, on every rank,
    - a ``repr`` that shows the whole stack and its settings.

    Subclasses set ``name`` and ``level`` and override what they need:
    ``run`` (around the inner step), ``init_state``, ``gather_params`` and any
    primitive handler (a method named after the primitive, see module doc).

    ``level`` orders transforms: a transform may wrap only steps whose
    transforms have a level at most its own. Compute transforms (accumulate,
    checkpoint, mixed_precision) are level 0, offload 1, shard 2, so the only
    stacks refused are those that would, e.g., move whole gradients to the
    host before partitioning them.
    """

    name: ClassVar[str] = "transform"
    level: ClassVar[int] = 0

    def __init__(self, step: Callable) -> None:
        if not callable(step):
            raise TypeError(f"{self.name}() takes a step function (state, batch) -> (state, metrics), "
                            f"got {type(step).__name__}")
        for inner in transforms_of(step):
            if inner.name == self.name:
                raise ValueError(f"{self.name} is applied twice in {step!r}; apply it once")
            if inner.level > self.level:
                raise ValueError(
                    f"{self.name}(...) cannot wrap {inner.name}(...): {inner.name} must be the outer one. "
                    f"Order transforms as shard(offload(compute_transforms(step))), e.g. "
                    f"{inner.name}({self.name}(step)) instead of {self.name}({inner.name}(step))."
                )
        self.step = step

    # -- the step --------------------------------------------------------
    def __call__(self, state, batch):
        with activate(self):
            return self.run(state, batch)

    def run(self, state, batch):
        """Runs the inner step with this transform active; override to add work around it."""
        return self.step(state, batch)

    # -- layout ----------------------------------------------------------
    def init(self, state):
        """Rewrite a plain `TrainState` into this stack's layout."""
        inner = self.step.init(state) if isinstance(self.step, Transform) else state
        return self.init_state(inner)

    def init_state(self, state):
        return state

    def gather(self, state) -> dict[str, torch.Tensor]:
        """Full parameters (master dtype) as a dict keyed like `functional`'s params."""
        inner = self.step.gather if isinstance(self.step, Transform) else _plain_gather
        return self.gather_params(state, inner)

    def gather_params(self, state, next: Callable) -> dict[str, torch.Tensor]:
        return next(state)

    # -- display ---------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """The settings shown by ``repr``; override in subclasses."""
        return {}

    def __repr__(self) -> str:
        inner = repr(self.step) if isinstance(self.step, Transform) else getattr(
            self.step, "__name__", repr(self.step))
        extra = "".join(f", {k}={v!r}" for k, v in self.settings().items())
        return f"{self.name}({inner}{extra})"


def transforms_of(step: Callable) -> list[Transform]:
    """The transforms of a step, outermost first (empty for a plain function)."""
    found = []
    while isinstance(step, Transform):
        found.append(step)
        step = step.step
    return found


def _plain_gather(state) -> dict[str, torch.Tensor]:
    return dict(state.params)


def init(step: Callable, state):
    """``step.init(state)`` for a transform, ``state`` itself for a plain step."""
    return step.init(state) if isinstance(step, Transform) else state


def gather(step: Callable, state) -> dict[str, torch.Tensor]:
    """``step.gather(state)`` for a transform, ``dict(state.params)`` for a plain step."""
    return step.gather(state) if isinstance(step, Transform) else _plain_gather(state)
