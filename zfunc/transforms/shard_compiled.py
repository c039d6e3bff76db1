"""`shard` while torch.compile traces a step: functional collectives and storage-free views.

The eager `shard` (stages 1-3) issues asynchronous collectives, waits for them
with a timeout, finds a unit's flat buffer from its views' storage and
fingerprints the collectives it issued; none of that can be traced. While
dynamo traces a step (`zfunc.compiled.tracing`), `shard` takes these
equivalents instead, at the few points `shard.py` and `shard_units.py` name:

- `CompiledComm` stands in for `zfunc.dist.Comm`: torch's functional
  collectives (``all_gather_tensor``, ``reduce_scatter_tensor``,
  ``all_reduce`` in ``torch.distributed._functional_collectives``; torch 2.11
  and 2.13 have all three), which the graph holds as ops that Inductor may
  reorder against compute. A gradient reduction is the mean over ranks of
  this rank's slice: ``reduce_scatter_tensor(avg)`` on NCCL; on gloo, which has
  no reduce-scatter, an ``all_reduce(sum)`` of which the rank keeps its slice
  ÷ N (what the eager gloo path computes, in the same dtype);
- `GatherUnit` (stage 3 and the root unit): the unit's full flat buffer
  gathered from this rank's shard; backward reduce-scatters its gradient
  where it is complete, inside the backward half of the graph;
- `ResidentUnit` (stage 2): the resident full parameters handed to the model
  as they are; backward reduce-scatters their gradient likewise;
- at world size 1 neither: the model runs on the shards themselves, reshaped
  (`Units.runs_on_shards`), so the graph holds no collective and no autograd
  Function (one there makes AOTAutograd's cache refuse the graph, so a warm cache
  would not spare its trace);
- shards and the in-place all-gather of updated parameters (stages 1/2) are
  per-key slices of the parameters, not views of a buffer found from storage
  (at one rank, where nothing is gathered, `shard` finds each unit's buffer
  recorded on its parameters and cuts the shards from it, where each records
  that it sits under its own key: `zfunc.optim.flat.owner_of`; parameters
  moved between keys are refused, as the eager step refuses them).

What a compiled step does not do that the eager one does: the check that every
rank issued the same collectives (``verify``; a rank that diverges hangs in
its collective until the process group's own timeout), the bounded waits with
`zfunc.dist.CollectiveError` (the group's timeout applies instead), and the
stage-3 release/refill of gathered blocks (a compiled graph keeps a gathered
block's weights from its forward to its backward: see `zfunc.compiled`;
`zfunc.compile_step` gathers them again for backward in the graph;
`zfunc.transforms.compile_blocks` compiles the blocks and keeps the eager
release).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from zfunc.transforms.shard_layout import UnitLayout


class Wire(NamedTuple):
    """What a traced collective needs to know about its group (constants of the graph)."""

    group: Any          # the process group (torch.distributed's world when the Group has no handle)
    size: int
    rank: int
    on_cpu: bool        # gloo: no reduce-scatter; an all-reduce of which each rank keeps its slice
    reduce_dtype: torch.dtype | None


def gather(flat_shard: torch.Tensor, wire: Wire) -> torch.Tensor:
    """Concatenation over ranks of each rank's 1-D shard."""
    if wire.size == 1:
        return flat_shard.clone()
    return funcol.all_gather_tensor(flat_shard.contiguous(), 0, wire.group)


def mean_slice(full: torch.Tensor, wire: Wire) -> torch.Tensor:
    """This rank's 1/N slice of the mean over ranks of 1-D ``full``, in ``full``'s dtype (reduced
    in ``wire.reduce_dtype``)."""
    if wire.size == 1:
        return full.clone()
    send = full if wire.reduce_dtype in (None, full.dtype) else full.to(wire.reduce_dtype)
    n = full.numel() // wire.size
    if wire.on_cpu:
        summed = funcol.all_reduce(send.contiguous(), "sum", wire.group)
        mine = summed[wire.rank * n:(wire.rank + 1) * n] / wire.size
    else:
        mine = funcol.reduce_scatter_tensor(send.contiguous(), "avg", 0, wire.group)
    return mine if mine.dtype == full.dtype else mine.to(full.dtype)


class CompiledComm:
    """`zfunc.dist.Comm`'s interface over functional collectives (see the module docstring)."""

    def __init__(self, group, reduce_dtype: torch.dtype | None = None) -> None:
        self.group = group
        self.reduce_dtype = reduce_dtype
        handle = group.handle if group.handle is not None else (dist.group.WORLD if group.size > 1 else None)
        self.wire = Wire(handle, group.size, group.rank, group.device.type == "cpu", reduce_dtype)
        self.gathered = self.reduced = self.summed = 0
        self.pending: list = []
        self.overlap = True
        self.waits = 0

    @property
    def total(self) -> int:
        return self.gathered + self.reduced + self.summed

    def all_gather(self, shard: torch.Tensor, out: torch.Tensor | None = None, tag=None) -> torch.Tensor:
        full = gather(shard, self.wire)
        if self.group.size > 1:
            self.gathered += full.numel()
        if out is not None:
            out.copy_(full)
            return out
        return full

    def all_gather_async(self, shard: torch.Tensor, out: torch.Tensor | None = None, tag=None) -> "_Ready":
        # (The graph orders the gather; Inductor may issue it early.)
        return _Ready(self.all_gather(shard, out, tag))

    def reduce_scatter(self, full: torch.Tensor, tag=None) -> torch.Tensor:
        if self.group.size > 1:
            self.reduced += full.numel()
        return mean_slice(full, self.wire)

    def finish_pending(self) -> None:
        """Nothing in flight to wait for: the graph's data dependencies order the collectives."""

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return x
        self.summed += x.numel()
        return funcol.all_reduce(x.detach().contiguous(), "sum", self.wire.group)

    def check_sequence(self, what: str) -> None:
        """Not checked in a compiled step (see the module docstring)."""


class _Ready:
    """A gather that is already part of the graph (`Prefetch`'s interface)."""

    def __init__(self, full: torch.Tensor) -> None:
        self.full = full

    def result(self) -> torch.Tensor:
        return self.full


class GatherUnit(torch.autograd.Function):
    """``full = cat_r(shard_r)``; backward: this rank's slice of the mean of the gradients."""

    @staticmethod
    def forward(flat_shard: torch.Tensor, wire: Wire) -> torch.Tensor:
        return gather(flat_shard, wire)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.wire = inputs[1]

    @staticmethod
    def backward(ctx, grad_full):
        return mean_slice(grad_full, ctx.wire), None


class ResidentUnit(torch.autograd.Function):
    """Stage 2: the resident full parameters as they are; backward reduce-scatters their gradient
    (``flat_shard`` is only the differentiation handle: its values are this rank's part of ``full``)."""

    @staticmethod
    def forward(flat_shard: torch.Tensor, wire: Wire, unit: UnitLayout, *full: torch.Tensor):
        return tuple(t.view_as(t) for t in full)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.wire, ctx.unit = inputs[1], inputs[2]
        ctx.like = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        unit, like = ctx.unit, ctx.like
        parts = [like.new_zeros(n) if g is None else g.reshape(-1) for g, n in zip(grads, unit.numels)]
        if unit.padded > unit.numel:
            parts.append(like.new_zeros(unit.padded - unit.numel))
        return (mean_slice(torch.cat(parts), ctx.wire), None, None, *([None] * len(grads)))


def unit_views(comm: CompiledComm, unit: UnitLayout, slices: dict, rank: int,
               resident: dict | None) -> dict[str, torch.Tensor]:
    """What the model sees of ``unit`` in a compiled step: full parameters, differentiable with
    respect to this rank's ``slices`` (gathered; or, at stage 2, the ``resident`` ones)."""
    flat_shard = unit.cat_shard(slices, rank)
    if resident is not None:
        if comm.group.size > 1:
            comm.reduced += unit.padded
        return dict(zip(unit.keys, ResidentUnit.apply(flat_shard, comm.wire, unit,
                                                       *(resident[k] for k in unit.keys))))
    if comm.group.size > 1:
        comm.gathered += unit.padded
        comm.reduced += unit.padded
    return unit.split_views(GatherUnit.apply(flat_shard, comm.wire))


def param_shards(params: dict, layout) -> dict[str, torch.Tensor]:
    """Stages 1/2: this rank's 1-D slices of the full parameters (views of them)."""
    if layout.world_size == 1:  # (the whole of each: no range to find per key, which a trace pays per key)
        return {key: params[key].reshape(-1) for unit in layout.units for key in unit.keys}
    shards = {}
    for unit in layout.units:
        for i, key in enumerate(unit.keys):
            a, b = unit.local_range(i, layout.rank)
            shards[key] = params[key].reshape(-1)[a:b]
    return shards


def gather_updated(comm: CompiledComm, params: dict, layout) -> None:
    """Stages 1/2 after the update wrote this rank's slices: every rank's slices into the full
    parameters, in place."""
    for unit in layout.units:
        mine = unit.cat_shard(param_shards({k: params[k] for k in unit.keys}, _one(unit, layout)), layout.rank)
        full = comm.all_gather(mine)
        with torch.no_grad():
            for key, view in unit.split_views(full).items():
                params[key].copy_(view)


def _one(unit: UnitLayout, layout):
    """A layout of ``unit`` alone (for `param_shards` over one unit's keys)."""
    return type(layout)(layout.stage, layout.world_size, layout.rank, (unit,))
