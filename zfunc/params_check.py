"""Checks of the params dict handed to ``apply_fn`` against the model's trainable parameters.

A params dict that does not match the model may still run: ``F.linear``
takes a (22, 10) weight in a ``Linear(10, 23)`` and the model trains at the
state's width; a key apply_fn does not know (a typo, a frozen parameter, a
buffer) is simply never read. So every call compares what it can, and says
which key, what the model expects and what it got:

- the keys (`refuse_other_keys`), on every call, in or out of a transformed step;
- shapes and dtypes (`check_shapes_and_dtypes`) of the full tensors: outside
  a step all of them, inside one those the running transforms hand to the
  plain apply whole (a shard's 1-D slices are checked through its layout,
  `check_layout_shapes`).

The model's side is its ``spec``: ``{key: (shape, dtype)}`` of each trainable
parameter, recorded when `zfunc.functional.functional` was called.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Collection, Iterable, Iterator

import torch
from torch import nn

from zfunc.compiled import remember, same_keys, tracing
from zfunc.tree import dtype_of, read_in_c, shape_of

Spec = dict[str, tuple[torch.Size, torch.dtype]]

_LOW_PRECISION = (torch.bfloat16, torch.float16)

# Set while a caller runs the model in another dtype on purpose (`other_dtypes`).
_OTHER_DTYPES = contextvars.ContextVar("zfunc_other_dtypes", default=False)


@contextlib.contextmanager
def other_dtypes() -> Iterator[None]:
    """Let ``apply_fn`` run on params in another dtype than the model's, outside a transformed step: for a
    caller that casts on purpose and has cast what the forward meets besides (frozen parameters, buffers,
    inputs), as `zfunc.plan` does when it measures a bf16 forward on fake tensors."""
    token = _OTHER_DTYPES.set(True)
    try:
        yield
    finally:
        _OTHER_DTYPES.reset(token)


def refuse_other_keys(model: nn.Module, keys: frozenset, aliases: dict[str, str], params: dict,
                      where: str = "") -> None:
    """Refuse ``params`` unless its keys are exactly the model's trainable ``keys``: a missing one would
    fail deep inside the model (a bare KeyError), an extra one would be silently ignored."""
    if same_keys(params, keys):
        return
    given = frozenset(params)  # (not a dict view: dynamo 2.11 cannot subtract one from a frozenset)
    missing = sorted(keys - given)
    if missing:
        raise ValueError(f"apply_fn{where}: params lack {len(missing)} trainable tensors of "
                         f"{type(model).__name__}: {', '.join(missing[:8])}; pass the params dict from "
                         "zf.functional (or the state's; a state built from a subset of the params must be "
                         "built again from all of them)")
    _refuse_extra(model, aliases, sorted(given - keys, key=str), where)


def _refuse_extra(model: nn.Module, aliases: dict[str, str], extra: list, where: str) -> None:
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}

    def what(key) -> str:
        if key in aliases:
            return f"a tied name of {aliases[key]!r}, which is the key params holds it under"
        if key in frozen:
            return "a frozen parameter (requires_grad=False), read from the module itself"
        if key in buffers:
            return "a buffer, read from the module itself"
        return "no parameter of the model by that name (a typo?)"

    listed = "; ".join(f"{k!r}: {what(k)}" for k in extra[:8])
    raise ValueError(
        f"apply_fn{where}: params hold {len(extra)} key(s) that are not a trainable parameter of "
        f"{type(model).__name__}, so their values would be ignored: {listed}. Pass exactly the keys of the "
        "params dict from zf.functional; to change a frozen parameter or a buffer, set it on the module "
        "(or make it trainable before calling zf.functional).")


def check_shapes_and_dtypes(model: nn.Module, spec: Spec, params: dict, skip: Collection = (),
                            compute_dtype: torch.dtype | None = None, where: str | Callable[[], str] = "",
                            passed: dict | None = None) -> None:
    """Refuse a full tensor of ``params`` (keys in ``skip`` aside) whose shape is not the model's, or whose
    dtype is neither ``compute_dtype`` (what the running transforms compute in) nor, without one, the
    model's parameter's. ``where`` (or ``where()``, asked only for an error) says where the call ran.

    ``passed``: a dict the caller keeps across calls with one ``spec`` (the model's): the shapes and dtypes
    that last passed, per keys, ``skip``, ``compute_dtype`` and `other_dtypes`, which decide the outcome with
    them. A call that hands the same (every call of a training run) is checked by one comparison of lists
    read in C, rather than a Python-level read of each parameter."""
    seen = None
    if passed is not None and not tracing():
        values = list(params.values())
        if read_in_c(values):  # (a subclass's shape may run its own code: checked below, every call)
            index = (tuple(params), skip, compute_dtype, _OTHER_DTYPES.get())
            seen = (list(map(shape_of, values)), list(map(dtype_of, values)))
            if passed.get(index) == seen:
                return
    _check_each(spec, params, skip, compute_dtype, where)
    if seen is not None:
        remember(passed, index, seen)


def _check_each(spec: Spec, params: dict, skip: Collection, compute_dtype: torch.dtype | None,
                where: str | Callable[[], str]) -> None:
    for key, (shape, dtype) in spec.items():
        if key in skip:
            continue
        t = params.get(key)
        if not isinstance(t, torch.Tensor):
            continue
        if t.shape != shape:
            hint = (" They look like the 1-D shards of a state under shard(stage=3): evaluate on full "
                    "parameters, full = step.gather(state), then apply_fn(full, ...).") if t.dim() == 1 and \
                len(shape) != 1 else (" The state was built for another configuration of the model (or another "
                                      "model): build it from this model's params (zf.functional(model)), or "
                                      "restore a checkpoint into a template made from them.")
            where = where() if callable(where) else where
            raise ValueError(f"apply_fn{where}: params[{key!r}] has shape {tuple(t.shape)}, the model's parameter "
                             f"has {tuple(shape)}.{hint}")
        want = compute_dtype if compute_dtype is not None and t.is_floating_point() else dtype
        if t.dtype != want and not _OTHER_DTYPES.get():
            where = where() if callable(where) else where
            raise ValueError(f"apply_fn{where}: params[{key!r}] is {t.dtype}, but the model computes in {want} "
                             f"here.{_dtype_hint(t.dtype, want, compute_dtype)}")


def _dtype_hint(got: torch.dtype, want: torch.dtype, compute_dtype: torch.dtype | None) -> str:
    if compute_dtype is None and got in _LOW_PRECISION and want == torch.float32:
        return (f" This looks like a mixed_precision state (its params are the {got} compute copy): run it "
                "with the step that made it (mixed_precision(step, ...)), or evaluate on step.gather(state). "
                f"To train in {got} without a master, build the model in {got} before zf.functional.")
    if compute_dtype is None:
        return (f" Cast the params to {want} ({{k: v.to({want}) ...}}), or build the model in {got} before "
                "zf.functional, so that both agree (to run in another dtype on purpose, having cast the module's "
                "frozen parameters and buffers too: with zfunc.params_check.other_dtypes(): ...).")
    return (f" Cast the params to {want} before building the state ({{k: v.to({want}) ...}}), or build the "
            f"model in {got} before zf.functional, so that both agree.")


def check_layout_shapes(model: nn.Module, spec: Spec, shapes: Iterable[tuple[str, tuple]], where: str = "") -> None:
    """Refuse a sharded state whose recorded full shapes (``(key, shape)`` of its layout) are not the
    model's: its 1-D shards cannot be compared directly."""
    for key, shape in shapes:
        expected = spec.get(key)
        if expected is not None and tuple(shape) != tuple(expected[0]):
            raise ValueError(
                f"apply_fn{where}: the state's params[{key!r}] has shape {tuple(shape)}, the model's parameter "
                f"has {tuple(expected[0])}. The state was built for another configuration of the model (or "
                "another model): build it from this model's params (zf.functional(model)) with step.init, or "
                f"restore a checkpoint into a template made from them.")
