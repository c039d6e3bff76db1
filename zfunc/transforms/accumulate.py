"""`accumulate`: gradient accumulation over micro-batches.

``accumulate(step, micro_batches=k)`` runs the step's ``value_and_grad`` on k
equal slices of its batch, one after another, and hands the *mean* of the k
gradients to a single optimizer update. For a loss that is a mean over
examples this equals the full-batch step (up to the order of float sums),
with the activation memory of one micro-batch.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from zfunc.interpret import Facts, Transform
from zfunc.tree import tree_flatten, tree_map, tree_unflatten


class accumulate(Transform):  # noqa: N801 (a transform reads like a function)
    """Gradient accumulation: ``micro_batches`` forward/backward passes, one update.

    Splitting rule: every tensor in the arguments after ``params`` of the
    ``value_and_grad`` call is split along dim 0 into ``micro_batches`` equal
    parts (a dim-0 size that does not divide raises). Non-tensor arguments are
    passed to every micro-batch unchanged.

    Results: ``loss`` = mean of micro-batch losses; ``grads`` = mean of
    micro-batch gradients, i.e. for ``L = 1/k Σ_i L_i`` exactly ``∇L``;
    floating-point tensors in ``aux`` are averaged, other aux leaves are
    taken from the last micro-batch.
    """

    name = "accumulate"
    level = 0

    def __init__(self, step: Callable, micro_batches: int) -> None:
        if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
        super().__init__(step)
        self.micro_batches = micro_batches

    def settings(self) -> dict[str, Any]:
        return {"micro_batches": self.micro_batches}

    def declare(self, facts: Facts) -> Facts:
        return facts.replace(micro_batches=facts.micro_batches * self.micro_batches)

    def value_and_grad(self, next, fn, params, args, kwargs, has_aux):
        k = self.micro_batches
        if k == 1:
            return next(fn, params, args, kwargs, has_aux)
        leaves, treedef = tree_flatten((args, kwargs))
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and (leaf.dim() == 0 or leaf.shape[0] % k):
                raise ValueError(
                    f"accumulate(micro_batches={k}) splits every batch tensor along dim 0, but got one "
                    f"of shape {tuple(leaf.shape)}; make the batch size a multiple of {k}")
        chunks = [leaf.chunk(k) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
        total_value = total_grads = None
        for i in range(k):
            micro = [c[i] if c is not None else leaf for c, leaf in zip(chunks, leaves)]
            micro_args, micro_kwargs = tree_unflatten(treedef, micro)
            value, grads = next(fn, params, micro_args, micro_kwargs, has_aux)
            if total_grads is None:
                total_value, total_grads = value, grads
            else:
                # Accumulate in place into the first micro-batch's gradients:
                # they are ours (fresh from backward), and this keeps one copy.
                tree_map(lambda acc, g: acc.add_(g), total_grads, grads)
                total_value = _add_values(total_value, value, has_aux)
        grads = tree_map(lambda g: g.div_(k), total_grads)
        return _mean_value(total_value, k, has_aux), grads


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
