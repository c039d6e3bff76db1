"""`DiskStore`: named, preallocated scratch files, read and written asynchronously from host tensors.

::

    with DiskStore("/nvme/scratch") as store:          # makes /nvme/scratch/zfunc-<pid>-<hex>/
        store.allocate("unit0.exp_avg", shape=(n,), dtype=torch.float32)
        store.write("unit0.exp_avg", buf).result()      # buf: contiguous CPU tensor (pinned or not)
        store.read_into("unit0.exp_avg", buf).result()  # removed, files and directory, on exit

Files: one per name, preallocated with ``posix_fallocate`` (after a free
space check that names what is needed and what is free), so a full disk
fails `allocate`, not a write in the middle of training (on copy-on-write
filesystems, btrfs and ZFS, preallocation reserves less: a write can still
hit ENOSPC there). The directory is created fresh and cleaned up by
`close`, by the context manager, or at interpreter exit (`weakref.finalize`):
only the files this store created, its marker and then the directory are
removed; entries someone else put there are left, with a warning. A killed
process cannot clean up: a later store on the same parent directory logs a
warning naming the dead process's directory, and removes it when asked
(``stale="remove"``, or `zfunc.tiers.remove_stale`); `zfunc.tiers.scratch`
says how a directory is proven dead. A forked child never removes its
parent's store, and cannot use it (its I/O threads do not exist there).

I/O: `write` and `read_into` return a `concurrent.futures.Future` at once;
the bytes move on the engine's threads (`ThreadedIO`: ``threads`` threads
of ``os.pwrite``/``os.preadv`` over ``chunk_bytes`` pieces, straight from/into
the tensor's memory) and the Future resolves, to the tensor, once every
piece is done, or with the first error (`DiskIOError`, an OSError naming
the file, offset and size; short reads included) once every piece has
stopped. Until it resolves the tensor must not be changed (write) or read
(read_into), nor freed. Offsets are in bytes.

Ordering and visibility: requests run concurrently with no order among
them. A read that starts after a write to the same bytes *resolved* sees
that write (the page cache and O_DIRECT are coherent within one machine);
requests on overlapping bytes that are in flight together have an
undefined result: order them through their Futures. Requests on different
names or disjoint ranges may overlap freely, from any threads (the store is
thread-safe).

Durability: none, by design. These are scratch files that live for one
process, so nothing is ever fsynced; `flush` only waits for requests in
flight (and raises the first error since the last `flush`). After a crash
the files are garbage, to be removed, never read.

Choosing the directory: a local NVMe drive (or a RAID0 of several; the
engine's thread count sets the queue depth that keeps them busy). Not a
network filesystem (slow, and fallocate/O_DIRECT may be emulated or
refused), and not tmpfs/ramfs: those hold files in RAM, so the tier would
save no host memory at all. `DiskStore` warns for both kinds.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import warnings
import weakref
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from zfunc.tiers import scratch
from zfunc.tiers.fileio import DiskIOError, FileIO, ThreadedIO

RAM_FILESYSTEMS = ("tmpfs", "ramfs")
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph", "lustre", "glusterfs", "gpfs",
                       "beegfs")


class DiskSpaceError(OSError):
    """Not enough free space for an allocation (``errno`` is ENOSPC)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.errno = errno.ENOSPC

    def __str__(self) -> str:
        return self.args[0]


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def filesystem_type(path: str | os.PathLike) -> str | None:
    """The type (``ext4``, ``tmpfs``, ``nfs4``...) of the filesystem holding ``path`` (/proc/self/mounts)."""
    path = os.path.realpath(path)
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    best, kind = "", None
    for fields in mounts:
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def warn_if_unsuitable(path: str | os.PathLike) -> None:
    """Warn when ``path`` is on a RAM or network filesystem (see the module doc)."""
    kind = filesystem_type(path)
    if kind in RAM_FILESYSTEMS:
        warnings.warn(f"DiskStore directory {path} is on {kind}, which keeps files in RAM: the disk tier "
                      f"would then save no host memory. Use a directory on a local NVMe drive.", stacklevel=3)
    elif kind is not None and (kind in NETWORK_FILESYSTEMS or kind.startswith("fuse")):
        warnings.warn(f"DiskStore directory {path} is on a {kind} filesystem (network or FUSE): expect low "
                      f"bandwidth. Use a directory on a local NVMe drive.", stacklevel=3)


def tensor_bytes(tensor: torch.Tensor, what: str) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview of its own memory (no copy)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{what}: the tensor is on {tensor.device}; DiskStore moves bytes between files and "
                         f"host memory: copy it to a (pinned) CPU buffer first")
    if not tensor.is_contiguous():
        raise ValueError(f"{what}: the tensor is not contiguous (shape {tuple(tensor.shape)}, strides "
                         f"{tensor.stride()}); pass a contiguous buffer (a staging copy)")
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray())
    return memoryview(flat.view(torch.uint8).numpy())


@dataclass
class _Entry:
    file: str
    nbytes: int
    handle: object = None


@dataclass
class _Scratch:
    """Everything the finalizer needs; holds no reference to the `DiskStore` itself."""

    path: Path
    pid: int
    io: FileIO
    entries: dict[str, _Entry] = field(default_factory=dict)
    files: set[str] = field(default_factory=set)  # every file created, even one whose allocate failed
    pending: set[Future] = field(default_factory=set)
    failures: list[BaseException] = field(default_factory=list)
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def cleanup(self) -> None:
        if os.getpid() != self.pid:  # a forked child: the files belong to the parent
            return
        with self.lock:
            self.closed = True
            pending = list(self.pending)
        wait(pending)
        self.io.shutdown()
        for e in self.entries.values():
            if e.handle is not None:
                self.io.close(e.handle)
        scratch.remove(self.path, self.files)


class DiskStore:
    """Named scratch files in a fresh subdirectory of ``directory``; see the module doc.

    Args:
        directory: an existing directory on a local NVMe drive; the store works in a new
            ``zfunc-<pid>-<hex>`` directory inside it.
        threads: I/O threads (the engine's queue depth).
        chunk_bytes: bytes one thread moves per task (multiple of 4096 after rounding up).
        direct: O_DIRECT use: ``"auto"`` (for 4096-aligned pieces where the filesystem allows it),
            ``"on"`` (raise where it does not) or ``"off"`` (page cache only).
        stale: what to do with scratch directories of dead processes found in ``directory``:
            ``"warn"`` (log a warning naming them), ``"remove"`` or ``"ignore"``.
        io: another `FileIO` engine (then ``threads``/``chunk_bytes``/``direct`` are unused); the
            store shuts it down on close.

    Attributes:
        path: the store's own directory; stale: the `StaleDir` list found (and left) at creation.
    """

    def __init__(self, directory: str | os.PathLike, *, threads: int = 4, chunk_bytes: int = 8 << 20,
                 direct: Literal["off", "auto", "on"] = "auto",
                 stale: Literal["warn", "remove", "ignore"] = "warn", io: FileIO | None = None):
        if stale not in ("warn", "remove", "ignore"):
            raise ValueError(f"stale must be 'warn', 'remove' or 'ignore', got {stale!r}")
        engine = io if io is not None else ThreadedIO(threads, chunk_bytes, direct)
        warn_if_unsuitable(directory)
        self.stale = scratch.report_stale(directory, stale)
        path, owner = scratch.create(directory)
        self._s = _Scratch(path, owner.pid, engine)
        self._finalizer = weakref.finalize(self, self._s.cleanup)

    # ------------------------------------------------------------------ inspection

    @property
    def path(self) -> Path:
        """This store's own directory."""
        return self._s.path

    @property
    def closed(self) -> bool:
        return self._s.closed

    def names(self) -> list[str]:
        """Allocated names, in allocation order."""
        with self._s.lock:
            return list(self._s.entries)

    def nbytes(self, name: str) -> int:
        """Bytes allocated to ``name``."""
        return self._entry(name).nbytes

    def file_of(self, name: str) -> Path:
        """The file holding ``name`` (for inspection; do not write it behind the store's back)."""
        return self._s.path / self._entry(name).file

    def __contains__(self, name: object) -> bool:
        return name in self._s.entries

    def __repr__(self) -> str:
        total = sum(e.nbytes for e in self._s.entries.values())
        state = "closed" if self.closed else f"{len(self._s.entries)} files, {gib(total)}"
        return f"DiskStore({str(self.path)!r}, {state})"

    # ------------------------------------------------------------------ allocation

    def ensure_space(self, nbytes: int, what: str = "this allocation") -> None:
        """Raise `DiskSpaceError` unless the filesystem has ``nbytes`` free (check a total up front)."""
        usage = shutil.disk_usage(self._s.path)
        if usage.free >= nbytes:
            return
        hint = ""
        stale = scratch.find_stale(self._s.path.parent)
        if stale:
            held = sum(s.nbytes for s in stale)
            hint = (f"; {len(stale)} scratch directories of dead zfunc processes hold {gib(held)} there: "
                    f"zfunc.tiers.remove_stale({str(self._s.path.parent)!r}) frees them")
        raise DiskSpaceError(f"DiskStore {self._s.path}: {what} needs {gib(nbytes)} ({nbytes} bytes) but the "
                             f"filesystem has {gib(usage.free)} free (of {gib(usage.total)}){hint}")

    def allocate(self, name: str, nbytes: int | None = None, *, shape: tuple[int, ...] | None = None,
                 dtype: torch.dtype | None = None) -> int:
        """Create and preallocate the file for ``name``: ``nbytes``, or room for ``shape`` of ``dtype``.

        Returns the byte size. Raises `DiskSpaceError` when the disk cannot hold it,
        ValueError for a name already allocated.
        """
        if (nbytes is None) == (shape is None) or (shape is not None and dtype is None):
            raise ValueError("allocate takes nbytes, or shape= and dtype=")
        if shape is not None:
            numel = 1
            for s in shape:
                numel *= int(s)
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        if int(nbytes) < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        nbytes = int(nbytes)
        s = self._s
        self._check_usable()
        with s.lock:
            self._check_usable()
            if name in s.entries:
                raise ValueError(f"{name!r} is already allocated in {s.path} "
                                 f"({s.entries[name].nbytes} bytes)")
            entry = s.entries[name] = _Entry(scratch.data_file_name(len(s.files), name), nbytes)
            s.files.add(entry.file)
        try:
            self.ensure_space(nbytes, f"allocating {name!r}")
            path = str(s.path / entry.file)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _preallocate(fd, nbytes, path)
            finally:
                os.close(fd)
            entry.handle = s.io.open(path)
        except BaseException:
            with s.lock:
                del s.entries[name]  # its file stays in s.files: removed on close
            raise
        return nbytes

    # ------------------------------------------------------------------ I/O

    def write(self, name: str, tensor: torch.Tensor, offset: int = 0) -> Future:
        """Start writing ``tensor``'s bytes into ``name`` at byte ``offset``. Resolves to ``tensor``."""
        return self._submit(name, tensor, offset, reading=False)

    def read_into(self, name: str, tensor: torch.Tensor, offset: int = 0) -> Future:
        """Start filling ``tensor`` from ``name`` at byte ``offset``. Resolves to ``tensor``."""
        return self._submit(name, tensor, offset, reading=True)

    def flush(self) -> None:
        """Wait for every request submitted so far; raise the first error since the last flush.

        Does not fsync (scratch files need no durability; see the module doc).
        """
        with self._s.lock:
            pending = list(self._s.pending)
        wait(pending)
        with self._s.lock:
            failures, self._s.failures = self._s.failures, []
        if failures:
            if len(failures) > 1:
                raise DiskIOError(f"{len(failures)} requests failed; the first: {failures[0]}",
                                  getattr(failures[0], "errno", None),
                                  getattr(failures[0], "filename", None)) from failures[0]
            raise failures[0]

    def close(self) -> None:
        """Wait for requests in flight, then remove this store's files and directory. Idempotent."""
        self._finalizer()

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _check_usable(self) -> None:
        """Called twice: before taking the lock (a forked child may inherit it held) and under it."""
        if self._s.closed:
            raise ValueError(f"DiskStore {self._s.path} is closed")
        if os.getpid() != self._s.pid:
            raise RuntimeError(f"DiskStore {self._s.path} was created by process {self._s.pid} and cannot be "
                               f"used in its forked child {os.getpid()}: create a store in the child")

    def _entry(self, name: str) -> _Entry:
        try:
            return self._s.entries[name]
        except KeyError:
            known = ", ".join(repr(n) for n in list(self._s.entries)[:8])
            raise KeyError(f"{name!r} is not allocated in {self._s.path} (allocated: {known or 'nothing'}"
                           f"{', ...' if len(self._s.entries) > 8 else ''})") from None

    def _submit(self, name: str, tensor: torch.Tensor, offset: int, reading: bool) -> Future:
        op = "read_into" if reading else "write"
        buf = tensor_bytes(tensor, f"DiskStore.{op}({name!r})")
        entry = self._entry(name)
        offset = int(offset)
        if offset < 0 or offset + len(buf) > entry.nbytes:
            raise ValueError(f"DiskStore.{op}({name!r}): {len(buf)} bytes at offset {offset} do not fit in "
                             f"the {entry.nbytes} bytes allocated to {name!r}")
        s = self._s
        self._check_usable()
        with s.lock:
            self._check_usable()
            move = s.io.read_into if reading else s.io.write
            inner = move(entry.handle, buf, offset)
            outer: Future = Future()
            outer.set_running_or_notify_cancel()
            s.pending.add(outer)
        inner.add_done_callback(lambda f: _settle(s, outer, f, tensor))
        return outer


def _settle(s: _Scratch, outer: Future, inner: Future, tensor: torch.Tensor) -> None:
    exc = inner.exception()
    with s.lock:
        s.pending.discard(outer)
        if exc is not None:
            s.failures.append(exc)
    if exc is not None:
        outer.set_exception(exc)
    else:
        outer.set_result(tensor)


def _preallocate(fd: int, nbytes: int, path: str) -> None:
    """Reserve ``nbytes`` of blocks for ``fd``; fall back to a sparse file where the filesystem cannot."""
    if nbytes == 0:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return
    except AttributeError:  # pragma: no cover - no posix_fallocate (macOS)
        pass
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise DiskSpaceError(f"DiskStore: preallocating {gib(nbytes)} for {path} failed: no space left "
                                 f"on the device") from e
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise DiskIOError(f"preallocating {nbytes} bytes for {path} failed: {e.strerror}", e.errno,
                              path) from e
    warnings.warn(f"{path}: the filesystem cannot preallocate; the file is sparse, so a full disk would "
                  f"surface as a write error during training", stacklevel=4)
    os.ftruncate(fd, nbytes)
