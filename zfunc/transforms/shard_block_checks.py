"""What a block run on a unit's parameters may do to them, and what its outputs may keep of them.

Under ``shard(stage=2|3)`` a block runs on views of its unit's gathered buffer (at
one rank: on the shards themselves). Two checks around each block's body
(`run_checked`): a forward that writes into those parameters in place is refused
at every world size alike (`refuse_writes`): the write would never leave a
gathered copy; and an output that is a view of the buffer is copied out before
the buffer is released (`detach_from`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as torch_pytree
from torch.distributed.tensor import DTensor

from zfunc.compiled import tracing
from zfunc.tree import version_of


def run_checked(body: Callable, block_params: dict, args: tuple, kwargs: dict, views: dict,
                 unit_name: str, who: object, opaque: Callable[[], None] | None = None) -> Any:
    """``body(block_params, ...)``, refusing an in-place write into the gathered parameters and
    copying out any output that is a view of them (it would outlive the buffer); ``opaque()`` is called
    when an output holds an object zfunc cannot look inside (which may hold such a view)."""
    if tracing():  # no version counters or storages to check in a compiled step (nor buffers to release)
        return body(block_params, *args, **kwargs)
    versions = list(map(version_of, views.values()))
    out = body(block_params, *args, **kwargs)
    refuse_writes(views, versions, who, f"block {unit_name!r}")
    return detach_from(out, next(iter(views.values())), opaque)


def refuse_writes(views: dict[str, torch.Tensor], versions: list[int], who: object, where: str) -> None:
    """Raise if the forward wrote in place into one of ``views`` (the parameters a unit gave the model), whose
    version counters were ``versions`` before it ran.

    Refused at every world size alike: on more than one rank the model runs on a gathered copy (or the
    stage 2 buffer's views) that the write never leaves; on one rank the views are the shards themselves, so
    the write would land there, and the same program would train differently on one GPU and on two.
    """
    if list(map(version_of, views.values())) == versions:
        return
    written = [key for key, v, before in zip(views, views.values(), versions) if v._version != before]
    # (Views of one gathered buffer share its version counter: then which of them was written is not known.)
    which = "one of " if len(written) == len(views) > 1 else ""
    raise RuntimeError(
        f"{who if isinstance(who, str) else repr(who)}: the forward wrote in place into {which}{', '.join(written[:6])}{' ...' if len(written) > 6 else ''} "
        f"({where}), e.g. nn.Embedding(max_norm=...) renormalizes the rows it looks up, or a weight is updated "
        "under torch.no_grad() or through .data inside forward. Under shard(stage=2|3) the model runs on a "
        "unit's gathered (or shared) buffer, which such a write never leaves: training would silently diverge "
        "from eager PyTorch, so it is refused on every world size. Make the forward pure (renormalize "
        "functionally: F.embedding(..., max_norm=None), then scale the looked-up rows), change weights outside "
        "the model call (e.g. after apply_gradients), or leave the block out of the units (shard(..., "
        "units=[...])).")


# What a block's output may hold that zfunc can see is not a view of its parameters (torch's pytree sees
# into tuples, dicts, dataclass-like model outputs); any other leaf is opaque.
_KNOWN_LEAVES = (torch.Tensor, bool, int, float, complex, str, type(None))


def detach_from(out: Any, base: torch.Tensor, opaque: Callable[[], None] | None = None) -> Any:
    """``out`` with every tensor that shares ``base``'s storage replaced by a (differentiable) copy;
    ``opaque()`` called if a leaf of ``out`` is not one of `_KNOWN_LEAVES`."""
    ptr = base.untyped_storage().data_ptr()
    # The usual outputs, a tensor or a tuple of tensors (and Nones), looked at directly: this runs per block,
    # and torch's tree_flatten (2.13) leaves a reference cycle per call (its recursive helper closure).
    if isinstance(out, torch.Tensor):
        return _unshared(out, ptr)
    if type(out) is tuple and all(x is None or isinstance(x, torch.Tensor) for x in out):
        fresh = tuple(x if x is None else _unshared(x, ptr) for x in out)
        return fresh if any(a is not b for a, b in zip(fresh, out)) else out
    leaves, spec = torch_pytree.tree_flatten(out)
    changed = False
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor):
            if opaque is not None and not isinstance(x, _KNOWN_LEAVES):
                opaque()
            continue
        leaves[i] = _unshared(x, ptr)
        changed = changed or leaves[i] is not x
    return torch_pytree.tree_unflatten(leaves, spec) if changed else out


def _unshared(x: torch.Tensor, ptr: int) -> torch.Tensor:
    """``x``, or a (differentiable) copy of it where it lies in the storage at ``ptr``."""
    # (A DTensor, e.g. tensor_parallel's sequence-split activations, holds its data in its local tensor.)
    local = x._local_tensor if isinstance(x, DTensor) else x
    return x.clone() if x.numel() and local.untyped_storage().data_ptr() == ptr else x
