"""Where `accumulate` sums micro-batch gradients: one accumulator per gradient call.

A `GradAccumulator` holds the running sum ``Σ_i g_i`` of the k micro-batch
gradients of one ``value_and_grad`` call, in the accumulation dtype (fp32
by default when the model computes in bf16/fp16: `accumulation_dtype`), and
hands their mean ``(1/k) Σ_i g_i`` to the update. Gradients reach it two ways:

- **per unit, as backward makes them** (`add_unit`): under `shard` stages 2
  and 3 each unit's reduced gradient (this rank's 1-D shard) is added as soon
  as its reduction lands, into one flat buffer per unit *on the tier where the
  unit's optimizer state lives* (the GPU, host memory for host units, host
  memory for NVMe units too: the update pages their state in chunk by chunk).
  A GPU gradient bound for the host goes down on a copy stream and is added
  by a host thread (`HostAdder`), so backward keeps issuing kernels.
  The unit's full-size gradient is freed then, so no full-model gradient
  buffer exists beside the accumulator; the update reads the buffer directly.
- **as a tree, after each micro-batch** (`add_tree`): every other gradient
  (the plain step, stage 1, a compiled step): into one flat buffer per device
  (Megatron's ``main_grad``), on the device backward made them on; under
  `offload` without `shard`, in host memory where the optimizer state is.

The first contribution to a buffer is a cast copy (``0 + g = g`` exactly),
later ones ``acc += g`` in the accumulation dtype; the order of the sum is the
order of the micro-batches, as before. When the accumulation dtype equals the
gradients' (fp32 compute, or the ``dtype=torch.bfloat16`` opt-in) the first
micro-batch's gradients are taken as the buffers themselves where they already
lie on the right tier, as they always were.

One micro-batch (`offload` under `shard` stages 2/3 without `accumulate`) uses
the same sink with the gradients' own dtype and ``sums=False``: nothing is
summed, so moving a bf16 gradient to its optimizer's tier as it is made is
exact, and costs 2 bytes per element there instead of 4. A GPU gradient then
goes straight into its host buffer, which is page-locked once
(`zfunc.tiers.placement.page_locked_empty`), on a copy stream with one event per
unit (`zfunc.tiers.landing.HostLanding`): no staging buffer, no host thread,
and backward never waits; whoever reads it on the host waits for its event
first (the update unit by unit, anything else through `ReadGuard`).

Host buffers come from a `HostBuffers` the stack keeps between its calls:
fresh host memory costs a page fault per 4 KiB page at first touch (measured
on a CPU: 1 GB/s into fresh memory, 10 GB/s into memory touched before), which
at 13B parameters is tens of seconds a step.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from zfunc.compiled import tracing
from zfunc.tiers.landing import HostLanding, ReadGuard
from zfunc.tiers.placement import page_locked_empty
from zfunc.transforms.shard_layout import UnitLayout, map_param_shaped
from zfunc.tree import tree_flatten, tree_unflatten

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
HOST_ADDER_DEPTH = 2  # gradients waiting for the host to add them before backward waits (`HostAdder`)


def accumulation_dtype(requested: torch.dtype | None, compute: torch.dtype | None) -> torch.dtype | None:
    """The dtype micro-batch gradients are summed in: ``requested`` if given, else fp32 when the
    compute dtype is narrower than fp32, else the compute dtype (None: the gradients' own)."""
    if requested is not None:
        return requested
    if compute is not None and compute.is_floating_point and torch.finfo(compute).bits < 32:
        return torch.float32
    return compute


def narrower(dtype: torch.dtype, than: torch.dtype) -> bool:
    """Whether summing ``than`` gradients in ``dtype`` loses range or precision (fewer bits, or the
    same bits laid out otherwise: fp16 and bf16 each lose what the other keeps)."""
    a, b = torch.finfo(dtype), torch.finfo(than)
    return a.bits < b.bits or (a.bits == b.bits and dtype != than)


def optimizer_devices(state) -> dict[str, torch.device]:
    """key -> where its optimizer state lives (the first param-shaped dict of the optimizer state, then
    of the extras (an fp32 master), else the parameter itself): where its accumulator goes."""
    keys = set(state.params)
    found: dict[str, torch.device] = {}

    def note(d: dict) -> dict:
        for k, t in d.items():
            found.setdefault(k, t.device)
        return d

    map_param_shaped(state.opt_state, keys, note)
    map_param_shaped(dict(state.extras), keys, note)
    for k, p in state.params.items():
        found.setdefault(k, p.device)
    return found


class GradAccumulator:
    """The running sum of one gradient call's micro-batch gradients (see the module docstring).

    Args:
      dtype: the accumulation dtype (None: each gradient's own).
      places: returns key -> the device of its optimizer state (`optimizer_devices`), for per-unit
        buffers; asked once, when the first unit arrives.
      tree_on_optimizer_tier: sum the gradients not fed per unit on their optimizer state's tier too
        (the update runs on them where they are: `offload` without `shard`).
      host_buffers: where host buffers come from and go back to at `release` (None: fresh each call).
      sums: False for one micro-batch (each unit's gradient arrives once, nothing is summed): a GPU gradient
        bound for the host is then copied straight into a page-locked host buffer (`HostLanding`).
    """

    def __init__(self, dtype: torch.dtype | None, places: Callable[[], dict[str, torch.device]],
                 tree_on_optimizer_tier: bool = False, host_buffers: HostBuffers | None = None,
                 sums: bool = True) -> None:
        self.dtype, self._places, self.tree_on_optimizer_tier = dtype, places, tree_on_optimizer_tier
        self.places: dict[str, torch.device] | None = None
        self.host_buffers, self.sums = host_buffers, sums
        self.taken: list[tuple[torch.Tensor, bool]] = []  # (host buffer, page-locked) drawn during this call
        # Gradients on their way into host buffers (``sums=False``), and the guard of their readers: they live
        # for the whole call (a second gradient call in one step waits for the first one's, `settle`).
        self.landing: HostLanding | None = None
        self.guard: ReadGuard | None = None
        self.begin()

    def begin(self) -> None:
        """A gradient call starts: nothing summed yet."""
        self.units: dict[str, dict[str, torch.Tensor]] = {}  # unit name -> per-key views of its flat buffer
        self.flats: dict[str, torch.Tensor] = {}  # unit name -> its flat buffer
        self.fed: set[str] = set()  # keys whose gradient arrives per unit
        self.tree: dict[str, torch.Tensor] = {}  # the other keys' sums
        self.host_adder: HostAdder | None = None  # sums GPU gradients into host buffers off backward's thread
        self.handed: dict[int, torch.Tensor] = {}  # the sums `mean` handed out, by identity

    def add_unit(self, unit: UnitLayout, rank: int, shard: torch.Tensor) -> None:
        """``acc[unit] += shard`` (this rank's reduced flat shard), on the unit's optimizer tier.

        Called during backward (on autograd's thread), once per unit and micro-batch; ``shard`` may be
        freed by the caller afterwards.
        """
        flat = self.flats.get(unit.name)
        first = flat is None
        if first:
            if self.places is None:
                self.places = self._places()
            device = self.places.get(unit.keys[0], shard.device)
            dtype = self.dtype or shard.dtype
            # One micro-batch, from the GPU to the host: straight into a page-locked buffer (the module docstring).
            lands = not self.sums and dtype == shard.dtype and crosses_to_host(shard, device)
            # The reduced shard itself where it is already the sum (fresh from the reduction, or the unit's own
            # summed gradient at one rank), else a buffer on the tier.
            taken = not lands and dtype == shard.dtype and device == shard.device and shard.dim() == 1 \
                and shard.is_contiguous()
            flat = self.flats[unit.name] = shard if taken else self._empty(shard.numel(), dtype, device, lands)
            self.units[unit.name] = unit.shard_views(flat, rank)
            self.fed.update(unit.keys)
            if taken:
                return
            if lands:
                if self.landing is None:
                    self.landing = HostLanding(shard.device)
                self.landing.copy(flat, shard.reshape(-1))
                return
        self._sum(flat, shard, first)

    def add_tree(self, grads: dict[str, torch.Tensor]) -> None:
        """``acc[k] += grads[k]`` for every key not fed per unit."""
        rest = {k: g for k, g in grads.items() if k not in self.fed}
        if not rest:
            return
        fresh = {k: g for k, g in rest.items() if k not in self.tree}
        if fresh:
            self.tree.update(self._buffers(fresh))
        for k, g in rest.items():
            if self.tree[k] is not g:
                self._sum(self.tree[k], g, first=k in fresh)

    def _buffers(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Where ``grads`` are summed: themselves where they are already in the accumulation dtype, where
        the sum goes, and writable (fresh from backward: ours), else one new flat buffer per device."""
        out: dict[str, torch.Tensor] = {}
        new: dict[torch.device, list[str]] = {}
        taken: list[tuple[int, int, int]] = []  # the memory of the gradients taken as buffers
        reuse = not tracing()  # (a compiled step has no memory addresses to compare: new buffers there)
        for k, g in grads.items():
            device = self._tree_place(k, g)
            if reuse and self.dtype in (None, g.dtype) and device == g.device and not _broadcast(g) \
                    and not _overlaps(g, taken):
                out[k] = g
            else:
                new.setdefault(device, []).append(k)
        for device, keys in new.items():
            dtype = self.dtype or grads[keys[0]].dtype
            flat = self._empty(sum(grads[k].numel() for k in keys), dtype, device)
            start = 0
            for k in keys:
                g = grads[k]
                out[k] = flat[start:start + g.numel()].view(g.shape)
                start += g.numel()
        return out

    def _tree_place(self, key: str, grad: torch.Tensor) -> torch.device:
        """Where a tree gradient is summed: on its optimizer state's tier when the update runs on full
        gradients (``offload`` without ``shard``), else where backward made it (stage 1 reduces the sum)."""
        if not self.tree_on_optimizer_tier:
            return grad.device
        if self.places is None:
            self.places = self._places()
        return self.places.get(key, grad.device)

    def _sum(self, acc: torch.Tensor, grad: torch.Tensor, first: bool) -> None:
        if self.landing is not None:  # (a unit fed twice without summing: the first copy must have landed)
            self.landing.wait(acc)
        if acc.device == grad.device:
            _sum_into(acc, grad, first)
        elif grad.device.type == "cuda":  # into host memory: down on a copy stream, summed by a host thread
            if self.host_adder is None:
                self.host_adder = HostAdder(grad.device)
            self.host_adder.add(acc, grad, first)
        else:
            _sum_into(acc, grad.to(acc.device), first)

    def mean(self, k: int, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``(1/k) Σ_i g_i``, keyed like ``like`` (the last micro-batch's gradients); the buffers are
        handed over (divided in place), and the accumulator is empty again."""
        if self.host_adder is not None:
            self.host_adder.finish()
        out: dict[str, torch.Tensor] = {}
        for views in self.units.values():
            out.update(views)
        out.update((key, t) for key, t in self.tree.items() if key not in out)
        if k != 1:
            for flat in self.flats.values():
                flat.div_(k)
            for key, t in self.tree.items():
                if key not in self.fed:
                    t.div_(k)
        result = {key: out[key] for key in like}
        self.begin()
        if not tracing():
            self.handed = {id(t): t for t in result.values()}
        return result

    def guard_reads(self) -> None:
        """The gradients `mean` handed out may still be landing: until the update takes them (`unguard`), any
        torch operation that reads one waits for it first (`ReadGuard`)."""
        if self.landing is not None and self.landing.pending and self.guard is None:
            self.guard = ReadGuard(self.landing).push()

    def unguard(self) -> None:
        """The host work that waits for each gradient itself (offload's update) takes over from the guard."""
        if self.guard is not None:
            self.guard.remove()
            self.guard = None

    def settle(self) -> None:
        """Every gradient has landed (a host wait), and the guard is gone."""
        self.unguard()
        if self.landing is not None:
            self.landing.wait_all()

    def release(self) -> None:
        """The call has ended (its update has read the sums): everything has landed (gradients the step returns
        are complete); give the host buffers back for the next call (`HostBuffers.give_back` keeps only those
        nothing else holds)."""
        self.settle()
        if self.host_adder is not None:
            self.host_adder.finish()
        self.begin()
        taken, self.taken = self.taken, []
        if self.host_buffers is not None:
            self.host_buffers.give_back(taken)

    def _empty(self, n: int, dtype: torch.dtype, device: torch.device, page_locked: bool = False) -> torch.Tensor:
        """A flat buffer of ``n`` elements on ``device``: from the kept host buffers on the host (page-locked ones
        for gradients that land there straight from a GPU)."""
        if device.type != "cpu":
            return _empty(n, dtype, device)
        if self.host_buffers is None:
            return page_locked_empty(n, dtype) if page_locked else _empty(n, dtype, device)
        buffer = self.host_buffers.take(n, dtype, page_locked)
        self.taken.append((buffer, page_locked))
        return buffer

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is one of the sums `mean` handed out: the step's own buffer, which the update may
        consume in place (fp16's unscaling, instead of a copy the size of the accumulator)."""
        return bool(self.handed) and self.handed.get(id(t)) is t  # (nothing is handed out while compiling)


class HostBuffers:
    """Host buffers a stack keeps from one call to the next (see the module docstring): what one call's
    accumulators took, given back at its end, taken again by the next call asking for the same sizes.

    A buffer goes back only if nothing outside zfunc still holds it or a view of it (a step that returned
    its gradients in its metrics keeps them; the next call then takes fresh memory), so reuse can never
    overwrite a tensor the user sees. What one call did not take again is dropped at its end: the kept
    memory is at most one call's buffers. Safe across threads running calls of one stack at once.

    Page-locked buffers (`page_locked_empty`) are registered once, when made, and kept registered while kept;
    one that is dropped is unregistered when its last holder lets it go (a view the user still holds stays
    valid memory).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[int, torch.dtype, bool], list[torch.Tensor]] = {}

    def take(self, n: int, dtype: torch.dtype, page_locked: bool = False) -> torch.Tensor:
        """A host buffer of ``n`` elements of ``dtype`` (a kept one if there is one; its values are stale),
        page-locked if asked."""
        with self._lock:
            free = self._free.get((n, dtype, page_locked))
            if free:
                return free.pop()
        return page_locked_empty(n, dtype) if page_locked else _empty(n, dtype, torch.device("cpu"))

    def give_back(self, buffers: list[tuple[torch.Tensor, bool]]) -> None:
        """Keep ``buffers`` (``(buffer, page-locked)`` pairs, as taken) for the next call (those held elsewhere
        are left alone), and drop the rest."""
        kept: dict[tuple[int, torch.dtype, bool], list[torch.Tensor]] = {}
        for buffer, page_locked in buffers:
            if _held_only_here(buffer):
                kept.setdefault((buffer.numel(), buffer.dtype, page_locked), []).append(buffer)
        with self._lock:
            self._free = kept

    def kept_bytes(self) -> int:
        """The bytes kept for the next call."""
        with self._lock:
            return sum(b.numel() * b.element_size() for free in self._free.values() for b in free)


def kept_host_buffers(ctx) -> HostBuffers | None:
    """The host gradient buffers the running step's stack keeps between its calls (None while torch.compile
    traces a step: the compiled step's buffers are its graph's)."""
    if tracing():
        return None
    return ctx.stack.kept.setdefault("host gradient buffers", HostBuffers())


def _held_only_here(buffer: torch.Tensor) -> bool:
    """Whether ``buffer`` is the only tensor on its memory (no view of it is alive anywhere), so that writing
    into it later can change nothing anybody sees. Unknown (an older torch): no."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    # (``untyped_storage()`` makes one more reference of its own while it is asked)
    return use_count(buffer.untyped_storage()._cdata) == 2


def crosses_to_host(grad: torch.Tensor, dest: torch.device) -> bool:
    """Whether ``grad`` goes to host memory ``dest`` from a GPU, through a copy engine."""
    return grad.device.type == "cuda" and dest.type == "cpu"


def keyed_grads(grads: Any) -> tuple[dict, Callable[[dict], Any]]:
    """``grads`` as a dict (params are a dict of names almost always; any other pytree is keyed by leaf
    position) and the function that rebuilds the original structure from such a dict."""
    if isinstance(grads, dict):
        return grads, lambda d: d
    leaves, treedef = tree_flatten(grads)
    return {str(i): g for i, g in enumerate(leaves)}, lambda d: tree_unflatten(treedef, list(d.values()))


class HostAdder:
    """Sums gradients made on a GPU into host buffers without holding back the thread that runs backward
    (which must keep issuing the next unit's kernels): each gradient is copied down on a copy stream into a
    page-locked staging buffer, and one worker thread adds it into its buffer once the copy has landed, in
    the order the gradients came (so every buffer's sum is taken in micro-batch order, as on the GPU). At
    most ``depth`` gradients wait at once: backward then waits for the host to catch up."""

    def __init__(self, device: torch.device, depth: int = HOST_ADDER_DEPTH) -> None:
        self.device, self.depth = device, depth
        self.stream = torch.cuda.Stream(device)
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="zfunc-grad-accumulator")
        self.pending: deque[Future] = deque()

    def add(self, flat: torch.Tensor, grad: torch.Tensor, first: bool) -> None:
        staging = torch.empty(grad.numel(), dtype=grad.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the gradient was made there
        with torch.cuda.stream(self.stream):
            staging.copy_(grad, non_blocking=True)
            grad.record_stream(self.stream)  # the caller drops it now: its memory waits for this copy
            landed = torch.cuda.Event()
            landed.record(self.stream)

        def accumulate() -> None:
            landed.synchronize()
            _sum_into(flat, staging, first)

        while len(self.pending) >= self.depth:
            self.pending.popleft().result()
        self.pending.append(self.worker.submit(accumulate))

    def finish(self) -> None:
        """Wait until every gradient is summed (errors of the worker are raised here)."""
        try:
            while self.pending:
                self.pending.popleft().result()
        finally:
            self.worker.shutdown(wait=True)


def _sum_into(acc: torch.Tensor, grad: torch.Tensor, first: bool) -> None:
    """``acc ← grad`` (cast) for the first contribution, else ``acc ← acc + grad`` (in ``acc``'s dtype)."""
    if first:
        acc.copy_(grad)
    else:
        acc.add_(grad)


def _empty(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of ``n`` elements on ``device``. Host buffers are plain pageable memory, exactly their
    size: only the staging buffers a copy engine writes are page-locked (`HostAdder`); torch's page-locked
    cache would round every buffer up to a power of two (up to twice the accumulator)."""
    return torch.empty(n, dtype=dtype, device=device)


def _overlaps(g: torch.Tensor, taken: list[tuple[int, int, int]]) -> bool:
    """Whether ``g`` shares memory with a gradient already taken as a buffer (autograd hands the same
    tensor to both inputs of an addition: summing into one in place would add into the other), and if not,
    note its memory as taken."""
    if not g.numel():
        return False
    storage = g.untyped_storage()
    if g.is_contiguous():
        start = g.storage_offset() * g.element_size()
        region = (storage.data_ptr(), start, start + g.numel() * g.element_size())
    else:
        region = (storage.data_ptr(), 0, storage.nbytes())
    if any(ptr == region[0] and lo < region[2] and region[1] < hi for ptr, lo, hi in taken):
        return True
    taken.append(region)
    return False


def _broadcast(g: torch.Tensor) -> bool:
    """Whether ``g`` is a broadcast view (the gradient of ``p.sum()`` is ``ones`` expanded: every element one
    memory location), which cannot be summed into in place."""
    return any(st == 0 and n > 1 for st, n in zip(g.stride(), g.shape))
