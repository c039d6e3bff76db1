"""Changes made through ``.data`` to the parameters a model runs on.

``weight.data`` is a tensor that shares ``weight``'s memory but not its
version counter: a write through it (``self.lin.weight.data.mul_(0.9)`` in a
forward) is invisible to autograd and to every check zfunc makes by version
counter, and ``weight.data = other`` swaps the memory under the tensor. In
eager PyTorch either change lands in the parameter and the optimizer steps
from there. Under zfunc the model runs on tensors made for the call (leaves
for differentiation, `mixed_precision`'s compute copy, stage 3's gathered
buffer, a block recomputed in backward), where such a change would be lost
without a word. `ParamsWatch` sees both while the model runs:

- an assignment ``parameter.data = other`` moves the tensor's data pointer:
  checked when the call (or the block) returns, and refused everywhere (the
  state's parameter is never the tensor the model holds);
- a write through ``parameter.data`` is seen where the model runs on a copy
  or a block is recomputed: there a ``TorchFunctionMode`` (which lets every
  other function through untouched) makes ``.data`` of a watched parameter
  return ``parameter.detach()``: the same memory, the same values, but the
  parameter's own version counter, so the write is seen exactly like a write
  under ``torch.no_grad()`` and refused by the transform, naming the
  parameter. Elsewhere (the plain step, offload, accumulate, stage 1/2) the
  write lands in the state's parameter as in eager PyTorch.

The mode costs a Python call per torch function the forward makes (on one
H200, GPT-2 medium under stage 3 and bf16, it made the forward's host time
20-30% longer and the step 4-10% slower). So it watches a model's first
`WATCHED_FORWARDS` forwards in such stacks (`DataReadHistory`), and every
forward after them if any of those read ``.data`` of a parameter: code that
reads ``.data`` of a parameter only after its first forwards (at step 1000)
is not watched.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from zfunc.tree import PLAIN_TENSOR_TYPES, data_ptr_of, read_in_c

_DATA = torch.Tensor.data  # the getset descriptor; its __get__ arrives as a fresh method-wrapper (compare with ==)


WATCHED_FORWARDS = 3


class DataReadHistory:
    """Whether a model's forward reads ``.data`` of its parameters, as its first forwards showed.

    One per model (`ModelStructure`), updated under its lock."""

    def __init__(self) -> None:
        self.watched = 0  # forwards watched so far
        self.seen = False  # whether one of them read `.data` of a parameter

    def should_watch(self) -> bool:
        return self.seen or self.watched < WATCHED_FORWARDS

    def record(self, watch: ParamsWatch) -> None:
        if watch.mode is not None:
            self.watched += 1
            self.seen = self.seen or watch.mode.seen


class ParamsWatch:
    """What one model call gives the model as parameters, watched for changes through ``.data``.

    Args:
      see_data_writes: whether to push `DataReadsAsDetach`, making writes through ``.data`` visible to
        version counters (for the stacks where the model runs on copies or recomputes blocks).
    """

    def __init__(self, see_data_writes: bool) -> None:
        self.mode = DataReadsAsDetach() if see_data_writes else None

    @contextlib.contextmanager
    def watching(self, params: dict[str, Any], where: str = "") -> Iterator[None]:
        """While the ``with`` body runs the model on ``params`` (name -> tensor): route their ``.data``
        through ``detach()`` (with ``see_data_writes``), and refuse after it any whose data pointer moved.
        Nothing is kept once the body ends (a gathered block's buffer may be released then)."""
        # (Each selection made in C where it can: this runs for every parameter of every block per forward.)
        tensors = params if all(map(isinstance, params.values(), itertools.repeat(torch.Tensor))) else \
            {name: t for name, t in params.items() if isinstance(t, torch.Tensor)}
        # Only a plain tensor has a data pointer to watch (`_data_pointer`): a subclass (shard's stand-in for a
        # parameter outside its block) may run code when asked for one.
        plain = tensors if read_in_c(tensors.values()) else \
            dict(itertools.compress(tensors.items(), map(PLAIN_TENSOR_TYPES.__contains__, map(type, tensors.values()))))
        pointers = _data_pointers(plain.values())
        if self.mode is not None:
            added = [i for i in map(id, tensors.values()) if i not in self.mode.watched]
            self.mode.watched.update(added)
        try:
            yield
        finally:
            if self.mode is not None:
                self.mode.watched.difference_update(added)
        after = _data_pointers(plain.values())
        if after == pointers:  # (the common case: one comparison in C)
            return
        moved = [name for name, was, now in zip(plain, pointers, after) if was is not None and now != was]
        if moved:
            raise RuntimeError(
                f"the model's forward assigns {where}{moved[0]}.data = ...{' (and ' + str(len(moved) - 1) + ' more)' if len(moved) > 1 else ''}: "
                "that replaces the memory of the tensor this call runs on (a leaf made for differentiation or a "
                "copy of the state's parameter), never the state's parameter, so the change would be silently "
                "lost. Change parameters outside the model: in the step, on state.params (e.g. after "
                "apply_gradients).")

    def __enter__(self) -> ParamsWatch:
        if self.mode is not None:
            self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.mode is not None:
            self.mode.__exit__(*exc)


_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _data_pointers(tensors: Iterable[torch.Tensor]) -> list[int | None]:
    """`_data_pointer` of each tensor. This runs for every parameter of every block twice in every forward:
    in the common case (plain tensors with storage, none wrapped by torch.func) the pointers are read by
    ``map`` in C, with no Python-level call per tensor; otherwise one by one."""
    tensors = list(tensors)
    if read_in_c(tensors) and not any(map(_wrapped, tensors)):
        try:
            return list(map(data_ptr_of, tensors))
        except RuntimeError:  # a plain tensor without storage: the careful way below
            pass
    return [_data_pointer(t) for t in tensors]


def _data_pointer(t: torch.Tensor) -> int | None:
    """Where ``t``'s elements are (through torch.func's wrappers); None for a tensor subclass, whose
    ``data_ptr`` may run code (shard's stand-ins for a block's parameters gather them when used), or a
    tensor without storage."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return None
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    try:
        return t.data_ptr()
    except RuntimeError:
        return None


class DataReadsAsDetach(TorchFunctionMode):
    """``.data`` of a watched tensor (by identity) returns ``detach()``, which shares its version counter."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: set[int] = set()
        self.seen = False  # whether the forward read `.data` of a watched tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func == _DATA.__get__ and args and id(args[0]) in self.watched:
            self.seen = True
            return args[0].detach()
        return func(*args, **(kwargs or {}))
