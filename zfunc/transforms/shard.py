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
  stage 2) through one autograd node per unit (`UnitLayout.reduced_views`)
  whose backward reduce-scatters, so the gradients arrive sharded. Under
  torch.func or torch.compile the same goes through `dist.AllGather` /
  `dist.Replicated`, the collectives' own composable Functions. Stage 1 reduce-scatters the full gradients once
  after backward (after all micro-batches under `accumulate`). In every stage
  the step sees gradients as this rank's 1-D shards, keyed like params.
- ``apply``: stage 3 gathers the root unit once per call and each block unit
  inside the block (a "materialize" wrapper), so only the running block is
  whole, plus the next one, whose all-gather is issued asynchronously while
  the current block computes (forward in layout order, backward in reverse).
  Autograd would keep every gathered block alive until backward; with
  ``reshard="release"`` (default) the gathered storage is freed after the
  block's forward and refilled just before its backward (`reshard`), as
  FSDP2 does; with ``reshard="recompute"`` the block is recomputed in
  backward (`zfunc.recompute`), which also drops its activations (ZeRO-3 +
  activation checkpointing) at the cost of a second forward. Under a
  `torch.func` transform or `torch.compile`, stage 3 recomputes.
- ``apply_gradients``: the inner transforms and the optimizer run on this
  rank's shards (the state's param-shaped dicts are 1-D views into flat
  per-unit buffers); the results are written back into those buffers and,
  in stages 1 and 2, the updated shards are all-gathered into the full
  parameters in place.
- ``update_params``: Adam/AdamW (optionally after clip_by_global_norm)
  over this rank's shards in one fused launch per unit, writing the compute
  copy in the same pass (`zfunc.kernels.gpu_adam`); under `offload`, or for
  other optimizers, the next handler (offload's kernel, or the pure pytree
  update).
- ``compute_copy``: the compute copy that fused update wrote.
- ``psum``: an all-reduce, so norms and overflow checks are global.

Gradient reductions are asynchronous (waited when backward ends) and run in
the ``reduce_dtype`` of an inner `mixed_precision` policy.

Metrics gain ``comm_elements`` (elements this rank moved in collectives this
step), used by the tests that check the ZeRO volumes.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Sequence

import torch

from zfunc import dist
from zfunc.autodiff import under_torch_func_or_compile
from zfunc.interpret import Transform
from zfunc.optim.fused import FusedAdam
from zfunc.transforms.reshard import ReleasedBuffer, around_block
from zfunc.transforms.shard_layout import (
    ROOT,
    ShardLayout,
    UnitLayout,
    contiguous_runs,
    make_layout,
    map_param_shaped,
    span_of,
    zip_param_shaped,
)


class ShardedParams(dict):
    """The params handed to a loss function under `shard` stages 2 and 3.

    A dict of this rank's 1-D parameter shards. ``apply_fn`` recognizes it and
    gathers full parameters; pass it to ``apply_fn`` as it is (a plain dict
    copy of it would lose that).
    """

    def __init__(self, shards: dict, full_flats: dict[str, torch.Tensor] | None) -> None:
        super().__init__(shards)
        self.full_flats = full_flats  # stage 2: unit name -> resident full flat buffer


class _Call:
    """Scratch of one step call: layout, group and the communication counter."""

    def __init__(self, layout: ShardLayout, group: dist.Group) -> None:
        self.layout, self.group = layout, group
        self.counter = dist.CommCounter()
        self.sharded_applies = 0
        self.prefetched: dict[tuple[str, str], dist.Prefetch] = {}  # (phase, unit) -> gather in flight
        self.released: dict[str, ReleasedBuffer] = {}  # stage 3 blocks of the latest forward
        # During apply_gradients: the compute shards, and the copies the fused update wrote there.
        self.lowp_targets: dict[str, torch.Tensor] | None = None
        self.lowp_written: dict[int, torch.Tensor] = {}

    def drop_prefetched(self) -> None:
        """Finish and forget prefetches nobody used (e.g. a forward without backward)."""
        for prefetch in self.prefetched.values():
            prefetch.result()
        self.prefetched.clear()
        for buffer in self.released.values():
            buffer.wait()
        self.released.clear()


class shard(Transform):  # noqa: N801
    """ZeRO data parallelism: ``shard(step, stage=1|2|3, group=None, units=None)``.

    ``group``: a torch.distributed process group (default: the world; a world
    of 1 when torch.distributed is not initialized). ``units``: module names
    gathered/reduced as one collective each (default: the model's repeated
    blocks, read off parameter names; everything else is the root unit): the
    unit is also the reduce bucket of stage 2. ``reshard`` (stage 3): how a
    gathered block is dropped between its forward and backward, "release"
    (free and re-gather) or "recompute" (see the module docstring).
    """

    name = "shard"
    level = 2

    def __init__(self, step: Callable, stage: Literal[1, 2, 3] = 3, group: Any = None,
                 units: Sequence[str] | None = None,
                 reshard: Literal["release", "recompute"] = "release") -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"shard: stage must be 1, 2 or 3, got {stage!r}")
        if reshard not in ("release", "recompute"):
            raise ValueError(f"shard: reshard must be 'release' or 'recompute', got {reshard!r}")
        super().__init__(step)
        self.stage, self.group, self.units = stage, group, None if units is None else list(units)
        self.reshard = reshard
        self._call: _Call | None = None
        self._segments: dict[tuple, Any] = {}  # weight-decay tables of the fused update, per layout

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {"stage": self.stage}
        if self.units is not None:
            out["units"] = self.units
        if self.reshard != "release":
            out["reshard"] = self.reshard
        return out

    # -- layout --------------------------------------------------------------
    def init_state(self, state):
        if "shard" in state.extras:
            raise ValueError("shard.init: this state is already sharded; pass the plain state from TrainState.create")
        group = dist.Group.resolve(self.group)
        params = state.params
        layout = make_layout(params, self.stage, group.size, group.rank, self.units)
        keys = set(params)
        partition = lambda tree: _partition(tree, layout)  # noqa: E731
        opt_state = map_param_shaped(state.opt_state, keys, partition)
        extras = map_param_shaped(dict(state.extras), keys, partition)
        if self.stage == 3:
            new_params = _partition(params, layout)
        else:  # full parameters, stored as views of one flat buffer per unit
            new_params = {}
            for unit in layout.units:
                new_params.update(unit.full_views(unit.pack_full(params)))
        return state.replace(params=new_params, opt_state=opt_state, extras={**extras, "shard": layout})

    def gather_params(self, state, next) -> dict[str, torch.Tensor]:
        layout, group = self._check_layout(state)
        shards = next(state.replace(params=self._param_shards(state.params, layout)))
        full = {}
        for unit in layout.units:
            flat = dist.all_gather_flat(unit.cat_shard(shards, group.rank).detach(), group)
            full.update({k: v.clone() for k, v in unit.full_views(flat).items()})
        return full

    def _check_layout(self, state) -> tuple[ShardLayout, dist.Group]:
        layout = state.extras.get("shard")
        if not isinstance(layout, ShardLayout):
            raise ValueError("this state is not in shard's layout: call step.init(state) on the plain state first")
        group = dist.Group.resolve(self.group)
        if (layout.world_size, layout.rank) != (group.size, group.rank):
            raise ValueError(
                f"this state was sharded for rank {layout.rank} of {layout.world_size}, but this process is rank "
                f"{group.rank} of {group.size}; restore it with zfunc.io.restore(dir, like=step.init(...)) "
                "to reshard it for this world size")
        if layout.stage != self.stage:
            raise ValueError(f"this state is laid out for stage {layout.stage}, the step is stage {self.stage}")
        return layout, group

    @staticmethod
    def _full_flats(params: dict, layout: ShardLayout) -> dict[str, torch.Tensor]:
        """Stages 1/2: the flat buffer each unit's full parameters are views of."""
        flats = {}
        for unit in layout.units:
            flat = unit.flat_of({k: params[k] for k in unit.keys}, unit.padded)
            if flat is None:
                raise RuntimeError("shard: state.params are not in shard's flat layout (were they replaced?); "
                                   "use the state that step.init or the step returned")
            flats[unit.name] = flat
        return flats

    def _param_shards(self, params: dict, layout: ShardLayout,
                      flats: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """This rank's 1-D slices of the parameters (views, no copy)."""
        if layout.stage == 3:
            return dict(params)
        flats = self._full_flats(params, layout) if flats is None else flats
        shards = {}
        for unit in layout.units:
            shards.update(unit.shard_views(unit.rank_region(flats[unit.name], layout.rank), layout.rank))
        return shards

    # -- the step ------------------------------------------------------------
    def run(self, state, batch):
        layout, group = self._check_layout(state)
        outer, self._call = self._call, _Call(layout, group)
        policy = _mixed_precision_policy(self.step)
        if policy is not None:  # reduce gradients in the policy's reduce dtype (default: compute dtype)
            self._call.counter.reduce_dtype = policy.reduce
        try:
            new_state, metrics = self.step(state, batch)
            self._call.drop_prefetched()
            metrics = {**metrics, "comm_elements": self._call.counter.total}
        finally:
            self._call = outer
        return new_state, metrics

    def _active(self) -> _Call:
        if self._call is None:
            raise RuntimeError("shard's primitives ran outside its step")
        return self._call

    def psum(self, next, x):
        call = self._active()
        return next(dist.all_reduce_sum(x, call.group, call.counter))

    def value_and_grad(self, next, fn, params, args, kwargs, has_aux):
        call = self._active()
        layout, group = call.layout, call.group
        if self.stage == 1:
            value, grads = next(fn, params, args, kwargs, has_aux)
            sharded = {}
            for unit in layout.units:
                flat = unit.pack_full(grads)
                reduced = dist.reduce_scatter_flat(flat, group, call.counter, unit.name)
                sharded.update(unit.shard_views(reduced, group.rank))
            call.counter.wait_pending()
            return value, sharded
        full_flats = self._full_flats(params, layout) if self.stage == 2 else None
        shards = self._param_shards(params, layout, full_flats)
        before = call.sharded_applies

        def loss_on_shards(shard_params, *a, **kw):
            return fn(ShardedParams(shard_params, full_flats), *a, **kw)

        value, grads = next(loss_on_shards, shards, args, kwargs, has_aux)
        call.counter.wait_pending()  # the reduce-scatters issued during backward
        if call.sharded_applies == before:
            raise RuntimeError(
                "shard: the loss function did not run the model on the params it was given; under shard, pass "
                "the params argument of your loss function unchanged to apply_fn (a copy loses the sharding)")
        return value, grads

    def apply(self, next, model_call):
        params = model_call.params
        if not (self.stage == 3 or isinstance(params, ShardedParams)):
            return next(model_call)  # full parameters (stage 1/2 outside the loss)
        call = self._active()
        call.sharded_applies += 1
        layout, group = call.layout, call.group
        full_flats = params.full_flats if isinstance(params, ShardedParams) else None
        unit_of = layout.unit_of()
        _check_ties(model_call, unit_of)

        blocks = [u for u in layout.units if u.name != ROOT]
        position = {u.name: i for i, u in enumerate(blocks)}

        def prefetch(phase: str, index: int) -> None:
            # Stage 3 runs blocks in layout order forward and in reverse in the
            # recompute of backward: gather the next one while this one computes.
            if 0 <= index < len(blocks) and (phase, blocks[index].name) not in call.prefetched:
                unit = blocks[index]
                data = unit.shard_data(params, group.rank)
                call.prefetched[(phase, unit.name)] = dist.Prefetch(data, group, call.counter)

        # Release needs plain autograd; under torch.func or torch.compile, recompute.
        release = self.reshard == "release" and not under_torch_func_or_compile()

        def gather(unit: UnitLayout, data: torch.Tensor | None, phase: str,
                   differentiable_shard: torch.Tensor | None = None) -> torch.Tensor:
            """Block ``unit``'s full flat buffer (prefetched, or gathered now); prefetch the next block.

            ``differentiable_shard`` (under torch.func): gather through `dist.AllGather`, whose
            backward reduce-scatters; otherwise ``data`` is gathered as plain data.
            """
            ready = call.prefetched.pop((phase, unit.name), None)
            if differentiable_shard is not None:
                full = dist.AllGather.apply(differentiable_shard, group, call.counter, ready, unit.name)
            else:
                full = ready.result() if ready is not None else dist.all_gather_flat(data, group, call.counter)
            i = position[unit.name]
            if phase == "forward":
                prefetch("forward", i + 1)
                if i == len(blocks) - 1 and not release:
                    prefetch("backward", i)  # the recompute of backward starts with the last block
            else:
                prefetch("backward", i - 1)
            return full

        def reducer(unit: UnitLayout, buffer: ReleasedBuffer | None = None):
            """The gradient reduction of ``unit``'s views (see `UnitLayout.reduced_views`)."""
            def reduce(flat: torch.Tensor) -> torch.Tensor:
                if buffer is not None:
                    buffer.parameters_grad_ready()
                return dist.reduce_scatter_flat(flat, group, call.counter, unit.name)
            return reduce

        def materialize(unit: UnitLayout, slices: dict) -> dict:
            # A recomputed block's forward runs without grad; its rerun in backward with it.
            phase = "backward" if torch.is_grad_enabled() else "forward"
            if under_torch_func_or_compile():
                return composable_views(unit, slices, phase)
            if full_flats is not None:
                full = full_flats[unit.name]
            elif unit.name == ROOT:
                full = dist.all_gather_flat(unit.shard_data(slices, group.rank), group, call.counter)
                prefetch("forward", 0)
            else:
                full = gather(unit, unit.shard_data(slices, group.rank), phase)
            return unit.reduced_views(full, slices, group.rank, reducer(unit))

        def composable_views(unit: UnitLayout, slices: dict, phase: str) -> dict:
            # Under torch.func or torch.compile: the collectives' own autograd Functions, which
            # those support, and plain views.
            flat_shard = unit.cat_shard(slices, group.rank)
            if full_flats is not None:
                full = dist.Replicated.apply(flat_shard, dist.Holder(full_flats[unit.name]), group, call.counter,
                                             unit.name)
            elif unit.name == ROOT:
                full = dist.AllGather.apply(flat_shard, group, call.counter, None, unit.name)
                prefetch("forward", 0)
            else:
                full = gather(unit, None, phase, differentiable_shard=flat_shard)
            return unit.full_views(full)

        def released_body(unit: UnitLayout, local: dict, body, slices: dict, args, kwargs):
            data = unit.shard_data(slices, group.rank)
            full = gather(unit, data, "forward")
            buffer = ReleasedBuffer(full, data, group, call.counter)
            call.released[unit.name] = buffer
            i = position[unit.name]

            def refill_previous_block():  # prefetch: backward goes through the blocks in reverse
                previous = call.released.get(blocks[i - 1].name) if i > 0 else None
                if previous is not None:
                    previous.refill(asynchronous=True)

            views = unit.reduced_views(full, slices, group.rank, reducer(unit, buffer))
            return around_block(buffer, body, {n: views[k] for n, k in local.items()}, args, kwargs,
                                refill_previous_block)

        new_params = dict(params)
        for unit in layout.units:
            if unit.name == ROOT:
                new_params.update(materialize(unit, params))
                continue
            local = model_call.block_param_names(unit.name)  # local name -> key

            def wrapper(name, body, unit=unit, local=local):
                def gathered_body(block_params, *args, **kwargs):
                    slices = {local[n]: t for n, t in block_params.items()}
                    # Inside a recompute (checkpoint's, or a torch.func rerun) the block
                    # keeps nothing between its forward and backward: gather plainly.
                    if release and full_flats is None and torch.is_grad_enabled() \
                            and not under_torch_func_or_compile():
                        return released_body(unit, local, body, slices, args, kwargs)
                    full = materialize(unit, slices)
                    return body({n: full[k] for n, k in local.items()}, *args, **kwargs)
                return gathered_body

            model_call.wrap_block(unit.name, wrapper, kind="materialize")
            if self.stage == 3 and not release:
                model_call.require_recompute(unit.name)
        model_call.params = new_params
        return next(model_call)

    def watch_gradients(self, next, callback):
        """Call ``callback(grad_shards, wait)`` for each unit as soon as its reduction is issued.

        ``grad_shards``: this rank's 1-D gradient slices of the unit's
        parameters, keyed like params (views of the reduced buffer, final once
        ``wait()`` returned). Stages 2 and 3 issue them during backward, unit
        by unit; stage 1 right after it.
        """
        call = self._active()
        units = {u.name: u for u in call.layout.units}
        rank = call.group.rank

        def on_reduced(tag, flat, wait):
            callback(units[tag].shard_views(flat, rank), wait)

        call.counter.listeners.append(on_reduced)
        return True

    def update_params(self, next, tx, params, grads, opt_state):
        """Adam/AdamW over all of this rank's shards: one fused launch per unit.

        `zfunc.kernels.gpu_adam.adam_flat_` (Triton on CUDA, torch's fused
        kernels elsewhere) over each unit's flat shard of parameters,
        gradients (in their own dtype) and moments, with the weight decay of
        each parameter from a small per-unit table; under `mixed_precision`
        it also writes the compute copy straight into the compute shards
        (handed back through ``compute_copy``), so there is no separate cast
        and copy. Left to inner transforms under `offload` (its host kernel).
        """
        fused = FusedAdam.of(tx, opt_state, params)
        call = self._active()
        if fused is None or self._offloaded() or not params or not _fusable(params, grads, fused):
            return next(tx, params, grads, opt_state)
        from zfunc.kernels.gpu_adam import adam_flat_  # noqa: PLC0415

        divisor = fused.grad_divisor(grads)  # clip_by_global_norm, if chained before the Adam
        lowp = _lowp_targets(call.lowp_targets, params)
        operands = [params, grads, fused.mu, fused.nu, *([lowp] if lowp is not None else [])]
        for run in contiguous_runs([k for k, p in params.items() if p.numel()], operands):
            p, g, m, v, *out = (span_of(d, run) for d in operands)
            adam_flat_(p, g, m, v, self._segments_for(run, params, fused.weight_decay), lr=fused.lr,
                       step=fused.step, beta1=fused.b1, beta2=fused.b2, eps=fused.eps, mode=fused.mode,
                       grad_scale=divisor, out_lowp=out[0] if out else None)
        if lowp is not None:
            call.lowp_written = {id(params[k]): lowp[k] for k in params}
        return params, fused.new_state()

    def _segments_for(self, run: list[str], params: dict, weight_decay: dict):
        """The weight-decay table of one run (built once per layout, then reused)."""
        from zfunc.kernels.gpu_adam import AdamSegments  # noqa: PLC0415

        device = params[run[0]].device
        key = (tuple(run), tuple(params[k].numel() for k in run), tuple(weight_decay[k] for k in run), str(device))
        if key not in self._segments:
            runs, start = [], 0
            for k in run:
                runs.append((start, params[k].numel(), weight_decay[k]))
                start += params[k].numel()
            self._segments[key] = AdamSegments.build(runs, device)
        return self._segments[key]

    def _offloaded(self) -> bool:
        from zfunc.interpret import transforms_of  # noqa: PLC0415

        return any(t.name == "offload" for t in transforms_of(self.step))

    def compute_copy(self, next, master, dtype):
        """The compute copy that `update_params` wrote while updating ``master``, if it did."""
        from zfunc.transforms.mixed_precision import written_compute_copy  # noqa: PLC0415 (sibling)

        copies = written_compute_copy(self._call.lowp_written if self._call is not None else {}, master, dtype)
        return copies if copies is not None else next(master, dtype)

    def apply_gradients(self, next, state, grads):
        call = self._active()
        layout, group = call.layout, call.group
        keys = set(layout.keys)
        if set(grads) != keys:
            raise ValueError(f"shard: grads keys differ from params: {sorted(set(grads) ^ keys)[:8]}")
        flats = self._full_flats(state.params, layout) if self.stage != 3 else None
        shards = self._param_shards(state.params, layout, flats)
        call.lowp_targets = shards  # where a fused update may write the compute copy
        try:
            new = next(state.replace(params=shards), grads)
        finally:
            call.lowp_targets, call.lowp_written = None, {}

        def write_back(old: dict, fresh: dict) -> dict:
            for k, t in old.items():
                if fresh[k] is not t:
                    t.copy_(fresh[k])
            return old

        write_back(shards, new.params)
        opt_state = zip_param_shaped(state.opt_state, new.opt_state, keys, write_back)
        extras = zip_param_shaped(state.extras, new.extras, keys, write_back)
        if self.stage != 3:
            for unit in layout.units:
                flat = flats[unit.name]
                dist.all_gather_flat(unit.rank_region(flat, group.rank).clone(), group, call.counter, out=flat)
        return state.replace(step=new.step, opt_state=opt_state, extras={**extras, "shard": layout})


def _fusable(params: dict, grads: dict, fused: FusedAdam) -> bool:
    """Whether the fused update takes these: fp32 params and moments, float grads, one device."""
    device = next(iter(params.values())).device
    return all(p.dtype == torch.float32 and p.device == device for p in params.values()) \
        and all(grads[k].is_floating_point() and grads[k].device == device for k in params) \
        and all(fused.mu[k].dtype == torch.float32 and fused.mu[k].device == device for k in params)


def _lowp_targets(targets: dict | None, params: dict) -> dict | None:
    """The compute shards, if the fused update can write the compute copy into them."""
    if targets is None or set(targets) != set(params):
        return None
    ok = all(t.dtype in (torch.bfloat16, torch.float16) and t.device == params[k].device
             and t.numel() == params[k].numel() and t.is_contiguous() for k, t in targets.items())
    return targets if ok else None


def _partition(tree: dict[str, torch.Tensor], layout: ShardLayout) -> dict[str, torch.Tensor]:
    """This rank's 1-D slices of a dict of full tensors, as views of new flat shards."""
    out = {}
    for unit in layout.units:
        full = unit.pack_full(tree)
        out.update(unit.shard_views(unit.rank_region(full, layout.rank).clone(), layout.rank))
    return out


def _check_ties(model_call, unit_of: dict[str, UnitLayout]) -> None:
    """A parameter of a block unit must not also be used outside that block."""
    for name, key in model_call.aliases.items():
        unit = unit_of.get(key)
        if unit is not None and unit.name != ROOT and not name.startswith(unit.name + "."):
            raise NotImplementedError(
                f"shard: {name!r} is tied to {key!r}, which lives in block {unit.name!r}; weights tied across "
                "blocks are not supported in a block unit. Pass units= without that block.")


def _mixed_precision_policy(step: Callable):
    from zfunc.transforms.mixed_precision import policy_of  # noqa: PLC0415 (sibling transform)

    return policy_of(step)
