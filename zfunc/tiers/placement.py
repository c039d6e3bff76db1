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
  to the drive, so host memory holds only what is in use.
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
        return mapped

    def summary(self) -> dict[Tier, int]:
        """Units per tier."""
        out: dict[Tier, int] = {"device": 0, "host": 0, "nvme": 0}
        for tier in self.tiers.values():
            out[tier] += 1
        return out


def pinned_copy(values: torch.Tensor) -> torch.Tensor:
    """A copy of ``values`` in page-locked host memory of exactly its size (see the module docstring)."""
    out = torch.empty(values.numel(), dtype=values.dtype)
    nbytes = out.numel() * out.element_size()
    if nbytes:
        cudart = torch.cuda.cudart()
        ptr = out.data_ptr()
        err = cudart.cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:  # not fatal: copies from it are merely synchronous
            return out.copy_(values.reshape(-1))
        weakref.finalize(out, _unregister, ptr)
    return out.copy_(values.reshape(-1))


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ctypes.c_void_p(ptr).value)
    except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone already
        pass
