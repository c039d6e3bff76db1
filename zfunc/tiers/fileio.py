"""The byte mover behind `DiskStore`: `FileIO` (the interface) and `ThreadedIO` (the engine).

`ThreadedIO` splits each request into chunks of ``chunk_bytes`` and hands
them to a pool of ``threads`` threads, each doing ``os.preadv`` /
``os.pwrite`` straight into / out of the caller's memory (a memoryview of the
tensor's bytes: no copy). Both calls release the GIL, so the chunks of one
request, and of several requests, run in parallel: that keeps a queue of
requests in front of an NVMe drive, and lets a read proceed while a write is
in flight (measured numbers and the defaults' reasons: `zfunc.tiers`).

O_DIRECT (``direct="auto"``/``"on"``): each file is also opened with
``O_DIRECT`` and every chunk whose memory address, file offset and length
are multiples of `ALIGN` (4096) goes through it, bypassing the page cache
(the drive's DMA reads/writes the caller's buffer; no kernel memcpy, no
cache pollution); unaligned heads and tails go through the ordinary
descriptor. Buffers from `aligned_empty` (or pinned CUDA host memory, which
is page aligned) qualify. ``"auto"`` falls back to buffered I/O where the
filesystem refuses O_DIRECT (tmpfs before Linux 6.6, some network or FUSE
filesystems); ``"on"`` raises there.

Other engines plug in behind `FileIO`. KvikIO (not a dependency) would be
one: ``open`` returns a ``kvikio.CuFile(path, "r+")``, ``read_into`` /
``write`` call its ``pread`` / ``pwrite`` (which take host or device
buffers, split them into ``task_size`` pieces over KvikIO's own thread
pool, and use GPUDirect Storage where available) and wrap the returned
``IOFuture`` in a `concurrent.futures.Future` (a thread waiting on
``.get()``, or a callback); it would need no change to `DiskStore` or the
pipeline.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

ALIGN = 4096  # O_DIRECT needs memory, offset and length aligned to the device's logical block (<= 4096)
_MAX_IO = 0x7FFFF000  # Linux moves at most this many bytes per read/write call


class DiskIOError(OSError):
    """An I/O failure (or short read) of a `DiskStore` file; ``errno`` and ``filename`` are set."""

    def __init__(self, message: str, code: int | None, filename: str):
        super().__init__(message)
        self.errno = code
        self.filename = filename

    def __str__(self) -> str:  # OSError's own would show "[Errno n] strerror: filename" instead
        return self.args[0]


class FileIO(Protocol):
    """What `DiskStore` needs from an I/O engine. Methods may be called from any thread."""

    def open(self, path: str) -> object:
        """Open the existing file ``path`` for reading and writing; returns an engine handle."""

    def read_into(self, handle: object, buf: memoryview, offset: int) -> Future:
        """Fill ``buf`` (writable bytes) from file offset ``offset``; the Future resolves when done.

        Errors, short reads included, come through the Future as `DiskIOError`.
        The Future must resolve only after the engine stopped touching ``buf``.
        """

    def write(self, handle: object, buf: memoryview, offset: int) -> Future:
        """Write ``buf`` at file offset ``offset``; same contract as `read_into`."""

    def close(self, handle: object) -> None:
        """Release ``handle`` (no request on it may be in flight)."""

    def shutdown(self) -> None:
        """Wait for every request and stop the engine's threads."""


@dataclass
class _File:
    path: str
    fd: int
    direct_fd: int | None


def aligned_empty(shape: int | tuple[int, ...], dtype: torch.dtype = torch.float32, *,
                  pin_memory: bool = False) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor whose data starts on an `ALIGN`-byte boundary.

    What O_DIRECT needs; torch's own CPU allocations are only 64-byte
    aligned. (Pinned CUDA host allocations are page aligned already, but
    ``pin_memory=True`` works here too.)
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + nbytes].view(dtype).view(shape)


@dataclass
class _Join:
    """Resolves ``result`` once all ``left`` chunks finished, with the first chunk error if any."""

    left: int
    result: Future
    value: object = None
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def chunk_done(self, f: Future) -> None:
        exc = f.exception() if not f.cancelled() else RuntimeError("I/O chunk cancelled")
        with self.lock:
            if exc is not None and self.error is None:
                self.error = exc
            self.left -= 1
            last = self.left == 0
        if last:
            if self.error is not None:
                self.result.set_exception(self.error)
            else:
                self.result.set_result(self.value)


def _chunks(addr: int, nbytes: int, offset: int, chunk: int, direct: bool) -> list[tuple[int, int, bool]]:
    """``(start, length, use_direct)`` pieces of a request; direct pieces are fully `ALIGN`-aligned."""
    if not direct or (addr - offset) % ALIGN:  # memory and file can never be aligned together
        return [(s, min(chunk, nbytes - s), False) for s in range(0, nbytes, chunk)]
    head = min(-addr % ALIGN, nbytes)
    body = (nbytes - head) // ALIGN * ALIGN
    pieces = [(0, head, False)] if head else []
    pieces += [(head + s, min(chunk, body - s), True) for s in range(0, body, chunk)]
    if head + body < nbytes:
        pieces.append((head + body, nbytes - head - body, False))
    return pieces


class ThreadedIO:
    """`FileIO` over a thread pool of ``os.preadv``/``os.pwrite`` calls (see module doc).

    Args:
        threads: pool size (requests from all files share it, first come first served).
        chunk_bytes: the piece one thread moves per task; rounded up to a multiple of `ALIGN`.
        direct: ``"off"`` (page cache), ``"auto"`` (O_DIRECT for aligned pieces where the
            filesystem supports it) or ``"on"`` (like auto, but raise where unsupported).
    """

    def __init__(self, threads: int = 4, chunk_bytes: int = 8 << 20,
                 direct: Literal["off", "auto", "on"] = "auto"):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        if direct not in ("off", "auto", "on"):
            raise ValueError(f"direct must be 'off', 'auto' or 'on', got {direct!r}")
        self.threads = threads
        self.chunk_bytes = -(-chunk_bytes // ALIGN) * ALIGN
        self.direct = direct
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="zfunc-disk")

    def open(self, path: str) -> _File:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        direct_fd = None
        if self.direct == "on" and not hasattr(os, "O_DIRECT"):
            os.close(fd)
            raise DiskIOError("O_DIRECT does not exist on this platform: use direct='auto' or 'off'", None,
                              path)
        if self.direct != "off" and hasattr(os, "O_DIRECT"):
            try:
                direct_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT)
            except OSError as e:
                if self.direct == "on" or e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    os.close(fd)
                    raise DiskIOError(f"cannot open {path} with O_DIRECT: {e.strerror} (use direct='auto' "
                                      f"or 'off' on this filesystem)", e.errno, path) from e
        return _File(path, fd, direct_fd)

    def close(self, handle: _File) -> None:
        for fd in (handle.fd, handle.direct_fd):
            if fd is not None:
                os.close(fd)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)

    def read_into(self, handle: _File, buf: memoryview, offset: int) -> Future:
        return self._submit(handle, buf, offset, reading=True)

    def write(self, handle: _File, buf: memoryview, offset: int) -> Future:
        return self._submit(handle, buf, offset, reading=False)

    def _submit(self, f: _File, buf: memoryview, offset: int, reading: bool) -> Future:
        result: Future = Future()
        result.set_running_or_notify_cancel()
        addr = _address(buf)
        pieces = _chunks(addr, len(buf), offset, self.chunk_bytes, f.direct_fd is not None)
        if not pieces:
            result.set_result(None)
            return result
        join = _Join(len(pieces), result)
        failed = threading.Event()  # later pieces of a failed request are skipped, not attempted
        move = _read_piece if reading else _write_piece
        for start, length, direct in pieces:
            fd = f.direct_fd if direct else f.fd
            task = self.pool.submit(move, f, fd, buf[start:start + length], offset + start, failed)
            task.add_done_callback(join.chunk_done)
        return result


def _address(buf: memoryview) -> int:
    if len(buf) == 0:
        return 0
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _fail(failed: threading.Event, f: _File, op: str, n: int, offset: int, code: int | None, why: str):
    failed.set()
    return DiskIOError(f"{op} {n} bytes at offset {offset} of {f.path} failed: {why}", code, f.path)


def _read_piece(f: _File, fd: int, buf: memoryview, offset: int, failed: threading.Event) -> None:
    if failed.is_set():
        return
    done, n = 0, len(buf)
    while done < n:
        try:
            got = os.preadv(fd, [buf[done:done + _MAX_IO]], offset + done)
        except OSError as e:
            raise _fail(failed, f, "reading", n, offset, e.errno, e.strerror or str(e)) from e
        if got == 0:
            raise _fail(failed, f, "reading", n, offset, errno.EIO,
                        f"short read: the file ends {done} bytes in (was it truncated?)")
        done += got


def _write_piece(f: _File, fd: int, buf: memoryview, offset: int, failed: threading.Event) -> None:
    if failed.is_set():
        return
    done, n = 0, len(buf)
    while done < n:
        try:
            put = os.pwrite(fd, buf[done:done + _MAX_IO], offset + done)
        except OSError as e:
            raise _fail(failed, f, "writing", n, offset, e.errno, e.strerror or str(e)) from e
        if put == 0:
            raise _fail(failed, f, "writing", n, offset, errno.EIO, f"short write: 0 bytes after {done}")
        done += put
