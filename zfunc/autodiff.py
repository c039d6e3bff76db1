"""First-order gradients: `value_and_grad` and `grad`.

Two routes to the same numbers, picked per call:

- eagerly (the usual case), fresh leaf views of the params and
  `torch.autograd.grad`: exactly the memory of ``loss.backward()``;
- inside a `torch.func` transform (vmap for per-example gradients, an outer
  grad) or while `torch.compile` traces, `torch.func.vjp` whose backward is
  called with ``create_graph=False``.

Why not always torch.func: `torch.func.grad` runs its backward with
``create_graph=True`` and keeps saved tensors alive until it returns (~2.5x
``backward()``'s peak on an 8-block MLP, measured before zfunc's first line),
and even a first-order `torch.func.vjp` measured +35% peak over
``backward()`` on an 8-layer MLP here (benchmarks/value_and_grad_memory.py),
while autograd frees each saved tensor as soon as backward has used it. Use
`torch.func.grad` directly for higher-order derivatives.

After its backward returns, the plain implementation dispatches
``gradients_ready`` (see `zfunc.interpret`): transforms that started
asynchronous work during backward (`shard`'s reductions) finish it there, so
the gradients are final when ``value_and_grad`` returns.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from zfunc.interpret import current, dispatch, gradients_ready
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
        loss, aux = split_loss(fn(p, *args, **kwargs), has_aux)
        # torch.func.vjp accepts only tensors as aux: hand it the tensor leaves
        # and keep the rest of aux aside.
        leaves, side["spec"] = tree_flatten(aux)
        side["others"] = [x for x in leaves if not isinstance(x, torch.Tensor)]
        side["is_tensor"] = [isinstance(x, torch.Tensor) for x in leaves]
        return loss, [x for x in leaves if isinstance(x, torch.Tensor)]

    if under_torch_func_or_compile():
        loss, vjp_fn, aux_tensors = torch.func.vjp(loss_of, params, has_aux=True)
        (grads,) = vjp_fn(torch.ones_like(loss), retain_graph=False, create_graph=False)
    else:
        loss, grads, aux_tensors = _autograd_value_and_grad(loss_of, params)
    grads = gradients_ready(grads)
    if not has_aux:
        return loss.detach(), grads
    tensors, others = iter(aux_tensors), iter(side["others"])
    aux = tree_unflatten(side["spec"], [next(tensors).detach() if t else next(others) for t in side["is_tensor"]])
    return (loss.detach(), aux), grads


def _autograd_value_and_grad(loss_of: Callable, params: Any):
    """Eager path: fresh leaf views of params, one forward, `torch.autograd.grad`."""
    leaves, spec = tree_flatten(params)
    inputs = [leaf.detach().requires_grad_() for leaf in leaves]
    with torch.enable_grad():
        loss, aux_tensors = loss_of(tree_unflatten(spec, inputs))
    if loss.grad_fn is None:
        raise ValueError(
            "value_and_grad: the loss does not depend on the params it was given, so every gradient would be "
            "zero. Compute the loss from the params argument: call apply_fn(params, ...) (from zf.functional) "
            "inside the loss function, not the module itself, and do not detach the params.")
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    # (Under a transform, gradients may arrive after backward returns: `shard` reduces a unit that ran on
    # some ranks only once every rank's backward is done. Then the loss's dependence is all we check.)
    if all(g is None for g in grads) and current() is None:
        raise ValueError(
            "value_and_grad: no parameter received a gradient: the loss does not depend on the params it was "
            "given. Call apply_fn(params, ...) (from zf.functional) inside the loss function, not the module "
            "itself.")
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]
    return loss, tree_unflatten(spec, grads), aux_tensors


def under_torch_func_or_compile() -> bool:
    """True inside a torch.func transform (vmap, grad, ...) or while torch.compile traces."""
    if torch.compiler.is_compiling():
        return True
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)  # private; present since 2.0
    return peek is not None and peek() is not None


def split_loss(out: Any, has_aux: bool) -> tuple[torch.Tensor, Any]:
    """``(loss, aux)`` from what a loss function returned (aux ``()`` without has_aux), checked."""
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"with has_aux=True the function must return (loss, aux), got {type(out).__name__}")
        loss, aux = out
    else:
        loss, aux = out, ()
    check_scalar_loss(loss)
    return loss, aux


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

