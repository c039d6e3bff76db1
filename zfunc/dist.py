"""zfunc's one contact with torch.distributed: the group, bounded waits, a step's collectives.

- `Group`: a process group, its rank, size, device and timeout (a world of
  1 without torch.distributed; refused when a launcher started several ranks
  that never joined a group).
- `wait`, `all_gather_json`, `agree`: control exchanges (metadata, checks
  that ranks agree) that wait at most ``Group.timeout`` and then raise
  `CollectiveError` naming what never met, instead of hanging.
- `Comm`: the collectives of one step (all-gather, reduce-scatter, sums),
  their element counts, the reductions in flight, and a fingerprint of the
  sequence issued, so ranks that ran different units are caught.
- `AllGather` / `ReduceScatter` / `Replicated`: differentiable collectives
  for torch.func transforms. Each lives in the ``forward`` of its own
  `autograd.Function` and its backward calls its partner Function: measured
  before zfunc's first line, a collective called directly in a Function's
  backward fails under the functorch transforms on gloo, one called directly
  in the loss is silently treated as a constant, and torch's functional
  collectives lack ``setup_context``.

Gradient convention (data parallelism): every rank computes a loss on its own
batch, and the gradient of a gathered parameter is the *mean* over ranks of
their gradients, so `AllGather`'s backward is a reduce-scatter with AVG. With
N ranks on N local batches this equals one process on their concatenation
with a mean loss.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import zlib
from typing import Callable

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat collectives (the old names warn); 2.11 has only the old ones.
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


TIMEOUT_ENV = "ZFUNC_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0


class CollectiveError(RuntimeError):
    """Ranks did not meet in a collective (one never came, or they disagree): the message says which."""


def default_timeout() -> float:
    """Seconds a rank waits for the others in a collective before raising `CollectiveError`:
    ``$ZFUNC_TIMEOUT_S`` if set, else 300."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return value


@dataclasses.dataclass
class Group:
    """A process group with its rank and size (a world of 1 when none is initialized).

    ``timeout``: seconds a collective may wait for the other ranks before
    `CollectiveError` is raised (see `wait`).
    """

    handle: object | None
    rank: int
    size: int
    device: torch.device = torch.device("cpu")  # where this group's collectives run
    timeout: float = DEFAULT_TIMEOUT_S

    @classmethod
    def resolve(cls, group=None, timeout: float | None = None) -> "Group":
        """The given process group, else the world; a world of 1 when torch.distributed is not initialized.

        ``device`` is where `shard` places parameters and computes: the current CUDA device for an
        NCCL group or a single process on a machine with a GPU, the CPU for a gloo group.

        Refuses to pretend to be alone when a launcher (torchrun) started
        several processes (``WORLD_SIZE`` > 1) and none joined a group: each
        would train on its own, silently.
        """
        timeout = default_timeout() if timeout is None else float(timeout)
        if group is None and not (dist.is_available() and dist.is_initialized()):
            launched = os.environ.get("WORLD_SIZE", "1")
            if launched.isdigit() and int(launched) > 1:
                raise CollectiveError(
                    f"this process was launched as one of WORLD_SIZE={launched} ranks (torchrun), but "
                    "torch.distributed is not initialized, so each rank would train its own model. Call "
                    "torch.distributed.init_process_group('nccl' or 'gloo') at the start of the script (and "
                    "destroy_process_group() at its end), or run a single process without torchrun.")
            # Alone: compute where a process group on this machine would (NCCL's current CUDA device).
            alone = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
                torch.device("cpu")
            return cls(None, 0, 1, alone, timeout=timeout)
        backend = str(dist.get_backend(group)).lower()
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        return cls(group, dist.get_rank(group), dist.get_world_size(group), device, timeout)

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the device this group communicates from (NCCL cannot send host tensors)."""
        return t if t.device == self.device else t.to(self.device, non_blocking=True)


class Comm:
    """The collectives of one step of `shard`, their counts, and the reductions still in flight.

    Gradient reduce-scatters are issued asynchronously while backward goes on
    (``pending``) and finished in `finish_pending`, which `shard` calls when
    the backward pass that issued them has returned (the ``gradients_ready``
    primitive), so communication overlaps compute. Every wait is bounded by
    ``group.timeout`` on the host (gloo); on NCCL a wait only orders the
    current stream and a hang ends in NCCL's own watchdog timeout.

    ``sequence`` fingerprints the collectives issued so far (kind, unit, size,
    in order): ranks that ran different units (a module run on some ranks
    only) have different fingerprints, which `shard` checks before it lets an
    update use the gradients.
    """

    def __init__(self, group: "Group", reduce_dtype: torch.dtype | None = None, overlap: bool = True) -> None:
        self.group = group
        self.reduce_dtype = reduce_dtype  # gradients are reduced in this dtype (None: their own)
        self.overlap = overlap
        self.gathered = 0  # elements moved per rank, by kind of collective
        self.reduced = 0
        self.summed = 0
        self.pending: list[tuple[object, Callable[[], None]]] = []  # (work, finisher)
        self.sequence = 0
        self.waits = 0  # how many times pending reductions were waited for (tests count them)

    @property
    def total(self) -> int:
        return self.gathered + self.reduced + self.summed

    def _note(self, kind: str, tag, numel: int) -> None:
        self.sequence = zlib.crc32(f"{kind}:{tag}:{numel};".encode(), self.sequence)

    def finish(self, work, what: str) -> None:
        """Wait for one collective: on the host within ``group.timeout`` (gloo), or by ordering the
        current stream after it (NCCL)."""
        if self.group.device.type == "cuda":
            work.wait()
        else:
            wait(work, self.group, what)

    # -- the collectives ------------------------------------------------------
    def all_gather(self, shard: torch.Tensor, out: torch.Tensor | None = None, tag=None) -> torch.Tensor:
        """Concatenation over ranks of each rank's 1-D ``shard`` (not differentiable), into ``out`` if given."""
        return self.all_gather_async(shard, out, tag).result()

    def all_gather_async(self, shard: torch.Tensor, out: torch.Tensor | None = None, tag=None) -> "Prefetch":
        """The same gather, issued now and redeemed with ``.result()`` (e.g. while another block computes)."""
        self._note("all_gather", tag, shard.numel())
        return Prefetch(self, shard, out, tag)

    def reduce_scatter(self, full: torch.Tensor, tag=None, dtype: torch.dtype | None = None,
                       owned: bool = False) -> torch.Tensor:
        """This rank's 1/N slice of the mean over ranks of 1-D ``full`` (not differentiable), in ``dtype``
        (default: ``full``'s; the reduction itself runs in the reduce dtype). ``owned``: the caller hands
        ``full`` over (nothing else reads or writes it later), so at world size 1 it is the result itself
        rather than a copy.

        With ``overlap`` it is asynchronous: the caller gets the result now and
        must not read it before `finish_pending` (shard reads gradients only
        after the backward pass that made them returned).

        On gloo it is an all-reduce (sum, then ÷ N) of which this rank keeps its
        slice: gloo's reduce-scatter work neither reports completion nor honours
        a timeout, so a rank that never joins would hang it forever.
        """
        group = self.group
        self._note("reduce_scatter", tag, full.numel())
        if group.size == 1:
            return full if owned and dtype in (None, full.dtype) else full.clone()
        send = full if self.reduce_dtype in (None, full.dtype) else full.to(self.reduce_dtype)  # e.g. bf16 in fp32
        placed = group.place(send).contiguous()
        size = full.numel() // group.size
        self.reduced += full.numel()
        if group.device.type == "cpu":
            summed = placed.clone() if placed is full else placed
            work = dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group.handle, async_op=True)
            mine = summed[group.rank * size:(group.rank + 1) * size]
            result = full.new_empty(size, dtype=dtype)
            finisher = lambda: result.copy_(mine.div_(group.size))  # noqa: E731
        else:
            out = placed.new_empty(size)
            work = _reduce_scatter_into(out, placed, op=dist.ReduceOp.AVG, group=group.handle, async_op=True)
            result = out if out.dtype == (dtype or full.dtype) else full.new_empty(size, dtype=dtype)
            finisher = _nothing if result is out else lambda: result.copy_(out)  # back to the gradient's dtype
        if self.overlap:
            self.pending.append((work, finisher))
        else:
            self.finish(work, f"reducing the gradients of unit {tag!r}")
            finisher()
        return result

    def finish_pending(self) -> None:
        """Wait for every reduction in flight (see the class docstring)."""
        if self.pending:
            self.waits += 1
        while self.pending:
            work, finisher = self.pending.pop(0)
            self.finish(work, "reducing gradients")
            finisher()

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Σ over ranks of ``x`` (a new tensor; not differentiable)."""
        group = self.group
        self._note("all_reduce", None, x.numel())
        if group.size == 1:
            return x
        out = group.place(x.detach()).clone()
        self.finish(dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group.handle, async_op=True), "a sum over ranks")
        self.summed += out.numel()
        return out.to(x.device)

    def check_sequence(self, what: str) -> None:
        """Raise on every rank if the ranks issued different collectives (see the class docstring)."""
        if self.group.size > 1:
            agree(self.sequence, self.group, what)


def _nothing() -> None:
    """The finisher of a reduction that lands where it is read."""


class Prefetch:
    """An all-gather issued ahead of its use (asynchronously), redeemed once with `result`.

    `shard(stage=3)` gathers the next block's parameters while the current
    block computes. Every rank issues the same prefetches in the same order,
    so collectives stay matched across ranks.
    """

    def __init__(self, comm: Comm, shard: torch.Tensor, out: torch.Tensor | None, tag) -> None:
        group = comm.group
        placed = group.place(shard).contiguous()
        self.out = placed.new_empty(shard.numel() * group.size) if out is None else out
        self.comm, self.tag, self.work = comm, tag, None
        if group.size == 1:
            self.out.copy_(placed)
            return
        target = group.place(self.out)
        self.work = _all_gather_into(target, placed, group=group.handle, async_op=True)
        self.target = target
        comm.gathered += self.out.numel()

    def result(self) -> torch.Tensor:
        if self.work is not None:
            self.comm.finish(self.work, f"gathering the parameters of unit {self.tag!r}")
            self.work = None
            if self.target is not self.out:
                self.out.copy_(self.target)
        return self.out


def wait(work, group: Group, what: str) -> None:
    """Wait for an asynchronous collective, at most ``group.timeout`` seconds.

    Past it, raise `CollectiveError` naming ``what``: the other ranks are
    elsewhere (another step or stage, a rank that skipped the call, a dead
    rank), and waiting on would hang the job with no word.
    """
    try:
        work.wait(timeout=datetime.timedelta(seconds=group.timeout))
    except RuntimeError as err:
        if "timed out" not in str(err).lower() and "timeout" not in str(err).lower():
            raise
        raise CollectiveError(
            f"{what}: rank {group.rank} of {group.size} waited {group.timeout:g} s for the other ranks, which "
            f"never joined. Every rank must make the same zfunc calls in the same order (the same step, "
            f"stage and model; e.g. every rank calls zf.io.save). Raise the limit with ${TIMEOUT_ENV} if a "
            "rank is merely slow.") from None


def all_gather_json(obj, group: Group, what: str = "exchanging metadata between ranks") -> list:
    """Every rank's ``obj`` (anything `json` can encode), in rank order.

    Sent as JSON bytes in a uint8 tensor, never pickled: what crosses ranks
    is data (steps, file lists, error messages), and no rank should run code
    another one sent. Tuples come back as lists, on every world size alike.
    Sizes are exchanged first, so ranks with payloads of different lengths
    never issue mismatched collectives; each exchange waits at most
    ``group.timeout`` seconds (`wait`; ``what`` names it in the error).
    """
    encoded = json.dumps(obj).encode()
    if group.size == 1:
        return [json.loads(encoded)]
    size = torch.tensor([len(encoded)], dtype=torch.int64, device=group.device)
    sizes = _gather_within_timeout(size, group, what).cpu()
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8)
    if encoded:
        padded[:len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    gathered = _gather_within_timeout(padded.to(group.device), group, what).cpu()
    return [json.loads(bytes(gathered[r * longest:r * longest + int(sizes[r])].tolist()))
            for r in range(group.size)]


def _gather_within_timeout(t: torch.Tensor, group: Group, what: str) -> torch.Tensor:
    out = t.new_empty(t.numel() * group.size)
    work = _all_gather_into(out, t.contiguous(), group=group.handle, async_op=True)
    wait(work, group, what)
    return out


def host_group(group: Group) -> Group:
    """A group over ``group``'s ranks whose collectives run on the host (gloo), for control exchanges
    of values the host already knows (which units a rank ran): over NCCL the same exchange would copy
    the answer back from the GPU, and the host would wait for the GPU's queue to drain first.

    ``group`` itself when its collectives already run on the host (gloo, or a world of 1). Otherwise a
    new gloo group over the same ranks: creating it is a collective of those ranks only
    (``use_local_synchronization``, so the ranks of other dp groups of a mesh need not join), made once
    by the caller, who keeps it (`shard` keeps it in its stack's ``kept``).
    """
    if group.size == 1 or group.device.type == "cpu":
        return group
    ranks = dist.get_process_group_ranks(group.handle) if group.handle is not None else list(range(group.size))
    handle = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=group.timeout),
                            use_local_synchronization=True)
    return Group(handle, group.rank, group.size, torch.device("cpu"), timeout=group.timeout)


def exchange_on_host(obj, host: Group, what: str) -> list:
    """`all_gather_json` over a `host_group`: every rank's ``obj``, read without waiting for any device."""
    if host.device.type != "cpu":
        raise ValueError(f"exchange_on_host needs a host (gloo) group, got one on {host.device}; see host_group")
    return all_gather_json(obj, host, what)


CALL_NAME_BYTES = 64  # the fixed size of `announce`'s exchange


class CallMismatch(CollectiveError):
    """Ranks met in `announce` from different zfunc calls; ``calls`` holds each rank's call, in rank order."""

    def __init__(self, message: str, calls: list[str]) -> None:
        super().__init__(message)
        self.calls = calls


def announce(group: Group, call: str, waiting: str | None = None) -> None:
    """Check that every rank is starting the same zfunc call ``call``; raise on every rank if not.

    Each communicating entry point (a `shard` step, ``step.gather``,
    ``step.init``, each exchange of ``zf.io.save``/``restore``) first
    all-gathers its name in a fixed-size buffer. Ranks in different calls
    (one saves while another steps, one gathers while another steps) thus
    meet in exchanges of equal size and all get this error, where their own
    collectives would have had different sizes: gloo aborts the process on
    that, and NCCL may pair the wrong bytes. A rank that never comes makes
    the others time out here (`wait`; ``waiting`` names the wait in that
    error, default "starting <call>"). Ranks in different calls raise
    `CallMismatch`.
    """
    if group.size == 1:
        return
    name = call.encode()[:CALL_NAME_BYTES]
    mine = torch.zeros(CALL_NAME_BYTES, dtype=torch.uint8)
    if name:
        mine[:len(name)] = torch.frombuffer(bytearray(name), dtype=torch.uint8)
    got = _gather_within_timeout(mine.to(group.device), group, waiting or f"starting {call}").cpu()
    got = got.view(group.size, -1)
    names = [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in got]
    if any(n != names[group.rank] for n in names):
        calls = "; ".join(f"rank {r}: {n}" for r, n in enumerate(names))
        raise CallMismatch(
            f"{call} on rank {group.rank}: the ranks are in different zfunc calls ({calls}). Every rank must make "
            "the same zfunc calls in the same order (every rank steps, every rank calls step.gather, zf.io.save "
            "and zf.io.restore).", names)


def agree(value, group: Group, what: str) -> None:
    """Check that every rank holds the same ``value`` (JSON-able); raise the same error on every rank if not.

    ``what`` names the value ("the parameter names and shapes"); the error
    lists the ranks whose value differs from rank 0's and the first
    difference. Used before any collective whose shapes depend on the value,
    so a disagreement is an error rather than a hang or a gloo abort.
    """
    values = all_gather_json(value, group, f"checking that all ranks agree on {what}")
    differing = [r for r, v in enumerate(values) if v != values[0]]
    if differing:
        raise CollectiveError(
            f"ranks disagree on {what}: rank(s) {differing} differ from rank 0 "
            f"({_first_difference(values[0], values[differing[0]])}). Every rank must build the same model "
            "and the same step (same transforms and arguments) from the same code.")


def _first_difference(a, b, path: str = "") -> str:
    """A short description of where two JSON values first differ."""
    where = path or "the value"
    if type(a) is not type(b):
        return f"at {where}: {_short(a)} vs {_short(b)}"
    if isinstance(a, dict):
        if list(a) != list(b):
            only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
            if only_a or only_b:
                return f"at {where}: keys only on rank 0: {only_a[:4]}, only on the other: {only_b[:4]}"
            return f"at {where}: the same keys in another order"
        for k in a:
            if a[k] != b[k]:
                return _first_difference(a[k], b[k], f"{path}.{k}" if path else str(k))
    if isinstance(a, list):
        if len(a) != len(b):
            return f"at {where}: {len(a)} entries vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
    return f"at {where}: {_short(a)} vs {_short(b)}"


def _short(v) -> str:
    text = json.dumps(v)
    return text if len(text) <= 80 else text[:77] + "..."


# --------------------------------------------------------------------------
# Differentiable collectives, for torch.func transforms (shard's plain-autograd path has
# its own node per unit, `zfunc.transforms.shard_units`). Their reductions are synchronous:
# a unit used twice gets two reductions, which autograd sums at once.


class AllGather(torch.autograd.Function):
    """``full = cat_r(shard_r)``; backward: ``grad_shard = mean_r(grad_full)[this rank]``.

    ``prefetched``: a `Prefetch` of the same gather issued earlier, used instead of gathering now.
    """

    @staticmethod
    def forward(shard, comm, prefetched=None, tag=None):
        if prefetched is not None:
            return prefetched.result()
        return comm.all_gather(shard, tag=tag)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm = inputs[1]
        ctx.tag = inputs[3] if len(inputs) > 3 else None

    @staticmethod
    def backward(ctx, grad_full):
        return ReduceScatter.apply(grad_full, ctx.comm, ctx.tag), None, None, None


class ReduceScatter(torch.autograd.Function):
    """``shard = mean_r(full_r)[this rank]``; backward: all-gather divided by N."""

    @staticmethod
    def forward(full, comm, tag=None):
        overlap, comm.overlap = comm.overlap, False
        try:
            return comm.reduce_scatter(full, tag)
        finally:
            comm.overlap = overlap

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm = inputs[1]

    @staticmethod
    def backward(ctx, grad_shard):
        return AllGather.apply(grad_shard, ctx.comm) / ctx.comm.group.size, None, None


class Replicated(torch.autograd.Function):
    """Hands out an already-resident full buffer; backward reduce-scatters its gradient.

    ZeRO stage 2: every rank keeps the full parameters, but the gradient that
    flows back is this rank's shard of the data-parallel mean, produced while
    backward runs (as soon as the unit's gradient is complete), so no rank
    ever holds the full gradient of more than one unit.
    ``forward(shard, full)``: ``shard`` is only the differentiation handle
    (its value is this rank's slice of ``full``).
    """

    @staticmethod
    def forward(shard, holder, comm, tag=None):
        return holder.full.view(-1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm = inputs[2]
        ctx.tag = inputs[3] if len(inputs) > 3 else None

    @staticmethod
    def backward(ctx, grad_full):
        return ReduceScatter.apply(grad_full, ctx.comm, ctx.tag), None, None, None


class Holder:
    """Carries a tensor past autograd (a non-tensor argument of a Function)."""

    def __init__(self, full: torch.Tensor) -> None:
        self.full = full
