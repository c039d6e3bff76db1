"""`accumulate`: gradient accumulation over micro-batches.

``accumulate(step, micro_batches=k)`` runs the step's ``value_and_grad`` on k
equal slices of its batch, one after another, and hands the *mean* of the k
gradients to a single optimizer update. For a loss that is a mean over
examples this equals the full-batch step (up to the order of float sums),
with the activation memory of one micro-batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from numbers import Integral
from typing import Any, Callable

import torch

from zfunc.interpret import Facts, Transform
from zfunc.tree import tree_flatten, tree_map, tree_unflatten


class accumulate(Transform):  # noqa: N801 (a transform reads like a function)
    """Gradient accumulation: ``micro_batches`` forward/backward passes, one update.

    Splitting rule: every tensor in the arguments after ``params`` of the
    ``value_and_grad`` call is split along dim 0 into ``micro_batches`` equal
    parts (a dim-0 size that does not divide raises), inside dicts, lists,
    tuples, other mappings (a Hugging Face ``BatchEncoding``) and dataclasses.
    Other non-tensor arguments are passed to every micro-batch unchanged; an
    object that holds tensors in another way is refused.

    Results: ``loss`` = mean of micro-batch losses; ``grads`` = mean of
    micro-batch gradients, i.e. for ``L = 1/k Σ_i L_i`` exactly ``∇L``;
    floating-point tensors in ``aux`` are averaged, other aux leaves are
    taken from the last micro-batch.
    """

    name = "accumulate"
    level = 0

    def __init__(self, step: Callable, micro_batches: int) -> None:
        if not isinstance(micro_batches, Integral) or isinstance(micro_batches, bool) or micro_batches < 1:
            raise ValueError(f"accumulate: micro_batches must be a positive int (the number of slices each batch "
                             f"is split into), got {micro_batches!r}")
        super().__init__(step)
        self.micro_batches = int(micro_batches)

    def settings(self) -> dict[str, Any]:
        return {"micro_batches": self.micro_batches}

    def declare(self, facts: Facts) -> Facts:
        return facts.replace(micro_batches=facts.micro_batches * self.micro_batches)

    def value_and_grad(self, next, fn, params, args, kwargs, has_aux):
        k = self.micro_batches
        if k == 1:
            return next(fn, params, args, kwargs, has_aux)
        micro_batches = _split((args, kwargs), k)
        total_value = total_grads = None
        for micro_args, micro_kwargs in micro_batches:
            value, grads = next(fn, params, micro_args, micro_kwargs, has_aux)
            if total_grads is None:
                total_value, total_grads = value, tree_map(_writable, grads)
            else:
                # Accumulate in place into the first micro-batch's gradients:
                # they are ours (fresh from backward), and this keeps one copy.
                tree_map(lambda acc, g: acc.add_(g), total_grads, grads)
                total_value = _add_values(total_value, value, has_aux)
        grads = tree_map(lambda g: g.div_(k), total_grads)
        return _mean_value(total_value, k, has_aux), grads


def split_micro_batches(tree: Any, k: int) -> list:
    """``k`` micro-batches of ``tree`` (the arguments of a loss function): `accumulate`'s splitting rule
    (also `pipeline`'s)."""
    return _split(tree, k)


def _split(tree: Any, k: int) -> list:
    """``k`` copies of ``tree`` in which every tensor is replaced by its i-th slice along dim 0.

    Containers that zfunc's pytrees do not open are opened here when they hold the batch: a mapping
    (e.g. a Hugging Face ``BatchEncoding``, rebuilt with its own type) and a dataclass. Anything else
    that carries tensors is refused: passed whole to every micro-batch, it would silently make each one
    the full batch (k times the compute and the full batch's activation memory).
    """
    leaves, treedef = tree_flatten(tree)
    parts = [_split_leaf(leaf, k) for leaf in leaves]
    return [tree_unflatten(treedef, [p[i] for p in parts]) for i in range(k)]


def _split_leaf(leaf: Any, k: int) -> list:
    if isinstance(leaf, torch.Tensor):
        if leaf.dim() == 0 or leaf.shape[0] % k:
            raise ValueError(
                f"accumulate(micro_batches={k}) splits every batch tensor along dim 0, but got one "
                f"of shape {tuple(leaf.shape)}; make the batch size a multiple of {k}")
        return list(leaf.chunk(k))
    if isinstance(leaf, Mapping):
        return [_rebuilt(leaf, part) for part in _split(dict(leaf), k)]
    if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
        fields = {f.name: getattr(leaf, f.name) for f in dataclasses.fields(leaf) if f.init}
        return [dataclasses.replace(leaf, **part) for part in _split(fields, k)]
    held = [name for name, value in getattr(leaf, "__dict__", {}).items() if isinstance(value, torch.Tensor)]
    if held:
        raise ValueError(
            f"accumulate(micro_batches={k}) cannot split a {type(leaf).__name__} (it holds tensors: "
            f"{', '.join(held[:4])}): pass the batch as a dict, tuple, list or dataclass of tensors (and an "
            "object that every micro-batch should see whole through a closure of the loss function)")
    return [leaf] * k


def _rebuilt(original: Mapping, data: dict) -> Mapping:
    """``data`` in ``original``'s mapping type."""
    try:
        rebuilt = type(original)(data)
    except Exception as err:  # noqa: BLE001 (any failure means the same: we cannot rebuild it)
        raise ValueError(f"accumulate cannot split a {type(original).__name__} batch (its type does not rebuild "
                         f"from a dict: {err}); pass dict(batch) instead") from None
    if not isinstance(rebuilt, Mapping) or set(rebuilt.keys()) != set(data):
        raise ValueError(f"accumulate cannot split a {type(original).__name__} batch; pass dict(batch) instead")
    return rebuilt


def _writable(g: torch.Tensor) -> torch.Tensor:
    """``g``, or a copy of it when it cannot be accumulated into in place: autograd may hand back a
    broadcast view (the gradient of ``p.sum()`` is ``ones`` expanded to ``p``'s shape, every element
    one memory location)."""
    if isinstance(g, torch.Tensor) and any(st == 0 and n > 1 for st, n in zip(g.stride(), g.shape)):
        return g.clone()
    return g


def _add_values(total, value, has_aux):
    if not has_aux:
        return total + value
    (loss_t, aux_t), (loss, aux) = total, value
    aux_sum = tree_map(lambda a, b: a + b if _averaged(a) else b, aux_t, aux)
    return loss_t + loss, aux_sum


def _mean_value(total, k, has_aux):
    if not has_aux:
        return total / k
    loss, aux = total
    return loss / k, tree_map(lambda a: a / k if _averaged(a) else a, aux)


def _averaged(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()
