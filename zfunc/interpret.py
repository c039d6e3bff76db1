"""How transforms rewrite a step: primitives, the step context and the transform stack.

A step is an ordinary function ``(state, batch) -> (state, metrics)`` written
with zfunc's primitives. Each primitive is a small function that, outside a
transformed step, runs its plain implementation, and inside one hands the
call to the stack's handlers, outermost first, each of which may rewrite the
arguments, call ``next`` (the rest of the stack, ending in the plain
implementation) and rewrite the result. This is JAX's interpreter idea
reduced to what zfunc needs (ARCHITECTURE.md walks one call end to end):

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

The step context. Everything that lives for one call of a transformed step
— the handlers' per-call scratch, the facts of the stack — is in one
`StepContext`, reached through one `contextvars.ContextVar` that is set only
while a transformed step runs. Transform objects hold their configuration
only: running one changes nothing in it, and two threads may run steps of
one stack at once. Work that autograd runs later on its own threads
(backward of CUDA ops) must not look the context up: it captures what it
needs when the forward builds it.

Facts about the stack are computed once, when the stack is built: each
transform declares what it does (`Transform.declare`), from the innermost
out, into one frozen `Facts`; no transform looks another up by name or type.

What a step finds on the device (a NaN loss) skips its update there
(`StepContext.skip_update_if`) and is reported at the next use of the state
the step returned; that, and donation (a step consumes the state it is
given), is `zfunc.donation`, whose names this module re-exports.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar, Literal, NamedTuple

import torch

from zfunc.donation import (  # noqa: F401 (re-exported: the interpreter's names for what it runs)
    Donation,
    Finding,
    Pending,
    check_alive,
    check_laid_out_by,
    consume,
    defer_findings,
    forget_copies,
)
from zfunc.materialize import is_meta, materialized
from zfunc.state_check import require_state
from zfunc.tree import tree_leaves, tree_sum_of_squares

PRIMITIVES = ("apply", "value_and_grad", "gradients_ready", "apply_gradients", "update_params", "psum",
              "sum_of_squares")

Tier = Literal["device", "host", "nvme"]


@dataclasses.dataclass(frozen=True)
class Facts:
    """What a stack of transforms does, as its transforms declare it (see `Transform.declare`).

    Attributes:
      compute_dtype: the dtype the model computes in (`mixed_precision`; None: the params' own).
      master_dtype: the dtype of the master parameters the optimizer updates (None: the params').
      reduce_dtype: the dtype gradients are reduced in across ranks (None: the gradients' own).
      loss_scaling: "none", "static" or "dynamic" (fp16 `mixed_precision`).
      stage: the ZeRO stage of `shard` (0 without shard).
      optimizer_tier: where the optimizer state and its update live ("device", "host", "nvme"): the
        tier holding most of it.
      optimizer_split: the shares (device, host, nvme) of the optimizer state (master and moments),
        placed unit by unit (`shard` places them; the update runs where each unit lives).
      nvme_dir: the directory of the NVMe tier's files.
      params_tier: where parameter shards live between their uses (stage 3).
      fused_update: whether the optimizer may run as a fused in-place kernel (the stack owns the
        state's buffers, which the step consumes); False keeps the pure pytree update.
      micro_batches: forward/backward passes per update (`accumulate`).
      accumulates: whether `accumulate` sums the gradients in its own accumulator.
      accumulate_dtype: the dtype `accumulate` was asked to sum in (None: fp32 under a narrower compute
        dtype, else the compute dtype; `zfunc.transforms.grad_accumulator.accumulation_dtype`).
      recompute: whether the model's blocks are recomputed in backward (`checkpoint`, or stage 3
        with ``reshard="recompute"``): activations of one block, not of all.
      pp: the pipeline-parallel degree (`pipeline`): each rank holds the parameters of its stages only, and
        the loss exists on the last stage (which is why `pipeline` checks it for NaN itself).
      tp: the tensor-parallel degree (`tensor_parallel`): sharded parameters hold 1/tp of their elements.
    """

    compute_dtype: torch.dtype | None = None
    master_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    loss_scaling: Literal["none", "static", "dynamic"] = "none"
    stage: int = 0
    optimizer_tier: Tier = "device"
    optimizer_split: tuple[float, float, float] = (1.0, 0.0, 0.0)
    nvme_dir: str | None = None
    params_tier: Tier = "device"
    fused_update: bool | None = None  # None: nobody declared; the pure update
    micro_batches: int = 1
    accumulates: bool = False
    accumulate_dtype: torch.dtype | None = None
    recompute: bool = False
    pp: int = 1
    tp: int = 1

    def replace(self, **changes: Any) -> Facts:
        return dataclasses.replace(self, **changes)


class Stack:
    """A transformed step's transforms, outermost first, their facts and their handlers (built once)."""

    def __init__(self, outermost: Transform) -> None:
        self.transforms: tuple[Transform, ...] = tuple(transforms_of(outermost))
        facts = Facts()
        for transform in reversed(self.transforms):  # innermost first: outer ones see inner facts
            facts = transform.declare(facts)
        self.facts = facts
        for transform in self.transforms:
            transform.check(facts)
        self.handlers: dict[str, tuple[Callable, ...]] = {
            p: tuple(getattr(t, p) for t in self.transforms if callable(getattr(type(t), p, None)))
            for p in PRIMITIVES}
        self._ids = frozenset(id(t) for t in self.transforms)
        # Memory a transform keeps from one call of this stack to the next, by name (host gradient buffers:
        # `zfunc.transforms.grad_accumulator.HostBuffers`); each entry is safe for concurrent calls itself.
        self.kept: dict[str, Any] = {}

    def __contains__(self, transform: Transform) -> bool:
        return id(transform) in self._ids


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
        if finding is not None:
            self.findings.append(finding)

    def of(self, transform: Transform) -> Any:
        """``transform``'s per-call scratch."""
        try:
            return self.scratch[id(transform)]
        except KeyError:
            raise RuntimeError(f"{transform.name}'s primitives ran outside its step") from None


_CONTEXT: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar("zfunc_step", default=None)


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


_TRACED = _Traced()


def current() -> StepContext | None:
    """The context of the transformed step running now on this thread, if any (while torch.compile
    traces a step: the traced step's)."""
    if torch.compiler.is_dynamo_compiling():
        return _TRACED.context
    return _CONTEXT.get()


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
    for a host kernel (`offload`'s share of the cores).
    """

    compute_dtype: torch.dtype | None = None
    compute_into: dict | None = None
    host_threads: int | None = None


class Updated(NamedTuple):
    """The result of the ``apply_gradients`` primitive: the new state and, if an `UpdateRequest`
    asked for one, the compute copy of its parameters (else None)."""

    state: Any
    compute_copy: dict | None = None


# --------------------------------------------------------------------------
# The protocol every transform follows.


class Transform:
    """Base class of step transforms (`accumulate`, `mixed_precision`, ...).

    A transform wraps a step (a plain function or another transform) and is
    itself a step: ``transform(state, batch) -> (state, metrics)``. It also has

    - ``init(state)``: the plain state from `TrainState.create`, rewritten into
      this stack's layout (inner transforms first, then this one),
    - ``gather(state)``: a dict of full parameters in the master dtype, keyed
      like `functional`'s params, on every rank (fresh tensors that later steps
      do not change),
    - a ``repr`` that shows the whole stack and its settings.

    Subclasses set ``name`` and ``level`` and override what they need:
    ``declare`` (the facts they add), ``start`` (their per-call scratch),
    ``run`` (around the inner step), ``init_state``, ``gather_params`` and any
    primitive handler (a method named after the primitive, see the module doc).
    A transform object holds only its configuration: nothing may be stored on
    it while a step runs (use the scratch).

    ``level`` orders transforms: a transform may wrap only steps whose
    transforms have a level at most its own. Compute transforms (accumulate,
    checkpoint, compile_blocks, mixed_precision) are level 0, tensor_parallel 0.5,
    pipeline 0.75, offload 1, shard 2, so the only
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
                    f"Order transforms as shard(offload(pipeline(tensor_parallel(compute_transforms(step))))), e.g. "
                    f"{inner.name}({self.name}(step)) instead of {self.name}({inner.name}(step)).")
        self.step = step

    @functools.cached_property
    def stack(self) -> Stack:
        """This transform's stack (itself and everything it wraps) and its facts, built once (an
        inner transform's own stack is a part; a step runs under its outermost transform's)."""
        return Stack(self)

    # -- the step --------------------------------------------------------
    def __call__(self, state, batch):
        if torch.compiler.is_dynamo_compiling():
            return self._traced_call(state, batch)
        ctx = _CONTEXT.get()
        if ctx is not None and self in ctx.stack:  # called by the transform around it
            return self._run(ctx, state, batch)
        require_state(state, f"{self.name}(...)")  # (a pair from zf.io.restore, params, a model: said first)
        ctx = StepContext(self.stack)
        token = _CONTEXT.set(ctx)
        try:
            check_alive(state, f"{self.name}(...)")
            check_copies(state, self)
            try:
                out = self._run(ctx, state, batch)
            except BaseException:
                if ctx.state_consumed:
                    consume(state, f"{self!r}, which failed after it began updating it in place")
                raise
            if not (isinstance(out, tuple) and out and out[0] is state):
                consume(state, f"{self!r}")
            if isinstance(out, tuple) and out:
                stamp_copies(out[0], self)
                if ctx.findings:  # raised at the next use of the state returned (`check_alive`)
                    defer_findings(out[0], Pending(ctx.findings, state.step))
            return out
        finally:
            _CONTEXT.reset(token)

    def _traced_call(self, state, batch):
        """``__call__`` while torch.compile traces it: the same steps, the context kept in `_TRACED`
        (which dynamo can trace) instead of the ContextVar (which it cannot)."""
        ctx = _TRACED.context
        if ctx is not None and self in ctx.stack:
            return self._run(ctx, state, batch)
        require_state(state, f"{self.name}(...)")
        # A fresh Stack, not the cached ``self.stack``: filling that cache while tracing would be replayed
        # when the compiled step runs, and change what the next call's guards saw (`zfunc.compiled`).
        ctx = StepContext(Stack(self))
        outer, _TRACED.context = _TRACED.context, ctx
        try:
            out = self._run(ctx, state, batch)
            if not (isinstance(out, tuple) and out and out[0] is state):
                # (The name, not repr: a setting dynamo made symbolic cannot be formatted while tracing.)
                consume(state, f"{self.name}(...)")
            return out
        finally:
            _TRACED.context = outer

    def _run(self, ctx: StepContext, state, batch):
        check_alive(state, f"{self.name}(...)")
        if self is ctx.stack.transforms[0]:
            check_laid_out_by(state, {t.name for t in ctx.stack.transforms}, self)
        ctx.scratch[id(self)] = self.start(ctx, state)
        return self.run(state, batch)

    def declare(self, facts: Facts) -> Facts:
        """The stack's facts with what this transform does added (default: nothing)."""
        return facts

    def check(self, facts: Facts) -> None:
        """Refuse, with a clear error, a stack whose facts this transform cannot work with (default: none)."""

    def start(self, ctx: StepContext, state) -> Any:
        """This transform's per-call scratch (reached with `call_scratch`); default None."""
        return None

    def call_scratch(self) -> Any:
        """The scratch `start` made for the step running now on this thread."""
        ctx = current()
        if ctx is None:
            raise RuntimeError(f"{self.name}'s primitives ran outside its step")
        return ctx.of(self)

    def run(self, state, batch):
        """Runs the inner step with this transform active; override to add work around it."""
        return self.step(state, batch)

    # -- layout ----------------------------------------------------------
    def init(self, state, *, init_device="cpu"):
        """Rewrite a plain `TrainState` into this stack's layout.

        Args:
          state: the state from `TrainState.create` (not already initialized). For
            a model built on the meta device, the parameters get their values here
            (`zfunc.materialize`), one unit at a time under `shard`.
          init_device: where a meta-built model's values are drawn (its generator
            decides them; the CPU matches eager construction).
        Returns:
          The state in this stack's layout (shards, host placement, masters).
        """
        require_state(state, f"{self.name}(...).init")
        check_alive(state, f"{self.name}(...).init")
        if getattr(state, "materializer", None) is not None and is_meta(tree_leaves(state.params)):
            out = self.init_meta(state, init_device)
        else:
            out = self.init_state(self.step.init(state) if isinstance(self.step, Transform) else state)
        stamp_copies(out, self)
        return out

    def init_meta(self, state, init_device):
        """``init`` of a meta-built model's state; by default every value at once (only `shard`, which keeps
        a share of each unit, streams them)."""
        return self.init(materialized(state, init_device))

    def init_state(self, state):
        return state

    def copies(self, state) -> dict[str, torch.Tensor]:
        """Tensors of ``state`` this transform keeps consistent with each other (a compute copy and its
        master), by a name for errors; an edit between steps is refused (`check_copies`). Default: none."""
        return {}

    def copies_explained(self) -> str:
        """What `copies` are, for the error that refuses an edit to them."""
        return ""

    def gather(self, state) -> dict[str, torch.Tensor]:
        """Full parameters (master dtype), keyed like `functional`'s params, on every rank.

        Args:
          state: a state in this stack's layout (from ``init`` or a step).
        Returns:
          A dict of fresh tensors: later steps do not change them.
        """
        require_state(state, f"{self.name}(...).gather")
        check_alive(state, f"{self.name}(...).gather")
        full = self._gather(state)
        for transform in _wrapped(self):  # e.g. tensor_parallel's all-gather over its dim, after shard's
            full = transform.complete_gather(full, state)
        return fresh_copies(full, state)

    def rank_params(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The part of the model's full ``params`` one rank holds along this transform's mesh dimension, as
        meta tensors of their shapes (`zfunc.plan` counts bytes from them); default: all of them."""
        return params

    def partition_ranks(self) -> int | None:
        """How many ranks this transform partitions the state over (`shard`: its dp group), for `zfunc.plan`;
        default None (it partitions nothing)."""
        return None

    def complete_gather(self, params: dict[str, torch.Tensor], state) -> dict[str, torch.Tensor]:
        """The parameters the outermost transform's gather collected, made whole along this transform's own
        mesh dimension (default: as they are). Runs after every ``gather_params``, outermost first."""
        return params

    def _gather(self, state) -> dict[str, torch.Tensor]:
        inner = self.step._gather if isinstance(self.step, Transform) else _plain_gather
        return self.gather_params(state, inner)

    def gather_params(self, state, next: Callable) -> dict[str, torch.Tensor]:
        return next(state)

    # ``step.plan(loss_fn, batch, params, **budgets)``, the memory plan of this stack, is `zfunc.plan.plan`,
    # which attaches itself here (the planner is a layer above the interpreter: it is not imported from here).

    # -- display ---------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        """The settings shown by ``repr``; override in subclasses."""
        return {}

    # Settings that may differ between ranks without changing what the step computes (a rank's own NVMe
    # directory, its host threads): left out of what ranks compare (`agreed_repr`).
    rank_local_settings: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return self._repr(everything=True)

    def agreed_repr(self) -> str:
        """``repr`` without the `rank_local_settings` of any transform in it: what every rank must share."""
        return self._repr(everything=False)

    def _repr(self, everything: bool) -> str:
        inner = self.step._repr(everything) if isinstance(self.step, Transform) else getattr(
            self.step, "__name__", repr(self.step))
        extra = "".join(f", {k}={v!r}" for k, v in self.settings().items()
                        if everything or k not in self.rank_local_settings)
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


def fresh_copies(tensors: dict[str, torch.Tensor], state) -> dict[str, torch.Tensor]:
    """``tensors`` with every one that shares memory with ``state`` replaced by a copy."""
    owned = {leaf.untyped_storage().data_ptr() for leaf in tree_leaves(state)
             if isinstance(leaf, torch.Tensor) and leaf.numel() and leaf.device.type != "meta"}
    return {k: v.clone() if v.numel() and v.device.type != "meta" and v.untyped_storage().data_ptr() in owned
            else v for k, v in tensors.items()}


def stamp_copies(state, outermost: Transform) -> None:
    """Record, on ``state``, the identity and version of the tensors that ``outermost`` and the transforms
    it wraps keep consistent."""
    donation = getattr(state, "donation", None)
    if isinstance(donation, Donation):
        donation.stamp = {name: (id(t), t._version) for name, t in _copies(state, outermost).items()}


def check_copies(state, outermost: Transform) -> None:
    """Refuse a state in which a tensor the stack keeps consistent with another (`Transform.copies`) was
    changed or replaced since the step that returned it: the step would silently ignore the edit, or train
    from weights that no longer match it."""
    donation = getattr(state, "donation", None)
    stamp = donation.stamp if isinstance(donation, Donation) else None
    if not stamp:
        return
    for name, t in _copies(state, outermost).items():
        if stamp.get(name) != (id(t), t._version):
            owner = next(tr for tr in _wrapped(outermost) if name in tr.copies(state))
            raise ValueError(
                f"{name} was changed (in place or replaced) since {outermost!r} returned this state. "
                f"{owner.copies_explained()} An edit to one of them alone would be silently ignored by the next "
                "step, or trained from weights that no longer match it. To change weights, take "
                "step.gather(state), edit that, and build a new state with step.init(zf.TrainState.create(...)) "
                "(or restore a checkpoint into step.init's template).")


def _wrapped(outermost: Transform) -> list[Transform]:
    """``outermost`` and the transforms inside it, outermost first (without building their `Stack`)."""
    chain, t = [], outermost
    while isinstance(t, Transform):
        chain.append(t)
        t = t.step
    return chain


def _copies(state, outermost: Transform) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for transform in _wrapped(outermost):
        out.update(transform.copies(state))
    return out


def init(step: Callable, state, *, init_device="cpu"):
    """``step.init(state)`` for a transform; for a plain step ``state`` itself (given values first if
    the model was built on the meta device)."""
    if isinstance(step, Transform):
        return step.init(state, init_device=init_device)
    require_state(state, "zf.init")
    if getattr(state, "materializer", None) is not None and is_meta(tree_leaves(state.params)):
        return materialized(state, init_device)
    return state


def gather(step: Callable, state) -> dict[str, torch.Tensor]:
    """``step.gather(state)`` for a transform, a copy of ``state.params`` for a plain step."""
    if isinstance(step, Transform):
        return step.gather(state)
    require_state(state, "zf.gather")
    check_alive(state, "zf.gather")
    return {k: v.clone() for k, v in state.params.items()}
