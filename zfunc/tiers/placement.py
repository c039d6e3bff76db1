"""Where each unit's state lives: the GPU, host memory, or NVMe files, and tensors allocated there.

`shard` cuts the state into units (a block's parameters, one flat buffer per
kind of tensor and rank); `offload` declares the shares of the optimizer
state (fp32 master and moments) per tier (``Facts.optimizer_split``) and
where stage 3's parameter shards live (``Facts.params_tier``). `Placement`
turns those into a tier per unit, whole units at a time in layout order: the
first units' optimizer state stays on the GPU (updated there by the fused GPU
kernel, DeepSpeed's Twin-Flow idea), the last ones go to NVMe, the rest to
the host.

How each tier holds a tensor:

- GPU: an ordinary CUDA tensor (``device``, the group's device; the CPU when
  there is no GPU, so every placement also runs, and is tested, on a CPU-only
  machine).
- host: plain pageable memory, exactly sized: the CPU kernel reads and writes
  it, and only the chunk buffers a copy engine touches are pinned
  (`zfunc.optim.streamed`).
- pinned host (stage 3 parameters kept on the host): page-locked memory
  registered with CUDA (``cudaHostRegister``) on an exactly sized allocation,
  so each unit copies to the GPU asynchronously ahead of its use; torch's own
  ``pin_memory=True`` allocations come from a cache that rounds every request
  up to a power of two (up to 2x the memory for large buffers).
- NVMe: a tensor backed by a file in the user's NVMe directory
  (``torch.from_file(..., shared=True)``: a shared memory map). The file is
  preallocated by `zfunc.tiers.disk.DiskStore` (a clear error when the disk
  is too small) and unlinked as soon as it is mapped, so it disappears with
  the process, even one that is killed, while the mapping keeps the data; the
  kernel pages units in as the update reads them and writes dirty pages back
  to the drive. Left to itself the kernel would keep every page it ever
  touched resident until memory runs short (host memory then looks full of
  NVMe data, and the process's resident size passes any budget), so each
  piece is asked ahead (`prefetch`: readahead while the previous piece
  computes) and handed back once written (`page_out`: written back to the
  drive and dropped from memory), and host memory holds only the pieces in
  flight.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from typing import Literal

import torch

Tier = Literal["device", "host", "nvme"]


class Placement:
    """Tiers for the units of one layout (see the module docstring).

    Args:
      units: ``[(unit name, elements)]`` in layout order (this rank's share of each unit).
      split: the (device, host, nvme) shares of the optimizer state.
      device: the compute device.
      params_tier: "device" or "host": where stage 3 keeps parameter shards.
      nvme_dir: the NVMe tier's directory (needed when its share is not zero).
    """

    def __init__(self, units: list[tuple[str, int]], split: tuple[float, float, float], device: torch.device,
                 params_tier: str = "device", nvme_dir: str | None = None) -> None:
        self.device, self.params_tier, self.nvme_dir = device, params_tier, nvme_dir
        total = sum(n for _, n in units) or 1
        device_share, _, nvme_share = split
        self.tiers: dict[str, Tier] = {}
        taken = 0
        for name, n in units:  # the first units to the GPU, up to its share
            if taken + n <= device_share * total + 1e-9 and device_share > 0:
                self.tiers[name] = "device"
                taken += n
        taken = 0
        for name, n in reversed(units):  # the last ones to NVMe, up to its share
            if name in self.tiers:
                continue
            if taken + n <= nvme_share * total + 1e-9 and nvme_share > 0:
                self.tiers[name] = "nvme"
                taken += n
        for name, _ in units:
            self.tiers.setdefault(name, "host")
        self._store = None

    def optimizer_tensor(self, unit: str, values: torch.Tensor) -> torch.Tensor:
        """A flat copy of ``values`` (a unit's optimizer state of one kind) on ``unit``'s tier."""
        tier = self.tiers[unit]
        if tier == "device":
            return values.to(self.device, copy=True)
        if tier == "nvme":
            return self._mapped(f"{unit or 'root'}", values)
        return values.to("cpu", copy=True)

    def params_tensor(self, values: torch.Tensor) -> torch.Tensor:
        """A flat copy of ``values`` (stage 3 parameter shards) where parameters live."""
        if self.params_tier == "host" and self.device.type == "cuda":
            return pinned_copy(values)
        if self.params_tier == "host":
            return values.to("cpu", copy=True)
        return values.to(self.device, copy=True)

    def _mapped(self, name: str, values: torch.Tensor) -> torch.Tensor:
        from zfunc.tiers.disk import DiskStore  # noqa: PLC0415

        if self.nvme_dir is None:
            raise ValueError("the NVMe tier needs offload(..., nvme_dir=...)")
        if self._store is None:
            self._store = DiskStore(self.nvme_dir)
        file = f"{name}.{len(self._store.names())}"
        self._store.allocate(file, shape=(values.numel(),), dtype=values.dtype)
        path = str(self._store.file_of(file))
        mapped = torch.from_file(path, shared=True, size=values.numel(), dtype=values.dtype)
        os.unlink(path)  # the mapping keeps the data; the file is gone with the process
        mapped.copy_(values.reshape(-1))
        page_out(mapped)
        return mapped

    def summary(self) -> dict[Tier, int]:
        """Units per tier."""
        out: dict[Tier, int] = {"device": 0, "host": 0, "nvme": 0}
        for tier in self.tiers.values():
            out[tier] += 1
        return out


_MADV_WILLNEED, _MADV_DONTNEED, _MADV_PAGEOUT = 3, 4, 21
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def is_mapped(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in an NVMe tier file (a shared file mapping, `Placement._mapped`)."""
    return t.device.type == "cpu" and t.untyped_storage().filename is not None


def prefetch(t: torch.Tensor) -> None:
    """Start reading the pages of ``t`` (part of a mapped NVMe tensor) from the drive, without waiting."""
    _advise(t, _MADV_WILLNEED)


def page_out(t: torch.Tensor) -> None:
    """Write the pages of ``t`` (part of a mapped NVMe tensor) back to the drive and drop them from host
    memory (Linux ``MADV_PAGEOUT``; where the kernel lacks it, ``MADV_DONTNEED``, which drops them from the
    process and leaves the written-back pages to the page cache). The data stays in the file."""
    if not _advise(t, _MADV_PAGEOUT):
        _advise(t, _MADV_DONTNEED)


def _advise(t: torch.Tensor, advice: int) -> bool:
    """``madvise`` over the whole pages inside ``t``'s bytes (a partial page at either end is left alone:
    it may hold a neighbour's data in use). False where the call is refused (old kernel, not Linux)."""
    if not is_mapped(t) or t.numel() == 0:
        return True
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first, last = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
    if last <= first:
        return True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), ctypes.c_int(advice)) == 0
    except (OSError, AttributeError):
        return False


def pinned_copy(values: torch.Tensor) -> torch.Tensor:
    """A copy of ``values`` in page-locked host memory of exactly its size (see the module docstring)."""
    return page_locked_empty(values.numel(), values.dtype).copy_(values.reshape(-1))


def page_locked_empty(n: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat host tensor of exactly ``n`` elements, page-locked (``cudaHostRegister``) for as long as this tensor
    object lives, so that copy engines read and write it directly (asynchronous copies). Where registration is
    not possible (no GPU, or refused) it is plain pageable memory: copies to and from it are then merely
    synchronous. Unregistered when the tensor object is collected; a view that outlives it keeps valid
    (pageable) memory."""
    out = torch.empty(n, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    if nbytes and register_host(out.data_ptr(), nbytes):
        weakref.finalize(out, unregister_host, out.data_ptr())
    return out


def register_host(ptr: int, nbytes: int) -> bool:
    """Page-lock ``nbytes`` of host memory at ``ptr`` with CUDA; False where there is no GPU or CUDA refuses."""
    if not torch.cuda.is_available():
        return False
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) == 0


def unregister_host(ptr: int) -> None:
    """Undo `register_host` (before the memory is freed)."""
    try:
        torch.cuda.cudart().cudaHostUnregister(ctypes.c_void_p(ptr).value)
    except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone already
        pass
