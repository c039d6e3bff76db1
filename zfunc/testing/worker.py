"""The forked side of `zfunc.testing.run_distributed`: one gloo rank.

Runs in the child right after fork: makes the process fork-safe (see the
package docstring), joins its own gloo group, runs the function and sends back
its result or formatted traceback through a pipe, then leaves through
``os._exit``.
"""

from __future__ import annotations

import ctypes
import datetime
import faulthandler
import io
import os
import pickle
import signal
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


class WorkerSpec:
    """Everything a worker needs; inherited through fork, never pickled."""

    def __init__(self, fn, args, kwargs, world_size, tmpdir, timeout, parent_pid, pipes):
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.world_size = world_size
        self.tmpdir = tmpdir
        self.timeout = timeout
        self.parent_pid = parent_pid
        self.pipes = pipes


_stack_file = None  # kept open for faulthandler in the worker


def worker_main(spec: WorkerSpec, rank: int) -> None:
    # Runs in the forked child. Never returns: leaves through os._exit.
    code = 1
    conn = spec.pipes[rank][1]
    try:
        for i, (r, w) in enumerate(spec.pipes):
            r.close()
            if i != rank:
                w.close()
        error = _run_rank(spec, rank, conn)
        if error is None:
            code = 0
        else:
            conn.send_bytes(error)
        conn.close()
    except BaseException:  # reporting itself failed: say so on stderr
        try:
            traceback.print_exc()
        except BaseException:
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(code)


def _error_payload(exc: BaseException, prefix: str = "") -> bytes:
    t = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        tb = tb.tb_next  # drop the harness's own frames from the top
    text = prefix + "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        return pickle.dumps(("error", t, text, pickle.dumps(exc)))
    except Exception:  # unpicklable exception object: keep the text only
        return pickle.dumps(("error", t, text, None))


def _setup_worker(spec: WorkerSpec, rank: int) -> None:
    global _stack_file
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(spec.parent_pid)
    # Must come before the first torch op: see "OpenMP is not fork-safe" above.
    torch.set_num_threads(1)
    env = {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(spec.world_size),
        "LOCAL_WORLD_SIZE": str(spec.world_size),
    }
    if any(ifname == "lo" for _, ifname in socket.if_nameindex()):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    numba = sys.modules.get("numba")
    if numba is None:
        # For a numba imported later in this worker. Not once the parent imported it: numba re-reads the
        # variable whenever it compiles a function (a kernel first compiled here, with no cache on disk
        # yet), and refuses a value other than the thread count its configuration started with.
        env["NUMBA_NUM_THREADS"] = "1"
    os.environ.update(env)
    if numba is not None:
        try:
            numba.set_num_threads(1)
        except Exception:
            pass
    _stack_file = open(os.path.join(spec.tmpdir, f"stacks-{rank}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except Exception:
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl
        os._exit(1)


def _run_rank(spec: WorkerSpec, rank: int, conn) -> bytes | None:
    """Run fn on this rank; send the result; return an error payload or None."""
    try:
        _setup_worker(spec, rank)
        store = dist.FileStore(os.path.join(spec.tmpdir, "store"), spec.world_size)
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=spec.world_size,
            store=store,
            # Longer than the harness's deadline, so that a hang is always
            # reported by the parent (as a TimeoutError naming the stuck
            # ranks), never first as a gloo timeout in the ranks waiting on it.
            timeout=datetime.timedelta(seconds=2 * spec.timeout + 10),
        )
        # Every rank has finished connecting before any rank runs fn: a rank
        # that fails at once in fn then cannot break a peer's connect phase
        # (seen: "Gloo connectFullMesh failed ... Connection closed by peer").
        dist.barrier()
        result = spec.fn(*spec.args, **spec.kwargs)
        buf = io.BytesIO()
        torch.save(result, buf)
    except BaseException as e:
        return _error_payload(e)
    conn.send_bytes(pickle.dumps(("ok", buf.getvalue())))
    try:
        if dist.is_initialized():  # fn may have torn it down itself
            # The barrier keeps a rank from closing its gloo sockets while a
            # peer may still be finishing the last collective.
            dist.barrier()
            dist.destroy_process_group()
    except BaseException as e:
        return _error_payload(
            e, "fn returned on this rank, but the final barrier / destroy_process_group failed:\n"
        )
    return None
