"""`TrainState`: everything one training step reads and writes.

Fields (all pytrees of tensors, so that tree utilities, torch.func and
checkpoints see the whole state):

- ``step``: an int64 0-d tensor, the number of optimizer updates applied
  (a tensor, so `torch.compile` does not recompile as it grows);
- ``params``: the trainable parameters, keyed like `functional`'s params. In a
  transformed step they are in that stack's layout (a compute-dtype copy under
  `mixed_precision`, shards under `shard(stage=3)`);
- ``opt_state``: the optimizer's state (a NamedTuple per transformation);
- ``extras``: a dict of per-transform state keyed by transform name (the fp32
  master and loss scale of `mixed_precision`, the layout of `shard`, ...), so
  that whatever saves and restores a state restores the transforms too.

``tx`` (the optimizer), ``ties`` (tied weights: ``(alias, key)`` pairs,
e.g. ``("head.weight", "embed.weight")``, recorded from `zf.functional`'s
params so that checkpoints can export every name the model has) and
``blocks`` (the model's repeated blocks, `zfunc.blocks.find_blocks`, so
that `shard` groups parameters as `checkpoint` recomputes them) are static:
part of the tree structure, not leaves.

Donation: a transformed step consumes the state it is given (it updates its
buffers in place, as JAX's ``donate_argnums`` allows); that state is dead
afterwards, and using it again through zfunc raises (`zfunc.donation.Donation`).
The plain, untransformed step is pure and consumes nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from zfunc.compiled import init_fields, replaced, tracing
from zfunc.donation import Donation, check_laid_out_by
from zfunc.primitives import UpdateRequest, Updated, dispatch
from zfunc.step_context import count_increment, current
from zfunc.optim import GradientTransformation, apply_updates
from zfunc.optim.flat import flat_adam_update
from zfunc.optim.fused import fused_update
from zfunc.tree import describe_mismatch, register_pytree_node, tree_map, tree_structure


@dataclasses.dataclass(frozen=True)
class TrainState:
    step: torch.Tensor
    params: dict[str, torch.Tensor]
    opt_state: Any
    tx: GradientTransformation = dataclasses.field(repr=False)
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    ties: tuple[tuple[str, str], ...] = dataclasses.field(default=(), repr=False)
    blocks: tuple[str, ...] | None = dataclasses.field(default=None, repr=False)
    # A meta-built model's initializer (`zfunc.materialize`): the params are meta tensors until
    # `step.init` (or `zf.init`) gives them values.
    materializer: Any = dataclasses.field(default=None, repr=False)
    donation: Donation = dataclasses.field(default_factory=Donation, repr=False, compare=False)

    @classmethod
    def create(cls, params: dict[str, torch.Tensor], tx: GradientTransformation,
               ties: dict[str, str] | None = None, blocks: list[str] | None = None) -> "TrainState":
        """A fresh state: ``step = 0``, ``opt_state = tx.init(params)``.

        Args:
          params: the trainable parameters, a dict of tensors (from `zf.functional`).
          tx: the optimizer (`zf.optim`).
          ties: ``{alias: key}`` of tied weights; by default the ones `zf.functional`
            recorded on ``params`` (a plain dict built from them records none).
          blocks: the model's repeated blocks (qualified names); by default the ones
            `zf.functional` recorded (`zfunc.blocks.find_blocks`), else found from
            the parameter names when a transform needs them.
        Returns:
          The state, ``step`` on the parameters' device.
        """
        if not isinstance(params, dict) or not all(isinstance(v, torch.Tensor) for v in params.values()):
            raise TypeError("TrainState.create takes params as a dict of tensors (from zf.functional(model))")
        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise TypeError(f"TrainState.create takes an optimizer (zf.optim.*), got {type(tx).__name__}")
        ties = dict(getattr(params, "ties", {}) if ties is None else ties)
        for alias, key in ties.items():
            if key not in params:
                raise ValueError(f"TrainState.create: tied weight {alias!r} -> {key!r}, but params has no {key!r}")
        blocks = getattr(params, "blocks", None) if blocks is None else list(blocks)
        materializer = getattr(params, "materializer", None)
        device = next(iter(params.values())).device if params else None
        if device is not None and device.type == "meta":
            device = torch.device("cpu")  # the step counter is a value even for a meta-built model
        return cls(step=torch.zeros((), dtype=torch.int64, device=device), params=dict(params),
                   opt_state=tx.init(dict(params)), tx=tx, ties=tuple(sorted(ties.items())),
                   blocks=None if blocks is None else tuple(blocks), materializer=materializer)

    def replace(self, **changes: Any) -> "TrainState":
        """A copy with some fields replaced (the state itself is immutable)."""
        donation = Donation()
        # The record of what a stack keeps consistent carries over, so that a compute copy or master swapped
        # in by ``replace`` is refused like one edited in place (`zfunc.interpret.check_copies`).
        donation.stamp = self.donation.stamp
        donation.pending = self.donation.pending  # (an error the step that made it found: raised at next use)
        if type(self) is not TrainState:  # (a subclass may have fields of its own)
            return dataclasses.replace(self, donation=donation, **changes)
        if "donation" in changes:
            raise TypeError("TrainState.replace: the donation record is not replaced")
        if tracing() or not _FIELD_NAMES.issuperset(changes):  # (an unknown field: refused as dataclasses refuses it)
            return replaced(self, _FIELDS, {**changes, "donation": donation})
        # Eagerly, the fields as they are with the changes over them: what ``__init__`` would do, without its one
        # ``object.__setattr__`` per field of a frozen dataclass (a step replaces its state five times).
        new = object.__new__(TrainState)
        fields = new.__dict__
        fields.update(self.__dict__)
        fields.update(changes)
        fields["donation"] = donation
        return new

    def apply_gradients(self, grads: dict[str, torch.Tensor]) -> "TrainState":
        """One optimizer update: ``updates, opt_state = tx.update(grads, opt_state, params)``,
        ``params ← params + updates``, ``step ← step + 1``.

        Under transforms this is where gradients are unscaled, partitioned,
        moved to the host or fed to a fused kernel; the result is the same.

        Args:
          grads: gradients keyed like ``params`` (what `zf.value_and_grad` returned).
        Returns:
          The new state.
        """
        return dispatch("apply_gradients", plain_apply_gradients, self, grads, UpdateRequest()).state


def plain_apply_gradients(state: TrainState, grads: dict[str, torch.Tensor], request: UpdateRequest) -> Updated:
    """The ``apply_gradients`` primitive's plain implementation: the optimizer on ``state.params``.

    A step whose update is skipped on the device (`zfunc.step_context.StepContext.skip`: a NaN loss) keeps the
    parameters, the optimizer state and the step count (``step + ~skip``), without a host read.
    """
    ctx = current()
    if ctx is None:
        check_laid_out_by(state, set(), "a plain step (no transforms)")
    # (The gradients' shapes are checked by the update, first: `plain_update_params`.)
    params, opt_state, copy = dispatch("update_params", plain_update_params, state.tx, state.params, grads,
                                       state.opt_state, request)
    if copy is None and request.compute_dtype is not None:
        copy = {k: v.to(request.compute_dtype) for k, v in params.items()}
    skip = ctx.skip if ctx is not None else None
    step = state.step + 1 if skip is None else state.step + count_increment(skip, state.step.dtype)
    return Updated(state.replace(step=step, params=params, opt_state=opt_state), copy)


def plain_update_params(tx: GradientTransformation, params: Any, grads: Any, opt_state: Any,
                        request: UpdateRequest):
    """The ``update_params`` primitive: ``(params, opt_state, compute_copy or None)``.

    In a stack whose transforms own the state's buffers (``Facts.fused_update``:
    `shard`, `offload`), an optimizer that declares a fused form runs as one
    in-place kernel per run of parameters, on the host or the GPU by where
    the tensors are (`zfunc.optim.fused.fused_update`), writing the compute
    copy the request asks for in the same pass; while torch.compile traces,
    as torch operations once per flat run the request names
    (`zfunc.optim.flat.flat_adam_update`). Otherwise, and for every other
    optimizer, the pure update (`pure_update`).

    First of all, gradients not shaped as the params are refused (`check_grads_match`); the fused update makes
    that check itself, or finds it made by what its plan reads of the gradients anyway.
    """
    ctx = current()
    skip = ctx.skip if ctx is not None else None  # skip the update on the device (see `plain_apply_gradients`)
    landing = request.grads_landing  # (gradients still landing in host memory: `UpdateRequest`)
    fused = ctx is not None and ctx.facts.fused_update and tx.fused is not None
    if not (fused and not tracing()):
        check_grads_match(params, grads)
    if fused:
        if not tracing():
            done = fused_update(tx.fused, params, grads, opt_state, request.compute_dtype, request.compute_into,
                                request.host_threads, skip=skip, skip_ready=ctx.skip_ready, landing=landing,
                                check_grads=check_grads_match)
        elif request.flat_runs is not None:
            # Under torch.compile (dynamo cannot trace the kernels): the same arithmetic as torch operations,
            # once per flat buffer instead of once per parameter (a smaller graph, a faster compile).
            done = flat_adam_update(tx.fused, params, grads, opt_state, request.flat_runs, request.compute_dtype,
                                    request.compute_into, skip=skip, run_grads=request.flat_grads,
                                    run_params=request.flat_params)
        else:
            done = None
        if done is not None:
            ctx.state_consumed = True
            return done
    if landing is not None:
        landing.wait_all()
    new_params, new_opt_state = pure_update(tx, params, grads, opt_state)
    if skip is not None:  # branch-free: the old values where skipped
        keep = functools.partial(torch.where, skip)
        new_params = tree_map(lambda new, old: keep(old, new), new_params, params)
        new_opt_state = tree_map(lambda new, old: keep(old, new) if isinstance(new, torch.Tensor) else new,
                                 new_opt_state, opt_state)
    return new_params, new_opt_state, None


def pure_update(tx: GradientTransformation, params: Any, grads: Any, opt_state: Any):
    """``updates, opt_state = tx.update(grads, opt_state, params)``; ``params + updates``.

    Gradients may arrive in a lower precision than the parameters (the bf16
    gradients of `mixed_precision` against its fp32 master); they are upcast
    here, exactly.
    """
    grads = {k: g if g.dtype == params[k].dtype else g.to(params[k].dtype) for k, g in grads.items()} \
        if isinstance(grads, dict) and isinstance(params, dict) else grads
    updates, opt_state = tx.update(grads, opt_state, params)
    return apply_updates(params, updates), opt_state


def check_grads_match(params: Any, grads: Any) -> None:
    """Raise a readable error if ``grads`` is not shaped like ``params``."""
    if isinstance(params, dict) and isinstance(grads, dict):
        problems = describe_mismatch(params, grads, what="grads")  # (one pass over the shapes when they match)
        if problems:
            raise ValueError("grads do not match params:\n" + problems +
                             "\nPass the grads returned by zf.value_and_grad for these params.")
        return
    if tree_structure(params) != tree_structure(grads):
        raise ValueError(f"grads have structure {tree_structure(grads)}, params {tree_structure(params)}")


def _flatten(state: TrainState):
    return (state.step, state.params, state.opt_state, state.extras), \
        (state.tx, state.ties, state.blocks, state.materializer)


def _unflatten(static, children) -> TrainState:
    step, params, opt_state, extras = children
    tx, ties, blocks, materializer = static
    return TrainState(step=step, params=params, opt_state=opt_state, tx=tx, extras=extras, ties=ties,
                      blocks=blocks, materializer=materializer)



register_pytree_node(TrainState, _flatten, _unflatten)
_FIELDS = init_fields(TrainState)
_FIELD_NAMES = frozenset(_FIELDS)
