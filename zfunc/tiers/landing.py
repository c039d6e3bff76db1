"""Gradients landing in page-locked host memory while backward runs, and who waits for them.

Under ``shard(offload(...), stage=2|3)`` at one micro-batch each unit's reduced
gradient leaves the GPU as its reduction lands (`zfunc.transforms.grad_accumulator`).
`HostLanding` copies it on a copy stream straight into its host buffer, which is
page-locked (registered with CUDA once, `zfunc.tiers.placement.page_locked_empty`),
so the copy engine writes it directly: no staging buffer, no host thread, and
the thread running backward never waits. One CUDA event per buffer says when
it has landed.

Until then the buffer's values are not the gradient's. Whoever reads a landing
gradient on the host therefore waits for it first:

- the host update (`zfunc.optim.fused`, handed the landing through
  ``UpdateRequest.grads_landing``) waits for each unit just before it reads
  that unit, and takes the units in the order they land (backward's order), so
  it starts on the first ones while the GPU still runs backward on the rest;
- every other reader (the user's step between ``value_and_grad`` and
  ``apply_gradients``, say a gradient norm for logging) meets `ReadGuard`: a
  torch function mode, on the stack only while gradients are landing and no
  update has taken them, that waits for a landing buffer the first time an
  operation reads it (operations that only look at shapes or make views do not
  wait), so no step can read a gradient that is not there yet;
- at the end of the step everything has landed (`HostLanding.wait_all`):
  gradients a step returns are complete.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves


def memory_of(t: torch.Tensor) -> int:
    """The address of ``t``'s memory block (its storage): the same for a buffer and every view of it."""
    return t.untyped_storage().data_ptr()


class HostLanding:
    """Copies of GPU tensors into host buffers on one copy stream, and one event per buffer (module docstring).

    ``copy`` never waits on the host; ``wait``/``wait_all`` do (the host work that reads the buffers).
    Buffers are told apart by their memory (`memory_of`), so a view of a landing buffer waits for it too.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pending: dict[int, tuple[int, torch.cuda.Event]] = {}  # memory -> (copy number, its event)
        self.issued = 0

    def copy(self, dest: torch.Tensor, grad: torch.Tensor) -> None:
        """``dest ← grad`` (same dtype and size; ``dest`` a page-locked host buffer), asynchronously, after the
        work already queued on the current stream (which made ``grad``); the caller may drop ``grad`` now."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dest.copy_(grad, non_blocking=True)
            grad.record_stream(self.stream)  # its memory is not reused before the copy has read it
            landed = torch.cuda.Event()
            landed.record(self.stream)
        self.note(dest, landed)

    def note(self, dest: torch.Tensor, landed) -> None:
        """Record that ``dest`` lands when ``landed`` (an event: ``synchronize()``) completes."""
        self.pending[memory_of(dest)] = (self.issued, landed)
        self.issued += 1

    def order(self, t: torch.Tensor) -> int:
        """When ``t``'s copy was issued (copies land in this order); -1 for a tensor that is not landing."""
        found = self.pending.get(memory_of(t)) if self.pending else None
        return -1 if found is None else found[0]

    def wait(self, t: torch.Tensor) -> None:
        """Wait until ``t``'s buffer has landed (nothing if it is not landing)."""
        if self.pending:
            found = self.pending.pop(memory_of(t), None)
            if found is not None:
                found[1].synchronize()

    def wait_all(self) -> None:
        """Wait until every buffer has landed."""
        pending, self.pending = self.pending, {}
        for _, landed in sorted(pending.values(), key=lambda entry: entry[0]):
            landed.synchronize()


# Operations that read no element of a tensor: its metadata, or a view of it (whose reads are caught in turn).
_READS_NOTHING = frozenset({
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__, torch.Tensor.ndim.__get__,
    torch.Tensor.requires_grad.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.layout.__get__,
    torch.Tensor.grad_fn.__get__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement,
    torch.Tensor.stride, torch.Tensor.storage_offset, torch.Tensor.is_contiguous, torch.Tensor.element_size,
    torch.Tensor.is_floating_point, torch.Tensor.view, torch.Tensor.detach, torch.Tensor.__len__,
    torch.Tensor.__getitem__,  # (slicing: a view; indexing by tensors reads, `_indexes_with_tensors`)
})


class ReadGuard(TorchFunctionMode):
    """Waits for a landing gradient before any torch operation reads it (see the module docstring).

    Pushed by `push` while gradients are landing, removed by `remove` (wherever it is on the stack: the user
    may have pushed modes of their own above it). Thread-local, like every torch function mode: a read from
    another thread is not seen.
    """

    def __init__(self, landing: HostLanding) -> None:
        super().__init__()
        self.landing = landing

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.landing.pending and (func not in _READS_NOTHING or _indexes_with_tensors(func, args)):
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu":
                    self.landing.wait(leaf)
        return func(*args, **kwargs)

    def push(self) -> ReadGuard:
        torch._C._push_on_torch_function_stack(self)
        return self

    def remove(self) -> None:
        """Take this mode off the torch function stack (the modes above it go back in their order)."""
        depth = torch._C._len_torch_function_stack()
        above = []
        for _ in range(depth):
            top = torch._C._pop_torch_function_stack()
            if top is self:
                break
            above.append(top)
        for mode in reversed(above):
            torch._C._push_on_torch_function_stack(mode)


def _indexes_with_tensors(func, args) -> bool:
    """Whether ``func`` is indexing by tensors (``t[idx]`` gathers: it reads), not slicing (a view)."""
    return func == torch.Tensor.__getitem__ and any(isinstance(x, torch.Tensor) for x in tree_leaves(args[1:]))
