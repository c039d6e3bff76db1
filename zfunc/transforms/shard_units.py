"""Stages 2 and 3: how a unit's full parameters reach the model, and how its gradient goes back.

One component, `Units`, made once per call of `shard` and decided once per
call: ``mode`` is "autograd" (zfunc's eager `value_and_grad`) or
"functional" (inside a `torch.func` transform or a `torch.compile` trace,
probed once when the step's gradient call starts). Per unit it then hands
the model views of the unit's full flat buffer — resident (stage 2) or
all-gathered (stage 3, prefetched one block ahead) — that are
differentiable with respect to this rank's shards:

- **autograd**: one autograd node per unit and use, `UnitViews`. Its
  backward concatenates the views' gradients once and gives them to the
  unit's `Reducer`, which sums the contributions of every use of the unit in
  this backward pass (a block called twice, a layer shared by two positions,
  ``apply_fn`` called twice in one loss, checkpoint's recompute of each)
  and, when the last one arrived, issues the unit's one reduce-scatter,
  asynchronously. Autograd never sums two buffers whose reductions are still
  in flight: each slice gets exactly one gradient, from the last use.
  Uses are counted in the forward pass (never in backward's recomputes), so
  "the last one" is known. Under `accumulate` the reduced shard is added into
  the call's accumulator as it lands (`Units.reduce_into_sink`), on the tier
  of the unit's optimizer state, and autograd gets zeros that take no memory. Reductions are waited for when the backward pass
  returns (`finish_pass`, from the ``gradients_ready`` primitive): under
  `checkpoint`, whose recomputes run nested backward passes, communication
  still overlaps the rest of backward.
- **functional**: the collectives' composable Functions (`dist.AllGather`,
  `dist.Replicated`), whose reductions are synchronous; stage 3 recomputes
  its blocks (saved-tensor tricks are refused there).

Stage 3 keeps a gathered block from forward to backward in one of two ways
(``reshard``), decided per block from the call, never from ambient state: a
block that `checkpoint` (or ``reshard="recompute"``) recomputes simply
gathers again in its recompute; any other block is *released* after its
forward and refilled just before its backward (`zfunc.transforms.reshard`).

At one rank a shard is its whole parameter: the model runs on the shards
themselves (`Units.runs_on_shards`), with nothing gathered, released or
reduced. Around each block, at every world size, the checks of
`zfunc.transforms.shard_block_checks`: a forward that writes into its
parameters in place is refused, an output that is a view of them is copied out.
"""

from __future__ import annotations

import itertools
import operator
from typing import Callable, Literal

import torch

from zfunc import dist
from zfunc.autodiff import apply_function, under_torch_func_or_compile
from zfunc.compiled import tracing
from zfunc.interpret import current
from zfunc.transforms.reshard import ReleasedBuffer, around_block
from zfunc.transforms.shard_block_checks import run_checked
from zfunc.transforms.shard_blocks import BlockUnit
from zfunc.transforms.shard_compiled import unit_views
from zfunc.transforms.shard_layout import ROOT, ShardLayout, UnitLayout


def in_backward() -> bool:
    """Whether this thread is running an autograd backward pass (a recompute's rerun included)."""
    return torch._C._current_graph_task_id() != -1


class UnitUse:
    """One unit in one forward/backward pass: forward uses counted, backward contributions summed."""

    __slots__ = ("uses", "seen", "grad_sum", "issued")

    def __init__(self) -> None:
        self.uses = 0
        self.seen = 0
        self.grad_sum: torch.Tensor | None = None
        self.issued = False


class Reducer:
    """Called by a unit's `UnitViews` backward with one use's flat gradient; returns the unit's
    reduced shard once every use has contributed (None before, and for a unit whose reduction waits
    for the end of backward)."""

    def __init__(self, units: "Units", unit: UnitLayout, use: UnitUse, buffer: ReleasedBuffer | None) -> None:
        self.units, self.unit, self.use, self.buffer = units, unit, use, buffer

    def __call__(self, flat: torch.Tensor) -> torch.Tensor | None:
        if self.buffer is not None:
            self.buffer.parameters_grad_ready()
        self.units.backward_begins()
        use = self.use
        use.grad_sum = flat if use.grad_sum is None else use.grad_sum.add_(flat)
        use.seen += 1
        if use.seen < use.uses or use.issued or self.unit.name in self.units.deferred:
            return None
        use.issued = True
        grad, use.grad_sum = use.grad_sum, None
        if self.units.sink is not None:
            self.units.reduce_into_sink(self.unit, grad)
            return FED
        return self.units.comm.reduce_scatter(grad, self.unit.name, owned=True)  # (this use's sum: ours alone)


FED = object()  # what a `Reducer` returns when the unit's gradient went into the call's accumulator


class UnitViews(torch.autograd.Function):
    """Views of a unit's flat buffer out; the reduced gradient shards back (see the module docstring).

    The ``forward(ctx)`` form: it never runs under torch.func, and unlike the
    ``setup_context`` form its ``apply`` does not bind arguments through
    ``inspect.signature`` on every call. One node per unit and use: slicing the
    buffer per parameter would give each view its own node, and autograd would
    sum one zero-filled full-size buffer per parameter (12 in a GPT block:
    ~8x slower on the CPU).
    """

    @staticmethod
    def forward(ctx, holder: dist.Holder, unit: UnitLayout, rank: int, reducer: Reducer, *slices):
        ctx.unit, ctx.rank, ctx.reducer = unit, rank, reducer
        ctx.dtype, ctx.device = holder.full.dtype, holder.full.device
        ctx.set_materialize_grads(False)  # a parameter the model did not use gets None, not zeros
        return tuple(unit.strided_views(holder.full))

    @staticmethod
    def backward(ctx, *grads):
        unit = ctx.unit
        parts = [torch.zeros(n, dtype=ctx.dtype, device=ctx.device) if g is None else g
                 for g, n in zip(grads, unit.numels)]
        if unit.padded > unit.numel:
            parts.append(torch.zeros(unit.padded - unit.numel, dtype=ctx.dtype, device=ctx.device))
        shard = ctx.reducer(_flatten(parts))
        if shard is None:
            return (None, None, None, None, *([None] * len(unit.keys)))
        if shard is FED:  # summed where the update reads it: autograd gets zeros that take no memory
            shard = torch.zeros((), dtype=ctx.dtype, device=ctx.device).expand(unit.shard_size)
        return (None, None, None, None, *unit.split_shard(shard, ctx.rank).values())


# ``torch.cat([t.reshape(-1) for t in tensors])`` in one call from Python: torch's own (DDP's bucket
# flattening), whose loop over the tensors runs in C++ (each ``reshape`` from Python costs a dispatch).
_flatten = torch._C._nn.flatten_dense_tensors


_requires_grad = operator.attrgetter("requires_grad")


class Units:
    """The stage 2/3 unit machinery of one call of `shard` (see the module docstring)."""

    def __init__(self, layout: ShardLayout, comm: dist.Comm, reshard: Literal["release", "recompute"],
                 explicit_units: bool = False, verify: bool = True, host: dist.Group | None = None,
                 who: object = "shard") -> None:
        self.layout, self.comm, self.reshard = layout, comm, reshard
        self.who = who  # the transform errors name (formatted only then: its repr is not cheap, nor traced)
        self.explicit_units, self.verify = explicit_units, verify
        self.host = host  # where ``verify`` exchanges the units each rank ran (`dist.host_group`)
        self.rank = comm.group.rank
        self.blocks = [u for u in layout.units if u.name != ROOT]
        self.position = {u.name: i for i, u in enumerate(self.blocks)}
        self.mode: Literal["autograd", "functional"] = "autograd"
        self.uses: dict[str, UnitUse] = {}  # this backward pass's forward uses, by unit
        self.agreed = False  # this pass's uses were compared across ranks
        self.deferred: set[str] = set()  # units run unevenly across ranks: reduced after backward
        self.prefetched: dict[tuple[str, str], dist.Prefetch] = {}  # (phase, unit) -> gather in flight
        self.issued = -1  # this model call's forward gathers: blocks [0, issued] are issued (stage 3)
        self.released: dict[str, ReleasedBuffer] = {}  # stage 3 blocks of the latest forward
        self.host_data: dict[int, torch.Tensor] = {}  # a stand-in's storage -> its shard on the host
        # unit -> (the slice tensors it was found from, this rank's flat shard): see `_data`
        self.flat_shards: dict[str, tuple[tuple[torch.Tensor, ...], torch.Tensor]] = {}
        # The call's gradient accumulator (`accumulate`), fed as each unit's reduction lands, and the
        # reductions issued into it that have not landed yet.
        self.sink = None
        self.landing: list[tuple[UnitLayout, torch.Tensor]] = []

    # -- parameter shards on the host ---------------------------------------------
    def on_compute_device(self, shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stage 3 with parameter shards on the host (``offload(params="host")``): what autograd
        differentiates instead of each host shard is a stand-in on the compute device (one element,
        expanded: no memory), so the shard's gradient comes out on the GPU, where backward reduced it
        and the update streams it from; the gathers read the host data through `_data` (pinned memory,
        copied to the GPU asynchronously as each unit is gathered)."""
        device = self.comm.group.device
        # (The few distinct devices, read by ``map``: in C eagerly, natively while dynamo traces.)
        if not shards or frozenset(map(getattr, shards.values(), itertools.repeat("device"))) == frozenset((device,)):
            return shards
        if under_torch_func_or_compile():
            raise NotImplementedError(
                "offload(params='host') gathers host shards block by block in eager autograd; under "
                "torch.func or torch.compile keep the parameters on the device (offload(params='device')).")
        out = {}
        for key, t in shards.items():
            if t.device == device:
                out[key] = t
                continue
            stand_in = torch.zeros(1, dtype=t.dtype, device=device).expand(t.shape)
            self.host_data[stand_in.untyped_storage().data_ptr()] = t
            out[key] = stand_in
        return out

    def _data(self, unit: UnitLayout, slices: dict[str, torch.Tensor]) -> torch.Tensor:
        """``unit``'s flat shard on this rank (`UnitLayout.shard_data`), read from the host where the
        slices are stand-ins (`on_compute_device`).

        Found once per unit and call: a block asks for it when it is gathered and again when the block
        before it prefetches it (and its recompute in backward once more); the same slice tensors (by
        identity) give the same buffer, so only their identities are compared the next times. (A
        concatenated copy, for slices that are not views of one buffer, is made anew each time, as it
        was: kept for the call it would hold memory.)
        """
        tensors = tuple(map(slices.__getitem__, unit.keys))
        known = self.flat_shards.get(unit.name)
        if known is not None and all(map(operator.is_, tensors, known[0])):
            return known[1]
        if self.host_data:
            slices = {k: self.host_data.get(slices[k].untyped_storage().data_ptr(), slices[k]) for k in unit.keys}
        data = unit.shard_data(slices, self.rank)
        if data.untyped_storage().data_ptr() == tensors[0].untyped_storage().data_ptr():
            self.flat_shards[unit.name] = (tensors, data)  # (the buffer itself, not a copy)
        return data

    # -- a pass -------------------------------------------------------------------
    def start_pass(self) -> None:
        """A gradient call begins: decide the mode for this call; count uses afresh."""
        self.mode = "functional" if under_torch_func_or_compile() else "autograd"
        self.uses, self.agreed, self.deferred = {}, False, set()
        ctx = current()
        self.sink = ctx.grad_sink if ctx is not None and self.mode == "autograd" else None

    def reduce_into_sink(self, unit: UnitLayout, grad: torch.Tensor) -> None:
        """Reduce ``unit``'s full gradient and add this rank's shard into the accumulator.

        The reduction is asynchronous: it lands (is added, and the unit's gradient freed) when the next
        unit's reduction is issued, or at the end of the backward pass, so it overlaps the next unit's
        backward and at most two units' gradients are alive at once. One rank reduces nothing: added now.
        """
        if self.comm.group.size == 1:
            self.sink.add_unit(unit, self.rank, grad)
            return
        self.land()
        self.landing.append((unit, self.comm.reduce_scatter(grad, unit.name, dtype=self.comm.reduce_dtype)))

    def land(self) -> None:
        """Wait for the reductions issued into the accumulator and add them there."""
        if not self.landing:
            return
        self.comm.finish_pending()
        landing, self.landing = self.landing, []
        for unit, shard in landing:
            self.sink.add_unit(unit, self.rank, shard)

    def backward_begins(self) -> None:
        """Before the first collective of a backward pass: compare the units each rank ran.

        A unit run on some ranks only (a module chosen by rank, a block skipped by data) would make
        the ranks' reductions pair up wrongly, or hang. With the default units (the model's blocks)
        its reduction waits for the end of backward, where every rank issues the uneven units'
        reductions in unit order (zeros where a rank did not run it): exact, without overlap for
        them. Named ``units=``, or at stage 3 (where backward gathers the unit again), it is refused
        on every rank, before any gradient collective. One small exchange per backward pass, between
        the ranks' hosts (``host``: a gloo group), which never waits for a device.
        """
        if self.agreed:
            return
        self.agreed = True
        if not self.verify or self.comm.group.size == 1 or tracing():  # (not checked when compiled)
            return
        mine = {name: use.uses for name, use in self.uses.items() if use.uses}
        # Which units ran is known on the host: exchanged over a host (gloo) group, the answer never waits
        # for the GPU (over NCCL it would come back through the device, after the forward's kernels).
        host = self.host if self.host is not None else self.comm.group  # (refused below unless on the host)
        counts = dist.exchange_on_host(mine, host, "comparing the units each rank ran")
        names = sorted({n for c in counts for n in c}, key=lambda n: self.position.get(n, -1))
        uneven = [n for n in names if len({c.get(n, 0) for c in counts}) > 1]
        if not uneven:
            return
        stage3 = any(b.name in uneven for b in self.blocks) and self.layout.stage == 3
        if self.explicit_units or stage3:
            runs = ", ".join(f"{n}: {[c.get(n, 0) for c in counts]}" for n in uneven[:6])
            raise dist.CollectiveError(
                f"shard: unit(s) {uneven[:6]} ran on some ranks only (times each rank ran them: {runs}); their "
                "gathers and reductions cannot pair up across ranks. A module that runs on some ranks only (a "
                "branch chosen by rank, an MoE expert that got no tokens) must live inside a unit every rank "
                "runs: leave it out of units= (its parent block, or the root unit, then holds it)"
                + ("" if self.explicit_units else "; at stage 3 the blocks found by default must also run on every "
                   "rank: name the units that do with shard(..., units=[...])") + ".")
        self.deferred = set(uneven)

    def finish_pass(self, grads: dict | None) -> dict | None:
        """The backward pass returned ``grads`` (keyed by param, this rank's shards): reduce what is
        still unreduced, wait for every reduction, and hand back the final gradients."""
        self.backward_begins()  # (a backward that issued no collective still compares)
        flushed = {}
        units = {u.name: u for u in self.layout.units}
        for name in sorted(self.deferred, key=lambda n: self.position.get(n, -1)):
            use = self.uses.get(name)
            grad = use.grad_sum if use is not None else None
            if grad is None:  # this rank did not run it: its share of the mean is zero
                like = grads[units[name].keys[0]] if grads is not None else None
                grad = torch.zeros(units[name].padded, dtype=like.dtype if like is not None else torch.float32,
                                   device=like.device if like is not None else self.comm.group.device)
            if use is not None:
                use.issued, use.grad_sum = True, None
            flushed[name] = self._reduce_at_end(units[name], grad)
        for name, use in self.uses.items():
            if use.grad_sum is not None and not use.issued:
                # A use whose backward never ran (its output did not reach the loss): reduce the
                # sum of the uses that did, now, in unit order (the same on every rank).
                use.issued = True
                grad, use.grad_sum = use.grad_sum, None
                flushed[name] = self._reduce_at_end(units[name], grad)
        self.comm.finish_pending()
        self.land()
        flushed = {name: shard for name, shard in flushed.items() if shard is not FED}
        self.uses = {}
        if flushed and grads is not None:
            units = {u.name: u for u in self.layout.units}
            grads = {**grads}
            for name, shard in flushed.items():
                grads.update(units[name].shard_views(shard, self.rank))
        return grads

    def _reduce_at_end(self, unit: UnitLayout, grad: torch.Tensor):
        if self.sink is not None:
            self.reduce_into_sink(unit, grad)
            return FED
        return self.comm.reduce_scatter(grad, unit.name, owned=True)

    def drop(self) -> None:
        """Finish and forget gathers nobody used (e.g. a forward without backward)."""
        for prefetch in self.prefetched.values():
            prefetch.result()
        self.prefetched.clear()
        for buffer in self.released.values():
            buffer.wait()
        self.released.clear()
        self.flat_shards.clear()

    def _use(self, unit: UnitLayout) -> UnitUse:
        use = self.uses.get(unit.name)
        if use is None:
            use = self.uses[unit.name] = UnitUse()
        return use

    # -- gathering ----------------------------------------------------------------
    def whole_shards(self) -> bool:
        """Whether each unit's flat shard is the whole unit, on the compute device (one rank, shards not
        on the host): then a "gather" would copy it into a buffer of the same size, to be released after
        the block and refilled for its backward; the block gets views of the shard itself instead (no
        copy, nothing to release), as the stage 1 step runs on its parameters."""
        return self.comm.group.size == 1 and not self.host_data

    def runs_on_shards(self) -> bool:
        """Whether the model runs on the shards themselves (reshaped): at one rank, where each shard is its whole
        parameter and its reduction the identity, so autograd (or torch.func, or a compiled step) hands each its
        gradient as at stage 1, with no node or collective per unit. (A call whose gradients feed an
        accumulator per unit as backward makes them, `accumulate`'s or `offload`'s, keeps the unit's node,
        which feeds it.) A write into them is refused as into a gathered copy
        (`shard_block_checks.refuse_writes`)."""
        return self.sink is None and self.whole_shards()

    def _gathered_now(self, unit: UnitLayout, slices: dict) -> torch.Tensor:
        """``unit``'s full flat buffer gathered now, not prefetched (the root unit, a parameter used outside its
        block): the shard itself where it is the whole unit (`whole_shards`)."""
        data = self._data(unit, slices)
        return data if self.whole_shards() else self.comm.all_gather(data, tag=unit.name)

    def _prefetch(self, phase: str, index: int, params: dict) -> None:
        # Stage 3 runs blocks in layout order forward and in reverse in backward's recomputes:
        # gather the next one while this one computes.
        if self.whole_shards():
            return
        if 0 <= index < len(self.blocks) and (phase, self.blocks[index].name) not in self.prefetched:
            unit = self.blocks[index]
            self.prefetched[(phase, unit.name)] = self.comm.all_gather_async(
                self._data(unit, params), tag=unit.name)

    def prefetch_first(self, params: dict, full_flats: dict | None) -> None:
        """A model call starts (stage 3): gather the first block ahead.

        Forward gathers follow layout order whatever this rank runs: entering block i issues every
        block up to i+1 not issued yet (a skipped block's gather is made and dropped), and the call's
        end issues the rest (`finish_call`). So every rank issues the gathers of blocks 0, 1, ..., n-1,
        each once, in that order, even where ranks run different blocks (a branch chosen by rank, a
        block skipped by data), and no gather pairs with another unit's.
        """
        self.issued = -1
        if full_flats is None and self.mode == "autograd" and not in_backward():
            self._issue_upto(0, params)

    def finish_call(self, params: dict, full_flats: dict | None) -> None:
        """A model call ended: issue the gathers of the blocks it skipped at its end (see `prefetch_first`)."""
        if full_flats is None and self.mode == "autograd" and not in_backward():
            self._issue_upto(len(self.blocks) - 1, params)

    def _issue_upto(self, index: int, params: dict) -> None:
        for j in range(self.issued + 1, min(index, len(self.blocks) - 1) + 1):
            self._prefetch("forward", j, params)
        self.issued = max(self.issued, min(index, len(self.blocks) - 1))

    def _gathered(self, unit: UnitLayout, data: torch.Tensor, phase: str, params: dict,
                  recomputed: bool) -> torch.Tensor:
        """Block ``unit``'s full flat buffer (prefetched, or gathered now); prefetch the next block."""
        if self.whole_shards():
            return data
        i = self.position[unit.name]
        if phase == "forward" and i > self.issued:
            self._issue_upto(i, params)  # blocks this rank skipped, and this one
        ready = self.prefetched.pop((phase, unit.name), None)
        full = ready.result() if ready is not None else self.comm.all_gather(data, tag=unit.name)
        if phase == "forward":
            self._issue_upto(i + 1, params)
            if i == len(self.blocks) - 1 and recomputed:
                self._prefetch("backward", i, params)  # backward's recomputes start with the last block
        elif recomputed:
            self._prefetch("backward", i - 1, params)
        return full

    def views(self, unit: UnitLayout, slices: dict, params: dict, full_flats: dict | None,
              recomputed: bool, buffer: ReleasedBuffer | None = None, full: torch.Tensor | None = None) -> dict:
        """What the model sees of ``unit`` this time: views of its full buffer keyed by param,
        differentiable with respect to ``slices`` (this rank's shards)."""
        if buffer is None and self.runs_on_shards():
            return unit.reshaped(slices)
        if self.mode == "functional":
            return self._composable_views(unit, slices, params, full_flats)
        phase = "backward" if in_backward() else "forward"
        if full is None:
            if full_flats is not None:
                full = full_flats[unit.name]
            elif phase == "backward":
                self.backward_begins()
                full = self._gathered(unit, self._data(unit, slices), phase, params, recomputed)
            elif unit.name == ROOT:
                full = self._gathered_now(unit, slices)
            else:
                full = self._gathered(unit, self._data(unit, slices), phase, params, recomputed)
        tensors = tuple(map(slices.__getitem__, unit.keys))
        grad = torch.is_grad_enabled() and any(map(_requires_grad, tensors))
        counted = phase == "forward" and (grad or recomputed)
        use = self._use(unit) if counted or grad else None
        if counted:
            use.uses += 1
        if not grad:
            return dict(zip(unit.keys, unit.strided_views(full)))
        reducer = Reducer(self, unit, use, buffer)
        return dict(zip(unit.keys, apply_function(UnitViews, (dist.Holder(full), unit, self.rank, reducer), tensors)))

    def outside(self, params: dict, full_flats: dict | None) -> Callable[[str], torch.Tensor]:
        """key -> the full parameter, for a block's parameter used outside its block (a weight shared with
        another block or a layer outside, `zfunc.model_structure.OutsideItsBlock`): its unit's views, made on
        demand (stage 3 gathers the unit then) and counted as one more use of the unit, so its gradient
        joins the unit's one reduction. Within one forward, one use per unit and call."""
        unit_of = self.layout.unit_of()
        made: dict[str, dict] = {}

        def resolve(key: str) -> torch.Tensor:
            unit = unit_of[key]
            views = None if in_backward() else made.get(unit.name)
            if views is None:
                slices = {k: params[k] for k in unit.keys}
                full = None
                if full_flats is None and self.mode == "autograd" and not self.runs_on_shards():
                    if in_backward():
                        self.backward_begins()
                    full = self._gathered_now(unit, slices)
                views = self.views(unit, slices, params, full_flats, recomputed=False, full=full)
                if not in_backward():
                    made[unit.name] = views
            return views[key]

        return resolve

    def _composable_views(self, unit: UnitLayout, slices: dict, params: dict, full_flats: dict | None) -> dict:
        if tracing():  # torch.compile: functional collectives (`shard_compiled`)
            return unit_views(self.comm, unit, slices, self.rank, full_flats[unit.name] if full_flats else None)
        flat_shard = unit.cat_shard(slices, self.rank)
        if full_flats is not None:
            full = dist.Replicated.apply(flat_shard, dist.Holder(full_flats[unit.name]), self.comm, unit.name)
        else:
            full = dist.AllGather.apply(flat_shard, self.comm, None, unit.name)
        return unit.full_views(full)

    # -- a block's body -------------------------------------------------------------
    def block_body(self, block: BlockUnit, body: Callable, params: dict, full_flats: dict | None,
                   recomputed: bool, outside: Callable[[str], torch.Tensor] | None = None) -> Callable:
        """``body`` (the block's own forward on its params) run on gathered views of its unit; a
        parameter of the block that belongs to another unit (tied across blocks) comes from ``outside``."""
        unit, mine, foreign = block.unit, block.mine, block.foreign

        def gathered_body(block_params: dict, *args, **kwargs):
            slices = {mine[n]: t for n, t in block_params.items() if n in mine}
            extra = {n: outside(k) for n, k in foreign.items()} if foreign else {}
            release = (full_flats is None and not recomputed and self.reshard == "release"
                       and self.mode == "autograd" and torch.is_grad_enabled() and not in_backward()
                       and not self.whole_shards())
            if release:
                return self._released_body(unit, mine, body, slices, params, args, kwargs, extra)
            views = self.views(unit, slices, params, full_flats, recomputed)
            return run_checked(body, {**{n: views[k] for n, k in mine.items()}, **extra}, args, kwargs, views,
                               unit.name, self.who)

        return gathered_body

    def _released_body(self, unit, local, body, slices, params, args, kwargs, extra=None):
        data = self._data(unit, slices)
        full = self._gathered(unit, data, "forward", params, recomputed=False)
        buffer = ReleasedBuffer(full, data, self.comm, unit.name, before_refill=self.backward_begins)
        self.released[unit.name] = buffer
        i = self.position[unit.name]

        def refill_previous_block():  # prefetch: backward goes through the blocks in reverse
            previous = self.released.get(self.blocks[i - 1].name) if i > 0 else None
            if previous is not None:
                previous.refill(asynchronous=True)

        views = self.views(unit, slices, params, None, recomputed=False, buffer=buffer, full=full)
        block_params = {**{n: views[k] for n, k in local.items()}, **(extra or {})}

        def keep() -> None:  # an output zfunc cannot look inside may hold a view: never release the buffer
            buffer.keep = True

        def run(bp, *a, **kw):
            return run_checked(body, bp, a, kw, views, unit.name, self.who, opaque=keep)

        return around_block(buffer, run, block_params, args, kwargs, refill_previous_block)
