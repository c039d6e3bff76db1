"""Multi-process test harness: run a function on N gloo ranks in ~0.1 s.

``run_distributed(fn, world_size, *args, timeout=120, **kwargs)`` forks
``world_size`` workers from the calling (already warm) process; each worker
joins its own gloo process group of ``world_size`` ranks on localhost, runs
``fn(*args, **kwargs)`` (the rank is ``torch.distributed.get_rank()``), tears
the group down and sends its return value back. The call returns the list of
return values ordered by rank.

Why fork
--------
``spawn``/``forkserver`` start a fresh interpreter per rank that re-imports
torch (seconds per rank, ~20 s for a 4-rank test on 2 cores). ``fork`` copies
the pytest process with torch already imported: a whole call (fork, gloo
rendezvous through a ``FileStore``, a collective, barrier, teardown, result
transfer) took 50-140 ms at world size 2 and 80-300 ms at world size 4 on a
2-core machine, depending on its load (a third of it is
``destroy_process_group``; forking a ~230 MB pytest process costs ~7 ms).
A side benefit: ``fn`` and its arguments are never pickled, so lambdas,
closures and locally defined functions all work. Only the return values are
serialised (``torch.save`` to bytes, sent through a pipe), so they must be
picklable; tensors come back as ordinary (non-shared) CPU tensors.

What is unsafe about fork, and how it is avoided (measured on torch 2.13 CPU,
libgomp bundled in the wheel, 2 cores)
-----------------------------------------------------------------------------
* **OpenMP (libgomp) is not fork-safe.** Once the parent has run any parallel
  region (a matmul through MKL, a large elementwise op through
  ``at::parallel_for``, a oneDNN conv, a backward pass), libgomp keeps a thread
  team whose threads do not exist in a forked child. The child's *first*
  parallel region then waits forever on that team: every combination of
  {matmul, elementwise, conv2d} in the parent x {matmul, elementwise, conv2d,
  backward} in the child hung. Setting ``OMP_NUM_THREADS=1`` in the child does
  NOT help (libgomp read it when the parent loaded it), and
  ``torch.set_num_threads(2)`` in the child still hangs. What works in every
  case: ``torch.set_num_threads(1)`` in the child before its first op (it sets
  the OpenMP and MKL thread counts to 1, so parallel regions run inline and
  never touch the stale team). If the parent has not run a parallel region yet,
  the child is fine either way. Each worker therefore runs single-threaded
  (intra-op); with several ranks on a small machine that is what one wants
  anyway. Consequence for tests: CPU reductions may split work differently with
  1 thread than with N, so a single-process reference that must match *bitwise*
  should also be computed in a worker (``run_distributed(ref, 1)``), not in the
  multi-threaded parent.
* **torch's inter-op pool** (``torch.jit.fork``/``at::launch``) is reset in the
  child by torch's own ``pthread_atfork`` handler: works after the fix above.
* **numba** shares the same libgomp when its threading layer is ``omp`` (the
  default when TBB is absent, as here). Two failure modes: (1) if the parent
  ran a numba ``prange`` kernel, numba's fork handler kills every child at once
  ("Terminating: fork() called from a process already using GNU OpenMP, this
  is unsafe.", exit code -SIGTERM), whatever the child does; (2) if the parent
  ran torch parallel ops, a numba ``prange`` kernel in the child hangs unless
  numba is also limited to one thread. The ``workqueue`` layer (always built
  into numba) is fork-safe in both directions. Importing this module therefore
  sets ``NUMBA_THREADING_LAYER=workqueue`` unless the variable is already set
  (``tests/conftest.py`` does the same before anything imports numba), and
  workers call ``numba.set_num_threads(1)`` if numba is loaded and set
  ``NUMBA_NUM_THREADS=1`` for a later import. (``workqueue`` does not support
  concurrent or nested parallel kernel launches: numba aborts with a message
  if a test does that; set ``NUMBA_THREADING_LAYER`` explicitly to override.)
* **autograd on a CUDA build of torch.** Once the parent ran a backward pass,
  a CUDA build refuses autograd in every forked child ("Unable to handle
  autograd's threading in combination with fork-based multiprocessing"): its
  engine started device threads that a fork does not copy. The CPU build does
  not. Tests run their single-process references inside a rank
  (``run_distributed(ref, 1)``); the error a refused rank raises says so.
* **torch.distributed state.** The parent must never create a process group
  (it would be inherited by every child, half-alive): ``run_distributed``
  refuses to run if one exists. Every worker builds its own group from a
  fresh ``FileStore`` in a new temporary directory: no ports to pick (no race
  for a "free" port, no store server thread in the parent while it forks),
  nothing shared between calls. Gloo is pinned to the loopback interface
  (``GLOO_SOCKET_IFNAME=lo``) in the workers.
* **Process hygiene.** Workers ignore SIGINT (Ctrl-C reaches the parent, which
  kills them), die with the parent (``PR_SET_PDEATHSIG``), and leave through
  ``os._exit`` so no atexit handler or finaliser inherited from pytest runs in
  them. The parent kills any worker still alive when the call returns or
  raises, so nothing outlives a test.

Failures
--------
If a rank raises, the parent raises :class:`DistributedError` carrying the
formatted traceback of every rank that failed (the first failure first: the
others are often consequences, e.g. gloo "connection closed" in ranks that were
waiting for it; a rank killed by a signal counts as first, since its peers'
errors can reach the parent before its death does); ranks still running ``FAILURE_GRACE_S`` seconds after the first
failure are killed. A rank that dies without reporting (segfault, ``os._exit``)
counts as a failure with its exit code. If ``timeout`` seconds pass first, the
parent dumps the Python stacks of the unfinished ranks (``faulthandler`` on
SIGUSR1), kills all ranks and raises ``TimeoutError`` naming the ranks that
did not return from ``fn`` (and, separately, those that returned but are stuck
in the final barrier waiting for them), stacks included.

Other things workers inherit from the parent
--------------------------------------------
* Random generator states: all ranks start identical, and equal to whatever
  the parent's state was. Seed inside ``fn`` (:func:`seed_everything`).
* Warning filters: under pytest, ``-W error`` / ``filterwarnings = error``
  also applies in the ranks, and warnings a rank emits are not shown by pytest
  (they go to the rank's copy of pytest's recorder). Note that torch 2.13
  flags ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` with a
  FutureWarning in favour of ``all_gather_single`` / ``reduce_scatter_single``
  (same signatures; both work on gloo).
* stdout/stderr file descriptors: a rank's prints land in pytest's capture of
  the calling test.

Python >= 3.12 emits a DeprecationWarning when forking a multi-threaded
process (the parent has OpenMP worker threads); the hazards it warns about are
the ones handled above. Linux only.

This module is the parent's side; `worker.py` beside it is what runs in each
forked rank.
"""

from __future__ import annotations

import gc
import io
import multiprocessing
import os
import pickle
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait as _wait_ready
from typing import Any

import torch
import torch.distributed as dist

from zfunc.testing import worker
from zfunc.testing.worker import WorkerSpec, worker_main

__all__ = [
    "DistributedError",
    "FAILURE_GRACE_S",
    "WORLD_SIZES",
    "run_distributed",
    "seed_everything",
]

#: World sizes the test suite exercises.
WORLD_SIZES = (1, 2, 4)

#: Seconds the parent keeps collecting reports after the first rank failed,
#: before killing the ranks that are still running.
FAILURE_GRACE_S = 1.0

_STACK_DUMP_WAIT_S = 1.0


class DistributedError(RuntimeError):
    """One or more ranks of a :func:`run_distributed` call failed.

    Attributes:
        tracebacks: ``{rank: formatted traceback or exit description}`` for
            every failed rank, in the order the failures happened.
        exceptions: ``{rank: exception object}`` where the exception could be
            pickled back to the parent (absent otherwise).
        first_rank: the rank that failed first.
        killed: ranks that were still running and were killed.
    """

    def __init__(self, message, tracebacks=None, exceptions=None, first_rank=None, killed=()):
        super().__init__(message)
        self.tracebacks = dict(tracebacks or {})
        self.exceptions = dict(exceptions or {})
        self.first_rank = first_rank
        self.killed = list(killed)


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's (if loaded) and torch's global generators.

    Workers inherit the parent's generator states at fork, so all ranks start
    identical but depend on what ran before in the parent: call this inside
    ``fn`` (e.g. ``seed_everything(seed + dist.get_rank())``) when it draws
    random numbers.
    """
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120, **kwargs: Any
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` forked gloo ranks.

    Returns the list of return values, index = rank. Raises
    :class:`DistributedError` if any rank fails and ``TimeoutError`` if the
    ranks have not all finished after ``timeout`` seconds. See the module
    docstring for what the workers look like.
    """
    _check_parent(world_size)
    name = getattr(fn, "__qualname__", repr(fn))
    ctx = multiprocessing.get_context("fork")
    tmpdir = tempfile.mkdtemp(prefix="zfunc-dist-")
    procs: list = []
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    readers = [r for r, _ in pipes]
    try:
        spec = WorkerSpec(fn, args, kwargs, world_size, tmpdir, float(timeout), os.getpid(), pipes)
        # Everything the workers inherit is frozen out of their garbage collector: an inherited object whose
        # finalizer waits on a lock or a thread of the parent (threads do not survive fork) would hang the
        # worker's first collection (seen: Lightning's window thread, then accelerate's gc.collect()).
        gc.freeze()
        try:
            for rank in range(world_size):
                p = ctx.Process(target=worker_main, args=(spec, rank), name=f"zfunc-rank{rank}")
                p.start()
                procs.append(p)
        finally:
            gc.unfreeze()  # (the parent collects its own objects as before)
        for _, w in pipes:
            w.close()
        return _collect(name, procs, readers, tmpdir, float(timeout))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        for r, w in pipes:
            r.close()
            w.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


# ----------------------------------------------------------------------------
# parent side


def _check_parent(world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if "fork" not in multiprocessing.get_all_start_methods():
        raise RuntimeError("run_distributed needs the 'fork' start method (Linux)")
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build")
    if dist.is_initialized():
        raise RuntimeError(
            "the calling process has a default process group; run_distributed's "
            "workers would inherit it. Never init a process group in the test "
            "process (call torch.distributed.destroy_process_group() first)."
        )


def _collect(name, procs, readers, tmpdir, timeout):
    """Wait for every rank's report and exit; raise on failure or timeout.

    Protocol per rank: the worker sends ("ok", result bytes) as soon as ``fn``
    returns, then runs the final barrier and destroys its group, then exits 0;
    or it sends ("error", ...) once and exits 1. A rank is finished when its
    process has exited.
    """
    n = len(procs)
    deadline = time.monotonic() + timeout
    results: list = [None] * n
    returned: set = set()  # ranks whose fn returned (result received)
    live = set(range(n))  # processes not yet seen exiting
    open_readers = dict(enumerate(readers))
    failures: dict = {}  # rank -> (monotonic time, text, exception or None)
    by_obj = {}
    for r in range(n):
        by_obj[readers[r]] = r
        by_obj[procs[r].sentinel] = r
    grace_end = None

    def read(rank):
        try:
            data = readers[rank].recv_bytes()
        except (EOFError, OSError):  # the worker closed its end
            open_readers.pop(rank, None)
            return
        msg = pickle.loads(data)
        if msg[0] == "ok":
            try:
                results[rank] = torch.load(io.BytesIO(msg[1]), weights_only=False)
                returned.add(rank)
            except Exception:
                text = "could not load the rank's result in the parent:\n" + traceback.format_exc()
                failures.setdefault(rank, (time.monotonic(), text, None))
        else:
            _, t, text, exc_bytes = msg
            exc = None
            if exc_bytes is not None:
                try:
                    exc = pickle.loads(exc_bytes)
                except Exception:
                    exc = None
            failures.setdefault(rank, (t, text, exc))

    def exited(rank):
        while rank in open_readers and readers[rank].poll():
            read(rank)
        open_readers.pop(rank, None)
        live.discard(rank)
        procs[rank].join()  # reap; the sentinel fires just before exitcode is set
        code = procs[rank].exitcode
        if rank in failures:
            return
        if rank not in returned:
            # Died without a word (a signal, os._exit): its peers' errors ("connection closed") often
            # reach the parent before its exit does, yet it is the cause. Rank it first.
            failures[rank] = (-1.0 if code < 0 else time.monotonic(), _describe_death(code), None)
        elif code != 0:
            text = "fn returned on this rank, but then " + _describe_death(code, after_result=True)
            failures[rank] = (time.monotonic(), text, None)

    while live:
        now = time.monotonic()
        limit = deadline if grace_end is None else min(deadline, grace_end)
        if now >= limit:
            break
        objs = list(open_readers.values()) + [procs[r].sentinel for r in live]
        for obj in _wait_ready(objs, timeout=limit - now):
            rank = by_obj[obj]
            if obj is procs[rank].sentinel:
                if rank in live:
                    exited(rank)
            elif rank in open_readers:
                read(rank)
        if failures and grace_end is None:
            grace_end = time.monotonic() + FAILURE_GRACE_S

    if failures:
        killed = sorted(live)
        for r in killed:
            procs[r].kill()
        raise _failure_error(name, n, failures, killed)
    if live:
        stuck = sorted(live - returned)
        in_teardown = sorted(live & returned)
        stacks = _dump_stacks(procs, sorted(live), tmpdir)
        for r in live:
            procs[r].kill()
        parts = []
        if stuck:
            parts.append(f"rank(s) {stuck} did not return from {name}")
        if in_teardown:
            parts.append(
                f"rank(s) {in_teardown} returned but did not get through the final "
                "barrier / destroy_process_group"
            )
        msg = (
            f"run_distributed({name}, world_size={n}) timed out after {timeout:g} s: "
            + "; ".join(parts)
            + ". All ranks were killed."
        )
        for r in stuck + in_teardown:
            msg += f"\n\n----- rank {r}: Python stacks at timeout -----\n{stacks[r]}"
        raise TimeoutError(msg)
    return results


def _failure_error(name, n, failures, killed):
    order = sorted(failures, key=lambda r: failures[r][0])
    first = order[0]
    head = (
        f"{len(failures)} of {n} rank(s) failed in run_distributed({name}, world_size={n}); "
        f"first failure: rank {first}."
    )
    if killed:
        head += f" Rank(s) {killed} were still running {FAILURE_GRACE_S:g} s after it and were killed."
    parts = [head]
    if len(order) > 1:
        parts.append(
            "Later failures are often consequences of the first one (e.g. gloo "
            "'Connection closed by peer' in ranks that were waiting for it)."
        )
    if any(AUTOGRAD_FORK_REFUSAL in failures[r][1] for r in order):
        parts.append(AUTOGRAD_FORK_HINT)
    for r in order:
        tag = " (first failure)" if r == first else ""
        parts.append(f"----- rank {r}{tag} -----\n{failures[r][1].rstrip()}")
    return DistributedError(
        "\n\n".join(parts),
        tracebacks={r: failures[r][1] for r in order},
        exceptions={r: failures[r][2] for r in order if failures[r][2] is not None},
        first_rank=first,
        killed=killed,
    )


# What a CUDA build of torch raises in a forked child once the parent ran a backward pass (its autograd engine
# started device threads, which do not survive fork); the CPU build CI runs never raises it.
AUTOGRAD_FORK_REFUSAL = "autograd's threading in combination with fork-based multiprocessing"
AUTOGRAD_FORK_HINT = (
    "The ranks could not run autograd: this is a CUDA build of torch, and the calling process ran a backward "
    "pass (or a compiled step) before forking them, which such a build refuses in every later fork. Run that "
    "work inside the ranks (run_distributed(fn, 1) for a single-process reference) so the test process never "
    "starts autograd; every later run_distributed call in this process fails the same way until then."
)


def _describe_death(code, after_result=False):
    if code < 0:
        try:
            what = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            what = f"was killed by signal {-code}"
    else:
        what = f"exited with code {code}"
    if after_result:
        return f"it {what} during the final barrier / destroy_process_group (see its stderr)"
    text = f"the rank {what} without reporting a result or an exception (see its stderr)"
    if code == -signal.SIGTERM and _numba_layer() == "omp":
        text += (
            ". numba's 'omp' threading layer kills forked children after the parent "
            "ran a parallel numba kernel; set NUMBA_THREADING_LAYER=workqueue before "
            "numba starts its threads (tests/conftest.py does)"
        )
    return text


def _numba_layer():
    if "numba" not in sys.modules:
        return None
    try:
        from numba.np.ufunc import parallel

        return parallel._threading_layer
    except Exception:
        return None


def _dump_stacks(procs, ranks, tmpdir):
    for r in ranks:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except (ProcessLookupError, TypeError):
            pass
    paths = {r: os.path.join(tmpdir, f"stacks-{r}.txt") for r in ranks}
    end = time.monotonic() + _STACK_DUMP_WAIT_S
    while time.monotonic() < end:
        if all(os.path.exists(p) and os.path.getsize(p) > 0 for p in paths.values()):
            time.sleep(0.05)  # let the dumps finish
            break
        time.sleep(0.02)
    out = {}
    for r, p in paths.items():
        try:
            with open(p, errors="replace") as f:
                out[r] = _trim_stack_dump(f.read()) or "(no stack dump received)"
        except OSError:
            out[r] = "(no stack dump received)"
    return out


def _trim_stack_dump(text: str) -> str:
    """Drop the harness frames and the parent's stack below them (inherited at fork)."""
    lines, skipping = [], False
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            skipping = False
        elif (
            not skipping
            and f'File "{worker.__file__}"' in line
            and (" in _run_rank" in line or " in worker_main" in line)
        ):
            skipping = True
            lines.append("  ... (harness and parent frames omitted)")
        if not skipping:
            lines.append(line)
    return "\n".join(lines).rstrip()


# ----------------------------------------------------------------------------
# numba: prefer the fork-safe threading layer (see the module docstring)


def _prefer_fork_safe_numba() -> None:
    if "NUMBA_THREADING_LAYER" in os.environ:
        return
    os.environ["NUMBA_THREADING_LAYER"] = "workqueue"
    numba = sys.modules.get("numba")
    if numba is None:
        return
    try:
        from numba.np.ufunc import parallel

        if not parallel._is_initialized:
            numba.config.THREADING_LAYER = "workqueue"
    except Exception:
        pass


_prefer_fork_safe_numba()
