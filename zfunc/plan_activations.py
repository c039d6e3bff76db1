"""The activations of one forward and backward, measured on fake tensors (`measure_activations`), for `zf.plan`.

The loss function runs once under `torch._subclasses.fake_tensor.FakeTensorMode` (shapes and dtypes, no
memory, any model size) with a dispatch mode counting the bytes of every storage an operator allocates
(`_LiveBytes`): a view allocates nothing (by the operator's schema), a storage is freed when its last
tensor is, and the gradients the loss returns are left out (the plan counts them where the stack keeps
them). With recompute, the blocks run under zfunc's own `checkpoint`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zfunc.tree import tree_leaves, tree_map


class _LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors created while it is active (each storage once); with
    `peak_without`, the peak had some of them never been made (the gradients the plan counts elsewhere)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.sizes: dict[int, int] = {}
        self.born: dict[int, int] = {}  # storage key -> the allocation it is (keys are reused once freed)
        self.events: list[tuple[int, int]] = []  # (allocation, +bytes / -bytes), in order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _aliases_an_input(func):
            # (a view or detach allocates nothing; fake tensors' views do not always share their base's storage
            # object, so their storages cannot be matched: counted by what the schema says instead)
            return out
        for t in tree_leaves(out) if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self.sizes:
                    self.sizes[key] = storage.nbytes()
                    self.born[key] = len(self.events)
                    self.events.append((self.born[key], self.sizes[key]))
                    self.live += self.sizes[key]
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._free, key)
        return out

    def _free(self, key: int) -> None:
        size = self.sizes.pop(key, 0)
        self.live -= size
        if key in self.born:
            self.events.append((self.born.pop(key), -size))

    def peak_without(self, tensors) -> int:
        """The peak had ``tensors`` (alive now, made while this was active) never been allocated."""
        skip = {self.born[t.untyped_storage()._cdata] for t in tensors
                if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in self.born}
        live = peak = 0
        for allocation, delta in self.events:
            if allocation not in skip:
                live += delta
                peak = max(peak, live)
        return peak


def _aliases_an_input(func) -> bool:
    """Whether an operator's outputs are views of (or the same memory as) one of its inputs, by its schema."""
    schema = getattr(func, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def measure_activations(loss_fn: Callable, batch: Any, params: dict[str, torch.Tensor], dtype: torch.dtype,
                        recompute: bool, blocks: list[str] | None) -> int:
    """Peak bytes of what one forward and backward of ``loss_fn`` allocate beyond the parameters and their
    gradients (activations, and what backward holds while it runs), measured on fake tensors: no memory, no
    compute, any model size. The gradients it returns are left out: where they live, and how many at once
    (the whole model's, a unit's, an accumulator), is the stack's, and the plan counts them itself."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zfunc.autodiff import value_and_grad
    from zfunc.params_check import other_dtypes

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    device = _batch_device(batch)
    with fake:
        fake_params = {k: torch.empty(v.shape, dtype=dtype if v.is_floating_point() else v.dtype, device=device)
                       for k, v in params.items()}
        fake_batch = tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device)
                              if isinstance(t, torch.Tensor) else t, batch)
    model = _model_of(loss_fn)
    restore = _fake_constants(model, fake, device, dtype) if model is not None else []
    tracker = _LiveBytes()
    try:
        with fake, tracker, other_dtypes():  # (the constants were cast to ``dtype`` too)
            loss_of = _with_recompute(loss_fn, blocks) if recompute and blocks else loss_fn
            _, grads = value_and_grad(loss_of)(fake_params, fake_batch)
    finally:
        for where, attr, original in restore:
            where[attr] = original
    return tracker.peak_without(tree_leaves(grads))


def _batch_device(batch: Any) -> torch.device:
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor) and not t.is_meta:
            return t.device
    return torch.device("cpu")


def _model_of(loss_fn: Callable, depth: int = 0):
    """The module behind the apply function ``loss_fn`` uses (a closure or a global it names)."""
    from zfunc.functional import FunctionalModel

    if isinstance(loss_fn, FunctionalModel):
        return loss_fn.model
    code = getattr(loss_fn, "__code__", None)
    values = [cell.cell_contents for cell in getattr(loss_fn, "__closure__", None) or ()]
    if code is not None:
        names = getattr(loss_fn, "__globals__", {})
        values += [names[n] for n in code.co_names if n in names]
    for value in values:
        if isinstance(value, FunctionalModel):
            return value.model
    if depth < 3:
        for value in values:
            if callable(value) and value is not loss_fn and hasattr(value, "__code__"):
                found = _model_of(value, depth + 1)
                if found is not None:
                    return found
    return None


def _fake_constants(model, fake, device, dtype) -> list:
    """Frozen parameters and buffers as fake tensors for the measurement; returns what to put back."""
    restore = []
    with fake:
        for module in model.modules():
            for slots in (module._parameters, module._buffers):
                for attr, t in list(slots.items()):
                    if t is None or (t.requires_grad and slots is module._parameters):
                        continue
                    restore.append((slots, attr, t))
                    made = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
                    slots[attr] = torch.nn.Parameter(made, requires_grad=False) if slots is module._parameters \
                        else made
    return restore


def _with_recompute(loss_fn: Callable, blocks: list[str]) -> Callable:
    """``loss_fn`` run under a `checkpoint` transform of the model's blocks (zfunc's recompute, which hands a
    block its parameters as inputs, so the recompute in backward still sees them)."""
    from zfunc.step_context import CONTEXT, StepContext
    from zfunc.transforms.checkpoint import checkpoint

    stack = checkpoint(lambda state, batch: (state, {}), modules=list(blocks))

    def wrapped(params, batch):
        ctx = StepContext(stack.stack)
        ctx.scratch[id(stack)] = stack.start(ctx, None)
        token = CONTEXT.set(ctx)
        try:
            return loss_fn(params, batch)
        finally:
            CONTEXT.reset(token)

    return wrapped
