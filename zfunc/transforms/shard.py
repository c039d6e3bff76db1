"""`shard`: ZeRO stages 1, 2 and 3 as a transform over torch.distributed.

Data parallelism with partitioned state. Every rank runs the same step on its
own local batch; gradients are averaged over ranks (DDP semantics), so N
ranks on N local batches equal one process on their concatenation with a
mean loss. What is partitioned (Ψ parameters, N ranks; units and flat
buffers as in `shard_layout`):

=========  ====================================================  ===========================
stage      partitioned                                           collectives per step
=========  ====================================================  ===========================
1          optimizer state (and fp32 master): each rank          reduce-scatter grads after
           updates its 1/N and all-gathers the parameters        backward + all-gather: 2Ψ
2          + gradients: reduce-scattered unit by unit while      the same 2Ψ, during backward
           backward runs; no full gradient beyond one unit
3          + parameters: a unit is all-gathered just before      all-gather forward, again in
           it runs, freed after, re-gathered in backward         backward, reduce-scatter: 3Ψ
=========  ====================================================  ===========================

How it falls out of the primitives:

- ``value_and_grad``: differentiates with respect to this rank's parameter
  *shards*; the model sees full parameters (gathered in stage 3, resident in
  stage 2) through `zfunc.transforms.shard_units`, whose backward
  reduce-scatters, so the gradients arrive sharded. Stage 1 reduce-scatters
  the full gradients once after backward (after all micro-batches under
  `accumulate`). In every stage the step sees gradients as this rank's 1-D
  shards, keyed like params.
- ``apply``: stage 3 gathers the root unit once per model call and each
  block unit inside the block (a "materialize" wrapper), so only the running
  block is whole, plus the next one, whose all-gather is issued
  asynchronously while the current block computes.
- ``gradients_ready``: the reductions a backward pass issued are finished
  when it returns; ranks are checked to have issued the same collectives
  (``verify``), so a module run on some ranks only is an error, never a
  silent mix of two units' gradients.
- ``apply_gradients``: the inner transforms and the optimizer run on this
  rank's shards (the state's param-shaped dicts are 1-D views into flat
  per-unit buffers); the results are written back into those buffers and,
  in stages 1 and 2, the updated shards are all-gathered into the full
  parameters in place. The optimizer itself runs fused over each unit's flat
  shard (`zfunc.optim.fused`), declared through ``Facts.fused_update``.
- ``psum``: an all-reduce, so norms and overflow checks are global.

Gradient reductions run in the stack's reduce dtype (``Facts.reduce_dtype``,
declared by `mixed_precision`). Metrics gain ``comm_elements`` (elements this
rank moved in collectives this step), used by the tests that check the ZeRO
volumes.
"""

from __future__ import annotations

import numbers
import operator
import weakref
from typing import Any, Callable, Literal, Sequence

import torch
from torch.nn.modules.batchnorm import _NormBase

from zfunc import dist
from zfunc.compiled import dict_of, same_keys, tracing
from zfunc.interpret import Facts, Transform, Updated, current
from zfunc.mesh import describe_mesh, dim_group
from zfunc.optim.flat import moved_keys, owner_of
from zfunc.recompute import refuse_running_statistics
from zfunc.transforms.shard_compiled import CompiledComm, gather_updated, param_shards
from zfunc.transforms.shard_layout import (
    ROOT,
    ShardLayout,
    zip_param_shaped,
)
from zfunc.transforms.shard_blocks import BlockPlan, refuse_container_units
from zfunc.transforms.shard_init import partition_meta_state, partition_state
from zfunc.transforms.shard_pipelined import StageUnits
from zfunc.transforms.shard_block_checks import refuse_writes
from zfunc.transforms.shard_units import Units
from zfunc.tree import version_of


_NOT_IN_LAYOUT = ("shard: state.params are not in shard's flat layout (were they replaced, or moved between keys?); "
                  "use the state that step.init or the step returned (to copy one, copy.deepcopy(state) keeps the "
                  "flat buffers; a per-tensor clone does not)")


class ShardedParams(dict):
    """The params handed to a loss function under `shard` stages 2 and 3.

    A dict of this rank's 1-D parameter shards. ``apply_fn`` recognizes it and
    gathers full parameters; pass it to ``apply_fn`` as it is (a plain dict
    copy of it would lose that).
    """

    def __init__(self, shards: dict, full_flats: dict[str, torch.Tensor] | None, shaped: bool = False) -> None:
        super().__init__()
        self.update(shards)  # (not ``__init__(shards)``: dynamo interprets that per key, ``update`` in one step)
        self.full_flats = full_flats  # stage 2: unit name -> resident full flat buffer
        self.shaped = shaped  # one rank (`Units.runs_on_shards`): the shards viewed in their parameters' shapes


class _Call:
    """Per-call scratch of `shard`: the layout, the collectives and the unit machinery."""

    def __init__(self, layout: ShardLayout, comm: dist.Comm, units: Units | None,
                 pipelined: StageUnits | None = None) -> None:
        self.layout, self.comm, self.units = layout, comm, units
        self.pipelined = pipelined  # stages 2/3 around `pipeline` (`shard_pipelined`), instead of ``units``
        self.sharded_applies = 0
        # While dynamo traces, at one rank: each unit's flat gradient and its keys' parts (views of it), handed to
        # the flat update (`_value_and_grad_of_flats`, `zfunc.primitives.UpdateRequest.flat_grads`).
        self.grad_flats: dict[str, tuple[torch.Tensor, dict]] = {}


class shard(Transform):  # noqa: N801
    """ZeRO data parallelism.

    Args:
      step: the step to transform (``shard`` must be the outermost transform).
      stage: 1, 2 or 3 (see the module docstring).
      group: a torch.distributed process group (default: the world; a world of 1
        when torch.distributed is not initialized).
      mesh: a device mesh (`zfunc.mesh.make_mesh`): shard partitions over its
        ``"dp"`` dimension (this rank's group of ranks that differ only in their dp
        coordinate); the other dimensions belong to `tensor_parallel` and
        `pipeline`. Give ``mesh`` or ``group``, not both.
      units: module names gathered/reduced as one collective each (default: the
        model's blocks, `zfunc.blocks.find_blocks`; everything else is the root
        unit). The unit is also the reduce bucket of stage 2.
      reshard: stage 3, how a gathered block is dropped between its forward and
        backward: "release" (free and re-gather) or "recompute" (run it again).
      timeout: seconds a rank waits for the others in a collective before raising
        `zfunc.dist.CollectiveError` (default ``$ZFUNC_TIMEOUT_S`` or 300).
      verify: compare, before each backward pass's first reduction, which units every rank ran
        (one tiny exchange between the ranks' hosts over a gloo group, which never waits for the
        GPU; catches modules run on some ranks only, see `Units.backward_begins`).
    """

    name = "shard"
    level = 2

    def __init__(self, step: Callable, stage: Literal[1, 2, 3] = 3, group: Any = None,
                 units: Sequence[str] | None = None, reshard: Literal["release", "recompute"] = "release",
                 timeout: float | None = None, verify: bool = True, mesh: Any = None) -> None:
        # An integer, not merely equal to one: 3.0 == 3, but it would show as 'stage=3.0' in the repr ranks
        # compare, and True == 1 is no stage at all.
        if not isinstance(stage, numbers.Integral) or isinstance(stage, bool) or stage not in (1, 2, 3):
            raise ValueError(f"shard: stage must be 1, 2 or 3 (an int), got {stage!r}")
        stage = int(stage)
        if reshard not in ("release", "recompute"):
            raise ValueError(f"shard: reshard must be 'release' or 'recompute', got {reshard!r}")
        if units is not None and (isinstance(units, str) or not all(isinstance(u, str) for u in units)):
            raise ValueError(f"shard: units must be a list of module names, got {units!r}")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"shard: timeout must be a positive number of seconds, got {timeout!r}")
        if not isinstance(verify, bool):
            raise ValueError(f"shard: verify must be True or False, got {verify!r}")
        if mesh is not None:
            if group is not None:
                raise ValueError("shard: give mesh= or group=, not both (with a mesh, shard uses mesh['dp'])")
            group = dim_group(mesh, "dp", "shard")
        super().__init__(step)
        self.stage, self.group, self.units = stage, group, None if units is None else list(units)
        self.mesh = mesh
        self.reshard, self.timeout, self.verify = reshard, timeout, verify
        self.stack.facts  # noqa: B018 - the stack is checked when it is built (e.g. offload(params="host") needs stage 3)

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {"stage": self.stage}
        if self.units is not None:
            out["units"] = self.units
        if self.reshard != "release":
            out["reshard"] = self.reshard
        if self.mesh is not None:
            out["mesh"] = describe_mesh(self.mesh)
        return out

    def declare(self, facts: Facts) -> Facts:
        return facts.replace(stage=self.stage, fused_update=True if facts.fused_update is None else facts.fused_update,
                             recompute=facts.recompute or (self.stage == 3 and self.reshard == "recompute"))

    def check(self, facts: Facts) -> None:
        if facts.pp > 1 and self.stage == 3 and self.reshard == "recompute":
            raise ValueError("shard(stage=3, reshard='recompute') around pipeline: a pipeline stage's units stay "
                             "gathered for the whole schedule (zfunc.transforms.shard_pipelined), so there is nothing "
                             "to re-gather or recompute; use reshard='release', and checkpoint(...) inside the "
                             "pipeline to recompute the blocks' activations")

    def _group(self) -> dist.Group:
        return dist.Group.resolve(self.group, self.timeout)

    def partition_ranks(self) -> int:
        return self._group().size

    # -- layout --------------------------------------------------------------
    def init_state(self, state):
        return partition_state(self, state)

    def init_meta(self, state, init_device):
        """A meta-built model: values drawn unit by unit (`zfunc.materialize`); each complete unit goes
        through the inner transforms' init and is cut to this rank's share at once, so no rank ever holds
        more than one unit (and the root unit) of full values (`shard_init.partition_meta_state`)."""
        return partition_meta_state(self, state, init_device)

    def gather_params(self, state, next) -> dict[str, torch.Tensor]:
        layout, group = self._check_layout(state)
        dist.announce(group, "step.gather of shard")
        shards = next(state.replace(params=self._param_shards(state.params, layout)))
        comm = dist.Comm(group)
        full = {}
        for unit in layout.units:
            flat = comm.all_gather(unit.cat_shard(shards, group.rank).detach(), tag=unit.name)
            full.update({k: v.clone() for k, v in unit.full_views(flat).items()})
        return full

    def _check_layout(self, state) -> tuple[ShardLayout, dist.Group]:
        layout = state.extras.get("shard")
        if not isinstance(layout, ShardLayout):
            raise ValueError("this state is not in shard's layout: call step.init(state) on the plain state first")
        group = self._group()
        if (layout.world_size, layout.rank) != (group.size, group.rank):
            raise ValueError(
                f"this state was sharded for rank {layout.rank} of {layout.world_size}, but this process is rank "
                f"{group.rank} of {group.size}; restore it with zfunc.io.restore(dir, like=step.init(...)) "
                "to reshard it for this world size")
        if layout.stage != self.stage:
            raise ValueError(f"this state is laid out for stage {layout.stage}, the step is stage {self.stage}")
        if not same_keys(state.params, layout.keys):
            given = frozenset(state.params)  # (not a dict view: dynamo 2.11 cannot subtract one from a frozenset)
            missing, extra = sorted(layout.keys - given), sorted(given - layout.keys)
            raise ValueError(f"{self!r}: state.params do not match the state's shard layout (missing: {missing[:6]}, "
                             f"unexpected: {extra[:6]}); use the state that step.init or the step returned")
        return layout, group

    @staticmethod
    def _full_flats(params: dict, layout: ShardLayout) -> dict[str, torch.Tensor]:
        """Stages 1/2: the flat buffer each unit's full parameters are views of (while torch.compile
        traces, which cannot find it from storage: the unit's full parameters themselves, `shard_compiled`;
        at one rank `_flats_and_shards` reads it from the parameters first, `_one_rank_flats`). Parameters
        moved between keys are refused, eager or traced (where the key each view records stands for the
        storage offset a trace cannot read: `zfunc.optim.flat.moved_keys`)."""
        if tracing():
            moved = moved_keys(params, tuple(params))  # (its keys are the layout's: `_check_layout`)
            if moved:
                raise RuntimeError(f"{_NOT_IN_LAYOUT} (found under another key: {moved[:6]})")
            return {unit.name: {k: params[k] for k in unit.keys} for unit in layout.units}
        flats = {}
        for unit in layout.units:
            flat = unit.full_flat_of({k: params[k] for k in unit.keys})
            if flat is None:
                raise RuntimeError(_NOT_IN_LAYOUT)
            flats[unit.name] = flat
        return flats

    def _param_shards(self, params: dict, layout: ShardLayout,
                      flats: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """This rank's 1-D slices of the parameters (views, no copy), keyed in ``params``' order (as the fused
        update reads every operand, `zfunc.optim.fused_plan`)."""
        if layout.stage == 3:
            return {**params}
        if tracing():
            return param_shards(params, layout)
        flats = self._full_flats(params, layout) if flats is None else flats
        shards = {}
        for unit in layout.units:
            shards.update(unit.shard_views(unit.rank_region(flats[unit.name], layout.rank), layout.rank))
        return dict_of(params, map(shards.__getitem__, params))

    def _flats_and_shards(self, params: dict, layout: ShardLayout) -> tuple[dict | None, dict]:
        """``(unit flats, this rank's shards)`` of the state whose params are ``params`` (stages 1/2: the flats
        and views `_full_flats` and `_param_shards` find, built once per state, `StateViews`; stage 3: None
        and the params themselves), not copies (the caller changes neither): the same dict of the same views
        step after step, where the fused update finds them by the dict's tag (`zfunc.optim.fused_plan`)."""
        if self.stage == 3:
            return None, params
        if tracing():
            flats = self._one_rank_flats(params, layout)  # (each unit's buffer, recorded on its parameters at init)
            if flats is not None:  # the shards: each key's 1-D part of it, made by one split per unit
                shards: dict = {}
                for unit in layout.units:
                    shards.update(unit.split_flat(flats[unit.name]))
                return flats, shards
        if tracing() or not params:
            flats = self._full_flats(params, layout)
            return flats, self._param_shards(params, layout, flats)
        found = layout.state_views.get(params)
        if found is None:
            flats = self._full_flats(params, layout)
            found = (flats, self._param_shards(params, layout, flats))
            layout.state_views.put(params, *found)
        return found

    # -- the step ------------------------------------------------------------
    def start(self, ctx, state) -> _Call:
        layout, group = self._check_layout(state)
        if group.device.type == "cpu" and not tracing():
            # (Not on GPUs: reading the names back would make the host wait for the GPU every step.)
            dist.announce(group, f"a step of shard(stage={self.stage})")
        comm = (CompiledComm(group, ctx.facts.reduce_dtype) if tracing()
                else dist.Comm(group, reduce_dtype=ctx.facts.reduce_dtype))
        if self.stage > 1 and ctx.facts.pp > 1:  # around a pipeline: units whole for the schedule
            return _Call(layout, comm, None, StageUnits(layout, comm))
        units = Units(layout, comm, self.reshard, explicit_units=self.units is not None,
                      verify=self.verify, host=self._host_group(ctx, group), who=self) if self.stage > 1 else None
        return _Call(layout, comm, units)

    def _host_group(self, ctx, group: dist.Group) -> dist.Group | None:
        """Where ``verify`` compares the units each rank ran: a gloo group over the same ranks, made at the
        first step and kept by the stack (`dist.host_group`), so the comparison never waits for the GPU."""
        if not self.verify or group.size == 1 or tracing():
            return None
        key = f"shard: host group of ranks {group.rank}/{group.size} ({id(group.handle)})"
        host = ctx.stack.kept.get(key)
        if host is None:
            host = ctx.stack.kept[key] = dist.host_group(group)
        return host

    def run(self, state, batch):
        call: _Call = self.call_scratch()
        try:
            new_state, metrics = self.step(state, batch)
        finally:
            if call.units is not None:
                call.units.drop()
        return new_state, {**metrics, "comm_elements": call.comm.total}

    def psum(self, next, x):
        return next(self.call_scratch().comm.all_reduce_sum(x))

    def value_and_grad(self, next, fn, params, args, kwargs, has_aux):
        call: _Call = self.call_scratch()
        layout, comm = call.layout, call.comm
        if self.stage == 1:
            flats = self._one_rank_flats(params, layout)
            if flats is not None:
                return self._value_and_grad_of_flats(next, fn, flats, layout, None, None, args, kwargs, has_aux)
            value, grads = next(fn, params, args, kwargs, has_aux)
            if comm.group.size == 1:
                # One rank: its shard of a gradient is the whole gradient and the reduction the identity, so
                # each is handed on as the 1-D shard it stands for (packing the units' gradients into flat
                # buffers to reduce them would only copy every gradient, twice). (By ``map``: a view per key made
                # from C, and none of a gradient already 1-D.)
                return value, dict_of(grads, map(torch.flatten, grads.values()))
            sharded = {}
            for unit in layout.units:
                reduced = comm.reduce_scatter(unit.pack_full(grads), unit.name)
                sharded.update(unit.shard_views(reduced, comm.group.rank))
            comm.finish_pending()
            return value, sharded
        if call.pipelined is not None:  # reduced in gradients_ready, once the schedule returned
            return next(fn, call.pipelined.full_params(params), args, kwargs, has_aux)
        before = call.sharded_applies
        call.units.start_pass()
        shaped = self._runs_on_shards(call.units)
        if shaped and self.stage == 2:  # (traced at one rank: the units' buffers, recorded on the parameters)
            flats = self._one_rank_flats(params, layout)
            if flats is not None:
                return self._value_and_grad_of_flats(next, fn, flats, layout, flats, before, args, kwargs, has_aux)
        full_flats, shards = self._flats_and_shards(params, layout)  # (stage 2: found once per state)
        if self.stage == 3:
            shards = call.units.on_compute_device(shards)
        flats = self._one_rank_flats(shards, layout) if shaped and self.stage == 3 else None
        if flats is not None:
            return self._value_and_grad_of_flats(next, fn, flats, layout, full_flats, before, args, kwargs, has_aux)
        if shaped:
            # One rank: each shard is its whole parameter. What is differentiated is each viewed in its
            # parameter's shape, handed to the model as it is (`_apply_on_shards`), and each gradient handed on
            # as the 1-D shard it stands for, as at stage 1: the views are made here, not in the forward,
            # whose host time is the one that must hide under the GPU's.
            shards = layout.reshaped(shards)

        def loss_on_shards(shard_params, *a, **kw):
            return fn(ShardedParams(shard_params, full_flats, shaped), *a, **kw)

        value, grads = next(loss_on_shards, shards, args, kwargs, has_aux)
        _refuse_unsharded_call(call, before)
        if shaped and grads is not None:
            grads = dict_of(grads, map(torch.flatten, grads.values()))  # (by ``map``: natively in a trace)
        return value, grads

    def _one_rank_flats(self, tensors: dict, layout: ShardLayout) -> dict[str, torch.Tensor] | None:
        """While dynamo traces at one rank (no tensor or pipeline parallelism): each unit's flat buffer, found
        from ``tensors`` (the parameters at stages 1/2, the shards at stage 3: `shard_init` records it on each
        at init), where every unit's are the whole of one buffer; else None."""
        if not (tracing() and layout.world_size == 1):
            return None
        facts = current().facts
        return _unit_flats(tensors, layout) if facts.tp == 1 and facts.pp == 1 else None

    def _value_and_grad_of_flats(self, next, fn, flats: dict, layout: ShardLayout, full_flats, before: int | None,
                                 args, kwargs, has_aux):
        """`value_and_grad` at one rank while dynamo traces, where every unit's parameters are views of its flat
        buffer (``flats``): what is differentiated is each unit's flat buffer, the model given each parameter
        as a view of it, and each gradient handed on as the 1-D part of its unit's. The same numbers as
        differentiating every parameter; what torch.func.vjp wraps and unwraps, interpreted by dynamo leaf by
        leaf (~150 instructions each), is one tensor per unit, and the backward graph makes each unit's
        gradient in one piece. (Stage 1, ``before`` None: the loss gets the views as plain full parameters.)"""
        call: _Call = self.call_scratch()

        def loss_on_flats(flat_params, *a, **kw):
            views: dict = {}
            for unit in layout.units:
                views.update(unit.split_views(flat_params[unit.name]))
            return fn(views if before is None else ShardedParams(views, full_flats, True), *a, **kw)

        value, flat_grads = next(loss_on_flats, flats, args, kwargs, has_aux)
        if before is not None:
            _refuse_unsharded_call(call, before)
        grads: dict = {}
        for unit in layout.units:
            parts = unit.split_flat(flat_grads[unit.name])
            call.grad_flats[unit.name] = (flat_grads[unit.name], parts)
            grads.update(parts)
        return value, grads

    def gradients_ready(self, next, grads):
        call: _Call = self.call_scratch()
        if call.units is not None:
            grads = call.units.finish_pass(grads)
        elif call.pipelined is not None:
            grads = call.pipelined.reduce(grads)
        return next(grads)

    def apply(self, next, model_call):
        params = model_call.params
        if not (self.stage == 3 or isinstance(params, ShardedParams)):
            return next(model_call)  # full parameters (stage 1/2 outside the loss)
        call: _Call = self.call_scratch()
        if call.pipelined is not None:  # the stage's parameters are whole for the schedule (`shard_pipelined`)
            return next(model_call)
        call.sharded_applies += 1
        units = call.units
        if units.mode == "autograd" and _under_torch_func():
            # Only zf.value_and_grad (whose handler above switches the units to torch.func's collectives)
            # knows a torch.func transform differentiates the shards; an outer torch.func.grad would meet
            # eager gathers and fail deep inside torch ('Cannot access storage of TensorWrapper').
            raise RuntimeError(
                f"{self!r}: the model ran under a torch.func transform (torch.func.grad, vjp, vmap, ...) that was "
                "not taken through zfunc, so shard cannot gather the parameter shards in a form it can "
                "differentiate. Differentiate with zf.value_and_grad (or zf.grad) under shard; to vmap, vmap "
                "inside the loss function given to zf.value_and_grad.")
        layout = call.layout
        if self._runs_on_shards(units):
            return self._apply_on_shards(next, model_call, params, layout)
        plan = model_call.structure.derived("shard.apply", layout,
                                            lambda: BlockPlan.build(model_call, layout, "" if tracing() else f" under {self!r}"))
        full_flats = params.full_flats if isinstance(params, ShardedParams) else None
        new_params = {**params}
        root = layout.unit_of_name(ROOT)
        root_written = None  # version counters to check after the forward (see below)
        if root is not None:
            root_views = units.views(root, params, params, full_flats, recomputed=False)
            new_params.update(root_views)
            if root_views and not tracing() and (units.whole_shards() or (self.stage == 3
                                                                           and not torch.is_grad_enabled())):
                # Without gradients the stage 3 root unit is a plain gathered copy: a write into it (an
                # evaluation forward through nn.Embedding(max_norm=...)) would never reach the shards; the
                # shards themselves (one rank) are refused the same writes. (Otherwise autograd refuses the
                # write; blocks are checked as they run, `shard_block_checks.refuse_writes`.)
                root_written = (root_views, [t._version for t in root_views.values()])
        units.prefetch_first(params, full_flats)
        outside = units.outside(params, full_flats)
        recomputed = self.stage == 3 and self.reshard == "recompute"
        # (The call weakly: it holds the wrappers, and a wrapper holding it would be a reference cycle, which
        # kept the call and its tensors until the garbage collector's next pass. A wrapper runs while the call
        # runs, `model_call._run_locked`, where the call lives.)
        call_of = weakref.ref(model_call)
        for block in plan.blocks:

            def wrapper(name, body, block=block):
                return units.block_body(block, body, params, full_flats, recomputed or call_of().recomputed(name),
                                        outside)

            model_call.wrap_block(block.name, wrapper, kind="materialize")
            # (Under torch.func stage 3 recomputes its blocks rather than keep them gathered; at one rank the blocks
            # run on the shards themselves, where there is nothing to free.)
            if recomputed or (units.mode == "functional" and self.stage == 3 and not units.runs_on_shards()):
                norms = model_call.structure.submodules_of_type(block.name, _NormBase)
                if norms:  # (repr(self) only then: it formats every setting, per block while dynamo traces)
                    refuse_running_statistics(norms, repr(self), "use reshard='release'" if recomputed else
                                              "differentiate with zf.value_and_grad rather than under torch.func")
                model_call.require_recompute(block.name)
        model_call.params = new_params
        model_call.partial_keys = plan.partial_keys
        model_call.resolve_outside = outside
        out = next(model_call)
        units.finish_call(params, full_flats)
        if root_written is not None:
            refuse_writes(*root_written, self, "the root unit")
        return out

    def _runs_on_shards(self, units: Units) -> bool:
        """Whether this call runs the model on the shards themselves (`Units.runs_on_shards`), given whole
        (`_apply_on_shards`); ``reshard="recompute"`` keeps its recompute of every block."""
        return units.runs_on_shards() and not (self.stage == 3 and self.reshard == "recompute")

    def _apply_on_shards(self, next, model_call, params, layout: ShardLayout):
        """One rank, shards on the compute device, no accumulator fed per unit (`Units.runs_on_shards`): the
        model runs on every unit's shard reshaped, given once for the whole call as at stage 1. No block is
        routed through the units: there is nothing to gather, release or reduce, and routing each block
        cost ~0.3 ms of host time per block (GPT-2 medium on an H200). A forward that writes into a parameter
        in place is refused after it, as a block's would be at more ranks (`refuse_writes`: the same program
        must not train differently on one GPU and on two)."""
        model_call.structure.derived("shard.on_shards", layout, lambda: refuse_container_units(model_call, layout))
        if isinstance(params, ShardedParams) and params.shaped:  # (viewed so by `value_and_grad`)
            views = {**params}
        else:
            views = layout.reshaped(params)
        model_call.params = views
        if tracing():  # (no version counters to check in a compiled step)
            return next(model_call)
        versions = list(map(version_of, views.values()))
        out = next(model_call)
        refuse_writes(views, versions, self, "the model's forward, on one rank")
        return out

    def apply_gradients(self, next, state, grads, request):
        call: _Call = self.call_scratch()
        layout, comm = call.layout, call.comm
        keys = layout.keys
        if not same_keys(grads, keys):
            raise ValueError(f"shard: grads keys differ from params: {sorted(set(grads) ^ keys)[:8]}")
        flats, shards = self._flats_and_shards(state.params, layout)
        current().state_consumed = True  # the update writes into the state's buffers from here on
        if tracing():  # the update may run once per unit's flat buffers (`zfunc.optim.flat`)
            # Stages 1/2 at one rank: the shards were made in the trace as parts of each unit's buffer
            # (`_flats_and_shards`), which they do not record: the update is told it, to write into it whole.
            parted = (self.stage != 3 and layout.world_size == 1 and len(layout.units) > 0
                      and isinstance(flats[layout.units[0].name], torch.Tensor))
            runs, made, owners = [], [], []
            for unit in layout.units:
                run = unit.filled_keys(layout.rank)
                if run:
                    runs.append(run)
                    found = call.grad_flats.get(unit.name)  # (its gradient made whole: `_value_and_grad_of_flats`)
                    made.append(None if found is None else (found[0], tuple(map(found[1].__getitem__, run))))
                    owners.append((flats[unit.name], tuple(map(shards.__getitem__, run))) if parted else None)
            request = request._replace(flat_runs=tuple(runs), flat_grads=tuple(made) if call.grad_flats else None,
                                       flat_params=tuple(owners) if parted else None)
        new = next(state.replace(params=shards), grads, request)

        def write_back(old: dict, fresh: dict) -> dict:
            # (The fused update hands back the moments it updated in place. Not asked while dynamo traces: its
            # 2.11 cannot trace `is` between two dicts, and the loop below then copies nothing that is itself.)
            if not tracing() and fresh is old:
                return old
            news = list(map(fresh.__getitem__, old))
            if False in list(map(operator.is_, news, old.values())):  # (per key only where some tensor is new)
                for t, new in zip(old.values(), news):
                    if new is not t:
                        t.copy_(new)
            return old

        write_back(shards, new.state.params)
        opt_state = zip_param_shaped(state.opt_state, new.state.opt_state, keys, write_back)
        extras = zip_param_shaped(state.extras, new.state.extras, keys, write_back)
        # (At world 1 the shard is the whole parameter: the update wrote it in place, traced or not.)
        if self.stage != 3 and tracing() and comm.group.size > 1:
            gather_updated(comm, state.params, layout)
        elif self.stage != 3 and comm.group.size > 1:
            # NCCL gathers in place: each rank's input is its own slot of the output (NCCL's documented in-place
            # all-gather, as FSDP2 issues it), so the updated shard is not copied out first; gloo gets a copy.
            in_place = comm.group.device.type == "cuda" and all(f.device == comm.group.device for f in flats.values())
            for unit in layout.units:
                flat = flats[unit.name]
                mine = unit.rank_region(flat, comm.group.rank)
                comm.all_gather(mine if in_place else mine.clone(), out=flat, tag=unit.name)
        new_state = state.replace(step=new.state.step, opt_state=opt_state, extras={**extras, "shard": layout})
        return Updated(new_state, None)


def _refuse_unsharded_call(call: _Call, before: int) -> None:
    """After the loss function ran: refuse it if it never ran the model on the sharded params it was given
    (``call.sharded_applies`` still ``before``)."""
    if call.sharded_applies == before:
        raise RuntimeError(
            "shard: the loss function did not run the model on the params it was given; under shard, pass "
            "the params argument of your loss function unchanged to apply_fn (a copy loses the sharding)")


def _unit_flats(shards: dict, layout: ShardLayout) -> dict[str, torch.Tensor] | None:
    """``{unit name: the flat buffer its keys' shards are views of}`` where every unit's shards are, in order,
    the whole of one buffer of their own (`shard_init.owned_views` at one rank), else None."""
    flats = {}
    for unit in layout.units:
        ((name, keys, _, numel, padded, _, _),) = unit._table  # (`UnitLayout.table`, inline: one guard in a trace)
        flat = owner_of(shards, keys)
        if flat is None or flat.dim() != 1 or flat.numel() != padded or padded != numel:
            return None
        flats[name] = flat
    return flats


def _under_torch_func() -> bool:
    """Inside a torch.func transform (not a torch.compile trace, which zfunc's own passes handle)."""
    if torch.compiler.is_compiling():
        return False
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)  # private; present since 2.0
    return peek is not None and peek() is not None
