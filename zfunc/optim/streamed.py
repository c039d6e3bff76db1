"""The fused Adam update of host-resident optimizer state from GPU gradients, streamed in chunks.

`offload` keeps the fp32 master and the moments in host memory; the
gradients are produced on the GPU, and the compute copy of the new
parameters is needed back on the GPU. Copying all gradients to the host, then
updating, then copying all parameters back would hold two extra full-size
pinned buffers on the host (4 bytes per parameter at bf16) and leave the
copy engines and the CPU idle in turn. Instead each run of parameters goes
through in chunks of ``chunk`` elements, double-buffered:

    gradient chunk j+1: GPU -> pinned buffer (copy engine, device-to-host)
    chunk j: the numba kernel updates master, m, v in place (CPU) and writes the
             new parameters in the compute dtype into a pinned buffer
    chunk j-1: pinned buffer -> the compute parameters on the GPU (host-to-device)

so the host holds the state itself (12 bytes per parameter, in plain pageable
memory: only the buffers a copy engine reads or writes need pinning) plus four
chunk buffers. A gradient that is on the host already (summed there over
micro-batches by `accumulate`, or landing there as backward made it under
`offload` at one micro-batch: `zfunc.tiers.landing`) is read where it is,
after ``ready(grad)`` (the wait for its copy): only the new parameters
travel. The arithmetic is the kernel's, unchanged: the result is bit for bit
that of one whole-state update (chunk boundaries fall on multiples of the
kernel's vector width).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zfunc.tiers.placement import is_mapped, page_out, prefetch

# Elements per chunk: large enough that a chunk's copies run at full PCIe speed, small enough
# that the four pinned buffers stay far below the state (~128 MiB each at fp32).
CHUNK = 1 << 25
ALIGN = 64  # chunk sizes are multiples of this (the kernel's tail handling is per call)


def streamed_update(runs: list[tuple], kernel, out_dtype: torch.dtype | None, chunk: int = CHUNK,
                    ready: Callable[[torch.Tensor], None] | None = None) -> None:
    """Run ``kernel`` over every run, chunk by chunk, with the copies overlapped (module docstring).

    Args:
      runs: ``(param, grad, exp_avg, exp_avg_sq, out, weight_decay[, host_out])``: flat spans; param and
        the moments on the host, grad on one CUDA device; ``out`` the compute copy's span on that device
        (or None); ``host_out`` instead a span on the host (parameters kept in pinned host memory, stage 3
        with ``offload(params="host")``), which the kernel writes directly.
      kernel: ``kernel(p, g, m, v, out_lowp, weight_decay)`` on host chunks (the numba Adam).
      out_dtype: the dtype of ``out`` (bf16/fp16), or None when the parameters themselves (fp32) go back.
      chunk: elements per chunk.
      ready: called with a run's host gradient before the kernel first reads it (waits until it has landed).
    """
    if not runs:
        return
    chunk = max(ALIGN, chunk - chunk % ALIGN)
    # The GPU: that of the gradients, or of the compute copy where the gradients were summed on the host.
    device = next((t.device for run in runs for t in (run[1], run[4] if len(run) > 4 else None)
                   if t is not None and t.device.type == "cuda"), runs[0][1].device)
    grad_dtype = runs[0][1].dtype
    largest = min(chunk, max(p.numel() for p, *_ in runs))
    cuda = device.type == "cuda"  # (off a GPU the same loop runs with plain copies: the tests' way in)
    streams = _Streams(device) if cuda else _Inline()
    down, up = streams.down, streams.up
    on_host = [run[1].device.type == "cpu" and cuda for run in runs]  # gradients read in place
    grad_bufs = [torch.empty(largest if not all(on_host) else 0, dtype=grad_dtype, pin_memory=cuda)
                 for _ in range(2)]
    back_dtype = out_dtype or torch.float32
    out_bufs = [torch.empty(largest, dtype=back_dtype, pin_memory=cuda) for _ in range(2)]
    landed = [streams.event() for _ in range(2)]  # a gradient chunk reached its pinned buffer
    sent = [None, None]  # the event of the last upload from each out buffer

    runs = [tuple(run) + (None,) * (7 - len(run)) + (host,) for run, host in zip(runs, on_host)]
    pieces = [(run, start, min(start + chunk, run[0].numel())) for run in runs
              for start in range(0, run[0].numel(), chunk)]

    def download(i: int) -> None:
        (p, g, *_, host), a, b = pieces[i]
        if host:
            return
        if ready is not None and a == 0:  # (off a GPU the tests' host gradients come this way)
            ready(g)
        slot = i % 2
        with streams.on(down):
            grad_bufs[slot][:b - a].copy_(g[a:b], non_blocking=cuda)
            landed[slot].record(down)

    # Each chunk's state that lives in NVMe tier files (`zfunc.tiers.placement`): read ahead, then paged out.
    on_drive = [[t[a:b] for t in (p, m, v) if is_mapped(t)] for (p, _, m, v, *_), a, b in pieces]

    download(0)
    for piece in on_drive[0]:
        prefetch(piece)
    for i, ((p, g, m, v, out, decay, host_out, host), a, b) in enumerate(pieces):
        slot = i % 2
        if i + 1 < len(pieces):
            download(i + 1)  # its gradient buffer was read by the kernel of chunk i-1, which has returned
            for piece in on_drive[i + 1]:  # the drive reads chunk i+1 while the kernel updates chunk i
                prefetch(piece)
        n = b - a
        if host:
            if ready is not None and a == 0:
                ready(g)
            grad = g[a:b]
        else:
            landed[slot].synchronize()
            grad = grad_bufs[slot][:n]
        if host_out is not None:  # the parameters live on the host: written in place, nothing goes back
            kernel(p[a:b], grad, m[a:b], v[a:b], host_out[a:b] if out_dtype is not None else None, decay)
            if out_dtype is None:
                host_out[a:b].copy_(p[a:b])
            for piece in on_drive[i]:
                page_out(piece)
            continue
        if sent[slot] is not None:
            sent[slot].synchronize()  # the upload of chunk i-2 has left this out buffer
        back = out_bufs[slot][:n]
        kernel(p[a:b], grad, m[a:b], v[a:b], back if out_dtype is not None else None, decay)
        if out_dtype is None:
            back.copy_(p[a:b])  # fp32 parameters go back as they are
        for piece in on_drive[i]:  # written back to the drive and out of host memory
            page_out(piece)
        target = out[a:b] if out is not None else None
        if target is not None:
            with streams.on(up):
                target.copy_(back, non_blocking=cuda)
                event = streams.event()
                event.record(up)
            sent[slot] = event
    streams.finish()


class _Streams:
    """A download and an upload stream on one GPU, ordered after the compute stream, and back."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.down, self.up = torch.cuda.Stream(device), torch.cuda.Stream(device)
        self.down.wait_stream(torch.cuda.current_stream(device))  # gradients were made on the compute stream

    @staticmethod
    def on(stream):
        return torch.cuda.stream(stream)

    @staticmethod
    def event():
        return torch.cuda.Event()

    def finish(self) -> None:
        # The GPU's next work waits for the last uploads; the host does not (the caller's own work between steps
        # runs meanwhile). The pinned chunk buffers they read are not reused before they end: torch's pinned-memory
        # cache records each non-blocking copy's stream and holds a freed buffer until that work is done.
        torch.cuda.current_stream(self.device).wait_stream(self.up)


class _Inline:
    """The same interface with nothing asynchronous (tensors on the CPU)."""

    down = up = None

    @staticmethod
    def on(stream):
        import contextlib  # noqa: PLC0415

        return contextlib.nullcontext()

    @staticmethod
    def event():
        return _Done()

    def finish(self) -> None:
        pass


class _Done:
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass
