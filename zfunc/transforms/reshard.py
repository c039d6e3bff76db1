"""Free a gathered block's parameters after its forward; gather them again just before its backward.

ZeRO-3 without recomputation (what FSDP2 does with ``reshard_after_forward``).
Autograd saves the gathered weights that a block's forward used (a linear
layer saves its weight), so a plain all-gather keeps every block whole until
backward: ZeRO-2's memory. Instead, once a block's forward has run, the
storage of its gathered flat buffer is released (``resize_(0)``: the saved
views keep their shape but hold no memory); a tiny autograd Function on the
block's outputs refills it (all-gathers into the same storage) when backward
reaches the block, and it is released again once the block's backward is
done (the gradients of both its inputs and its parameters are computed). Only the running block and the next one (prefetched) are
whole at any time, and no forward is recomputed.

This route needs plain autograd (the refill writes into a tensor autograd
saved, under `torch.autograd._unsafe_preserve_version_counter`, so autograd
does not see an in-place change). Inside a `torch.func` transform or a
`torch.compile` trace, `shard` recomputes the block instead
(`zfunc.recompute`), which needs nothing private; so does a block that
`checkpoint` recomputes anyway.
"""

from __future__ import annotations

from typing import Any

import torch

from zfunc import dist
from zfunc.autodiff import apply_function
from zfunc.tree import tree_flatten, tree_unflatten


class ReleasedBuffer:
    """A gathered flat buffer whose storage exists only while its block runs."""

    def __init__(self, full: torch.Tensor, flat_shard: torch.Tensor, comm: dist.Comm, tag: str = "",
                 before_refill=None) -> None:
        self.full, self.flat_shard = full, flat_shard.detach()
        self.comm, self.tag = comm, tag
        self.before_refill = before_refill  # called before a refill's collective (shard compares ranks there)
        self.keep = False  # never released (an output may hold a view of it)
        self.nbytes = full.untyped_storage().nbytes()
        self.pending = None  # an asynchronous refill in flight
        # Backward is done with the block when both the gradient of the gathered
        # parameters (`parameters_grad_ready`, called by the node that reduces them)
        # and that of the block's inputs are computed: only then is no backward node
        # left that reads the parameters' values.
        self.events_needed, self.events = 1, 0

    def parameters_grad_ready(self) -> None:
        self.backward_event()

    def backward_event(self) -> None:
        self.events += 1
        if self.events >= self.events_needed:
            self.release()

    @property
    def filled(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def release(self) -> None:
        self.wait()
        if self.filled and not self.keep:
            self.full.untyped_storage().resize_(0)

    def refill(self, asynchronous: bool = False) -> None:
        """All-gather the block's parameters back into the released storage."""
        if self.filled or self.pending is not None:
            return
        if self.before_refill is not None:
            self.before_refill()
        self.events = 0
        self.full.untyped_storage().resize_(self.nbytes)
        # The guard records the version now and restores it when closed: an
        # asynchronous collective may bump it from its own thread on completion
        # (gloo does), so it is closed only after the gather has landed.
        guard = torch.autograd._unsafe_preserve_version_counter(self.full)
        if asynchronous:
            self.pending = (self.comm.all_gather_async(self.flat_shard, out=self.full, tag=self.tag), guard)
        else:
            self.comm.all_gather(self.flat_shard, out=self.full, tag=self.tag)
            guard.__exit__(None, None, None)

    def wait(self) -> None:
        if self.pending is not None:
            prefetch, guard = self.pending
            prefetch.result()
            guard.__exit__(None, None, None)
            self.pending = None


def around_block(buffer: ReleasedBuffer, body, block_params: dict, args: tuple, kwargs: dict,
                 before_backward) -> Any:
    """Run ``body`` on gathered params, then release them; refill when backward comes back.

    ``before_backward()`` runs as this block's backward starts (after its own
    refill): `shard` uses it to prefetch the refill of the block before.
    """
    (args, kwargs), marked = _through(_ReleaseAfterBackward, (buffer,), (args, kwargs))
    if marked:  # release waits for the inputs' gradients too
        buffer.events_needed = 2
    out = body(block_params, *args, **kwargs)
    out, _ = _through(_RefillBeforeBackward, (buffer, before_backward), out)
    buffer.release()
    return out


def _through(function: type[torch.autograd.Function], head: tuple, tree: Any) -> tuple[Any, bool]:
    """``tree`` with its tensors that require grad replaced by ``function.apply(*head, *those)``'s outputs;
    whether there were any."""
    leaves, spec = tree_flatten(tree)
    slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if slots:
        for i, t in zip(slots, apply_function(function, head, [leaves[i] for i in slots])):
            leaves[i] = t
    return tree_unflatten(spec, leaves), bool(slots)


class _RefillBeforeBackward(torch.autograd.Function):
    """Identity on a block's outputs; its backward (the block's first) refills the parameters."""

    @staticmethod
    def forward(ctx, buffer, before_backward, *outputs):
        ctx.buffer, ctx.before_backward = buffer, before_backward
        return tuple(t.view_as(t) for t in outputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.buffer.wait()
        ctx.buffer.refill()
        ctx.before_backward()
        return (None, None, *grads)


class _ReleaseAfterBackward(torch.autograd.Function):
    """Identity on a block's inputs; its backward (after the block's) releases the parameters."""

    @staticmethod
    def forward(ctx, buffer, *inputs):
        ctx.buffer = buffer
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.buffer.backward_event()
        return (None, *grads)
