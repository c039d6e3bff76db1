"""A memory plan you can read before running: `plan`, and the actual placement of a state: `describe`.

``zf.plan(step, loss_fn, batch)`` takes the step stack, the loss function (it
calls the model's ``apply_fn``; the model may be built on the meta device), one
rank's batch, the world size and the memory each tier has, and returns a
`MemoryPlan`: per tier (GPU, host, NVMe) and per rank, the bytes of
parameters, gradients, optimizer state, activations and buffers, and the
predicted peak; with ``offload(...)`` in the stack and budgets given, also the
placement that fits (`MemoryPlan.offload_kwargs`).

What is counted, and how (Ψ parameters, N ranks; sizes from the shard layout,
padding included):

- model state, exactly, from the stack's declared facts (`zfunc.facts.Facts`)
  and the shard layout: parameters in the compute dtype (stage 3: this rank's
  shards), gradients kept for the update (stages 2 and 3: shards of the reduce
  dtype, or under `offload` on the tier of each unit's optimizer state, where
  they go as backward makes them; stages 0 and 1: the full gradient; under `accumulate`, its accumulator
  instead, in the accumulation dtype: at stages 2 and 3 each unit's shard on
  the tier of the unit's optimizer state, host memory for NVMe units, and no
  gradient shards beside it; at stages 0 and 1 one full buffer on the GPU
  beside one micro-batch's full gradient), fp32 moments and master (12 bytes
  per parameter, or 8 when the parameters are the fp32 master) split over the
  tiers by the offload shares, whole units at a time (`zfunc.tiers.placement`);
- activations, measured: the loss function runs forward and backward once on
  fake tensors (`torch._subclasses.fake_tensor.FakeTensorMode`: shapes and
  dtypes, no memory, any model size), and the peak of the live bytes it
  allocates is taken, with the model's blocks recomputed when the stack
  recomputes them, leaving out the gradients it returns (counted above,
  where the stack keeps them); one micro-batch at a time, as `accumulate`
  runs them (``choose_micro_batches=True``: the fewest micro-batches that fit);
- buffers, held during a step: at stage 3 the root unit and two block units
  gathered (one in use, one prefetched), a unit's full gradient and its
  reduce-dtype copy in flight (stages 2 and 3 around `pipeline`: the stage's
  units whole and its full gradient for the schedule, `shard_pipelined`), the host update's chunk buffers
  (`zfunc.optim.streamed`), and the process's own resident memory before
  training (``baseline``: torch, the CUDA context).

DeepSpeed's estimators (``estimate_zero3_model_states_mem_needs_*``) count
model states only; activations are most of the memory of a long sequence.
BENCHMARKS.md lists this plan's predicted GPU peaks beside the measured ones.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

import torch

from zfunc.blocks import find_blocks
from zfunc.facts import Facts
from zfunc.interpret import Transform, transforms_of
from zfunc.optim.streamed import CHUNK
from zfunc.plan_activations import measure_activations
from zfunc.tiers.placement import Placement
from zfunc.transforms.accumulate import split_micro_batches
from zfunc.transforms.grad_accumulator import HOST_ADDER_DEPTH, accumulation_dtype
from zfunc.transforms.offload import offload
from zfunc.transforms.pipeline import pipeline
from zfunc.transforms.pipeline_layout import make_pipeline_layout
from zfunc.transforms.shard_layout import ROOT, make_layout
from zfunc.tree import tree_leaves

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class TierBytes:
    """Bytes on one tier of one rank, by kind; ``peak`` is their sum (what must fit).

    ``params``, ``grads`` and ``optimizer`` are what the state keeps between steps (`describe` measures
    the same for a real state); ``activations`` and ``buffers`` (units gathered or reduced in flight,
    the host update's chunk buffers, the process's own memory) are held during a step.
    """

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    buffers: int = 0

    @property
    def peak(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per tier and rank (`TierBytes` for "gpu", "host", "nvme"), what was assumed, and the placement.

    Attributes:
      tiers: ``{"gpu": TierBytes, "host": ..., "nvme": ...}``.
      parameters: Ψ, the trainable parameters.
      world_size: N.
      facts: the stack's facts the plan assumed.
      placement: the optimizer shares (device, host, nvme) and where stage 3 keeps parameters.
      notes: what the plan could not fit, or assumed.
      micro_batches: the forward/backward passes per update this plan assumes (the stack's `accumulate`, or
        the number it chose with ``choose_micro_batches=True``: build the step with
        ``accumulate(step, plan.micro_batches)``, or without `accumulate` at 1).
      fits: whether every tier is within its budget (True where no budget was given).
    """

    tiers: dict[str, TierBytes]
    parameters: int
    world_size: int
    facts: Facts
    placement: dict[str, Any]
    notes: tuple[str, ...] = ()
    micro_batches: int = 1
    fits: bool = True

    @property
    def offload_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `offload` for this plan's placement."""
        out = {k: v for k, v in self.placement.items() if k in ("device_fraction", "nvme_fraction", "params")}
        return out

    def bytes_per_parameter(self, tier: str) -> float:
        return self.tiers[tier].peak / max(1, self.parameters / self.world_size)

    def __str__(self) -> str:
        head = (f"memory plan per rank (GiB): {self.parameters / 1e9:.2f}B parameters, world size {self.world_size}, "
                f"stage {self.facts.stage}, compute {_name(self.facts.compute_dtype)}, "
                f"{self.micro_batches} micro-batch{'es' if self.micro_batches > 1 else ''} per update, "
                f"placement {self.placement}{'' if self.fits else ' (DOES NOT FIT)'}")
        per_param = {t: self.bytes_per_parameter(t) for t in self.tiers}
        return "\n".join([head, format_tiers(self.tiers, per_param), *(f"note: {n}" for n in self.notes)])


class Tiers(dict):
    """``{"gpu": TierBytes, "host": ..., "nvme": ...}`` that prints as a table (what `describe` returns)."""

    def __str__(self) -> str:
        return format_tiers(self)


def format_tiers(tiers: dict[str, TierBytes], per_param: dict[str, float] | None = None) -> str:
    """A table of bytes per tier and kind, in GiB (and bytes per parameter when given)."""
    rows = [("tier", "params", "grads", "optimizer", "activations", "buffers", "peak",
             *(("bytes/param",) if per_param else ()))]
    for name, t in tiers.items():
        rows.append((name, *(f"{x / GiB:.2f}" for x in (t.params, t.grads, t.optimizer, t.activations,
                                                          t.buffers, t.peak)),
                     *((f"{per_param[name]:.1f}",) if per_param else ())))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def _name(dtype: torch.dtype | None) -> str:
    return "fp32" if dtype is None else str(dtype).removeprefix("torch.")


def plan(step: Transform | Callable, loss_fn: Callable, batch: Any, params: dict[str, torch.Tensor], *,
         world_size: int | None = None, blocks: list[str] | None = None, units: list[str] | None = None,
         gpu_bytes: int | None = None, host_bytes: int | None = None, nvme_bytes: int | None = None,
         measure: bool = True, baseline: int | None = None, fit: bool = True, pp_rank: int = 0,
         choose_micro_batches: bool = False) -> MemoryPlan:
    """The memory plan of ``step`` (see the module docstring).

    Args:
      step: the transformed step (its stack's facts say what is sharded, cast, offloaded, recomputed).
      loss_fn: ``loss_fn(params, batch) -> loss``, calling the model's ``apply_fn`` (measured on fake tensors).
      batch: one rank's batch for one micro-batch (tensors, or ``torch.empty`` shapes; any device).
      params: the model's trainable parameters (`zf.functional`'s; meta tensors are enough).
      world_size: N, the ranks shard partitions over (default: shard's group, e.g. a mesh's dp dim; else the
        current process group's size).
      blocks, units: the model's blocks (default: recorded on ``params`` by `zf.functional`) and shard's
        ``units=`` if given.
      gpu_bytes, host_bytes, nvme_bytes: what each tier may hold per rank; with them and `offload` in
        the stack, the plan chooses the optimizer shares and where parameters live (``placement``).
      measure: measure activations (else they count as 0).
      fit: with budgets, choose the placement (else describe the placement the stack declares).
      baseline: the process's resident bytes before training (default: measured now).
      pp_rank: under `pipeline`, the pipeline rank whose stages are planned (their parameters only);
        activations are measured on the whole model for one micro-batch (``batch``): an upper bound for a
        stage's.
      choose_micro_batches: ``batch`` is then one rank's batch for a whole update, and the plan splits it
        into the fewest micro-batches ``k`` (dividing its dim 0, `accumulate`'s rule) whose plan fits the
        budgets: bigger micro-batches keep the GPU busier, and at ``k = 1`` no gradient accumulator exists
        (4 bytes per parameter of fp32 sums, on the optimizer's tiers), which at billions of parameters
        outweighs the larger micro-batch's activations. The stack's own `accumulate` (if any) is replaced
        by the candidate's in the arithmetic; ``plan.micro_batches`` says what was chosen, and a note what
        was tried. None fitting: the candidate the fewest bytes over the budgets, with ``fits`` False.
    Returns:
      The `MemoryPlan`.
    """
    if choose_micro_batches:
        return _choose_micro_batches(step, loss_fn, batch, params, world_size=world_size, blocks=blocks,
                                     units=units, gpu_bytes=gpu_bytes, host_bytes=host_bytes,
                                     nvme_bytes=nvme_bytes, measure=measure, baseline=baseline, fit=fit,
                                     pp_rank=pp_rank)
    return _plan(step, loss_fn, batch, params, world_size=world_size, blocks=blocks, units=units,
                 gpu_bytes=gpu_bytes, host_bytes=host_bytes, nvme_bytes=nvme_bytes, measure=measure,
                 baseline=baseline, fit=fit, pp_rank=pp_rank)


def _choose_micro_batches(step, loss_fn, batch, params, **kwargs) -> MemoryPlan:
    """`plan` with ``choose_micro_batches=True``: the fewest micro-batches whose plan fits."""
    rows = {leaf.shape[0] for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor) and leaf.dim()}
    if len(rows) != 1:
        raise ValueError(f"zf.plan(choose_micro_batches=True) splits the batch along dim 0, so every tensor in it "
                         f"needs the same leading size; got {sorted(rows) or 'no tensors'}")
    (n,) = rows
    baseline = kwargs.pop("baseline")
    baseline = _resident_bytes() if baseline is None else baseline  # (one baseline for every candidate)
    budgets = {"gpu": kwargs["gpu_bytes"], "host": kwargs["host_bytes"], "nvme": kwargs["nvme_bytes"]}

    def missing(candidate: MemoryPlan) -> int:
        return sum(max(0, t.peak - budgets[name]) for name, t in candidate.tiers.items() if budgets[name] is not None)

    tried, best = [], None
    for k in (k for k in range(1, n + 1) if n % k == 0):
        candidate = _plan(step, loss_fn, split_micro_batches(batch, k)[0], params, micro_batches=k,
                          baseline=baseline, **kwargs)
        tried.append(f"{k} ({'fits' if candidate.fits else f'{missing(candidate) / GiB:.1f} GiB over'})")
        if best is None or (candidate.fits, -missing(candidate)) > (best.fits, -missing(best)):
            best = candidate
        if candidate.fits:
            break
    k = best.micro_batches
    how = "the fewest that fit" if best.fits else "none fits: the one closest to fitting"
    note = f"micro-batches: chose {k} of {n // k} rows each, {how}; tried " + ", ".join(tried)
    return dataclasses.replace(best, notes=(*best.notes, note))


def _plan(step, loss_fn, batch, params, *, world_size, blocks, units, gpu_bytes, host_bytes, nvme_bytes, measure,
          baseline, fit, pp_rank, micro_batches: int | None = None) -> MemoryPlan:
    """`plan` for one micro-batch ``batch`` (``micro_batches``: instead of the stack's `accumulate`)."""
    facts = step.stack.facts if isinstance(step, Transform) else Facts()
    splitting = step.stack.transforms if isinstance(step, Transform) else ()
    if micro_batches is not None:
        facts = facts.replace(micro_batches=micro_batches, accumulates=micro_batches > 1)
    if world_size is None:
        import torch.distributed as tdist

        world_size = tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1
        for transform in splitting:  # on a mesh, shard partitions over its dp group (world / (tp * pp))
            world_size = transform.partition_ranks() or world_size
    blocks_of, ties_of = getattr(params, "blocks", None), dict(getattr(params, "ties", {}))
    for transform in splitting:  # tensor_parallel: one rank holds 1/tp of the split parameters
        params = transform.rank_params(params)
    if blocks is None:
        blocks = blocks_of
    stage = facts.stage
    blocks = blocks if blocks is not None else getattr(params, "blocks", None)
    borrowed, model_params, model_blocks = 0, params, blocks  # (activations: measured on the whole model)
    if facts.pp > 1:  # one pipeline rank's stages: their parameters only, shard over the dp ranks
        params, blocks, borrowed = _pipeline_stage(step, params, ties_of, blocks, facts.pp, pp_rank)
    layout = make_layout(params, max(stage, 1), world_size, 0, units, blocks)
    psi = sum(u.numel for u in layout.units)
    compute = facts.compute_dtype or next(iter(params.values())).dtype
    cb = _bytes(compute)
    reduce_b = _bytes(facts.reduce_dtype or compute)
    shard_elems = sum(u.shard_size for u in layout.units)
    master_b = 4 if facts.compute_dtype not in (None, torch.float32) else 0  # a separate fp32 master
    opt_b = 8 + master_b  # m and v (+ the master) per parameter, fp32
    biggest_block = max((u.padded for u in layout.units if u.name != ROOT), default=0)
    root = sum(u.padded for u in layout.units if u.name == ROOT)
    activations = measure_activations(loss_fn, batch, model_params, compute, facts.recompute, model_blocks) \
        if measure else 0
    notes = []
    baseline = _resident_bytes() if baseline is None else baseline
    # `accumulate`'s accumulator: at stages 2 and 3 fed unit by unit, on each unit's optimizer tier (its bytes
    # per element, ``acc_b``, go with the optimizer shares below; the gradient shards are not kept beside it).
    acc_b = _bytes(accumulation_dtype(facts.accumulate_dtype, compute) or compute) if facts.accumulates else 0
    # One micro-batch under `offload` at stages 2/3: each unit's reduced gradient goes to its optimizer state's
    # tier as it is made, in the reduce dtype (nothing to sum), like an accumulator of that dtype.
    sunk = reduce_b if stage >= 2 and facts.pp == 1 and any(isinstance(t, offload) for t in splitting) else 0
    per_unit = (acc_b or sunk) if stage >= 2 else 0
    kept_grads = 0 if per_unit else reduce_b  # gradient shards kept until the update (stages 2 and 3)

    def on_gpu(params_tier: str) -> tuple[int, int, int]:
        """(params, grads, in flight) on the GPU: what the state holds between steps and what a step holds
        for a while (units gathered or reduced in flight). A per-unit accumulator is counted with the
        optimizer shares, not here."""
        padded = sum(u.padded for u in layout.units) * cb  # stages 1 and 2 keep the whole (padded) parameters
        lent = borrowed * 2 * cb  # a tied weight another stage owns, lent for the step, and its gradient
        if facts.pp > 1 and stage >= 2:
            # Around a pipeline (`shard_pipelined`): the stage's units whole for the schedule (stage 3 gathers
            # them), its gradient full (summed over the micro-batches), then two units' packed gradients and
            # their reduce-dtype copies while they are reduced.
            biggest = max(u.padded for u in layout.units)
            step_bytes = psi * cb + 2 * biggest * (cb + reduce_b) + lent
            if stage == 3:
                return ((shard_elems if params_tier == "device" else 0) * cb, shard_elems * kept_grads,
                        padded + step_bytes)
            return padded, shard_elems * kept_grads, step_bytes
        if stage == 3:
            return ((shard_elems if params_tier == "device" else 0) * cb, shard_elems * kept_grads,
                    (root + 2 * biggest_block) * cb + biggest_block * (cb + reduce_b))
        if stage == 2:
            return padded, shard_elems * kept_grads, biggest_block * (cb + reduce_b) + lent
        full_grads = psi * (cb + acc_b)  # (with accumulate: its full buffer and one micro-batch's gradient)
        return (padded, full_grads, lent) if stage == 1 else (psi * cb, full_grads, lent)

    split, params_tier = facts.optimizer_split, facts.params_tier
    offloading = facts.optimizer_tier != "device" or split != (1.0, 0.0, 0.0)
    # Summed on the host (`accumulate`), a unit's gradient goes down through a page-locked staging buffer
    # (`HostAdder`: those waiting and the one being added), which torch's pinned-memory cache rounds up to a power
    # of two and keeps. At one micro-batch it lands straight in its own buffer (page-locked in place, exactly its
    # size: `zfunc.tiers.landing`), already counted with the gradients: no staging.
    biggest_shard = max(u.shard_size for u in layout.units)
    staging = (HOST_ADDER_DEPTH + 1) * _power_of_two(biggest_shard * reduce_b) if acc_b and stage >= 2 and offloading \
        else 0
    fits = True
    if fit and offloading and gpu_bytes is not None and stage >= 1:
        split, params_tier, fit_notes, fits = _fit(on_gpu, shard_elems, biggest_shard, opt_b, cb, activations, stage == 3,
                                             gpu_bytes, host_bytes, nvme_bytes, baseline + staging, per_unit,
                                             "gradient accumulators" if acc_b else "gradients")
        notes += fit_notes
    placement = Placement([(u.name, u.shard_size) for u in layout.units], split, torch.device("cpu"), params_tier)
    share = {tier: sum(u.shard_size for u in layout.units if placement.tiers[u.name] == tier)
             for tier in ("device", "host", "nvme")}
    if stage == 0:
        share = {"device": psi, "host": 0, "nvme": 0} if not offloading else {"device": 0, "host": psi, "nvme": 0}
    gpu_params, gpu_grads, in_flight = on_gpu(params_tier)
    # (the streamed update's chunk buffers and the gradients' staging buffers, where units live off the GPU)
    chunk_buffers = _CHUNK_BUFFERS * min(CHUNK, max(shard_elems, 1)) * 4 + staging if share["host"] + share["nvme"] \
        else 0
    tiers = {
        "gpu": TierBytes(gpu_params, gpu_grads + share["device"] * per_unit, share["device"] * opt_b, activations,
                         in_flight),
        "host": TierBytes((shard_elems * cb if params_tier == "host" and stage == 3 else 0),
                          (share["host"] + share["nvme"]) * per_unit,  # (NVMe units' accumulators: host memory)
                          share["host"] * opt_b, 0, chunk_buffers + baseline),
        "nvme": TierBytes(0, 0, share["nvme"] * opt_b, 0, 0),
    }
    for tier, budget in (("gpu", gpu_bytes), ("host", host_bytes), ("nvme", nvme_bytes)):
        if budget is not None and tiers[tier].peak > budget:
            fits = False
            notes.append(f"{tier}: the plan needs {tiers[tier].peak / GiB:.1f} GiB, {budget / GiB:.1f} GiB is "
                         f"there: {(tiers[tier].peak - budget) / GiB:.2f} GiB ({tiers[tier].peak - budget} bytes) "
                         "missing")
    device_fraction = share["device"] / max(1, shard_elems)
    nvme_fraction = share["nvme"] / max(1, shard_elems)
    return MemoryPlan(tiers, psi, world_size, facts,
                      # (exact: rounded, a fraction could leave the last unit it covers to the next tier)
                      {"device_fraction": device_fraction, "nvme_fraction": nvme_fraction,
                       "params": params_tier}, tuple(notes), facts.micro_batches, fits)


def _pipeline_stage(step, params: dict, ties: dict, blocks, pp: int, pp_rank: int):
    """``(params, blocks, borrowed elements)`` of pipeline rank ``pp_rank``'s stages (`pipeline`'s layout)."""
    transform = next(t for t in transforms_of(step) if isinstance(t, pipeline))
    if blocks is None:
        blocks = find_blocks({k: v.numel() for k, v in params.items()})
    layout = make_pipeline_layout(list(params), sorted(ties.items()), list(blocks), {k: tuple(v.shape) for k, v in params.items()},
                                  transform.stages, pp, pp_rank, transform.schedule)
    mine = set(layout.local_stages)
    borrowed = sum(params[k].numel() for k, users in layout.borrowers if mine & set(users))
    return {k: params[k] for k in layout.keys}, list(layout.blocks), borrowed


_CHUNK_BUFFERS = 4  # the streamed host update's double-buffered chunks: gradients in, parameters out


def _power_of_two(n: int) -> int:
    """``n`` rounded up to a power of two (how torch's pinned-memory cache sizes its blocks)."""
    return 1 << max(0, (n - 1).bit_length())
_GPU_SLACK = 0.92  # of the GPU budget, the rest for the caching allocator's fragmentation
_HOST_SLACK = 0.90  # of the host budget, the rest for the page cache and the data loader


def _fit(on_gpu, shard_elems, biggest_unit, opt_b, cb, activations, stage3, gpu_bytes, host_bytes, nvme_bytes, baseline,
         acc_b=0, grads_name="gradient accumulators"):
    """The optimizer shares and parameter tier that fit the budgets: the GPU first, then the host, then NVMe
    (with the notes to print, and whether host and NVMe hold what they are given);
    at stage 3, parameters move to the host only when the GPU cannot hold them with the activations. A unit's
    gradient accumulator (``acc_b`` bytes per element, `accumulate` at stages 2/3) lives with its optimizer
    state, and in host memory for a unit on NVMe."""
    notes = []
    params_tier = "device"
    room = gpu_bytes * _GPU_SLACK - sum(on_gpu("device")) - activations
    if room < 0 and stage3:
        params_tier, room = "host", gpu_bytes * _GPU_SLACK - sum(on_gpu("host")) - activations
        notes.append("parameters kept on the host: the GPU cannot hold them with the activations")
    device_share = max(0.0, min(1.0, room / max(1, shard_elems * (opt_b + acc_b))))
    rest = 1.0 - device_share
    host_room = (host_bytes if host_bytes is not None else math.inf) * _HOST_SLACK - baseline - \
        (shard_elems * cb if params_tier == "host" else 0) - _CHUNK_BUFFERS * min(CHUNK, shard_elems) * 4
    # The host holds the accumulators of every unit off the GPU, and the optimizer state of those not on NVMe.
    host_room -= rest * shard_elems * acc_b
    fits = host_room >= 0
    if not fits:
        notes.append(f"host: the {grads_name} of the units off the GPU need {rest * shard_elems * acc_b / GiB:.2f} "
                     f"GiB of host memory; {-host_room / GiB:.2f} GiB ({int(-host_room)} bytes) missing")
    host_share = max(0.0, min(rest, host_room / max(1, shard_elems * opt_b)))
    nvme_share = max(0.0, rest - host_share)
    if nvme_share > 0:
        # Units are placed whole, NVMe filled up to its share from the last unit back, and what is left
        # goes to the host: one more unit's room on NVMe keeps the host within its share.
        nvme_share = min(rest, nvme_share + biggest_unit / max(1, shard_elems))
        notes.append("optimizer state on NVMe: give offload(..., nvme_dir=...) a directory on a local NVMe drive")
    if nvme_share > 0 and nvme_bytes is not None and nvme_share * shard_elems * opt_b > nvme_bytes:
        fits = False
        missing = nvme_share * shard_elems * opt_b - nvme_bytes
        notes.append(f"the optimizer state does not fit on GPU, host and NVMe together: nvme is short of "
                     f"{missing / GiB:.2f} GiB ({int(missing)} bytes)")
    return (device_share, 1.0 - device_share - nvme_share, nvme_share), params_tier, notes, fits


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _resident_bytes() -> int:
    """This process's resident memory now (Linux), 0 where unknown."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# ---------------------------------------------------------------------------
# The actual placement of a state.


def describe(state) -> Tiers:
    """Bytes of ``state`` per tier ("gpu", "host", "nvme": a file-backed host tensor) and kind, as placed now.

    Parameters are ``state.params``; the optimizer state is ``state.opt_state`` plus the param-shaped
    entries of ``state.extras`` (masters). Each storage counts once.
    """
    seen: set[int] = set()
    totals = {t: {"params": 0, "optimizer": 0} for t in ("gpu", "host", "nvme")}

    def add(tree, kind: str) -> None:
        for t in tree_leaves(tree):
            if not isinstance(t, torch.Tensor) or not t.numel() or t.is_meta:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            tier = "gpu" if t.device.type == "cuda" else ("nvme" if _file_backed(storage) else "host")
            totals[tier][kind] += storage.nbytes()

    add(state.params, "params")
    add((state.opt_state, state.extras), "optimizer")
    return Tiers({t: TierBytes(params=v["params"], optimizer=v["optimizer"]) for t, v in totals.items()})


def _file_backed(storage) -> bool:
    try:
        return bool(storage.filename)
    except (AttributeError, RuntimeError):
        return False


def _plan_method(self: Transform, loss_fn: Callable, batch: Any, params: dict, **budgets: Any) -> MemoryPlan:
    """The memory plan of this stack per tier and rank: ``zf.plan(step, loss_fn, batch, params, **budgets)``."""
    return plan(self, loss_fn, batch, params, **budgets)


# ``step.plan(...)``: attached by the planner, which sits above the interpreter (`Transform` cannot import it).
Transform.plan = _plan_method
