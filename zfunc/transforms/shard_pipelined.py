"""`shard` stages 2 and 3 around `pipeline`: a pipeline stage's units whole for the schedule, each unit's
gradient reduced once per schedule.

Outside a pipeline, stages 2 and 3 reduce a unit's gradient inside the backward pass that made it, as soon as
its last use there is differentiated (`shard_units`). torch's pipeline schedule runs one backward per
micro-batch, interleaved with other micro-batches' forwards (1F1B), so "the unit's last use in this backward"
would be the last use in one micro-batch: the reduction would run M times per step, and which micro-batch is
the last differs by stage and schedule. Here, instead, for one ``value_and_grad`` of ``shard(pipeline(...))``:

- **parameters**: the schedule runs on the stage's full parameters. Stage 2 holds them anyway (its state's
  params are full). Stage 3 all-gathers each of the stage's units once, before the schedule, in unit order on
  every dp rank, and frees them when it returns: a pipeline rank holds 1/pp of the model's blocks, so the
  stage whole for the duration of one schedule costs 1/pp of the model (plus the gradient, below) instead of
  one block at a time; between steps only this rank's 1/(pp·dp) shards remain. The trade: no per-block
  re-gathering in every micro-batch's forward and backward (2M gathers per unit and step, which the schedule's
  interleaving would also make hard to pair across ranks), for the stage's parameters being whole during the
  step.
- **gradients**: torch's schedule sums each parameter's gradient over the micro-batches (and scales it by
  1/M); when the schedule returned (`gradients_ready`, dispatched by `pipeline` after its tied weights'
  gradients came home), each unit's summed gradient is reduce-scattered over dp once, in unit order on every
  dp rank (one unit's reduction in flight while the next unit's gradient is packed), so each dp rank keeps
  its shard, as at stages 2 and 3 without pipeline. Under an `accumulate` inside the pipeline, each
  schedule's reduced shards are added into its accumulator (`GradAccumulator.add_unit`), on the tier of the
  unit's optimizer state, and no full-size gradient outlives a schedule. Not overlapped with this rank's
  compute, but a stage ends its last backward before the stage ahead of it does (1F1B: the last stage
  first), so its reductions run while earlier stages still compute; the first stage's are the exposed ones.

So at the step's peak a rank holds the stage's parameters and gradient whole, as at stage 1: stage 2 here is
stage 1's memory and communication, and stage 3 saves parameter memory between steps only (docs/pipeline.md).

Pairing across dp ranks: the dp ranks of one pipeline stage run the same schedule on their own data, and here
make the same collectives, in the same order, outside the schedule (before: gathers; after: reductions),
whatever the schedule interleaves; the schedule's own point-to-point transfers run on the pp group.
Communication per step and rank (Ψ_s: the stage's parameters): stage 2 Ψ_s reduced + Ψ_s all-gathered after
the update (as stage 1); stage 3 Ψ_s gathered + Ψ_s reduced.
"""

from __future__ import annotations

import torch

from zfunc import dist
from zfunc.interpret import current
from zfunc.transforms.shard_layout import ShardLayout


class StageUnits:
    """One call's stage 2/3 units under `pipeline` (see the module docstring)."""

    def __init__(self, layout: ShardLayout, comm: dist.Comm) -> None:
        self.layout, self.comm = layout, comm
        self.rank = comm.group.rank

    def full_params(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The stage's full parameters, keyed like ``params``: stage 2's own (resident) full parameters;
        stage 3's shards all-gathered unit by unit (new buffers, freed when the caller drops them)."""
        if self.layout.stage != 3:
            return dict(params)
        gathers = [(unit, self.comm.all_gather_async(unit.shard_data({k: params[k] for k in unit.keys}, self.rank),
                                                     tag=unit.name))
                   for unit in self.layout.units]
        full: dict[str, torch.Tensor] = {}
        for unit, gather in gathers:
            full.update(unit.full_views(gather.result()))
        return {k: full[k] for k in params}

    def reduce(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``grads`` (the stage's full gradients, summed over the micro-batches) reduce-scattered unit by unit:
        this rank's 1-D shards, keyed like ``grads``; under `accumulate` added into its accumulator instead
        (the keys then hold zeros that take no memory: the accumulator hands the sum to the update).

        One unit's reduction is in flight while the next unit's gradient is packed into its flat buffer, so at
        most two units' packed gradients exist at once."""
        ctx = current()
        sink = ctx.grad_sink if ctx is not None else None
        dtype = self.comm.reduce_dtype if sink is not None else None
        out: dict[str, torch.Tensor] = {}
        in_flight: list = []

        def land() -> None:
            self.comm.finish_pending()
            for unit, shard in in_flight:
                if sink is not None:
                    sink.add_unit(unit, self.rank, shard)
                    like = grads[unit.keys[0]]
                    shard = torch.zeros((), dtype=like.dtype, device=like.device).expand(unit.shard_size)
                out.update(unit.shard_views(shard, self.rank))
            in_flight.clear()

        for unit in self.layout.units:  # in unit order on every dp rank
            packed = unit.pack_full(grads)
            land()
            in_flight.append((unit, self.comm.reduce_scatter(packed, unit.name, dtype=dtype)))
        land()
        return {k: out[k] for k in grads}
