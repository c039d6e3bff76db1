"""`pipeline`: pipeline parallelism on torch's own `torch.distributed.pipelining` schedules.

``pipeline(step, stages=S, schedule="1F1B", micro_batches=M, mesh=mesh)`` splits the model at its
blocks (`zfunc.blocks.find_blocks`: the same blocks that `shard` gathers and `checkpoint` recomputes)
into S stages, stage k owning a contiguous run of blocks, and runs each step's ``value_and_grad`` as a
pipeline schedule of torch (`Schedule1F1B`, `ScheduleGPipe`, `ScheduleInterleaved1F1B`,
`ScheduleInterleavedZeroBubble`) over M micro-batches. The user's step is unchanged: it still calls
``zf.value_and_grad(loss_fn)(state.params, batch)`` and ``state.apply_gradients(grads)``.

What each pipeline rank holds and does (pp ranks; stage k on rank ``k % pp``; 1F1B and GPipe have one
stage per rank, the interleaved schedules two):

- **its stages' parameters only**, in ``state.params`` and in every param-shaped part of the optimizer
  state and extras (the fp32 master of `mixed_precision`, Adam's moments). The root parameters (those
  outside every block) go by where the model names them: named before the first block (embeddings) to
  the first stage, after the last block (final norm, head) to the last stage.
- **one copy of a tied weight**: a weight used under two names on two stages (GPT-2's ``wte``, the
  embedding on the first stage and the head on the last) is held, trained and updated by the first stage
  that uses it. Each step its owner lends it to the other stage (one send before the schedule), which
  differentiates it like its own and returns the gradient (one send after): the owner updates with the
  sum of both uses' gradients, exactly as one process does, and the copies can never drift apart.
  Clipping by the global norm then counts it once.
- **the forward of every micro-batch up to its stage**: each stage runs the user's loss function on the
  micro-batch, with every block of another stage skipped (it returns the activation received from the
  previous stage), and the forward ends after its stage's last block, whose output torch sends to the
  next stage. Code outside the blocks (embeddings, masks, rotary tables) runs on every stage; on a stage
  that does not hold a root parameter it computes with zeros in its place, and its result is replaced by
  the received activation before the stage's first block (a use of such a parameter after that, where
  its value would matter, is an error). The last stage computes the loss.
- the loss: the mean of the micro-batches' losses, broadcast from the last stage to every rank, so the
  step's metrics hold it everywhere; gradients are the mean of the micro-batches' (torch's
  ``scale_grads``), i.e. exactly ``∇ (1/M Σ_i L_i)``, the full batch's gradient for a mean loss.

Communication per step, per micro-batch and stage boundary (counted in the metrics, see `run`): one
activation send (one receive on the next stage) in forward and one gradient send (one receive on the
previous stage) in backward, of the tensors the boundary's block returns; plus per tied weight one send
of the weight and one of its gradient. ``psum`` (norms for clipping, overflow counts) adds over the pp
ranks (after `shard`'s sum over dp ranks).

How it falls out of the primitives: ``value_and_grad`` lets the transforms inside rewrite the loss
function as usual, and where the plain implementation would run one forward and backward, torch's
schedule runs them (``StepContext.differentiate``); ``apply`` skips the other stages' blocks and ends the
stage's forward (``ModelCall.intercept``); ``psum`` adds over the pp ranks; `step.gather` broadcasts each
parameter from its stage (``complete_gather``). The update is the inner stack's, on the stage's state.

Composition: ``shard(pipeline(tensor_parallel(checkpoint(mixed_precision(step)))), stage=1|2|3, mesh=mesh)``
on a ``make_mesh(dp=, pp=, tp=)`` mesh: pipeline uses ``mesh["pp"]``, shard ``mesh["dp"]``,
tensor_parallel ``mesh["tp"]``. Around a pipeline, shard's stages 2 and 3 keep the stage's units whole for
the schedule and reduce each unit's gradient, summed over the micro-batches, once after it
(`zfunc.transforms.shard_pipelined`), through the ``gradients_ready`` this transform dispatches. fp16 loss
scaling inside: the schedule differentiates the scaled loss, the step's loss is the broadcast mean
unscaled, the overflow check is ``psum``med over pp too (so every stage skips together, on the device).
`accumulate` inside: its k gradient calls each run one schedule (``StepContext.differentiate`` stays set
for the step's gradient calls). `zfunc.io` checkpoints record which pipeline rank holds each parameter (and, with shard or
tensor_parallel besides, each rank's dp and tp coordinates): restored exactly into any layout.

torch's built stages and schedule are structure built once per state and batch shape, kept with the
state's layout (`pipeline_stage.Schedules`), not on this transform, which holds configuration only.
"""

from __future__ import annotations

import math
import numbers
import re
import warnings
from typing import Any, Callable

import torch
import torch.distributed as tdist
from torch.distributed import pipelining

from zfunc import dist
from zfunc.autodiff import skip_update_if_nonfinite
from zfunc.blocks import find_blocks
from zfunc.interpret import Facts, Transform, current, gradients_ready, psum
from zfunc.mesh import describe_mesh, mesh_dim
from zfunc.transforms.accumulate import split_micro_batches
from zfunc.transforms.pipeline_layout import PipelineLayout, make_pipeline_layout
from zfunc.transforms.pipeline_stage import (
    Built,
    Counters,
    Run,
    StageModule,
    TorchStage,
    block_intercept,
    identity_loss,
    next_tensor,
    schedules_of,
)
from zfunc.transforms.shard_layout import map_param_shaped
from zfunc.tree import tree_flatten, tree_leaves, tree_map_tensors, tree_unflatten

# name -> (torch's schedule class, stages per rank); those this torch lacks are refused by name.
SCHEDULES: dict[str, tuple[str, int]] = {
    "1F1B": ("Schedule1F1B", 1),
    "gpipe": ("ScheduleGPipe", 1),
    "interleaved": ("ScheduleInterleaved1F1B", 2),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", 2),
}


class _Call:
    """Per-call scratch of `pipeline`."""

    def __init__(self, layout: PipelineLayout, group: dist.Group) -> None:
        self.layout, self.group = layout, group
        self.counters = Counters()
        self.run: Run | None = None
        self.ran = False


class pipeline(Transform):  # noqa: N801
    """Pipeline parallelism over the ``"pp"`` dimension of a mesh (see the module docstring).

    Args:
      step: the step to transform (pipeline sits inside `shard` and `offload`, outside `tensor_parallel`,
        `checkpoint` and `mixed_precision`).
      stages: the number of stages (default: the pp ranks times the schedule's stages per rank, 1 for
        "1F1B"/"gpipe", 2 for "interleaved"/"zero_bubble"); must be that many.
      schedule: "1F1B", "gpipe", "interleaved" (torch's ScheduleInterleaved1F1B) or "zero_bubble"
        (ScheduleInterleavedZeroBubble).
      micro_batches: how many equal slices of the batch (dim 0 of every batch tensor) flow through the
        pipeline per step (default: the number of stages, the fewest that keep every rank busy and the
        fewest "1F1B" accepts).
      mesh: a `zfunc.mesh.make_mesh` mesh (pipeline uses ``mesh["pp"]``); or
      group: the process group of the pipeline ranks (default: the world).
      timeout: seconds to wait for another rank (default ``$ZFUNC_TIMEOUT_S``).
    """

    name = "pipeline"
    # Between the compute transforms (and tensor_parallel, below it) and offload (1) / shard (2): a pipeline
    # stage is what shard partitions over dp and what tensor_parallel splits over tp.
    level = 0.75

    def __init__(self, step: Callable, stages: int | None = None, schedule: str = "1F1B",
                 micro_batches: int | None = None, mesh: Any = None, group: Any = None,
                 timeout: float | None = None) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"pipeline: schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")
        cls_name, per_rank = SCHEDULES[schedule]
        if not hasattr(pipelining, cls_name):
            raise ValueError(f"pipeline: schedule {schedule!r} needs torch.distributed.pipelining.{cls_name}, which "
                             f"torch {torch.__version__} lacks; use '1F1B'")
        if micro_batches is not None and (not isinstance(micro_batches, numbers.Integral)
                                          or isinstance(micro_batches, bool) or micro_batches < 1):
            raise ValueError(f"pipeline: micro_batches must be a positive int, got {micro_batches!r}")
        if mesh is not None:
            if group is not None:
                raise ValueError("pipeline: give mesh= or group=, not both (with a mesh, pipeline uses mesh['pp'])")
            if tdist.is_initialized() and mesh.size() != tdist.get_world_size():
                raise ValueError(f"pipeline: the mesh has {mesh.size()} ranks ({describe_mesh(mesh)}) but the world "
                                 f"has {tdist.get_world_size()}; build it with zfunc.mesh.make_mesh over the world")
            group = mesh_dim(mesh, "pp", "pipeline").get_group()
        super().__init__(step)
        self.mesh, self.group, self.timeout = mesh, group, timeout
        self.schedule = schedule
        pp = self._group().size
        expected = pp * per_rank
        if stages is None:
            stages = expected
        if not isinstance(stages, numbers.Integral) or isinstance(stages, bool) or stages != expected:
            raise ValueError(f"pipeline: schedule {schedule!r} on {pp} pipeline rank(s) runs {expected} stages "
                             f"({per_rank} per rank), got stages={stages!r}")
        self.stages = int(stages)
        self.micro_batches = self.stages if micro_batches is None else int(micro_batches)
        if schedule == "1F1B" and self.micro_batches < self.stages:
            # (torch's Schedule1F1B refuses it only at the first step, after the state is built)
            raise ValueError(f"pipeline: schedule '1F1B' needs at least as many micro-batches as stages, got "
                             f"micro_batches={self.micro_batches} for {self.stages} stages; use "
                             f"micro_batches>={self.stages} (more shrink the bubble) or schedule='gpipe'")
        self.stack.facts  # noqa: B018 - refuse a stack pipeline cannot run in, at once

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {"stages": self.stages, "schedule": self.schedule, "micro_batches": self.micro_batches}
        if self.mesh is not None:
            out["mesh"] = describe_mesh(self.mesh)
        return out

    def _group(self) -> dist.Group:
        return dist.Group.resolve(self.group, self.timeout)

    def declare(self, facts: Facts) -> Facts:
        return facts.replace(pp=self._group().size)

    # -- layout --------------------------------------------------------------
    def init_state(self, state):
        if "pipeline" in state.extras:
            raise ValueError("pipeline.init: this state is already split into stages; pass the plain state from "
                             "TrainState.create")
        group = self._group()
        layout = self._layout(state, group)
        if group.size > 1:
            dist.announce(group, "step.init of pipeline")
            dist.agree({"step": _without_addresses(self.agreed_repr()), "layout": layout.describe()}, group,
                       "the pipeline's step and stages")
            state = _from_rank_zero(state, group)
        keys = set(state.params)
        mine = layout.keys
        cut = lambda d: {k: d[k] for k in mine}  # noqa: E731
        ties = tuple((a, k) for a, k in state.ties if k in set(mine))
        return state.replace(params=cut(state.params), opt_state=map_param_shaped(state.opt_state, keys, cut),
                             extras={**map_param_shaped(dict(state.extras), keys, cut), "pipeline": layout},
                             ties=ties, blocks=layout.blocks)

    def _layout(self, state, group: dist.Group) -> PipelineLayout:
        blocks = list(state.blocks) if state.blocks is not None else \
            find_blocks({k: v.numel() for k, v in state.params.items()})
        return make_pipeline_layout(list(state.params), list(state.ties), blocks,
                                    {k: tuple(v.shape) for k, v in state.params.items()}, self.stages, group.size,
                                    group.rank, self.schedule)

    def _check_layout(self, state) -> tuple[PipelineLayout, dist.Group]:
        layout = state.extras.get("pipeline")
        if not isinstance(layout, PipelineLayout):
            raise ValueError("this state is not in pipeline's layout: call step.init(state) on the plain state first")
        group = self._group()
        if (layout.pp, layout.rank) != (group.size, group.rank):
            raise ValueError(f"this state was split for pipeline rank {layout.rank} of {layout.pp}, but this process "
                             f"is pipeline rank {group.rank} of {group.size}; restore it with zfunc.io.restore(dir, "
                             "like=step.init(...)) to re-split it")
        return layout, group

    def complete_gather(self, params: dict[str, torch.Tensor], state) -> dict[str, torch.Tensor]:
        """Every stage's parameters on every rank: each broadcast from the rank of the stage that owns it."""
        layout, group = self._check_layout(state)
        if group.size == 1:
            return params
        dist.announce(group, "step.gather of pipeline")
        dtypes = dist.all_gather_json({k: str(v.dtype) for k, v in params.items()}, group, "pipeline's gather")
        shapes = dict(layout.shapes)
        full = {}
        comm = dist.Comm(group)
        for key, stage in layout.owner:
            src = layout.rank_of(stage)
            t = params[key] if src == group.rank else torch.empty(
                shapes[key], dtype=getattr(torch, dtypes[src][key].removeprefix("torch.")), device=group.device)
            t = group.place(t).contiguous()
            work = tdist.broadcast(t, src=_global(group, src), group=group.handle, async_op=True)
            comm.finish(work, f"pipeline's gather of {key}")
            full[key] = t
        return full

    # -- the step --------------------------------------------------------------
    def start(self, ctx, state) -> _Call:
        layout, group = self._check_layout(state)
        return _Call(layout, group)

    def run(self, state, batch):
        call: _Call = self.call_scratch()
        new_state, metrics = self.step(state, batch)
        return new_state, {**metrics, **call.counters.metrics()}

    def psum(self, next, x):
        call: _Call = self.call_scratch()
        if call.group.size == 1:
            return next(x)
        out = call.group.place(x.detach().clone())
        dist.Comm(call.group).finish(tdist.all_reduce(out, group=call.group.handle, async_op=True),
                                     "pipeline's psum")
        return next(out.to(x.device))

    def value_and_grad(self, next, fn, params, args, kwargs, has_aux):
        # The transforms inside rewrite the loss function as usual (tensor_parallel's local loss, its
        # loss_parallel context around the whole schedule); where the plain value_and_grad would run one
        # forward and backward, torch's schedule runs them, micro-batch by micro-batch (`_differentiate`).
        call: _Call = self.call_scratch()
        if call.ran:
            raise RuntimeError("pipeline: value_and_grad ran twice in one step; a pipelined step takes one "
                               "value_and_grad (pipeline(..., micro_batches=k) splits the batch)")
        call.ran = True
        allow = getattr(fn, "allow_nonfinite", False)
        ctx = current()
        ctx.differentiate = lambda f, p, a, kw, aux: self._differentiate(call, f, p, a, kw, aux, allow)
        try:
            return next(fn, params, args, kwargs, has_aux)
        finally:
            ctx.differentiate = None

    def _differentiate(self, call: _Call, fn, params, args, kwargs, has_aux, allow: bool):
        layout, group = call.layout, call.group
        if set(params) != set(layout.keys):
            raise ValueError("pipeline: value_and_grad was given params other than this stage's (state.params); "
                             "differentiate with respect to state.params as the step received them")
        m = self.micro_batches
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and (leaf.dim() == 0 or leaf.shape[0] % m):
                k = current().facts.micro_batches  # (an `accumulate` inside: each of its k slices is split again)
                inside = f" (one of accumulate's {k} slices of the batch)" if k > 1 else ""
                raise ValueError(
                    f"pipeline(micro_batches={m}) splits every batch tensor along dim 0 into {m} equal micro-batches, "
                    f"but got one of shape {tuple(leaf.shape)}{inside}; make the batch size a multiple of {k * m}")
        micro = split_micro_batches((args, kwargs), m) if m > 1 else [(args, kwargs)]
        run = Run(fn, micro, has_aux, call.counters)
        lent = self._lend(layout, group, params, call.counters)
        key, built = self._built(layout, group, micro)
        for module in built.modules:
            module.load({**params, **lent.get(module.stage, {})})
            module.run = run
        call.run = run
        losses: list = []
        index = torch.arange(m)
        try:
            built.schedule.step(micro_batch=index, target=index, losses=losses, return_outputs=False)
        finally:
            call.run = None
            for module in built.modules:
                module.run = None
        grads: dict[str, torch.Tensor] = {}
        for module in built.modules:  # this rank's stages (keys are owned by one stage each)
            got = module.grads()
            grads.update({k: got[k] for k in layout.owned_by(module.stage)})
        borrowed = {module.stage: {k: g for k, g in module.grads().items() if k not in layout.owned_by(module.stage)}
                    for module in built.modules}
        for module in built.modules:  # (drop the leaves: the state keeps the parameters)
            module.load({k: torch.empty(0) for k in module.keys})
        # Free for the state's next step (a schedule that failed is dropped: torch's buffers may be half-used).
        schedules_of(layout).give(key, built)
        self._return_gradients(layout, group, grads, borrowed, call.counters)
        loss = self._loss(layout, group, losses)
        # Counted over every rank (pp ranks hold the same loss: /pp), whatever allow_nonfinite says on each.
        if current().facts.loss_scaling == "none":  # (fp16's scaler skips such steps: their gradients overflow)
            bad = psum((~torch.isfinite(loss)).to(torch.float32)) / group.size
            if not allow:  # (no host read: the update is skipped on the device, the error raised at the next use)
                skip_update_if_nonfinite(current(), loss, bad)
        grads = gradients_ready({k: grads[k] for k in layout.keys})
        if has_aux:
            return (loss, self._aux(layout, group, run)), grads
        return loss, grads

    def apply(self, next, model_call):
        call: _Call = self.call_scratch()
        active = call.run.active if call.run is not None else None
        if active is None:
            raise RuntimeError(
                f"{self!r}: the model ran outside zf.value_and_grad; under pipeline each rank holds only its "
                "stages' parameters, so the model runs only inside the pipelined value_and_grad. Evaluate on full "
                "parameters instead: full = step.gather(state), then apply_fn(full, ...) outside the step.")
        layout = call.layout
        stage_of = layout.stage_of_block()
        order = {b: i for i, b in enumerate(b for run in layout.stage_blocks for b in run)}
        mine = layout.stage_blocks[active.stage]
        last_stage = active.stage == layout.stages - 1
        for block in model_call.structure.blocks():
            if block not in stage_of:
                continue
            model_call.intercept(block, block_intercept(block, order[block], stage_of[block], active, mine,
                                                         last_stage))
        params = dict(model_call.params)
        missing = model_call.structure.keys - set(layout.used_by(active.stage))
        if missing:
            sample = params[layout.used_by(active.stage)[0]]
            params.update({k: sample.new_empty(0) for k in missing})
            shapes = dict(layout.shapes)
            outer = model_call.resolve_outside

            def resolve(key: str) -> torch.Tensor:
                if key not in missing:
                    return outer(key)
                if key in layout.first_root and not active.started:
                    return torch.zeros((), dtype=sample.dtype, device=sample.device).expand(shapes[key])
                where = "after its first block" if active.started else "before its first block"
                raise RuntimeError(
                    f"pipeline: stage {active.stage} computes with {key!r} {where}, but that parameter belongs to "
                    f"stage {dict(layout.owner)[key]} (parameters outside the blocks go by where the model names "
                    "them: before the first block to the first stage, after the last block to the last). A model "
                    "that uses a parameter elsewhere cannot be pipelined at its blocks as it is: move the "
                    "computation into a block, or register the parameter where it is used.")

            model_call.params = params
            model_call.partial_keys = model_call.partial_keys | frozenset(missing)
            model_call.resolve_outside = resolve
        return next(model_call)

    # -- pieces of value_and_grad -------------------------------------------------
    def _built(self, layout: PipelineLayout, group: dist.Group, micro: list) -> tuple[Any, Built]:
        """torch's stages and schedule for these micro-batches' shapes, taken out of the state's cache
        (`pipeline_stage.Schedules`; given back after the schedule ran) or built now, and their key."""
        leaves = [x for x in tree_leaves(micro[0]) if isinstance(x, torch.Tensor)]
        cls_name, per_rank = SCHEDULES[self.schedule]
        key = (cls_name, self.micro_batches, group.handle, group.device,
               tuple((tuple(x.shape), x.dtype, x.device) for x in leaves), str(tree_flatten(micro[0])[1]))
        built = schedules_of(layout).take(key)
        if built is not None:
            return key, built
        modules = [StageModule(s, layout.used_by(s), layout) for s in layout.local_stages]
        stages = [TorchStage(m, m.stage, layout.stages, group.device, group=group.handle) for m in modules]
        cls = getattr(pipelining, cls_name)
        schedule = cls(stages[0] if per_rank == 1 else stages, self.micro_batches, loss_fn=identity_loss,
                       scale_grads=True)
        return key, Built(modules, schedule)

    def _lend(self, layout: PipelineLayout, group: dist.Group, params: dict, counters: Counters) -> dict:
        """Tied weights: each owner sends its current value to the stages that borrow it."""
        lent: dict[int, dict[str, torch.Tensor]] = {}
        ops = []
        for key, user, src, dst in layout.loans():
            if src == dst == group.rank:
                lent.setdefault(user, {})[key] = params[key]
            elif src == group.rank:
                ops.append(tdist.P2POp(tdist.isend, group.place(params[key]).contiguous(), _global(group, dst),
                                       group.handle))
                counters.tied_sent += 1
                counters.elements += params[key].numel()
            elif dst == group.rank:
                shape = dict(layout.shapes)[key]
                buf = torch.empty(shape, dtype=next_tensor(params).dtype, device=group.device)
                ops.append(tdist.P2POp(tdist.irecv, buf, _global(group, src), group.handle))
                lent.setdefault(user, {})[key] = buf
                counters.tied_received += 1
                counters.elements += buf.numel()
        _exchange(ops, group, "lending tied weights between stages")
        return lent

    def _return_gradients(self, layout: PipelineLayout, group: dist.Group, grads: dict, borrowed: dict,
                          counters: Counters) -> None:
        """Tied weights: each borrower's gradient goes back to the owner, which adds them in stage order."""
        ops, arriving = [], []
        for key, user, src, dst in layout.loans():
            if src == dst == group.rank:
                arriving.append((key, borrowed[user][key]))
            elif dst == group.rank:
                ops.append(tdist.P2POp(tdist.isend, group.place(borrowed[user][key]).contiguous(),
                                       _global(group, src), group.handle))
                counters.tied_sent += 1
                counters.elements += borrowed[user][key].numel()
            elif src == group.rank:
                buf = torch.empty_like(grads[key], device=group.device)
                ops.append(tdist.P2POp(tdist.irecv, buf, _global(group, dst), group.handle))
                arriving.append((key, buf))
                counters.tied_received += 1
                counters.elements += buf.numel()
        _exchange(ops, group, "returning tied weights' gradients to their stage")
        for key, g in arriving:
            grads[key] = grads[key] + g.to(grads[key].device)

    def _loss(self, layout: PipelineLayout, group: dist.Group, losses: list) -> torch.Tensor:
        """The mean of the micro-batches' losses (float32), on every pipeline rank (broadcast from the last stage's)."""
        last = layout.rank_of(layout.stages - 1)
        # (float32 on every rank: the other ranks cannot know the loss's dtype without asking)
        if group.rank == last:
            loss = torch.stack([x.detach() for x in losses]).mean().to(torch.float32)
        else:
            loss = torch.empty((), dtype=torch.float32)
        if group.size == 1:
            return loss
        out = group.place(loss.contiguous())
        dist.Comm(group).finish(tdist.broadcast(out, src=_global(group, last), group=group.handle, async_op=True),
                                "broadcasting the pipeline's loss from its last stage")
        return out

    def _aux(self, layout: PipelineLayout, group: dist.Group, run: Run) -> Any:
        """``aux`` of the loss function, like `accumulate`'s (floating tensors averaged over micro-batches,
        other leaves the last micro-batch's), sent from the last stage to every pipeline rank (pickled: aux
        is the user's own values, and this costs a host round trip per step)."""
        last = layout.rank_of(layout.stages - 1)
        payload = [None]
        if group.rank == last:
            auxes = [run.aux[i] for i in sorted(run.aux)]
            leaves, spec = tree_flatten(auxes[0])
            flat = [tree_flatten(a)[0] for a in auxes]
            merged = [sum(f[j] for f in flat) / len(flat) if isinstance(x, torch.Tensor) and x.is_floating_point()
                      else flat[-1][j] for j, x in enumerate(leaves)]
            payload = [tree_unflatten(spec, [x.detach().cpu() if isinstance(x, torch.Tensor) else x
                                             for x in merged])]
        if group.size > 1:
            tdist.broadcast_object_list(payload, src=_global(group, last), group=group.handle)
        return payload[0]


def _global(group: dist.Group, rank: int) -> int:
    return tdist.get_global_rank(group.handle, rank) if group.handle is not None else rank


def _exchange(ops: list, group: dist.Group, what: str) -> None:
    if not ops:
        return
    comm = dist.Comm(group)
    for work in tdist.batch_isend_irecv(ops):
        comm.finish(work, what)


def _from_rank_zero(state, group: dist.Group):
    """Every rank builds the whole model; the stages take rank 0's values (a rank seeded differently would
    otherwise train a model spliced from several initializations)."""
    leaves = [x for x in tree_leaves(state.params) if isinstance(x, torch.Tensor) and x.numel()]
    fingerprint = float(sum(float(x.double().sum()) for x in leaves if x.is_floating_point()))
    prints = dist.all_gather_json(fingerprint, group, "comparing the pipeline ranks' initial parameters")
    if len(set(prints)) == 1 or (all(math.isnan(p) for p in prints)):
        return state
    if group.rank == 0:
        warnings.warn("pipeline.init: ranks had different initial parameters; every stage takes rank 0's. Seed "
                      "every rank alike before building the model to silence this.", stacklevel=4)
    comm = dist.Comm(group)

    def broadcast(t: torch.Tensor) -> torch.Tensor:
        placed = group.place(t.detach().clone()).contiguous()
        comm.finish(tdist.broadcast(placed, src=_global(group, 0), group=group.handle, async_op=True),
                    "sending rank 0's initial parameters")
        return placed.to(t.device)

    return state.replace(params={k: broadcast(v) for k, v in state.params.items()},
                         opt_state=tree_map_tensors(broadcast, state.opt_state),
                         extras=tree_map_tensors(broadcast, state.extras))


def _without_addresses(text: str) -> str:
    """``text`` without reprs' memory addresses (each rank's process has its own)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)
