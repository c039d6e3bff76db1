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

``tx`` (the optimizer) and ``ties`` (tied weights: ``(alias, key)`` pairs,
e.g. ``("head.weight", "embed.weight")``, recorded from `zf.functional`'s
params so that checkpoints can export every name the model has) are static:
part of the tree structure, not leaves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from zfunc.interpret import dispatch
from zfunc.optim import GradientTransformation, apply_updates
from zfunc.tree import describe_mismatch, register_pytree_node, tree_structure


@dataclasses.dataclass(frozen=True)
class TrainState:
    step: torch.Tensor
    params: dict[str, torch.Tensor]
    opt_state: Any
    tx: GradientTransformation = dataclasses.field(repr=False)
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    ties: tuple[tuple[str, str], ...] = dataclasses.field(default=(), repr=False)

    @classmethod
    def create(cls, params: dict[str, torch.Tensor], tx: GradientTransformation,
               ties: dict[str, str] | None = None) -> "TrainState":
        """A fresh state: ``step = 0``, ``opt_state = tx.init(params)``.

        Args:
          params: the trainable parameters, a dict of tensors (from `zf.functional`).
          tx: the optimizer (`zf.optim`).
          ties: ``{alias: key}`` of tied weights; by default the ones `zf.functional`
            recorded on ``params`` (a plain dict built from them records none).
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
        device = next(iter(params.values())).device if params else None
        return cls(step=torch.zeros((), dtype=torch.int64, device=device), params=dict(params),
                   opt_state=tx.init(dict(params)), tx=tx, ties=tuple(sorted(ties.items())))

    def replace(self, **changes: Any) -> "TrainState":
        """A copy with some fields replaced (the state itself is immutable)."""
        return dataclasses.replace(self, **changes)

    def apply_gradients(self, grads: dict[str, torch.Tensor]) -> "TrainState":
        """One optimizer update: ``updates, opt_state = tx.update(grads, opt_state, params)``,
        ``params ← params + updates``, ``step ← step + 1``.

        Under transforms this is where gradients are unscaled, partitioned,
        moved to the host or fed to a fused kernel; the result is the same.
        The state it is called on is consumed (it may be updated in place):
        use the returned one.
        """
        return dispatch("apply_gradients", plain_apply_gradients, self, grads)


def plain_apply_gradients(state: TrainState, grads: dict[str, torch.Tensor]) -> TrainState:
    """The untransformed update (pure: new tensors, inputs untouched)."""
    check_grads_match(state.params, grads)
    params, opt_state = dispatch("update_params", pure_update, state.tx, state.params, grads, state.opt_state)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state)


def pure_update(tx: GradientTransformation, params: Any, grads: Any, opt_state: Any):
    """``updates, opt_state = tx.update(grads, opt_state, params)``; ``params + updates``.

    This is the ``update_params`` primitive: the optimizer's arithmetic on
    whatever tensors reach it (shards, host copies, masters). A transform may
    replace it with a fused in-place kernel that computes the same update
    (`offload` does, on the host; `shard` on CUDA).

    Gradients may arrive in a lower precision than the parameters (the bf16
    gradients of `mixed_precision` against its fp32 master); they are upcast
    here, exactly, so that a fused kernel can read them in their own dtype
    instead of a transform materializing an fp32 copy first.
    """
    grads = {k: g if g.dtype == params[k].dtype else g.to(params[k].dtype) for k, g in grads.items()} \
        if isinstance(grads, dict) and isinstance(params, dict) else grads
    updates, opt_state = tx.update(grads, opt_state, params)
    return apply_updates(params, updates), opt_state


def check_grads_match(params: Any, grads: Any) -> None:
    """Raise a readable error if ``grads`` is not shaped like ``params``."""
    if isinstance(params, dict) and isinstance(grads, dict):
        problems = describe_mismatch(params, grads, what="grads")
        if problems:
            raise ValueError("grads do not match params:\n" + problems +
                             "\nPass the grads returned by zf.value_and_grad for these params.")
        return
    if tree_structure(params) != tree_structure(grads):
        raise ValueError(f"grads have structure {tree_structure(grads)}, params {tree_structure(params)}")


def _flatten(state: TrainState):
    return (state.step, state.params, state.opt_state, state.extras), (state.tx, state.ties)


def _unflatten(static, children) -> TrainState:
    step, params, opt_state, extras = children
    tx, ties = static
    return TrainState(step=step, params=params, opt_state=opt_state, tx=tx, extras=extras, ties=ties)


register_pytree_node(TrainState, _flatten, _unflatten)
