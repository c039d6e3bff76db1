"""First-order gradients: `value_and_grad` and `grad`.

Built on `torch.func.vjp` and called with ``create_graph=False``:
`torch.func.grad` runs its backward with ``create_graph=True``, so the graph
recorded during backward keeps saved tensors alive until it returns (about
2.5x the peak memory of ``loss.backward()``, DESIGN.md). A vjp whose backward
records nothing has exactly plain autograd's memory, and still composes with
`torch.func` (vmap over it for per-example gradients) and `torch.compile`.
Use `torch.func.grad` directly when you need higher-order derivatives.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from zfunc.interpret import dispatch
from zfunc.tree import tree_flatten, tree_leaves, tree_unflatten


def value_and_grad(fn: Callable, has_aux: bool = False) -> Callable:
    """``fn(params, *args) -> loss`` to ``(...)(params, *args) -> (loss, grads)``.

    ``grads`` has the structure of ``params`` and holds ∂loss/∂params (zeros for
    parameters the loss does not use). ``loss`` must be a real scalar tensor.
    With ``has_aux=True``, ``fn`` returns ``(loss, aux)`` and the result is
    ``((loss, aux), grads)``; ``aux`` is returned as computed (detached).

    Under transforms the same call may run differently (accumulated over
    micro-batches, with a loss scale, on parameter shards); its meaning does
    not change.
    """
    if not callable(fn):
        raise TypeError(f"value_and_grad takes a function, got {type(fn).__name__}")

    @functools.wraps(fn)
    def value_and_grad_fn(params, *args, **kwargs):
        return dispatch("value_and_grad", plain_value_and_grad, fn, params, args, kwargs, has_aux)

    return value_and_grad_fn


def grad(fn: Callable, has_aux: bool = False) -> Callable:
    """Like `value_and_grad`, returning only ``grads`` (``(grads, aux)`` with aux)."""
    vg = value_and_grad(fn, has_aux=has_aux)

    @functools.wraps(fn)
    def grad_fn(params, *args, **kwargs):
        value, grads = vg(params, *args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return grad_fn


def plain_value_and_grad(fn: Callable, params: Any, args: tuple, kwargs: dict, has_aux: bool):
    """The untransformed implementation: one forward, one first-order backward."""
    _check_differentiable(params)

    side: dict = {}

    def loss_of(p):
        out = fn(p, *args, **kwargs)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError("with has_aux=True the function must return (loss, aux), "
                                f"got {type(out).__name__}")
            loss, aux = out
        else:
            loss, aux = out, ()
        check_scalar_loss(loss)
        # torch.func.vjp accepts only tensors as aux: hand it the tensor leaves
        # and keep the rest of aux aside.
        leaves, side["spec"] = tree_flatten(aux)
        side["others"] = [x for x in leaves if not isinstance(x, torch.Tensor)]
        side["is_tensor"] = [isinstance(x, torch.Tensor) for x in leaves]
        return loss, [x for x in leaves if isinstance(x, torch.Tensor)]

    loss, vjp_fn, aux_tensors = torch.func.vjp(loss_of, params, has_aux=True)
    (grads,) = vjp_fn(torch.ones_like(loss), retain_graph=False, create_graph=False)
    if not has_aux:
        return loss.detach(), grads
    tensors, others = iter(aux_tensors), iter(side["others"])
    aux = tree_unflatten(side["spec"], [next(tensors).detach() if t else next(others) for t in side["is_tensor"]])
    return (loss.detach(), aux), grads


def check_scalar_loss(loss: Any) -> None:
    """Raise a clear error unless ``loss`` is a 0-d real floating tensor."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"the loss must be a scalar tensor, got {type(loss).__name__}"
                        " (with has_aux=True return (loss, aux))")
    if loss.dim() != 0:
        raise ValueError(f"the loss must be a scalar (0-d) tensor, got shape {tuple(loss.shape)}; "
                         "reduce it, e.g. with .mean()")
    if not loss.is_floating_point():
        raise TypeError(f"the loss must be a floating-point tensor, got {loss.dtype}")


def _check_differentiable(params: Any) -> None:
    leaves = tree_leaves(params)
    if not leaves:
        raise ValueError("value_and_grad: params is empty; nothing to differentiate")
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"value_and_grad: every leaf of params must be a tensor, got {type(leaf).__name__}")
        if not (leaf.is_floating_point() or leaf.is_complex()):
            raise TypeError(f"value_and_grad: cannot differentiate w.r.t. a {leaf.dtype} tensor")

