"""What the examples share: joining torchrun's process group, picking the device, averaging a metric over ranks."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class World:
    """This process's place: ``rank`` of ``size``, its ``device``, and whether it prints (rank 0)."""

    rank: int
    size: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    def log(self, *args, **kwargs) -> None:
        if self.main:
            print(*args, **kwargs, flush=True)

    def mean(self, x: torch.Tensor) -> float:
        """A per-rank metric averaged over ranks (each reports its own batch's)."""
        if self.size == 1:
            return float(x)
        import torch.distributed as dist

        x = x.detach().float().clone().to(self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(x)
        return float(x) / self.size


@contextlib.contextmanager
def distributed(device: str = "auto") -> Iterator[World]:
    """The world this example runs in: under torchrun (``WORLD_SIZE`` set) join its process group (NCCL on
    CUDA, gloo on the CPU) and leave it at the end; otherwise one process, no group."""
    import torch.distributed as dist

    launched = "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        dev = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    else:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    created = False
    if launched and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        created = True
    try:
        if dist.is_initialized():
            yield World(dist.get_rank(), dist.get_world_size(), dev)
        else:
            yield World(0, 1, dev)
    finally:
        if created:
            dist.destroy_process_group()
