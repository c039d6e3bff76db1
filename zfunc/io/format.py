"""The bytes on disk: safetensors files written and read in a streaming way, checksums, the manifest.

Every rank file is a standard safetensors file (8-byte little-endian header
length, a JSON header, then the raw little-endian tensor bytes in header
order), so ``safetensors.safe_open`` and ``safetensors.torch.load_file``
read it. It is written here rather than with ``safetensors.torch.save_file``
because that refuses tensors sharing storage (shard's per-key views of one
flat buffer) and builds the whole file in memory first; here each tensor's
bytes go straight from its memory to the file, and the SHA-256 of the file
is computed on the same bytes as they are written (in a second thread, so
hashing overlaps the write). Reading goes straight into the destination
tensor's memory (``readinto``), so nothing is ever unpickled.
"""

from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import json
import math
import os
import stat
import struct
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

FORMAT = "zfunc-checkpoint"
FORMAT_VERSION = 4  # the newest this zfunc reads. 2: manifest.sha256, ties, latest records the manifest's digest;
#                    3: one section of how the state is split beyond shard: "tensor_parallel" (the tp split and each
#                    rank's (dp, tp) coordinates) or "pipeline" (the rank holding each parameter); 4: "mesh" (the
#                    dp x pp x tp sizes and each rank's coordinates) with either section or both
WRITTEN_VERSION = 2  # what a save writes, unless the state is split by tensor_parallel or pipeline:
MESH_VERSION = 4
SECTIONS = ("tensor_parallel", "pipeline")  # the optional manifest sections of formats 3 and 4
MANIFEST = "manifest.json"
LATEST = "latest"
CHUNK = 64 << 20          # bytes per write/read/hash piece of a large tensor
MAX_HEADER = 256 << 20    # a header larger than this is corruption, not a model


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read: the message names the file and what is wrong."""


class MissingFile(CheckpointError):
    """A file a checkpoint should hold is not there."""


DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
TORCH_DTYPES = {code: dtype for dtype, code in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r}")
    return dtype


def as_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, as a memoryview of its own memory (copied only if not contiguous)."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


# --------------------------------------------------------------------------
# Writing


class HashingFile:
    """A file opened for writing whose SHA-256 is computed, in a helper thread, from what is written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "wb")  # noqa: SIM115 (closed in close())
        self.hash = hashlib.sha256()
        self.size = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zfunc-io-hash")
        self._pending: concurrent.futures.Future | None = None
        self._keep: Any = None

    def write(self, data: memoryview | bytes) -> None:
        for start in range(0, max(len(data), 1), CHUNK):
            piece = data[start:start + CHUNK]
            if self._pending is not None:
                self._pending.result()  # one hash in flight: it may not lag the writes by more than a chunk
            if len(piece) >= 1 << 20:   # hashlib releases the GIL on large buffers: overlap with the write
                self._pending, self._keep = self._pool.submit(self.hash.update, piece), piece
            else:
                self._pending, self._keep = None, None
                self.hash.update(piece)
            self.file.write(piece)
            self.size += len(piece)

    def close(self) -> str:
        """Flush, fsync and close; returns the hex SHA-256 of everything written."""
        try:
            if self._pending is not None:
                self._pending.result()
            self.file.flush()
            os.fsync(self.file.fileno())
        finally:
            self.file.close()
            self._pool.shutdown()
            self._keep = None
        return self.hash.hexdigest()

    def abort(self) -> None:
        self.file.close()
        self._pool.shutdown(wait=True)


def write_safetensors(path: Path, specs: list[tuple[str, torch.dtype, list[int]]], tensors: Iterable[torch.Tensor],
                      metadata: dict[str, str] | None = None) -> tuple[int, str]:
    """Write a safetensors file; returns ``(bytes, sha256)``.

    ``specs`` (name, dtype, shape) make the header; ``tensors`` (any
    iterable, e.g. a generator that builds one tensor at a time) yields the
    tensors in the same order, each with that dtype and element count. They
    may live on any device and share storage: a CPU tensor is written from
    its own memory, any other is copied to the host on its own.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, dtype, shape in specs:
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: cannot store {name!r}: dtype {dtype} is not supported by safetensors")
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    out = HashingFile(path)
    try:
        out.write(struct.pack("<Q", len(head)) + head)
        chunks = 0  # alternates the staging buffers across tensors: one may still be hashed
        for (name, dtype, shape), t in zip(specs, tensors, strict=True):
            if t.dtype != dtype or t.numel() != math.prod(shape):
                raise CheckpointError(f"{path}: {name!r} changed while it was written ({t.dtype}, {t.numel()} "
                                      f"elements; the header has {dtype}, shape {list(shape)})")
            if t.device.type == "cpu":
                out.write(as_bytes(t))
            else:  # through two pinned host buffers, a chunk at a time: host memory stays bounded
                src = t.detach().reshape(-1).contiguous().view(torch.uint8)
                bufs = staging_buffers(min(CHUNK, src.numel()))
                for start in range(0, src.numel(), CHUNK):
                    n = min(CHUNK, src.numel() - start)
                    buf = bufs[chunks % 2][:n]
                    chunks += 1
                    buf.copy_(src[start:start + n])
                    out.write(memoryview(buf.numpy()).cast("B"))
        return out.size, out.close()
    except BaseException:
        out.abort()
        raise


# --------------------------------------------------------------------------
# Reading


def open_regular(path: Path) -> int:
    """A read-only descriptor of ``path``, which must be a regular file and not a symbolic link.

    A checkpoint is read only from what zfunc wrote inside its directory: a
    symbolic link there (to another run's files, or anywhere else) is refused
    by the kernel (``O_NOFOLLOW``) before anything is read through it.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MissingFile(f"{path}: file is missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{path}: is a symbolic link; zfunc reads only the files it wrote inside a "
                                  "checkpoint, never through links") from None
        raise CheckpointError(f"{path}: cannot open ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: not a regular file")
    return fd


def read_small(path: Path, limit: int) -> bytes:
    """The whole of a small file (a manifest, its checksum, ``latest``), refused past ``limit`` bytes."""
    with os.fdopen(open_regular(path), "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{path}: more than the {limit} bytes a zfunc {path.name} can have")
    return data


class Entry:
    """One tensor of a safetensors file: dtype, shape and absolute byte range."""

    __slots__ = ("dtype", "end", "name", "shape", "start")

    def __init__(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], start: int, end: int) -> None:
        self.name, self.dtype, self.shape, self.start, self.end = name, dtype, shape, start, end

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class TensorFile:
    """A safetensors file opened for lazy, zero-copy reads of element ranges.

    The header is validated against the file size on open, so a truncated or
    garbled file fails here (as `CheckpointError`) and never inside torch.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.file = os.fdopen(open_regular(self.path), "rb", buffering=0)
        try:
            self.size = os.fstat(self.file.fileno()).st_size
            self.metadata, self.entries = self._read_header()
        except BaseException:
            self.file.close()
            raise

    def _fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {what}")

    def _read_header(self) -> tuple[dict[str, str], dict[str, Entry]]:
        raw = self.file.read(8)
        if len(raw) < 8:
            raise self._fail(f"truncated: {self.size} bytes, not even a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > min(MAX_HEADER, self.size - 8):
            raise self._fail(f"corrupt or truncated: header length {n} does not fit in a file of {self.size} bytes")
        try:
            header = json.loads(self.file.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._fail(f"corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise self._fail("corrupt safetensors header (not a JSON object)")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise self._fail("corrupt safetensors header (__metadata__ is not a JSON object)")
        base, entries, end = 8 + n, {}, 8 + n
        for name, info in header.items():
            try:
                dtype = TORCH_DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                a, b = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._fail(f"corrupt safetensors header entry {name!r}: {info!r}") from None
            entry = Entry(name, dtype, shape, base + a, base + b)
            if a < 0 or b < a or min(shape, default=0) < 0 or entry.numel * dtype.itemsize != b - a:
                raise self._fail(f"corrupt safetensors header: {name!r} has {b - a} bytes for shape {list(shape)} "
                                 f"of {dtype}")
            entries[name] = entry
            end = max(end, base + b)
        if end > self.size:
            raise self._fail(f"truncated: the header describes {end} bytes, the file has {self.size}")
        return metadata, entries

    def entry(self, name: str) -> Entry:
        try:
            return self.entries[name]
        except KeyError:
            raise self._fail(f"has no tensor {name!r}; the manifest says it should") from None

    def read_into(self, name: str, begin: int, out: torch.Tensor) -> None:
        """Elements ``[begin, begin + out.numel())`` of tensor ``name`` (flattened) into ``out``.

        ``out`` may be any tensor; when it is a contiguous CPU tensor of the
        stored dtype the bytes are read straight into its memory.
        """
        entry = self.entry(name)
        count = out.numel()
        if begin < 0 or begin + count > entry.numel:
            raise self._fail(f"{name!r} holds {entry.numel} elements, asked for [{begin}, {begin + count})")
        if count == 0:
            return
        position = entry.start + begin * entry.dtype.itemsize
        if out.dtype == entry.dtype and out.is_contiguous():
            if out.device.type == "cpu":  # straight into the destination's memory
                self._readinto(position, as_bytes_writable(out))
                return
            dst = out.view(-1).view(torch.uint8)  # another device: through a pinned chunk
            buf = staging_buffers(min(CHUNK, dst.numel()))[0]
            for start in range(0, dst.numel(), CHUNK):
                n = min(CHUNK, dst.numel() - start)
                self._readinto(position + start, as_bytes_writable(buf[:n]))
                dst[start:start + n].copy_(buf[:n])
            return
        buf = torch.empty(count, dtype=entry.dtype)  # another dtype (or layout): read, then cast
        self._readinto(position, as_bytes_writable(buf))
        out.copy_(buf.view(out.shape))

    def read(self, name: str) -> torch.Tensor:
        """A new CPU tensor with the stored dtype and shape."""
        entry = self.entry(name)
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self.read_into(name, 0, out)
        return out

    def _readinto(self, position: int, view: memoryview) -> None:
        done = 0  # pread: no shared file position, so threads may read one file at once
        while done < len(view):
            n = os.preadv(self.file.fileno(), [view[done:done + (1 << 30)]], position + done)
            if not n:
                raise self._fail(f"truncated: ended at byte {position + done} of {self.size}")
            done += n

    def sha256(self) -> str:
        """SHA-256 of the whole file, read in chunks (hashing one chunk while reading the next)."""
        h = hashlib.sha256()
        size = max(1, min(CHUNK, self.size))
        bufs = [bytearray(size), bytearray(size)]
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zfunc-io-hash") as pool:
            pending, i, position = None, 0, 0
            while True:
                buf = memoryview(bufs[i % 2])
                n = os.preadv(self.file.fileno(), [buf], position)
                if pending is not None:
                    pending.result()
                if not n:
                    break
                pending = pool.submit(h.update, buf[:n])
                i, position = i + 1, position + n
        return h.hexdigest()

    def close(self) -> None:
        self.file.close()


_staging = threading.local()


def staging_buffers(nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two host byte buffers of at least ``nbytes`` for this thread (pinned when CUDA is present), reused."""
    have = getattr(_staging, "bufs", None)
    if have is None or have[0].numel() < nbytes:
        pin = torch.cuda.is_available()
        have = _staging.bufs = tuple(torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2))
    return have


def as_bytes_writable(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


class RankFiles:
    """All the part files one rank wrote, opened, with an index from tensor name to its part.

    ``info`` is the rank's entry of the manifest's ``files``. Each part's size
    is checked against the manifest before it is opened, so a missing or
    truncated part names itself.
    """

    def __init__(self, step_dir: Path, info: dict[str, Any]) -> None:
        self.rank = info["rank"]
        self.parts: list[TensorFile] = []
        self.digests: list[str] = []
        self.index: dict[str, TensorFile] = {}
        try:
            for index, part in enumerate(info["parts"]):
                path = Path(step_dir) / part["file"]
                check_size(path, part["bytes"], self.rank)
                f = TensorFile(path)
                self.parts.append(f)
                written_as = (f.metadata.get("rank"), f.metadata.get("part"))
                if written_as != (str(self.rank), str(index)):
                    raise CheckpointError(f"{path}: written as part {written_as[1]} of rank {written_as[0]}, but "
                                          f"the manifest lists it as part {index} of rank {self.rank}: files were "
                                          "swapped or copied between checkpoints")
                self.digests.append(part["sha256"])
                for name in f.entries:
                    self.index[name] = f
        except BaseException:
            self.close()
            raise

    def file_of(self, name: str) -> TensorFile:
        try:
            return self.index[name]
        except KeyError:
            raise CheckpointError(f"{self.parts[0].path}: rank {self.rank}'s files have no tensor {name!r}; the "
                                  "manifest says they should") from None

    def entry(self, name: str) -> Entry:
        return self.file_of(name).entry(name)

    def read(self, name: str) -> torch.Tensor:
        return self.file_of(name).read(name)

    def close(self) -> None:
        for f in self.parts:
            f.close()


def check_size(path: Path, expected: int, rank: int) -> None:
    """``path`` is a regular file (not a link) of ``expected`` bytes; a stat, nothing is opened."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: rank {rank}'s file is missing; the checkpoint is incomplete (if every "
                              "rank saved, the ranks may not share this filesystem)") from None
    if stat.S_ISLNK(info.st_mode):
        raise CheckpointError(f"{path}: is a symbolic link; zfunc reads only the files it wrote inside a "
                              "checkpoint, never through links")
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{path}: not a regular file")
    size = info.st_size
    if size != expected:
        raise CheckpointError(f"{path}: {'truncated' if size < expected else 'corrupt'}: {size} bytes, the manifest "
                              f"says {expected}")


def verify_checksums(files: Iterable[RankFiles]) -> None:
    """Compare every part's SHA-256 with the manifest's, hashing the parts in parallel threads."""
    parts = [(f, digest) for rank in files for f, digest in zip(rank.parts, rank.digests)]
    if not parts:
        return
    with concurrent.futures.ThreadPoolExecutor(min(len(parts), os.cpu_count() or 1),
                                               thread_name_prefix="zfunc-io-verify") as pool:
        for (f, digest), actual in zip(parts, pool.map(lambda fd: fd[0].sha256(), parts)):
            if actual != digest:
                raise CheckpointError(f"{f.path}: checksum mismatch (its SHA-256 differs from the manifest's): the "
                                      "file is corrupted")


# --------------------------------------------------------------------------
# Small files written atomically, directories made durable


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str, token: str) -> None:
    """``path`` holds ``text`` or its old content, never a mix: temp file, fsync, rename, fsync dir."""
    tmp = path.with_name(f"{path.name}.tmp-{token}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class progress_bar:  # noqa: N801 (used as a context manager)
    """A tqdm bar over bytes when ``enabled``, else a no-op with the same methods."""

    def __init__(self, enabled: bool, total: int, desc: str) -> None:
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm  # noqa: PLC0415
            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc)

    def update(self, nbytes: int) -> None:
        if self.bar is not None:
            self.bar.update(nbytes)

    def counting(self, tensors: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]:
        """``tensors`` passed through, each counted once it has been consumed."""
        for t in tensors:
            yield t
            self.update(t.numel() * t.element_size())

    def __enter__(self) -> progress_bar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
