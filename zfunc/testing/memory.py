"""Peak bytes of live CPU tensors while a function runs, from torch.profiler's allocation records.

Why the allocation records and not the ops' memory columns: an op's ``cpu_memory_usage`` also
counts what the ops it calls allocate (``aten::cat`` -> ``aten::empty``: one buffer summed at each
level), and the code Inductor generates frees its buffers outside any op (``del buf3``), which the
profiler charges to the enclosing ``## Call CompiledFxGraph ##`` record at its start. Each
allocation record instead carries the allocator's running total of bytes in use on its device
(``total_allocated``) right after it, in time order: its maximum over the run, less the total
before the first record, is the peak of live tensors, whoever allocated or freed them.

`simulated_rank` runs code as rank 0 of a world of N with torch's fake process group: collectives
return at once and move no data (their outputs hold whatever their memory held), so the values
are meaningless but every buffer is allocated and freed where the program does it. That is what a
memory measurement wants: with gloo the ranks' buffers are also held by gloo's worker threads
until those threads run again after the wait returned (measured: the same compiled step's peak
varied from 5 to 13 blocks' worth of weights between steps on a loaded 2-core machine; 4.16 every
step with the fake group).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator


def peak_cpu_bytes(fn: Callable[[], object]) -> int:
    """The most bytes of CPU tensors live at once while ``fn()`` runs, above those live when it starts
    (0 when it allocates nothing)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = []
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        event = todo.pop()
        todo.extend(event.children)
        fields = event.extra_fields
        if event.tag == _EventType.Allocation and fields.device.type == "cpu":
            records.append((event.start_time_ns, fields.alloc_size, fields.total_allocated))
    if not records:
        return 0
    records.sort()
    _, size, total = records[0]
    before = total - size
    return max(0, max(total for _, _, total in records) - before)


_FAKE_AS_NCCL = "fake_as_nccl"


@contextlib.contextmanager
def simulated_rank(world_size: int, device: str = "cpu") -> Iterator[None]:
    """Run the body as rank 0 of ``world_size`` ranks on torch's fake process group (see the module doc),
    in place of this process's default group (destroyed first: call it in a forked rank of its own).

    ``device="cuda"``: the fake group under a backend name holding "nccl", which `zfunc.dist.Group` takes
    for a GPU group (its device the current CUDA device), so one GPU runs a rank of a larger world.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    backend = "fake"
    if device == "cuda":
        backend = _FAKE_AS_NCCL
        if backend.upper() not in dist.Backend._plugins:
            fake = dist.Backend._plugins["FAKE"]
            dist.Backend.register_backend(backend, fake.creator_fn, extended_api=fake.extended_api,
                                          devices=["cuda"])
    dist.init_process_group(backend, rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def fake_group_copies(device: str = "cpu") -> bool:
    """Whether the fake process group in force fills a gather's output (each rank's part a copy of this
    rank's input, as torch 2.13's does): where it leaves the output as it was allocated, a step computes
    on uninitialized memory, which may hold a NaN (and zfunc stops a step whose loss is not finite)."""
    import torch
    import torch.distributed as dist

    mine = torch.ones(2, device=device)
    out = torch.zeros(2 * dist.get_world_size(), device=device)
    with warnings.catch_warnings():  # (torch 2.13 names it all_gather_single; 2.11 has no such name)
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_into_tensor(out, mine)
    return bool(out.eq(1).all())
