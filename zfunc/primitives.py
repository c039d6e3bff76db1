"""The primitives a step is written with, and their dispatch through the running stack's handlers.

A step is an ordinary function ``(state, batch) -> (state, metrics)`` written
with zfunc's primitives. Each primitive is a small function that, outside a
transformed step, runs its plain implementation, and inside one hands the
call to the stack's handlers, outermost first, each of which may rewrite the
arguments, call ``next`` (the rest of the stack, ending in the plain
implementation) and rewrite the result (`dispatch`). This is JAX's
interpreter idea reduced to what zfunc needs (ARCHITECTURE.md walks one call
end to end; `zfunc.interpret` builds the stacks that handle them):

=====================  =================================================  ==========================
primitive              what it means                                      dispatched by
=====================  =================================================  ==========================
``apply``              run the model on some parameters (`ModelCall`)     `functional`'s apply_fn
``value_and_grad``     loss and first-order gradients w.r.t. params       `value_and_grad`
``gradients_ready``    backward has returned: finish what it started      the plain value_and_grad
``apply_gradients``    one optimizer update of a state                    `TrainState.apply_gradients`
``update_params``      the optimizer arithmetic on (params, grads, state) the plain apply_gradients
``psum``               sum a per-shard partial quantity over shards       norms, overflow checks
``sum_of_squares``     Σ x² of a param-shaped tree, each element counted  `optim.global_norm`
                       once over the ranks that hold it
=====================  =================================================  ==========================

Why outermost first: ``shard(offload(mixed_precision(step)))`` must partition
the gradients (shard) before they are moved to the host (offload) and
unscaled against the fp32 master (mixed_precision); results flow back the
other way (master -> compute copy -> device -> all-gather).

Two primitives are dispatched from *inside* the plain implementation of
another, so they reach transforms outer to where the work started:

- ``gradients_ready``: asynchronous gradient reductions that `shard` issues
  during backward must be finished before anyone reads the gradients, and
  that is right after the backward pass that produced them returns (once per
  micro-batch under `accumulate`, once per backward under `checkpoint`'s
  nested recomputes — not at the end of each nested backward, which would
  serialize communication with compute). Only the plain implementation knows
  when its backward returned.
- ``update_params``: the optimizer runs on whatever tensors reach it after
  every transform placed them (shards, host copies, the fp32 master); the
  transforms that own donated buffers declare it (``Facts.fused_update``) and
  the plain implementation then runs the fused kernel in place.

Values otherwise flow down as arguments and back as return values: e.g.
`mixed_precision` asks the update for a compute-dtype copy (`UpdateRequest`)
and gets it back with the new state (`Updated`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from zfunc.step_context import current
from zfunc.tree import tree_sum_of_squares

PRIMITIVES = ("apply", "value_and_grad", "gradients_ready", "apply_gradients", "update_params", "psum",
              "sum_of_squares")


def dispatch(primitive: str, plain: Callable, *args: Any) -> Any:
    """Run ``primitive`` through the running stack's handlers, outermost first.

    Each handler is called as ``handler(next, *args)``; ``next(*args)``
    continues with the next handler, and after the innermost with
    ``plain(*args)``.
    """
    ctx = current()
    if ctx is None:
        return plain(*args)
    handlers = ctx.stack.handlers[primitive]
    if not handlers:
        return plain(*args)

    # Built from the innermost outwards, each handler bound to the one after it: a chain of partials that
    # refer inwards only. (A recursive closure, a function whose cell holds itself, is a reference cycle:
    # with what it reached, such as the step's context and its device scalars, it lived until the garbage
    # collector's next pass, which then ran about once a step; and the small tensors it held moved where the
    # next step's gradients landed.)
    call = plain
    for handler in reversed(handlers):
        call = functools.partial(handler, call)
    return call(*args)


def psum(x: torch.Tensor) -> torch.Tensor:
    """Σ over data-parallel shards of a per-shard partial quantity.

    Under `shard` every rank holds a slice of each parameter, gradient and
    optimizer state, so a sum over their elements (a squared norm, a count of
    non-finite values) is partial; ``psum`` adds the partial sums of all ranks.
    Without `shard` it returns ``x`` unchanged. Use it only for sums over
    parameter-shaped data, never for replicated values (those would be counted
    N times).
    """
    return dispatch("psum", _identity, x)


def _identity(x):
    return x


def sum_of_squares(tree: Any) -> torch.Tensor:
    """Σ x² over the elements of ``tree`` (param-shaped: a dict keyed like the params, or any pytree) that
    this rank should count, as float32 (``psum`` of it is the global squared norm).

    Without transforms every element counts. Under `tensor_parallel` a parameter replicated over the
    tp ranks (a norm's weight, a row-parallel bias) is counted on one of them only, so that ``psum``
    over tp adds each element once.
    """
    return dispatch("sum_of_squares", tree_sum_of_squares, tree)


def gradients_ready(grads: Any) -> Any:
    """Tell the stack that a backward pass returned ``grads`` (see the module docstring)."""
    return dispatch("gradients_ready", _identity, grads)


class UpdateRequest(NamedTuple):
    """What the caller of an update wants back besides the new state.

    ``compute_dtype``: also return the new parameters cast to this dtype (the
    compute copy of `mixed_precision`); ``compute_into``: tensors, keyed like
    the params, that the copy should be written into when the update can
    (a fused kernel writes it in the same pass); ``host_threads``: threads
    for a host kernel (`offload`'s share of the cores); ``grads_landing``:
    gradients in host memory that may still be landing from the GPU
    (`zfunc.tiers.landing.HostLanding`, under `offload` at one micro-batch):
    whatever reads one on the host calls ``grads_landing.wait(g)`` (or
    ``wait_all()``) first; ``flat_runs``: groups of keys (each in buffer
    order) whose tensors are consecutive views of one flat buffer in each
    param-shaped operand that records it (`zfunc.optim.flat`), so that a
    traced update can run once per buffer; ``flat_grads``: for each flat run,
    None or ``(flat, parts)``: a 1-D gradient of the run whose keys' gradients
    were made as ``parts`` (views of it, in order), read whole by the update
    where the gradients it is given are still those very views;
    ``flat_params``: likewise for the parameters (and so the compute copy
    `mixed_precision` asks for into them): per flat run, None or ``(flat,
    parts)``, the run's parameters given as ``parts``, views of ``flat`` made
    in a trace (which records no buffer on them), so that the update writes
    the run's new values into ``flat`` in one piece.
    """

    compute_dtype: torch.dtype | None = None
    compute_into: dict | None = None
    host_threads: int | None = None
    grads_landing: Any = None
    flat_runs: tuple[tuple[str, ...], ...] | None = None
    flat_grads: tuple | None = None
    flat_params: tuple | None = None


class Updated(NamedTuple):
    """The result of the ``apply_gradients`` primitive: the new state and, if an `UpdateRequest`
    asked for one, the compute copy of its parameters (else None)."""

    state: Any
    compute_copy: dict | None = None


