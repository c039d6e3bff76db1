"""The interpreter: a stack of transforms, built once, running a step.

A step is an ordinary function ``(state, batch) -> (state, metrics)`` written
with zfunc's primitives (`zfunc.primitives`); a transform (`Transform`) wraps a
step and rewrites what some primitives do while it runs. The transforms of a
step, outermost first, their facts (`zfunc.facts.Facts`: each transform
declares what it does, from the innermost out) and their handlers of each
primitive form one `Stack`, built once per stack. A call of the outermost
transform makes the call's `zfunc.step_context.StepContext`, sets it for the
primitives to find (`zfunc.step_context.current`), runs the step and returns
its new state; the state it was given is consumed (`zfunc.donation`).

A call flows one way through these modules: `zfunc.interpret` (this: the stack
and the call) -> `zfunc.primitives` (a primitive through the stack's handlers)
-> `zfunc.step_context` (the call's scratch and facts) -> `zfunc.facts`,
`zfunc.donation`.

Transform authors find the interpreter's names here (`Transform`, `Facts`,
`current`, the primitives, `UpdateRequest`/`Updated`, donation's `Finding` and
`check_alive`): this module re-exports them from where each lives.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Hashable, Iterable
from typing import Any, ClassVar

import torch

from zfunc.donation import (  # noqa: F401 (re-exported: the interpreter's names for what it runs)
    CopiesStamp,
    Donation,
    Finding,
    Pending,
    check_alive,
    check_laid_out_by,
    consume,
    defer_findings,
    forget_copies,
)
from zfunc.facts import Facts
from zfunc.materialize import is_meta, materialized
from zfunc.primitives import (  # noqa: F401 (re-exported, see the module doc)
    PRIMITIVES,
    Updated,
    UpdateRequest,
    dispatch,
    gradients_ready,
    psum,
    sum_of_squares,
)
from zfunc.state_check import require_state
from zfunc.step_context import CONTEXT, TRACED, StepContext, current
from zfunc.tree import VersionBases, dict_tags, tree_leaves, values_of, version_of


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

    @functools.cached_property
    def described(self) -> str:
        """``repr`` of the outermost transform (its settings are its configuration, fixed as its facts are):
        what names it as the consumer of the states it steps (`zfunc.donation.consume`), formatted once, not
        at every step."""
        return repr(self.transforms[0])


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
    primitive handler (a method named after the primitive, see `zfunc.primitives`).
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
        ctx = CONTEXT.get()
        if ctx is not None and self in ctx.stack:  # called by the transform around it
            return self._run(ctx, state, batch)
        require_state(state, f"{self.name}(...)")  # (a pair from zf.io.restore, params, a model: said first)
        ctx = StepContext(self.stack)
        token = CONTEXT.set(ctx)
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
                consume(state, ctx.stack.described)
            if isinstance(out, tuple) and out:
                stamp_copies(out[0], self, _stamp_of(state))
                if ctx.findings:  # raised at the next use of the state returned (`check_alive`)
                    defer_findings(out[0], Pending(ctx.findings, state.step))
            return out
        finally:
            CONTEXT.reset(token)

    def _traced_call(self, state, batch):
        """``__call__`` while torch.compile traces it: the same steps, the context kept in `TRACED`
        (which dynamo can trace) instead of the ContextVar (which it cannot)."""
        ctx = TRACED.context
        if ctx is not None and self in ctx.stack:
            return self._run(ctx, state, batch)
        require_state(state, f"{self.name}(...)")
        # The stack built eagerly (a transform builds its own when it is made), else a fresh one: not
        # ``self.stack``, whose filling while tracing would be replayed when the compiled step runs, and change
        # what the next call's guards saw (`zfunc.compiled`); nor a fresh one always, whose facts and handlers
        # dynamo would interpret at every trace.
        stack = self.__dict__.get("stack")
        ctx = StepContext(stack if isinstance(stack, Stack) else Stack(self))
        outer, TRACED.context = TRACED.context, ctx
        try:
            out = self._run(ctx, state, batch)
            if not (isinstance(out, tuple) and out and out[0] is state):
                # (The name, not repr: a setting dynamo made symbolic cannot be formatted while tracing.)
                consume(state, f"{self.name}(...)")
            return out
        finally:
            TRACED.context = outer

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

    def copied(self, state) -> tuple[Hashable, list[torch.Tensor]]:
        """The tensors of ``state`` this transform keeps consistent with each other (a compute copy and its
        master), and a key that names them: ``copy_names(key)`` gives one name per tensor, for an error. An
        edit to them between steps is refused (`check_copies`), by the tensors' identities and versions and
        this key, compared at every step: equal keys must give equal names. Default: none."""
        return (), []

    @classmethod
    def copy_names(cls, key: Hashable) -> list[str]:
        """The names (for an error) of the tensors `copied` returned with ``key``, in its order."""
        return []

    def copies_held_in(self, state) -> tuple[dict, ...]:
        """The dicts that hold `copied`'s tensors (all of them as their values, dict after dict, in order), where
        there are such dicts: a stamp then records their version tags, and a later check finds them unchanged
        (the same keys and tensors) in one read per dict, reading only the tensors' versions. Where they do not
        hold exactly those tensors (a value `copied` leaves out), the stamp finds that out and records none.
        Default: none."""
        return ()

    def copies(self, state) -> dict[str, torch.Tensor]:
        """`copied`'s tensors by their names."""
        key, tensors = self.copied(state)
        return dict(zip(self.copy_names(key), tensors))

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


def stamp_copies(state, outermost: Transform, previous: CopiesStamp | None = None) -> None:
    """Record, on ``state``, the identity and version of the tensors that ``outermost`` and the transforms
    it wraps keep consistent (`Transform.copied`). ``previous``: the stamp of the state the step was given,
    which stands where the dicts holding the tensors are the very ones it recorded, unchanged
    (`Transform.copies_held_in`), and their version bases did not move (`zfunc.tree.VersionBases`: else their
    versions are read)."""
    donation = getattr(state, "donation", None)
    if not isinstance(donation, Donation):
        return
    held_in = _copies_held_in(state, outermost)
    tags = _tags_of(held_in)
    if tags is not None and previous is not None and tags == previous.tags:
        bases = None if previous.bases is None else previous.bases.versions()
        if bases is None or bases != previous.base_versions:
            previous = previous._replace(versions=list(map(version_of, _values_held(held_in))), base_versions=bases)
        donation.stamp = previous
        return
    keys, tensors = _copied(state, outermost)
    stamp = CopiesStamp(keys, list(map(id, tensors)), list(map(version_of, tensors)))
    if tags is not None and _held_exactly(held_in, tensors):
        bases = VersionBases.of(tensors)
        stamp = stamp._replace(tags=tags, bases=bases, base_versions=None if bases is None else bases.versions())
    donation.stamp = stamp


def check_copies(state, outermost: Transform) -> None:
    """Refuse a state in which a tensor the stack keeps consistent with another (`Transform.copied`) was
    changed or replaced since the step that returned it: the step would silently ignore the edit, or train
    from weights that no longer match it."""
    stamp = _stamp_of(state)
    if stamp is None or not stamp.ids:
        return
    # The common case, at every step: the same tensors (by identity and version) under the same keys. Where the
    # dicts holding them are the very ones stamped, unchanged (their version tags), those are the same keys and
    # tensors, and their versions are the stamp's where their bases' are (`zfunc.tree.VersionBases`: one read
    # per buffer under `shard`), else read in C. Otherwise the names decide, as they say which tensor changed.
    held_in = _copies_held_in(state, outermost) if stamp.tags is not None else ()
    if held_in and _tags_of(held_in) == stamp.tags:
        if (stamp.bases is not None and stamp.bases.versions() == stamp.base_versions) \
                or list(map(version_of, _values_held(held_in))) == stamp.versions:
            return
    keys, tensors = _copied(state, outermost)
    if keys == stamp.keys and stamp.ids == list(map(id, tensors)) \
            and stamp.versions == list(map(version_of, tensors)):
        return
    stamped = dict(zip(_copy_names(stamp.keys), zip(stamp.ids, stamp.versions)))
    for name, t in _copies(state, outermost).items():
        if stamped.get(name) != (id(t), t._version):
            owner = next(tr for tr in _wrapped(outermost) if name in tr.copies(state))
            raise ValueError(
                f"{name} was changed (in place or replaced) since {outermost!r} returned this state. "
                f"{owner.copies_explained()} An edit to one of them alone would be silently ignored by the next "
                "step, or trained from weights that no longer match it. To change weights, take "
                "step.gather(state), edit that, and build a new state with step.init(zf.TrainState.create(...)) "
                "(or restore a checkpoint into step.init's template).")


def _stamp_of(state) -> CopiesStamp | None:
    donation = getattr(state, "donation", None)
    return donation.stamp if isinstance(donation, Donation) else None


def _copies_held_in(state, outermost: Transform) -> tuple:
    """Each transform's `Transform.copies_held_in` that names some dicts, with its class: ``((owner, dicts), ...)``."""
    out = []
    for transform in _wrapped(outermost):
        dicts = transform.copies_held_in(state)
        if dicts:
            out.append((type(transform), dicts))
    return tuple(out)


def _tags_of(held_in: tuple) -> tuple | None:
    """The version tags of the dicts `_copies_held_in` named, with their owners (None where one cannot be read,
    `zfunc.tree.dict_tags`)."""
    tags = []
    for owner, dicts in held_in:
        mine = dict_tags(dicts)
        if mine is None:
            return None
        tags.append((owner, mine))
    return tuple(tags)


def _values_held(held_in: tuple) -> Iterable:
    """Every value of the dicts `_copies_held_in` named, in order."""
    return values_of(itertools.chain.from_iterable(dicts for _, dicts in held_in))


def _held_exactly(held_in: tuple, tensors: list) -> bool:
    """Whether the dicts `_copies_held_in` named hold exactly ``tensors`` as their values, in order."""
    values = list(_values_held(held_in))
    return len(values) == len(tensors) and all(map(operator.is_, values, tensors))


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


def _copied(state, outermost: Transform) -> tuple[tuple, list[torch.Tensor]]:
    """Each transform's `Transform.copied` key (with its class, which names them), and all their tensors."""
    keys, tensors = [], []
    for transform in _wrapped(outermost):
        key, mine = transform.copied(state)
        if mine:
            keys.append((type(transform), key))
            tensors += mine
    return tuple(keys), tensors


def _copy_names(keys: tuple) -> list[str]:
    """The names of the tensors `_copied` returned with ``keys``."""
    return [name for owner, key in keys for name in owner.copy_names(key)]


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
