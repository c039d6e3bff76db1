"""`offload`'s host update, started unit by unit while backward still runs.

Under `shard`, a unit's gradients are final as soon as its reduce-scatter
lands, long before backward ends (late blocks first). Waiting for the whole
backward before moving them to the host and running the optimizer there
adds the full transfer and the full host update (~28 bytes of host memory
traffic per parameter) to every step. `UpdateAhead` instead, for each unit
as `shard` announces it (the ``watch_gradients`` primitive):

1. once the reduction has landed (checked when the next unit's is issued),
   copies the unit's gradient shard into pinned host memory on a side CUDA
   stream (no host sync);
2. on one worker thread, waits for that copy and runs the fused CPU Adam
   kernel for the unit, writing the new master, moments and compute copy into
   *spare* buffers; the GIL is released inside the kernel, so the main thread
   keeps launching backward.

Exactness. Which gradients reach ``apply_gradients`` is up to the step
function (it may clip, scale or replace them); the update ahead is only a
guess that they are the ones backward produced. It never writes into the
state it reads, and it is used only if, when ``apply_gradients`` comes, every
gradient is the very tensor it saw (same storage, shape and version counter,
so unchanged in place) and the optimizer, its state and the master are the
ones it read. Otherwise it is dropped and the update runs as usual: the
result is the plain step's either way, bit for bit (the same kernel).

Cost: a second host copy of master and moments (12 bytes per parameter,
allocated once, then the two copies alternate), and the update is done twice
in the steps where the guess fails. `offload` guesses only when the previous
step computed gradients once (not under `accumulate`) and the optimizer is
Adam/AdamW without a clip, whose norm needs every gradient first.

Measured (BENCHMARKS.md, GPT-2 medium on one H200): exact, bit for bit, on
NCCL in every stage, but slower than the single in-place update after
backward (653 vs 238 ms per step): split into per-unit calls, written out of
place and competing with backward's threads, the host update ran at ~55
against ~140 GB/s, and it no longer fits in the backward it is meant to hide
in. Hence ``offload(overlap=False)`` by default.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from zfunc.optim.fused import FusedAdam

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
log = logging.getLogger("zfunc.offload")


class Spares:
    """Spare host buffers of an offloaded state, kept across steps.

    ``twin(t)`` is a view laid out like ``t`` in a buffer as big as ``t``'s
    storage; after a step commits, the buffers it wrote hold the state and the
    ones it read become their twins. ``lowp(params, dtype)`` keeps the pinned
    compute-copy buffers the kernel writes into.
    """

    def __init__(self) -> None:
        self._twins: dict[int, torch.Tensor] = {}  # storage address -> its twin's flat buffer
        self._lowp: dict[tuple, dict[str, torch.Tensor]] = {}

    def twin(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        flat = self._twins.get(storage.data_ptr())
        if flat is None or flat.untyped_storage().nbytes() != storage.nbytes() or flat.dtype != t.dtype:
            flat = torch.empty(storage.nbytes() // t.element_size(), dtype=t.dtype)
            self._twins[storage.data_ptr()] = flat
        return flat.as_strided(t.shape, t.stride(), t.storage_offset())

    def swap(self, read: list[torch.Tensor], written: list[torch.Tensor]) -> None:
        """After a commit: the storages ``written`` now hold the state; ``read``'s become their twins."""
        twins = {}
        for old, new in zip(read, written):
            storage = old.untyped_storage()
            twins[new.untyped_storage().data_ptr()] = old.new_empty(0).set_(
                storage, 0, (storage.nbytes() // old.element_size(),))
        self._twins = twins

    def lowp(self, params: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        from zfunc.transforms.offload import lowp_outputs  # noqa: PLC0415 (offload imports this module)

        key = (tuple(params), tuple(p.numel() for p in params.values()), dtype)
        if key not in self._lowp:
            self._lowp[key] = lowp_outputs(params, dtype, None)
        return self._lowp[key]


class UpdateAhead:
    """One step's speculative host update (see the module docstring)."""

    def __init__(self, fused: FusedAdam, tx, master: dict[str, torch.Tensor], lowp: torch.dtype | None,
                 threads: int, spares: Spares, executor: ThreadPoolExecutor) -> None:
        self.fused, self.tx, self.master = fused, tx, master
        self.threads, self.spares, self.executor = threads, spares, executor
        self.stream: torch.cuda.Stream | None = None  # the side stream of the copies (made on first use)
        self.jobs: list[Future] = []
        self.lock = threading.Lock()
        self.seen: dict[str, torch.Tensor] = {}  # key -> the device gradient it used
        self.versions: dict[str, int] = {}  # key -> that gradient's version once final
        self.host_grads: dict[str, torch.Tensor] = {}
        self.new_master = {k: spares.twin(t) for k, t in master.items()}
        self.new_mu = {k: spares.twin(t) for k, t in fused.mu.items()}
        self.new_nu = {k: spares.twin(t) for k, t in fused.nu.items()}
        self.lowp_out = spares.lowp(master, lowp) if lowp is not None else None
        self.done: set[str] = set()
        self.active, self.error = True, None
        self.repeated = False  # some gradient was announced twice: no guess this step
        self.waiting: tuple | None = None  # the last CUDA announcement, copied at the next one
        self.busy_s = 0.0  # time the worker spent in jobs (kernel and waiting for copies)

    # -- during backward (autograd's thread) ----------------------------------
    def on_grads(self, grads: dict[str, torch.Tensor], wait: Callable[[], None]) -> None:
        """A unit's gradient shards were issued; they are final once ``wait()`` returned."""
        if not self.active:
            return
        try:
            grads = {k: g for k, g in grads.items() if g.numel() and k in self.master}
            announced = set(self.seen) | (set(self.waiting[0]) if self.waiting is not None else set())
            if any(k in announced for k in grads):
                # A second backward in one gradient call (micro-batches accumulated
                # below offload): the update needs their sum, which comes later.
                self.active, self.repeated = False, True
                return
            if not grads or any(g.dtype not in GRAD_DTYPES for g in grads.values()):
                return
            if next(iter(grads.values())).is_cuda:
                # Copied one announcement late (see `_copy_to_host`).
                previous, self.waiting = self.waiting, (grads, wait)
                if previous is not None:
                    self._copy_to_host(*previous)
                return
            # Host and device coincide: the kernel reads them where they are. Wait
            # here, not in the worker, so that every wait is over by `seal`.
            wait()
            self._submit(grads, grads, None)
        except Exception as err:  # noqa: BLE001 - a failed guess must not break the step
            self.active, self.error = False, err

    def _copy_to_host(self, grads: dict[str, torch.Tensor], wait: Callable[[], None]) -> None:
        """Start the copy of a unit's reduced gradients to the host, on a side stream.

        ``wait()`` runs on the *current* stream (backward's), never on the side
        stream: an NCCL work's first wait also hands the buffers it read back
        to the caching allocator, for reuse by the stream that made them; had
        only the side stream waited, backward's stream could overwrite them
        while the reduction still reads them. Waiting for a unit's reduction
        when the *next* unit's is issued costs backward nothing (it has long
        landed by then), and the copy still runs while backward goes on.
        """
        from zfunc.transforms.offload import copy_grouped  # noqa: PLC0415

        device = next(iter(grads.values())).device
        wait()
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        self.stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.stream):
            host = copy_grouped(grads, lambda t: True)
            event = torch.cuda.Event()
            event.record(self.stream)
        for g in grads.values():
            g.record_stream(self.stream)  # read on our stream: not to be reused before the copy
        self._submit(grads, host, event)

    def _submit(self, grads, host, event) -> None:
        with self.lock:
            self.seen.update(grads)
            self.host_grads.update(host)
        self.jobs.append(self.executor.submit(self._update, grads, host, event))

    def _update(self, grads, host, event) -> None:
        start = time.perf_counter()
        if event is not None:
            event.synchronize()
        copied = time.perf_counter()
        from zfunc.transforms.offload import adam_over_runs  # noqa: PLC0415 (offload imports this module)

        adam_over_runs(self.fused, list(grads), self.master, host, 1.0, self.lowp_out,
                       (self.new_master, self.new_mu, self.new_nu), self.threads)
        with self.lock:
            self.done.update(grads)
        end = time.perf_counter()
        self.busy_s += end - start
        log.debug("update ahead: %d tensors, waited %.1f ms for the copy, kernel %.1f ms",
                  len(grads), 1e3 * (copied - start), 1e3 * (end - copied))

    # -- after backward and at apply_gradients (the main thread) ---------------
    def seal(self) -> None:
        """Backward has returned and every reduction landed: note each gradient's version now.

        (Not when a job starts: gloo bumps a reduced tensor's version counter
        from its own thread around completion.) A later in-place change by
        the step shows as a new version at `claim`.
        """
        if self.waiting is not None and self.active:  # the last unit announced
            try:
                self._copy_to_host(*self.waiting)
            except Exception as err:  # noqa: BLE001
                self.active, self.error = False, err
        self.waiting = None
        with self.lock:
            self.versions = {k: g._version for k, g in self.seen.items()}
        # Gradients announced from now on (stage 1 reduces after backward) come
        # too late to overlap anything: they are left to the update after backward.
        self.active = False

    def finish(self) -> None:
        """Wait for every job; afterwards nothing runs in the background."""
        self.active = False
        for job in self.jobs:
            try:
                job.result()
            except Exception as err:  # noqa: BLE001
                self.error = err
        self.jobs = []

    def claim(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The host gradients to update with, if ``grads`` are exactly what the guess used; else None."""
        waited = time.perf_counter()
        self.finish()
        log.debug("update ahead: %.1f ms of host work, %.1f ms of it after backward",
                  1e3 * self.busy_s, 1e3 * (time.perf_counter() - waited))
        if self.repeated:
            log.debug("update ahead not used: several backward passes in one gradient call")
            return None
        if self.error is not None:
            log.warning("offload: the host update ahead failed (%r); updating after backward instead",
                        self.error)
            return None
        wanted = {k for k, g in grads.items() if g.numel()}
        if wanted != set(self.master) - {k for k, t in self.master.items() if not t.numel()} \
                or wanted != self.done:
            log.debug("update ahead not used: gradients of %d parameters never announced",
                      len(wanted - self.done))
            return None
        for k in wanted:
            g, seen = grads[k], self.seen[k]
            if not (g is seen or (g.data_ptr() == seen.data_ptr() and g.shape == seen.shape
                                  and g.dtype == seen.dtype and g.stride() == seen.stride())) \
                    or g._version != self.versions.get(k):
                log.debug("update ahead not used: the step changed the gradient of %r", k)
                return None
        return {k: self.host_grads.get(k, g) for k, g in grads.items()}

    def result(self, tx, params: dict, grads: dict, opt_state, claimed: dict) -> tuple | None:
        """``(new_params, new_opt_state, lowp)`` if this update is the one asked for; else None."""
        if tx is not self.tx or set(params) != set(self.master):
            return None
        fused = FusedAdam.of(tx, opt_state, params)
        if fused is None or fused.clip is not None:
            return None
        f = self.fused
        same = all(params[k] is self.master[k] and fused.mu[k] is f.mu[k] and fused.nu[k] is f.nu[k]
                   and grads[k] is claimed[k] for k in params)
        if not same or fused.weight_decay != f.weight_decay or not torch.equal(fused.lr, f.lr) \
                or not torch.equal(fused.step, f.step):
            log.debug("update ahead not used: the optimizer, its state or the master differ")
            return None
        empty = [k for k, t in params.items() if not t.numel()]  # nothing to update; keep as they are
        new_params = {k: (params[k] if k in empty else self.new_master[k]) for k in params}
        mu = {k: (f.mu[k] if k in empty else self.new_mu[k]) for k in params}
        nu = {k: (f.nu[k] if k in empty else self.new_nu[k]) for k in params}
        read = [*self.master.values(), *f.mu.values(), *f.nu.values()]
        written = [*self.new_master.values(), *self.new_mu.values(), *self.new_nu.values()]
        self.spares.swap(read, written)
        return new_params, fused._replace(mu=mu, nu=nu).new_state(), self.lowp_out
