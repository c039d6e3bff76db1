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

Misuse is refused rather than differentiated into zeros: a loss that does not
reach the params (the module called instead of ``apply_fn``, detached params,
a forward under ``no_grad``), a loss that reached a module's own
``nn.Parameter`` while some params got no gradient (the module called beside
``apply_fn``: one walk of the graph, only in that case), and a forward that
wrote into a parameter in place where the gradient cannot follow (torch's
error, re-raised naming the parameters and the stack).

After its backward returns, the plain implementation dispatches
``gradients_ready`` (see `zfunc.primitives`): transforms that started
asynchronous work during backward (`shard`'s reductions) finish it there, so
the gradients are final when ``value_and_grad`` returns.
"""

from __future__ import annotations

import functools
import itertools
import operator
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor
from torch._subclasses.fake_tensor import is_fake

from zfunc.compiled import all_true, tracing
from zfunc.donation import Finding
from zfunc.primitives import dispatch, gradients_ready, psum
from zfunc.step_context import current
from zfunc.tree import dtype_of, read_in_c, tree_flatten, tree_leaves, tree_map_with_path, tree_unflatten


def value_and_grad(fn: Callable, has_aux: bool = False, *, allow_nonfinite: bool = False) -> Callable:
    """``fn(params, *args) -> loss`` to ``(...)(params, *args) -> (loss, grads)``.

    ``grads`` has the structure of ``params`` and holds ∂loss/∂params (zeros for
    parameters the loss does not use). ``loss`` must be a real scalar tensor.
    With ``has_aux=True``, ``fn`` returns ``(loss, aux)`` and the result is
    ``((loss, aux), grads)``; ``aux`` is returned as computed (detached).

    A NaN or infinite loss never reaches the weights: its gradients would be
    NaN and the update would overwrite the weights with them. In a transformed
    step the check is made on the device, without a host read: the step's
    update is skipped there (on every rank under `shard`, when one rank's loss
    is NaN), the state it returns holds the values of the state it was given,
    and the next use of that state (the next step, ``step.gather``, a save)
    raises `FloatingPointError` naming the step; the state is usable after
    that. Outside a transformed step (a plain step) the loss is read on the
    host and the error raised at once. ``allow_nonfinite=True`` returns the
    NaN gradients instead. Under fp16 loss scaling the scaler handles such
    steps (it skips them), and under torch.func transforms or torch.compile
    the loss is not checked.

    Under transforms the same call may run differently (accumulated over
    micro-batches, with a loss scale, on parameter shards); its meaning does
    not change.
    """
    if not callable(fn):
        raise TypeError(f"value_and_grad takes a function, got {type(fn).__name__}")

    @functools.wraps(fn)
    def checked_fn(params, *args, **kwargs):
        # Checked as soon as the forward has made the loss, before its backward is issued: the host waits for
        # the forward only, then issues backward and the update while the GPU runs backward. (Checked after
        # backward, the GPU would wait for the update's launches; under `accumulate`, each micro-batch.)
        out = fn(params, *args, **kwargs)
        _refuse_nonfinite_loss(split_loss(out, has_aux)[0], allow_nonfinite)
        return out

    # (Read by `pipeline`, whose loss exists on the last stage only: it checks the loss itself, once every
    # stage has it, honouring this setting.)
    checked_fn.allow_nonfinite = allow_nonfinite

    @functools.wraps(fn)
    def value_and_grad_fn(params, *args, **kwargs):
        return dispatch("value_and_grad", plain_value_and_grad, checked_fn, params, args, kwargs, has_aux)

    return value_and_grad_fn


def _refuse_nonfinite_loss(loss: torch.Tensor, allow: bool) -> None:
    """Skip the update, and raise at the next use of the state, if the loss is NaN or infinite on any rank (see
    `value_and_grad`); outside a transformed step, raise now.

    Inside a step nothing is read on the host: the count of non-finite losses (summed over ranks) becomes the
    step's skip flag (`zfunc.step_context.StepContext.skip_update_if`), which the update reads on the device.
    """
    ctx = current()
    if under_torch_func_or_compile() or (ctx is not None and (ctx.facts.loss_scaling != "none" or ctx.facts.pp > 1)):
        return  # (fp16's scaler skips such steps; `pipeline` checks the loss once its last stage broadcast it)
    if loss.is_meta or is_fake(loss):  # (the planner measures a step on fake tensors: there are no values)
        return
    # The count is summed over ranks even where it is not read (allow_nonfinite, which only this rank's code
    # may say): every rank then makes the same collectives, whatever each decides.
    if isinstance(loss, DTensor):  # (tensor_parallel's loss_parallel: a replicated DTensor; its local value)
        loss = loss.to_local()
    loss = loss.detach()
    bad = psum((~torch.isfinite(loss)).to(torch.float32))  # under shard: on how many ranks
    if allow:
        return
    if ctx is None:  # a plain step: nothing to defer to
        if bad.item():
            raise _nonfinite_loss_error(loss.item(), None, None)
        return
    skip_update_if_nonfinite(ctx, loss, bad)


def skip_update_if_nonfinite(ctx, loss: torch.Tensor, bad: torch.Tensor) -> None:
    """Skip ``ctx``'s update where ``bad`` (0-d on the device: how many ranks had a non-finite ``loss``) is
    nonzero, and raise the NaN-loss error at the next use of the state the step returns; no host read.
    (Also `pipeline`'s, once its last stage broadcast the loss.)"""
    # (The explanation holds the stack, which lives as long as the step, not ``ctx``: ``ctx`` holds the findings,
    # so it would be a reference cycle, kept with the step's scratch until the garbage collector's next pass.)
    ctx.skip_update_if(bad, Finding(torch.stack([bad, loss.detach()]).to(torch.float64),  # (`Finding`: float64)
                                    functools.partial(_explain_nonfinite_loss, ctx.stack)))


def _explain_nonfinite_loss(stack, values: list[float], step: int) -> FloatingPointError:
    return _nonfinite_loss_error(values[1], stack, (int(values[0]), step))


def _nonfinite_loss_error(loss: float, stack, found: tuple[int, int] | None) -> FloatingPointError:
    """The error for a NaN/inf loss under ``stack`` (a `zfunc.interpret.Stack`, or None: a plain step; ``found``:
    on how many ranks, at which step; None: raised at once)."""
    where = f" under {stack.transforms[0]!r}" if stack is not None and stack.transforms else ""
    if found is None:
        return FloatingPointError(
            f"value_and_grad: the loss is {loss}{where}. The step stops here, before any update: the state it "
            f"was given is unchanged and can be stepped again. {_NONFINITE_ADVICE}")
    ranks, step = found
    on = f" on {ranks} rank(s)" if stack.facts.stage else ""
    return FloatingPointError(
        f"value_and_grad: the loss is {loss}{on} at the step given the state with step={step}{where}. That step "
        "skipped its update before any update was written (the check is made on the device, without a host "
        "wait, and reported here, at the next use of the state it returned): the state it returned holds the "
        "values it was given and can be stepped again. "
        f"{_NONFINITE_ADVICE}")


_NONFINITE_ADVICE = (
    "Look for the cause (a batch with NaN or inf values, a log or division of zero, a learning rate that made "
    "the weights diverge); to differentiate it anyway pass zf.value_and_grad(fn, allow_nonfinite=True) (its "
    "gradients are NaN).")


def grad(fn: Callable, has_aux: bool = False) -> Callable:
    """Like `value_and_grad`, returning only ``grads`` (``(grads, aux)`` with aux)."""
    vg = value_and_grad(fn, has_aux=has_aux)

    @functools.wraps(fn)
    def grad_fn(params, *args, **kwargs):
        value, grads = vg(params, *args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return grad_fn


def plain_value_and_grad(fn: Callable, params: Any, args: tuple, kwargs: dict, has_aux: bool):
    """The untransformed implementation: one forward, one first-order backward (or, where a transform runs
    forward and backward itself, its ``StepContext.differentiate``, given the loss function as rewritten by
    the transforms inside it)."""
    ctx = current()
    if ctx is not None and ctx.differentiate is not None:
        # (Unset while it runs, so a value_and_grad inside the loss function is a plain one; set again after, for
        # the next gradient call of the same step, e.g. each micro-batch of an `accumulate` inside `pipeline`.)
        differentiate, ctx.differentiate = ctx.differentiate, None
        try:
            return differentiate(fn, params, args, kwargs, has_aux)
        finally:
            ctx.differentiate = differentiate
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
    if read_in_c(leaves):  # (the common case: each made by ``map`` in C; this runs for every parameter)
        inputs = list(map(_requires_grad_, map(_detach, leaves)))
    else:
        inputs = [leaf.detach().requires_grad_() for leaf in leaves]
    versions = [x._version for x in inputs]
    with torch.enable_grad():
        try:
            loss, aux_tensors = loss_of(tree_unflatten(spec, inputs))
        except RuntimeError as err:
            _raise_if_written_in_place(err, params, inputs, versions)
            raise
    if loss.grad_fn is None:
        raise ValueError(
            "value_and_grad: the loss does not depend on the params it was given, so every gradient would be "
            "zero. Compute the loss from the params argument: call apply_fn(params, ...) (from zf.functional) "
            "inside the loss function, not the module itself, and do not detach the params.")
    try:
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    except RuntimeError as err:
        _raise_if_written_in_place(err, params, inputs, versions)
        raise
    # (Under a transform, gradients may arrive after backward returns: `shard` reduces a unit that ran on
    # some ranks only once every rank's backward is done. Then the loss's dependence is all we check.)
    if all(g is None for g in grads) and current() is None:
        raise ValueError(
            "value_and_grad: no parameter received a gradient: the loss does not depend on the params it was "
            "given. Call apply_fn(params, ...) (from zf.functional) inside the loss function, not the module "
            "itself.")
    if any(map(operator.is_, grads, itertools.repeat(None))):  # (in C: a generator resumes once per parameter)
        _refuse_module_parameters(loss)
        grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]
    return loss, tree_unflatten(spec, grads), aux_tensors


# What torch says when an in-place write breaks differentiation: a tensor saved for backward changed, a
# view handed out by a multi-view Function (shard's gathered units) was written, a leaf was written.
_IN_PLACE_ERRORS = ("modified by an inplace operation", "has been modified inplace",
                    "leaf Variable that requires grad is being used in an in-place operation")


def _raise_if_written_in_place(err: RuntimeError, params: Any, inputs: list, versions: list) -> None:
    """Re-raise torch's error about an in-place write as one that names the parameters the forward wrote
    and says what to do; return (leaving ``err`` to its caller) if it is about something else."""
    text = str(err)
    if not any(marker in text for marker in _IN_PLACE_ERRORS):
        return
    names = [".".join(str(k) for k in path) for path, _ in _leaf_paths(params)]
    written = [n for n, x, v in zip(names, inputs, versions) if x._version != v]
    if written:
        what = f"parameter(s) {', '.join(written[:6])}{' ...' if len(written) > 6 else ''} (or a tensor sharing " \
               "their memory)"
    elif "returns multiple views" in text or "leaf Variable" in text:
        what = "a parameter"
    else:
        return  # an activation written in place: torch's own message is the one to read
    ctx = current()
    where = f" under {ctx.stack.transforms[0]!r}" if ctx is not None and ctx.stack.transforms else ""
    raise RuntimeError(
        f"value_and_grad: the model's forward wrote into {what} in place{where} (e.g. nn.Embedding(max_norm=...) "
        "renormalizes the rows it looks up, or a weight is updated under torch.no_grad() inside forward), and "
        "the gradient cannot be computed through that write here: shard keeps a unit's parameters in one shared "
        "(or gathered) buffer, checkpoint recomputes from the values it saved, and autograd refuses writes into "
        "the tensors it differentiates. Make the forward pure: renormalize functionally (F.embedding(..., "
        "max_norm=None), then scale the looked-up rows), and change weights outside the loss (e.g. after "
        f"apply_gradients). torch said: {text.splitlines()[0][:300]}") from err


def _leaf_paths(tree: Any) -> list:
    """``(path, leaf)`` for every leaf, in `tree_flatten`'s order."""
    found: list = []
    tree_map_with_path(lambda path, x: found.append((path, x)), tree)
    return found


def _refuse_module_parameters(loss: torch.Tensor, limit: int = 200_000) -> None:
    """Some parameters got no gradient: refuse if the loss reached a module's own ``nn.Parameter`` instead
    (the loss function called the module itself, whose gradients value_and_grad never returns).

    Walks the backward graph from the loss (at most ``limit`` nodes), only in this case: a model whose every
    parameter gets a gradient pays nothing.
    """
    seen, stack = set(), [loss.grad_fn]
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.nn.Parameter):
            raise ValueError(
                f"value_and_grad: the loss depends on a module's own parameter (an nn.Parameter of shape "
                f"{tuple(variable.shape)}) rather than on the params it was given, so its gradient would be "
                "dropped and that part of the model would silently not train. The loss function calls the module "
                "itself somewhere (model(x) or a submodule); call apply_fn(params, x) (from zf.functional) "
                "there, not the module itself.")
        stack.extend(next_node for next_node, _ in node.next_functions)


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
    if read_in_c(leaves) and all(d.is_floating_point or d.is_complex for d in set(map(dtype_of, leaves))):
        return  # (the common case, from the few distinct dtypes read in C: this runs for every parameter)
    if tracing() and all_true(map(isinstance, leaves, itertools.repeat(torch.Tensor))) and all(
            d.is_floating_point or d.is_complex for d in frozenset(map(getattr, leaves, itertools.repeat("dtype")))):
        return  # (the same while dynamo traces, by ``map`` over builtins, which it runs natively)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"value_and_grad: every leaf of params must be a tensor, got {type(leaf).__name__}")
        if not (leaf.is_floating_point() or leaf.is_complex()):
            raise TypeError(f"value_and_grad: cannot differentiate w.r.t. a {leaf.dtype} tensor")



_detach = torch.Tensor.detach
_requires_grad_ = torch.Tensor.requires_grad_
_FUNCTION_APPLY = torch._C._FunctionBase.__dict__["apply"]  # what `torch.autograd.Function.apply` ends in
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def apply_function(function: type[torch.autograd.Function], head: tuple, tensors: Any) -> Any:
    """``function.apply(*head, *tensors)`` for a Function in the ``forward(ctx, ...)`` form (no
    ``setup_context``), whose tensor arguments are ``tensors`` (any iterable) and come last.

    Outside torch.func transforms, ``Function.apply``'s Python preamble only unwraps dead torch.func
    wrappers, one generator step per argument; here that is one C call per tensor, and nothing else
    runs in Python (shard's stage 3 applies three Functions per block per forward, one of them with a
    tensor per parameter). Inside a transform it is ``function.apply`` itself.
    """
    if torch._C._are_functorch_transforms_active():
        return function.apply(*head, *tensors)
    return _FUNCTION_APPLY.__get__(None, function)(*head, *map(_unwrap_if_dead, tensors))
