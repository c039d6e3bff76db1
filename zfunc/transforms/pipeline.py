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

Composition: ``shard(pipeline(tensor_parallel(checkpoint(mixed_precision(step)))), stage=1, mesh=mesh)``
on a ``make_mesh(dp=, pp=, tp=)`` mesh: pipeline uses ``mesh["pp"]``, shard ``mesh["dp"]``,
tensor_parallel ``mesh["tp"]``. shard's stages 2 and 3 reduce gradients inside each backward pass, which
the schedule runs per micro-batch: they are refused under pipeline for now (stage 1, DeepSpeed's choice
with pipelines, composes). fp16 loss scaling and `accumulate` inside are refused (use bf16 and
``micro_batches``). `zfunc.io` checkpoints record which rank holds each parameter (restored by name into
any layout); with shard or tensor_parallel besides, they are refused for now.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from typing import Any, Callable

import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed import pipelining

from zfunc import dist
from zfunc.autodiff import split_loss
from zfunc.blocks import find_blocks
from zfunc.interpret import Facts, LossCheck, Transform, current, gradients_ready, psum
from zfunc.mesh import describe_mesh, mesh_dim
from zfunc.transforms.accumulate import split_micro_batches
from zfunc.transforms.shard_layout import map_param_shaped
from zfunc.tree import tree_flatten, tree_leaves, tree_map_tensors, tree_unflatten

# name -> (torch's schedule class, stages per rank); those this torch lacks are refused by name.
SCHEDULES: dict[str, tuple[str, int]] = {
    "1F1B": ("Schedule1F1B", 1),
    "gpipe": ("ScheduleGPipe", 1),
    "interleaved": ("ScheduleInterleaved1F1B", 2),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", 2),
}


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """Which stage owns what (the same on every rank but ``rank``); kept in ``state.extras["pipeline"]``.

    Attributes:
      pp: pipeline ranks. rank: this rank among them. schedule: the schedule's name.
      stage_blocks: the blocks of each stage, in order (stage k runs on rank ``k % pp``).
      owner: ``(key, stage)`` for every trainable parameter: the one stage that holds and updates it.
      borrowers: ``(key, stages)``: the other stages that use it (a tied weight), lent it each step.
      first_root: root parameters named before the first block (computed as zeros on later stages).
      shapes: ``(key, shape)`` of every parameter, for `step.gather` and checkpoints.
    """

    pp: int
    rank: int
    schedule: str
    stage_blocks: tuple[tuple[str, ...], ...]
    owner: tuple[tuple[str, int], ...]
    borrowers: tuple[tuple[str, tuple[int, ...]], ...]
    first_root: frozenset
    shapes: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def stages(self) -> int:
        return len(self.stage_blocks)

    def rank_of(self, stage: int) -> int:
        return stage % self.pp

    @property
    def local_stages(self) -> tuple[int, ...]:
        return tuple(s for s in range(self.stages) if self.rank_of(s) == self.rank)

    def owned_by(self, stage: int) -> list[str]:
        return [k for k, s in self.owner if s == stage]

    def used_by(self, stage: int) -> list[str]:
        """The keys stage ``stage`` computes with: its own and those it borrows."""
        return self.owned_by(stage) + [k for k, users in self.borrowers if stage in users]

    @property
    def keys(self) -> list[str]:
        """The keys this rank holds (its stages' own), in the model's order."""
        mine = set(self.local_stages)
        return [k for k, s in self.owner if s in mine]

    @property
    def blocks(self) -> tuple[str, ...]:
        return tuple(b for s in self.local_stages for b in self.stage_blocks[s])

    def stage_of_block(self) -> dict[str, int]:
        return {b: s for s, blocks in enumerate(self.stage_blocks) for b in blocks}

    def describe(self) -> dict:
        """A JSON description (checkpoint manifests, ranks' agreement)."""
        return {"pp": self.pp, "schedule": self.schedule, "stage_blocks": [list(b) for b in self.stage_blocks],
                "owner": dict(self.owner), "borrowers": {k: list(v) for k, v in self.borrowers}}


def make_pipeline_layout(keys: list[str], aliases: list[tuple[str, str]], blocks: list[str],
                         shapes: dict[str, tuple], stages: int, pp: int, rank: int, schedule: str) -> PipelineLayout:
    """Split ``blocks`` (in order) into ``stages`` contiguous runs and assign every parameter to a stage.

    Args:
      keys: the trainable parameters' keys in the model's order (`zf.functional`'s params).
      aliases: ``(alias, key)`` of tied weights (`TrainState.ties`).
      blocks: the model's blocks in order (`find_blocks`).
      shapes: key -> shape.
    Runs are as even as the counts allow (the first stages get one more block when they do not divide). A
    name inside a block belongs to the block's stage; a root name to the first stage if it comes before
    the blocks, else the last (an alias sits where its module's other parameters are, or after the blocks
    when its module holds nothing else: a tied head). A key's owner is the first stage using it by any name.
    """
    if len(blocks) < stages:
        raise ValueError(
            f"pipeline: {stages} stages but the model has {len(blocks)} blocks ({', '.join(blocks[:6])}): every "
            "stage needs at least one block. Use fewer stages (a smaller pp dimension, or the 1F1B schedule "
            "instead of an interleaved one, which puts two stages on each rank).")
    base, extra = divmod(len(blocks), stages)
    runs, start = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        runs.append(tuple(blocks[start:start + n]))
        start += n
    stage_of = {b: s for s, run in enumerate(runs) for b in run}
    block_of = lambda name: next((b for b in blocks if name.startswith(b + ".")), None)  # noqa: E731
    in_blocks = [i for i, k in enumerate(keys) if block_of(k) is not None]
    first_at, last_at = (min(in_blocks), max(in_blocks)) if in_blocks else (len(keys), -1)

    def stage_of_name(name: str, position: int | None) -> int:
        block = block_of(name)
        if block is not None:
            return stage_of[block]
        if position is None:  # an alias: where its module's own keys are, else after the blocks (a tied head)
            module = name.rpartition(".")[0]
            siblings = [i for i, k in enumerate(keys) if k.rpartition(".")[0] == module]
            position = siblings[0] if siblings else last_at + 1
        return 0 if position < first_at else stages - 1

    users: dict[str, list[int]] = {k: [stage_of_name(k, i)] for i, k in enumerate(keys)}
    for alias, key in aliases:
        s = stage_of_name(alias, None)
        if s not in users[key]:
            users[key].append(s)
    first_root = frozenset(k for i, k in enumerate(keys) if block_of(k) is None and i < first_at)
    owner = tuple((k, min(users[k])) for k in keys)
    borrowers = tuple((k, tuple(sorted(set(users[k]) - {min(users[k])}))) for k in keys if len(set(users[k])) > 1)
    return PipelineLayout(pp, rank, schedule, tuple(runs), owner, borrowers, first_root,
                          tuple((k, tuple(shapes[k])) for k in keys))


class _StageEnd(BaseException):
    """Ends a stage's forward after its last block (a BaseException: model code catching Exception must not
    swallow it), carrying the tensors to send to the next stage."""

    def __init__(self, tensors: tuple) -> None:
        super().__init__()
        self.tensors = tensors


class _Counters:
    """Point-to-point transfers of one step: counts of micro-batch activations and gradients sent and
    received over stage boundaries, and elements moved (tied weights included)."""

    def __init__(self) -> None:
        self.activations_sent = self.activations_received = 0
        self.gradients_sent = self.gradients_received = 0
        self.tied_sent = self.tied_received = 0
        self.elements = 0

    def metrics(self) -> dict[str, int]:
        return {"pp_activations_sent": self.activations_sent, "pp_activations_received": self.activations_received,
                "pp_gradients_sent": self.gradients_sent, "pp_gradients_received": self.gradients_received,
                "pp_tied_sent": self.tied_sent, "pp_tied_received": self.tied_received,
                "pp_elements": self.elements}


class _Active:
    """The stage forward running now: its stage, the activation it received, and whether its first block
    has started (root parameters it does not hold are zeros only before that)."""

    def __init__(self, stage: int, received: tuple) -> None:
        self.stage, self.received = stage, received
        self.started = False
        self.last_block = -1


class _Run:
    """One ``value_and_grad`` under pipeline: the loss function, the micro-batches, what the stages return."""

    def __init__(self, fn: Callable, micro_batches: list, has_aux: bool, counters: _Counters) -> None:
        self.fn, self.micro_batches, self.has_aux, self.counters = fn, micro_batches, has_aux, counters
        self.active: _Active | None = None
        self.inferring = False  # torch's shape inference (first use of a schedule): not counted
        self.aux: dict[int, Any] = {}


class _StageModule(nn.Module):
    """What torch's `PipelineStage` runs for one stage: the user's loss function on one micro-batch, with
    this stage's parameters as the module's own (so torch's schedules differentiate and scale them)."""

    def __init__(self, transform: "pipeline", stage: int, keys: list[str], layout: PipelineLayout) -> None:
        super().__init__()
        self.transform, self.stage, self.layout = transform, stage, layout
        self.keys = list(keys)
        self.run: _Run | None = None

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """This step's parameters, as fresh leaves sharing their memory."""
        for i, k in enumerate(self.keys):
            self._parameters[f"p{i}"] = nn.Parameter(tensors[k].detach(), requires_grad=True)

    def param(self, key: str) -> nn.Parameter:
        return self._parameters[f"p{self.keys.index(key)}"]

    def grads(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, k in enumerate(self.keys):
            p = self._parameters[f"p{i}"]
            out[k] = torch.zeros_like(p) if p.grad is None else p.grad
        return out

    def forward(self, *received: torch.Tensor, micro_batch: torch.Tensor) -> Any:
        run = self.run
        index = int(micro_batch.reshape(-1)[0])  # (a CPU tensor: no device sync)
        args, kwargs = run.micro_batches[index]
        mine = {k: self._parameters[f"p{i}"] for i, k in enumerate(self.keys)}
        # Every key, as apply_fn wants: other stages' parameters as empty stand-ins (`pipeline.apply`).
        sample = next_tensor(mine)
        params = {k: mine[k] if k in mine else sample.new_empty(0) for k, _ in self.layout.owner}
        counters = run.counters
        if received and not run.inferring:
            counters.activations_received += 1
            counters.elements += sum(t.numel() for t in received)
            hook_once(received, lambda: _count_gradient_sent(counters, received))
        outer, run.active = run.active, _Active(self.stage, received)
        try:
            out = run.fn(params, *args, **kwargs)
        except _StageEnd as end:
            sent = end.tensors
            if not run.inferring:
                counters.activations_sent += 1
                counters.elements += sum(t.numel() for t in sent)
                hook_once(sent, lambda: _count_gradient_received(counters, sent))
            return sent if len(sent) > 1 else sent[0]
        finally:
            run.active = outer
        if self.stage != self.layout.stages - 1:
            raise RuntimeError(f"pipeline: stage {self.stage}'s forward ended without running its last block "
                               f"({self.layout.stage_blocks[self.stage][-1]!r}): the loss function must run the "
                               "whole model on every micro-batch")
        loss, aux = split_loss(out, run.has_aux)
        if run.has_aux and not run.inferring:
            run.aux[index] = aux
        return loss


def hook_once(tensors: tuple, fn: Callable[[], None]) -> None:
    """Call ``fn`` once, when backward first reaches one of ``tensors`` (that need a gradient)."""
    fired = []

    def hook(grad):
        if not fired:
            fired.append(True)
            fn()
        return grad

    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(hook)
            return


def _count_gradient_sent(counters: _Counters, received: tuple) -> None:
    counters.gradients_sent += 1
    counters.elements += sum(t.numel() for t in received)


def _count_gradient_received(counters: _Counters, sent: tuple) -> None:
    counters.gradients_received += 1
    counters.elements += sum(t.numel() for t in sent)


class _Stage(pipelining.PipelineStage):
    """torch's stage, telling its module when a forward is torch's shape inference (not a micro-batch)."""

    def _compute_outputs(self, *args, module, **kwargs):
        run = module.run
        run.inferring = True
        try:
            return super()._compute_outputs(*args, module=module, **kwargs)
        finally:
            run.inferring = False


class _Built:
    """torch's stages and schedule for one layout and one shape of micro-batches (built on first use: torch
    infers the shapes crossing stages by running one micro-batch, which is worth doing once)."""

    def __init__(self, modules: list[_StageModule], schedule: Any) -> None:
        self.modules, self.schedule = modules, schedule


class _Schedules:
    """The built schedules of one pipeline transform, by layout and micro-batch shapes (a cache, like
    `ModelStructure`'s: what it holds follows from its key; a step of a pipeline is not re-entrant)."""

    def __init__(self) -> None:
        self.built: dict[Any, _Built] = {}


class _Call:
    """Per-call scratch of `pipeline`."""

    def __init__(self, layout: PipelineLayout, group: dist.Group) -> None:
        self.layout, self.group = layout, group
        self.counters = _Counters()
        self.run: _Run | None = None
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
        pipeline per step; at least the number of stages keeps every rank busy.
      mesh: a `zfunc.mesh.make_mesh` mesh (pipeline uses ``mesh["pp"]``); or
      group: the process group of the pipeline ranks (default: the world).
      timeout: seconds to wait for another rank (default ``$ZFUNC_TIMEOUT_S``).
    """

    name = "pipeline"
    # Between the compute transforms (and tensor_parallel, below it) and offload (1) / shard (2): a pipeline
    # stage is what shard partitions over dp and what tensor_parallel splits over tp.
    level = 0.75

    def __init__(self, step: Callable, stages: int | None = None, schedule: str = "1F1B",
                 micro_batches: int = 1, mesh: Any = None, group: Any = None, timeout: float | None = None) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"pipeline: schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")
        cls_name, per_rank = SCHEDULES[schedule]
        if not hasattr(pipelining, cls_name):
            raise ValueError(f"pipeline: schedule {schedule!r} needs torch.distributed.pipelining.{cls_name}, which "
                             f"torch {torch.__version__} lacks; use '1F1B'")
        if not isinstance(micro_batches, numbers.Integral) or isinstance(micro_batches, bool) or micro_batches < 1:
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
        self.schedule, self.micro_batches = schedule, int(micro_batches)
        pp = self._group().size
        expected = pp * per_rank
        if stages is None:
            stages = expected
        if not isinstance(stages, numbers.Integral) or isinstance(stages, bool) or stages != expected:
            raise ValueError(f"pipeline: schedule {schedule!r} on {pp} pipeline rank(s) runs {expected} stages "
                             f"({per_rank} per rank), got stages={stages!r}")
        self.stages = int(stages)
        self._schedules = _Schedules()
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

    def check(self, facts: Facts) -> None:
        if facts.stage >= 2:
            raise ValueError(
                f"pipeline: shard(stage={facts.stage}) reduces gradients inside every backward pass, and the "
                "pipeline schedule runs one backward per micro-batch; use shard(pipeline(...), stage=1) (ZeRO-1: "
                "the optimizer state and master partitioned over dp, as DeepSpeed pairs with pipelines)")
        if facts.loss_scaling != "none":
            raise ValueError("pipeline: fp16 loss scaling is not supported inside pipeline; use "
                             "mixed_precision(..., 'bf16')")
        if facts.micro_batches > 1:
            raise ValueError("pipeline: accumulate inside pipeline is refused: pipeline(..., micro_batches=k) "
                             "already splits the batch into micro-batches")

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
                raise ValueError(
                    f"pipeline(micro_batches={m}) splits every batch tensor along dim 0 into {m} equal micro-batches, "
                    f"but got one of shape {tuple(leaf.shape)}; make the batch size a multiple of {m}")
        micro = split_micro_batches((args, kwargs), m) if m > 1 else [(args, kwargs)]
        run = _Run(fn, micro, has_aux, call.counters)
        lent = self._lend(layout, group, params, call.counters)
        built = self._built(layout, group, micro)
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
        self._return_gradients(layout, group, grads, borrowed, call.counters)
        for module in built.modules:  # (drop the leaves: the state keeps the parameters)
            module.load({k: torch.empty(0) for k in module.keys})
        loss = self._loss(layout, group, losses, built)
        # Counted over every rank (pp ranks hold the same loss: /pp), whatever allow_nonfinite says on each.
        bad = psum((~torch.isfinite(loss)).to(torch.float32)) / group.size
        if not allow:
            ctx = current()
            check = LossCheck(bad, loss, ctx)
            if bad.device.type != "cuda":
                check.raise_if_nonfinite()
            else:
                ctx.loss_checks.append(check)
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
            model_call.intercept(block, _block_intercept(block, order[block], stage_of[block], active, mine,
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
    def _built(self, layout: PipelineLayout, group: dist.Group, micro: list) -> _Built:
        leaves = [x for x in tree_leaves(micro[0]) if isinstance(x, torch.Tensor)]
        key = (layout, tuple((tuple(x.shape), x.dtype, x.device) for x in leaves), str(tree_flatten(micro[0])[1]))
        built = self._schedules.built.get(key)
        if built is not None:
            return built
        cls_name, per_rank = SCHEDULES[self.schedule]
        modules = [_StageModule(self, s, layout.used_by(s), layout) for s in layout.local_stages]
        stages = [_Stage(m, m.stage, layout.stages, group.device, group=group.handle) for m in modules]
        cls = getattr(pipelining, cls_name)
        schedule = cls(stages[0] if per_rank == 1 else stages, self.micro_batches, loss_fn=_identity_loss,
                       scale_grads=True)
        built = self._schedules.built[key] = _Built(modules, schedule)
        return built

    def _lend(self, layout: PipelineLayout, group: dist.Group, params: dict, counters: _Counters) -> dict:
        """Tied weights: each owner sends its current value to the stages that borrow it."""
        lent: dict[int, dict[str, torch.Tensor]] = {}
        ops = []
        for key, users in layout.borrowers:
            owner = dict(layout.owner)[key]
            src = layout.rank_of(owner)
            for user in users:
                dst = layout.rank_of(user)
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
                          counters: _Counters) -> None:
        """Tied weights: each borrower's gradient goes back to the owner, which adds them in stage order."""
        ops, arriving = [], []
        for key, users in layout.borrowers:
            owner = dict(layout.owner)[key]
            src = layout.rank_of(owner)
            for user in users:
                dst = layout.rank_of(user)
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

    def _loss(self, layout: PipelineLayout, group: dist.Group, losses: list, built: _Built) -> torch.Tensor:
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

    def _aux(self, layout: PipelineLayout, group: dist.Group, run: _Run) -> Any:
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


def _block_intercept(block: str, position: int, stage: int, active: _Active, mine: tuple, last_stage: bool):
    """What replaces block ``block``'s call in the forward of stage ``active.stage``."""

    def intercept(run, args, kwargs):
        if position <= active.last_block:
            raise RuntimeError(
                f"pipeline: block {block!r} ran out of order (after a later block, or twice): a pipelined model "
                "must call each of its blocks once per forward, in order")
        active.last_block = position
        if stage != active.stage:  # another stage's block: the activation received stands for its output
            if stage > active.stage or not active.received:
                raise RuntimeError(f"pipeline: block {block!r} of stage {stage} ran in stage {active.stage}'s "
                                   "forward before that stage's own blocks ended")
            return active.received[0] if len(active.received) == 1 else active.received
        if block == mine[0]:
            active.started = True
            if active.received and not (args and any(args[0] is t for t in active.received)):
                raise RuntimeError(
                    f"pipeline: the first block of stage {active.stage} ({block!r}) was not given the activation "
                    "the previous stage's last block returned: the model computes on it between blocks (e.g. a "
                    "residual added outside the blocks), which a stage that skipped those blocks cannot "
                    "reproduce. Pipelining needs models whose blocks take the previous block's output as their "
                    "first argument (hidden = block(hidden, ...)), as Hugging Face transformers do.")
        out = run(*args, **kwargs)
        if block == mine[-1] and not last_stage:
            tensors = tuple(x for x in tree_leaves(out) if isinstance(x, torch.Tensor))
            if not tensors:
                raise RuntimeError(f"pipeline: block {block!r} returned no tensor to send to the next stage")
            raise _StageEnd(tensors)
        return out

    return intercept


def _identity_loss(output, target):
    """The last stage's module already returns the micro-batch's loss (the user's loss function)."""
    return output


def next_tensor(params: dict) -> torch.Tensor:
    return next(t for t in params.values() if isinstance(t, torch.Tensor))


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
    import re
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)
