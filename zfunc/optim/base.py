"""The optimizer protocol (optax's, over torch tensors): `GradientTransformation`.

A gradient transformation is a pair of pure functions::

    state = tx.init(params)
    updates, state = tx.update(grads, state, params)   # never mutates its inputs
    params = apply_updates(params, updates)            # p + u, in p's dtype

States are NamedTuples with named fields (both optree and torch's pytree see
them as nodes, so torch.func, torch.compile and checkpoints see every leaf).
Step counters are int64 0-d tensors and learning rates float32 0-d tensors,
never Python numbers, so a compiled step does not recompile as they change.

``tx.hyperparams`` describes what a transformation is (for ``repr``, reports
and the DeepSpeed config import). It is a read-only mapping; every
transformation built here fills it with at least

- ``name``: e.g. ``"adamw"``, ``"scale_by_adam"``, ``"chain"``;
- ``elementwise``: True when the update of one element depends only on that
  element and on global scalars (step count, learning rate, global norm), so
  it may run on any partition of the parameters;

plus its own arguments (see each constructor). A chain lists its parts under
``transforms``.

``tx.fused`` is the transformation's fused form, if a kernel can run it
(`zfunc.optim.fused.AdamSpec` for adam/adamw, and for a chain of
``clip_by_global_norm`` followed by one of them); None otherwise. Code that
runs optimizers in place (`shard`, `offload`) reads only that.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

from zfunc.tree import PyTree, tree_leaves, tree_map


class Hyperparams(Mapping):
    """A read-only ``dict`` describing a transformation (see the module docstring).

    Hashable (by ``name``, consistent with value equality), because a
    transformation is static pytree metadata of `TrainState` and must hash.
    """

    __slots__ = ("_items",)

    def __init__(self, **items: Any) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items.get("name"))

    def __repr__(self) -> str:
        return f"Hyperparams({self._items!r})"


class GradientTransformation(NamedTuple):
    """``init(params) -> state``; ``update(updates, state, params=None) -> (updates, state)``.

    ``hyperparams`` (defaulted, so ``GradientTransformation(init, update)``
    still works) is a `Hyperparams` mapping describing the transformation,
    or None for a hand-written one; ``fused`` its fused form (module doc).
    """

    init: Callable[[PyTree], Any]
    update: Callable[..., tuple[PyTree, Any]]
    hyperparams: Hyperparams | None = None
    fused: Any = None


class EmptyState(NamedTuple):
    """The state of a transformation that keeps none."""


def identity() -> GradientTransformation:
    """``u ← u``; no state."""
    return GradientTransformation(
        lambda params: EmptyState(),
        lambda updates, state, params=None: (updates, state),
        Hyperparams(name="identity", elementwise=True),
    )


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` in order: the updates of one are the input of the next.

    The state is the tuple of the parts' states, in the same order.
    """
    for tx in transforms:
        if not isinstance(tx, GradientTransformation):
            raise TypeError(f"chain takes GradientTransformations, got {type(tx).__name__}")

    def init(params: PyTree) -> tuple:
        return tuple(tx.init(params) for tx in transforms)

    def update(updates: PyTree, state: tuple, params: PyTree = None) -> tuple[PyTree, tuple]:
        if len(state) != len(transforms):
            raise ValueError(f"chain of {len(transforms)} transformations got a state of {len(state)} parts")
        new_state = []
        for tx, part in zip(transforms, state):
            updates, part = tx.update(updates, part, params)
            new_state.append(part)
        return updates, tuple(new_state)

    elementwise = all(tx.hyperparams is not None and tx.hyperparams.get("elementwise", False)
                      for tx in transforms)
    return GradientTransformation(init, update,
                                  Hyperparams(name="chain", elementwise=elementwise, transforms=transforms),
                                  fused=_chain_fused(transforms))


def _chain_fused(transforms: tuple[GradientTransformation, ...]):
    """The fused form of a chain: that of its one part, or of ``(clip_by_global_norm, fusable)``."""
    if len(transforms) == 1 and transforms[0].fused is not None:
        return transforms[0].fused.nested(0)
    if len(transforms) == 2 and transforms[1].fused is not None and transforms[1].fused.clip is None:
        head = transforms[0].hyperparams
        if head is not None and head.get("name") == "clip_by_global_norm":
            return transforms[1].fused.nested(1).clipped(head["max_norm"])
    return None


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """``p ← p + u`` leaf-wise, the result in ``p``'s dtype (a bf16 param stays bf16)."""
    return tree_map(lambda p, u: (p + u).to(p.dtype), params, updates)


def first_device(tree: PyTree) -> torch.device | None:
    """The device of the first tensor leaf, or None (then counters go to the default device)."""
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return None
