"""zfunc's one contact with torch.distributed: the group and differentiable collectives.

Each collective that gradients flow through lives inside the ``forward`` of
its own `autograd.Function`, and each one's backward calls its partner
Function (all-gather <-> reduce-scatter). DESIGN.md records why: a collective
called directly in ``Function.backward`` fails under the functorch transforms
on gloo, one called directly in the loss is silently treated as a constant,
and torch's functional collectives lack ``setup_context``.

Gradient convention (data parallelism): every rank computes a loss on its own
batch, and the gradient of a gathered parameter is the *mean* over ranks of
their gradients, so `AllGather`'s backward is a reduce-scatter with AVG. With
N ranks on N local batches this equals one process on their concatenation
with a mean loss.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

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
            return cls(None, 0, 1, timeout=timeout)
        backend = str(dist.get_backend(group)).lower()
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        return cls(group, dist.get_rank(group), dist.get_world_size(group), device, timeout)

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the device this group communicates from (NCCL cannot send host tensors)."""
        return t if t.device == self.device else t.to(self.device, non_blocking=True)


@dataclasses.dataclass
class CommCounter:
    """Elements moved per rank by the collectives of one step, by kind.

    Also holds the gradient reduce-scatters still in flight (``pending``):
    they are issued asynchronously while backward goes on, and their results
    are read only after `wait_pending`, so communication overlaps compute.

    ``listeners`` are told of each tagged gradient reduction as soon as it is
    issued, as ``listener(tag, result, wait)``: ``result`` holds its final
    value once ``wait()`` returned (``wait`` blocks the host on gloo and the
    calling thread's current stream on NCCL). `offload` starts moving and
    updating a unit's gradients this way while backward goes on.
    """

    all_gather: int = 0
    reduce_scatter: int = 0
    all_reduce: int = 0
    pending: list = dataclasses.field(default_factory=list)
    overlap: bool = True
    reduce_dtype: torch.dtype | None = None  # gradients are reduced in this dtype (None: their own)
    listeners: list = dataclasses.field(default_factory=list)

    def announce(self, tag, result: torch.Tensor, wait) -> None:
        if tag is not None:
            for listener in self.listeners:
                listener(tag, result, wait)

    def wait_pending(self) -> None:
        """Block (the host on gloo, the current stream on NCCL) until every pending collective is done."""
        while self.pending:
            ready, finish = self.pending.pop(0)
            ready()
            finish()

    @property
    def total(self) -> int:
        return self.all_gather + self.reduce_scatter + self.all_reduce


def all_gather_flat(shard: torch.Tensor, group: Group, counter: CommCounter | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenation over ranks of each rank's 1-D ``shard`` (not differentiable), into ``out`` if given."""
    if group.size == 1:
        return shard.clone() if out is None else out.copy_(shard)
    if out is None:
        out = group.place(shard).new_empty(shard.numel() * group.size)
    target = group.place(out)
    _all_gather_into(target, group.place(shard).contiguous(), group=group.handle)
    if target is not out:
        out.copy_(target)
    if counter is not None:
        counter.all_gather += out.numel()
    return out


def reduce_scatter_flat(full: torch.Tensor, group: Group, counter: CommCounter | None = None,
                        tag=None) -> torch.Tensor:
    """This rank's 1/N slice of the mean over ranks of 1-D ``full`` (not differentiable).

    ``tag`` names the reduction for ``counter.listeners`` (shard: the unit).
    """
    if group.size == 1:
        out = full.clone()
        if counter is not None:
            counter.announce(tag, out, _ready)
        return out
    reduce_dtype = counter.reduce_dtype if counter is not None else None
    send = full if reduce_dtype in (None, full.dtype) else full.to(reduce_dtype)  # e.g. bf16 grads in fp32
    placed = group.place(send).contiguous()
    out = placed.new_empty(full.numel() // group.size)
    if counter is not None:
        counter.reduce_scatter += full.numel()
    if counter is not None and counter.overlap and out.device == full.device:
        # Asynchronous: the caller gets the result now and must not read it
        # before counter.wait_pending() (shard does so when backward ends).
        work = _reduce_scatter_into(out, placed, op=dist.ReduceOp.AVG, group=group.handle, async_op=True)
        ready = ReadyOnce(work, out.device)
        if out.dtype == full.dtype:
            counter.pending.append((ready, lambda: None))
            _wait_when_backward_ends(counter)
            counter.announce(tag, out, ready)
            return out
        result = full.new_empty(out.numel())
        counter.pending.append((ready, lambda: result.copy_(out)))  # back to the gradient's dtype once landed
        _wait_when_backward_ends(counter)
        return result
    _reduce_scatter_into(out, placed, op=dist.ReduceOp.AVG, group=group.handle)
    out = out.to(device=full.device, dtype=full.dtype)
    if counter is not None:
        counter.announce(tag, out, _ready)
    return out


def _ready() -> None:
    """The ``wait`` of a result that is already final."""


class ReadyOnce:
    """``wait`` for an asynchronous collective that several streams (or threads) may call.

    A work's ``wait()`` is not idempotent: on NCCL only its first call makes
    the calling stream wait (a second caller's stream would read the result
    too early), and on gloo every call bumps the result's version counter.
    So the work is waited once; on CUDA an event recorded right after on that
    caller's stream is what later callers' streams wait for.
    """

    def __init__(self, work, device: torch.device) -> None:
        self.work, self.cuda = work, device.type == "cuda"
        self.event = None
        self.lock = threading.Lock()
        self.waited = False

    def __call__(self) -> None:
        with self.lock:
            if not self.waited:
                self.work.wait()
                if self.cuda:
                    self.event = torch.cuda.Event()
                    self.event.record()
                self.waited = True
                return
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


def wait(work, group: Group, what: str) -> None:
    """Wait for an asynchronous collective, at most ``group.timeout`` seconds.

    Past it, raise `CollectiveError` naming ``what``: the other ranks are
    elsewhere (another step or stage, a rank that skipped the call, a dead
    rank), and waiting on would hang the job with no word. Polls the work
    (``is_completed``), which both gloo and NCCL answer without blocking.
    """
    deadline = time.monotonic() + group.timeout
    pause = 1e-4
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise CollectiveError(
                f"{what}: rank {group.rank} of {group.size} waited {group.timeout:g} s for the other ranks, which "
                f"never joined. Every rank must make the same zfunc calls in the same order (the same step, "
                f"stage and model; e.g. every rank calls zf.io.save). Raise the limit with ${TIMEOUT_ENV} if a "
                "rank is merely slow.")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    work.wait()


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


def _wait_when_backward_ends(counter: CommCounter) -> None:
    """Have the running backward pass wait for ``counter``'s collectives before it returns.

    Whoever called backward (zf.value_and_grad, micro-batch by micro-batch
    under `accumulate`) may read the gradients as soon as it returns, so the
    wait is queued on the autograd engine (as DDP and FSDP do). Outside a
    backward pass this does nothing; the caller waits explicitly.
    """
    try:
        torch.autograd.Variable._execution_engine.queue_callback(counter.wait_pending)
    except RuntimeError:  # not inside backward
        pass


def all_reduce_sum(x: torch.Tensor, group: Group, counter: CommCounter | None = None) -> torch.Tensor:
    """Σ over ranks of ``x`` (a new tensor; not differentiable)."""
    if group.size == 1:
        return x
    out = group.place(x.detach()).clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group.handle)
    out = out.to(x.device)
    if counter is not None:
        counter.all_reduce += out.numel()
    return out


class Prefetch:
    """An all-gather issued ahead of its use (asynchronously), redeemed once with `result`.

    `shard(stage=3)` gathers the next block's parameters while the current
    block computes. Every rank issues the same prefetches in the same order,
    so collectives stay matched across ranks.
    """

    def __init__(self, shard: torch.Tensor, group: Group, counter: CommCounter,
                 out: torch.Tensor | None = None) -> None:
        placed = group.place(shard).contiguous()
        self.out = placed.new_empty(shard.numel() * group.size) if out is None else out
        self.work = None
        if group.size == 1:
            self.out.copy_(placed)
        else:
            self.work = _all_gather_into(self.out, placed, group=group.handle, async_op=True)
            counter.all_gather += self.out.numel()

    def result(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.out


class AllGather(torch.autograd.Function):
    """``full = cat_r(shard_r)``; backward: ``grad_shard = mean_r(grad_full)[this rank]``.

    ``prefetched``: a `Prefetch` of the same gather issued earlier, used instead of gathering now.
    ``tag``: passed on to the reduce-scatter of backward (see `CommCounter.listeners`).
    """

    @staticmethod
    def forward(shard, group, counter, prefetched=None, tag=None):
        if prefetched is not None:
            return prefetched.result()
        return all_gather_flat(shard, group, counter)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group, ctx.counter = inputs[1], inputs[2]
        ctx.tag = inputs[4] if len(inputs) > 4 else None

    @staticmethod
    def backward(ctx, grad_full):
        return ReduceScatter.apply(grad_full, ctx.group, ctx.counter, ctx.tag), None, None, None, None


class ReduceScatter(torch.autograd.Function):
    """``shard = mean_r(full_r)[this rank]``; backward: all-gather divided by N."""

    @staticmethod
    def forward(full, group, counter, tag=None):
        return reduce_scatter_flat(full, group, counter, tag)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group, ctx.counter = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad_shard):
        return AllGather.apply(grad_shard, ctx.group, ctx.counter) / ctx.group.size, None, None, None


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
    def forward(shard, holder, group, counter, tag=None):
        return holder.full.view(-1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group, ctx.counter = inputs[2], inputs[3]
        ctx.tag = inputs[4] if len(inputs) > 4 else None

    @staticmethod
    def backward(ctx, grad_full):
        return ReduceScatter.apply(grad_full, ctx.group, ctx.counter, ctx.tag), None, None, None, None


class Holder:
    """Carries a tensor past autograd (a non-tensor argument of a Function)."""

    def __init__(self, full: torch.Tensor) -> None:
        self.full = full
