"""`stream_units`: load -> compute -> store over units, with I/O of neighbours overlapping each compute.

::

    bufs = [make_buffers() for _ in range(3)]              # host buffer sets, reused round robin
    timeline = stream_units(range(n_units),
                            load=lambda k, b: [store.read_into(f"{k}.{x}", b[x]) for x in ("p", "m", "v")],
                            compute=lambda k, b: adamw_(b["p"], grads[k], b["m"], b["v"], lr=lr, step=t),
                            store=lambda k, b: [store.write(f"{k}.{x}", b[x]) for x in ("p", "m", "v")],
                            buffers=bufs)

Schedule: unit ``k`` uses ``buffers[k % B]``. Three stages run side by side,
each over the units in order: a loader thread calls ``load(unit, buf)``, the
calling thread ``compute(unit, buf)``, a writer thread ``store(unit, buf)``.
``load`` and ``store`` may do the work themselves or only start it and
return a `concurrent.futures.Future` or an iterable of Futures (as
`DiskStore` does); their stage thread waits for those before the step
counts as done. Dependencies, which are all the synchronization there is:

- ``compute(k)`` starts after ``load(k)`` finished, so it sees exactly the
  loaded data;
- ``load(k)`` starts after ``store(k - B)`` finished (without ``store``:
  after ``compute(k - B)``), so a buffer is reused only once the unit that
  held it is on disk;
- ``store(k)`` starts after ``compute(k)``.

With B = 3, ``load(k+1)`` and ``store(k-1)`` both run during
``compute(k)``; with B = 2, ``load(k+1)`` follows ``store(k-1)`` during
``compute(k)`` (still overlapped with the compute, but the two transfers
run one after the other); B = 1 is the serial loop. If the I/O of a unit
takes longer than its compute, the loop runs at I/O speed and `Timeline`
shows where it waited.

Errors: an exception in any stage stops the pipeline: no load or compute
starts after it, every Future already started is waited for (so nothing
touches the buffers once `stream_units` returns), and the writer stores
every unit whose compute finished (unless the writer itself failed). Then
`PipelineError` is raised (``phase``, ``unit``, ``stored``, ``torn``; the
original exception as ``__cause__``). Since units are stored in order, the
files then hold: units ``[0, stored)`` their new values; unit ``torn``
(only when a store failed) a mix of old and new bytes; every later unit
its previous values. The step as a whole did not happen, so the caller
must treat the state as torn (restore a checkpoint, or redo the units from
``stored`` on when no unit is torn); nothing is silently half-updated.
KeyboardInterrupt and other BaseExceptions from ``compute`` stop the
pipeline the same way and are re-raised as they are.

Timings: `Timeline` has each unit's phase start/end times (`UnitTimes`, for
drawing the timeline) and the stalls: the compute thread waiting for reads
and, at the end, for the last writes; the loader waiting for a free buffer.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

Phase = Literal["load", "compute", "store"]


class PipelineError(RuntimeError):
    """A stage of `stream_units` failed: ``phase`` of ``unit`` (the ``index``-th).

    ``stored``: units ``[0, stored)`` were stored; ``torn``: the index of the unit whose store
    failed part way (its file holds a mix of old and new bytes), or None; ``timeline``: the
    `Timeline` up to the failure.
    """

    def __init__(self, message: str, phase: Phase, unit: Any, index: int, stored: int, torn: int | None,
                 timeline: Timeline):
        super().__init__(message)
        self.phase, self.unit, self.index, self.stored = phase, unit, index, stored
        self.torn, self.timeline = torn, timeline


@dataclass
class UnitTimes:
    """Start and end of each phase of one unit, seconds since the pipeline started (NaN: never ran)."""

    unit: Any
    load: tuple[float, float] = (math.nan, math.nan)
    compute: tuple[float, float] = (math.nan, math.nan)
    store: tuple[float, float] = (math.nan, math.nan)


@dataclass
class Timeline:
    """Where a `stream_units` run spent its time.

    ``read_wait``: the compute thread idle, waiting for a load; ``write_wait``:
    waiting, after the last compute, for the last stores; ``buffer_wait``: the
    loader idle, waiting for a store to free a buffer (I/O-bound on writes).
    ``read``, ``compute``, ``write``: the summed durations of each phase.
    """

    units: list[UnitTimes]
    wall: float = 0.0
    read_wait: float = 0.0
    write_wait: float = 0.0
    buffer_wait: float = 0.0

    def _total(self, phase: str) -> float:
        return sum(b - a for a, b in (getattr(u, phase) for u in self.units) if not math.isnan(b))

    @property
    def read(self) -> float:
        return self._total("load")

    @property
    def compute(self) -> float:
        return self._total("compute")

    @property
    def write(self) -> float:
        return self._total("store")

    @property
    def serial(self) -> float:
        """The time the same work takes with no overlap: read + compute + write."""
        return self.read + self.compute + self.write

    @property
    def overlap(self) -> float:
        """``serial / wall``: 1.0 when nothing overlapped; up to 3 when reads, computes and writes all
        ran side by side. (Phases may run slower under overlap than alone, which this hides.)"""
        return self.serial / self.wall if self.wall > 0 else 1.0

    @property
    def compute_fraction(self) -> float:
        """``compute / wall``: the share of the loop the compute thread spent computing; 1.0 when
        the I/O is hidden entirely (possible only when compute is the busiest phase)."""
        return self.compute / self.wall if self.wall > 0 else 1.0

    def summary(self) -> str:
        return (f"{len(self.units)} units in {self.wall * 1e3:.1f} ms (serial sum {self.serial * 1e3:.1f} "
                f"ms, overlap {self.overlap:.2f}x, computing {self.compute_fraction:.0%} of it): read "
                f"{self.read * 1e3:.1f} / compute "
                f"{self.compute * 1e3:.1f} / write {self.write * 1e3:.1f} ms; waited for reads "
                f"{self.read_wait * 1e3:.1f}, for a free buffer {self.buffer_wait * 1e3:.1f}, for the last "
                f"writes {self.write_wait * 1e3:.1f} ms")


@dataclass
class _Progress:
    """Shared counters, guarded by ``cv``: each stage advances its own, in unit order."""

    loaded: int = 0
    computed: int = 0
    stored: int = 0
    stop: bool = False
    torn: int | None = None  # the unit whose store failed part way
    computing: bool = True  # the calling thread may still compute (the writer waits for it)
    error: tuple[Phase, int, BaseException] | None = None
    cv: threading.Condition = field(default_factory=threading.Condition)

    def fail(self, phase: Phase, index: int, exc: BaseException) -> None:
        with self.cv:
            if self.error is None:
                self.error = (phase, index, exc)
            self.stop = True
            self.cv.notify_all()

    def advance(self, counter: str) -> None:
        with self.cv:
            setattr(self, counter, getattr(self, counter) + 1)
            self.cv.notify_all()

    def wait_for(self, ready: Callable[[], bool]) -> bool:
        """Block until ``ready()`` or a stop; True when ready and not stopped."""
        with self.cv:
            self.cv.wait_for(lambda: ready() or self.stop)
            return not self.stop


def finish(result: Any) -> None:
    """Wait for what a load/store returned (None, a Future, or Futures); raise the first error.

    Every Future is waited for before raising, so no I/O is left running into a buffer.
    """
    if result is None:
        return
    futures = [result] if isinstance(result, Future) else result
    futures = list(futures) if isinstance(futures, Iterable) else [futures]
    if not all(isinstance(f, Future) for f in futures):
        raise TypeError(f"load/store must return None, a Future or an iterable of Futures, got {result!r}")
    wait(futures)
    for f in futures:
        f.result()


def stream_units(units: Iterable[Any], load: Callable[[Any, Any], Any], compute: Callable[[Any, Any], Any],
                 store: Callable[[Any, Any], Any] | None = None, *, buffers: Sequence[Any]) -> Timeline:
    """Run ``load(u, b); compute(u, b); store(u, b)`` for every unit, overlapped (see the module doc).

    Args:
        units: the units, in order (any objects; passed through).
        load: ``load(unit, buffer)``: fill the buffer; may return Future(s) to wait for.
        compute: ``compute(unit, buffer)``: runs on the calling thread; its return value is ignored.
        store: ``store(unit, buffer)``: write the buffer back; may return Future(s). None: nothing
            to store (a buffer is free again once its compute finished).
        buffers: B >= 1 buffer objects (anything: dicts of pinned tensors...), used round robin.

    Returns the `Timeline`. Raises `PipelineError` (see the module doc for the files' contents).
    """
    units = list(units)
    bufs = list(buffers)
    if not bufs:
        raise ValueError("stream_units needs at least one buffer (3 overlap both reads and writes)")
    n, nb = len(units), len(bufs)
    times = [UnitTimes(u) for u in units]
    tl = Timeline(times)
    p = _Progress()
    t0 = time.perf_counter()
    now = lambda: time.perf_counter() - t0  # noqa: E731
    released = (lambda: p.stored) if store is not None else (lambda: p.computed)

    def loader() -> None:
        for i in range(n):
            t = now()
            if not p.wait_for(lambda: released() > i - nb):
                return
            tl.buffer_wait += now() - t
            start = now()
            try:
                finish(load(units[i], bufs[i % nb]))
            except BaseException as e:  # noqa: BLE001 - handed to the calling thread
                p.fail("load", i, e)
                return
            times[i].load = (start, now())
            p.advance("loaded")

    def writer() -> None:
        for i in range(n):
            with p.cv:  # after a stop, still store every unit whose compute finished
                p.cv.wait_for(lambda: p.computed > i or not p.computing)
                if p.computed <= i:
                    return
            start = now()
            try:
                finish(store(units[i], bufs[i % nb]))
            except BaseException as e:  # noqa: BLE001
                p.torn = i
                p.fail("store", i, e)
                return
            times[i].store = (start, now())
            p.advance("stored")

    threads = [threading.Thread(target=loader, name="zfunc-stream-load", daemon=True)]
    if store is not None:
        threads.append(threading.Thread(target=writer, name="zfunc-stream-store", daemon=True))
    for t in threads:
        t.start()
    interrupt = None
    try:
        for i in range(n):
            t = now()
            if not p.wait_for(lambda: p.loaded > i):  # no compute after a failure anywhere
                break
            tl.read_wait += now() - t
            start = now()
            try:
                compute(units[i], bufs[i % nb])
            except Exception as e:  # noqa: BLE001
                p.fail("compute", i, e)
                break
            times[i].compute = (start, now())
            p.advance("computed")
    except BaseException as e:  # KeyboardInterrupt: stop the stages, then re-raise as is
        interrupt = e
        p.fail("compute", i, e)
    finally:
        with p.cv:
            p.computing = False
            p.cv.notify_all()
    t = now()
    for th in threads:
        th.join()
    tl.write_wait = now() - t
    tl.wall = now()
    if interrupt is not None:
        raise interrupt
    if p.error is not None:
        phase, i, exc = p.error
        stored = p.stored if store is not None else 0
        if store is None:
            files = "nothing is stored (store=None)"
        else:
            files = f"units #0..#{stored - 1} were stored" if stored else "no unit was stored"
            after = stored
            if p.torn is not None:
                files += f"; unit #{p.torn}'s file is partly written"
                after += 1
            if after < n:
                files += f"; units #{after}.. keep their previous contents"
        raise PipelineError(f"{phase} of unit {units[i]!r} (#{i} of {n}) failed: {type(exc).__name__}: "
                            f"{exc}. {files[0].upper()}{files[1:]}", phase, units[i], i, stored, p.torn,
                            tl) from exc
    return tl
