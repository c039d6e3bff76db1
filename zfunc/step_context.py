"""The step context: everything that lives for one call of a transformed step, and where to find it.

Everything that lives for one call of a transformed step — the handlers'
per-call scratch, the facts of the stack — is in one `StepContext`, reached
through one `contextvars.ContextVar` (`CONTEXT`) that is set only while a
transformed step runs (`zfunc.interpret.Transform.__call__` sets it). Transform
objects hold their configuration only: running one changes nothing in it, and
two threads may run steps of one stack at once. Work that autograd runs later
on its own threads (backward of CUDA ops) must not look the context up: it
captures what it needs when the forward builds it. While torch.compile traces
a step, the context is in `TRACED`, a slot dynamo can trace, instead.

What a step finds on the device (a NaN loss) skips its update there
(`StepContext.skip_update_if`) and is reported at the next use of the state
the step returned (`zfunc.donation.Finding`).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from zfunc.donation import Finding

if TYPE_CHECKING:  # (the interpreter builds stacks and contexts; this module only holds them)
    from zfunc.interpret import Stack, Transform


class StepContext:
    """Everything that lives for one call of a transformed step (see the module docstring).

    ``scratch`` holds each transform's per-call object (`Transform.start`),
    keyed by the transform; ``state_consumed`` is set once a handler starts
    writing into the state's buffers (the input state is dead from then on,
    even if the step later fails).
    """

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.facts = stack.facts
        self.scratch: dict[int, Any] = {}
        self.state_consumed = False
        # Whether this step's update is skipped (a 0-d bool on the device; None: it is not), and why: what a
        # step found on the device (a NaN loss, fp16 overflow at the minimum scale) without reading it on the
        # host. The update reads ``skip`` on the device; the findings are raised at the next use of the state.
        self.skip: torch.Tensor | None = None
        # A CUDA event recorded right after ``skip`` was last made: a host update that must know it (to skip its
        # work) waits for this, not for everything queued on the stream since (backward).
        self.skip_ready: Any = None
        self.findings: list[Finding] = []
        # Where gradients are summed across micro-batches, if anywhere (`accumulate`'s accumulator): `shard`
        # adds each unit's reduced gradient into it as soon as the reduction lands, then frees the unit's.
        self.grad_sink: Any = None
        # Set by a transform that runs forward and backward itself (`pipeline`: torch's schedule): the plain
        # value_and_grad hands it the loss function as the transforms inside rewrote it, and returns its result.
        self.differentiate: Callable | None = None

    def skip_update_if(self, flag: torch.Tensor, finding: Finding | None = None) -> None:
        """Skip this step's update where ``flag`` (0-d, on the device) is nonzero, without a host read; with
        ``finding``, an error to raise at the next use of the state the step returns (see `Finding`)."""
        flag = flag.detach() != 0
        self.skip = flag if self.skip is None else self.skip | flag
        if self.skip.is_cuda and not torch.compiler.is_compiling():
            self.skip_ready = torch.cuda.Event()
            self.skip_ready.record()
        if finding is not None:
            self.findings.append(finding)

    def of(self, transform: Transform) -> Any:
        """``transform``'s per-call scratch."""
        try:
            return self.scratch[id(transform)]
        except KeyError:
            raise RuntimeError(f"{transform.name}'s primitives ran outside its step") from None


def count_increment(skip: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a step's counts advance by where its update may be skipped: 0 where ``skip`` (a 0-d bool flag,
    `StepContext.skip`) is set, else 1, as ``dtype``, on the flag's device (no host read). Made once per flag and
    dtype in an eager step and kept on the flag, which lives as long as the step: the optimizer's counts and
    the state's step count advance by one tensor (on a GPU each count made its own: two launches each)."""
    if torch.compiler.is_dynamo_compiling():
        return (~skip).to(dtype)
    made = getattr(skip, "_zfunc_increment", None)
    if made is None or made.dtype != dtype:
        made = torch.where(skip, 0, 1)
        made = skip._zfunc_increment = made if made.dtype == dtype else made.to(dtype)
    return made


# The context of the eager step running now on this thread (set by `zfunc.interpret.Transform.__call__`).
CONTEXT: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar("zfunc_step", default=None)


class _Traced:
    """The context of the transformed step that `torch.compile` is tracing (see `current`).

    Dynamo cannot trace `ContextVar.get`, but it does trace reads and writes
    of a plain object's attribute, symbolically: while it traces a step, the
    traced ``__call__`` stores its context here in the tracer's model of the
    program only, and the compiled code's one runtime effect on this object
    is to write back the value it already holds (None). Tracing is
    serialized by dynamo's compile lock, so two threads never see each
    other's context here, and eager steps never touch it.
    """

    def __init__(self) -> None:
        self.context: StepContext | None = None


TRACED = _Traced()


def current() -> StepContext | None:
    """The context of the transformed step running now on this thread, if any (while torch.compile
    traces a step: the traced step's)."""
    if torch.compiler.is_dynamo_compiling():
        return TRACED.context
    return CONTEXT.get()

