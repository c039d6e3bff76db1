"""`AdamSegments`: which weight decay applies where in a flat buffer, as a chunk table.

The table `zfunc.kernels.gpu_adam.adam_flat_` launches over: one row per
chunk of at most `CHUNK` elements (start, length, weight decay), built once
per layout and reused every step. Kept apart from the kernels' API because it
is plain bookkeeping: runs in, validated, merged and split at `ALIGN`
boundaries, out as device tensors.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from typing import Sequence

import numpy
import torch

__all__ = ["ALIGN", "CHUNK", "MIN_CHUNK", "PROGRAMS_PER_SM", "AdamRuns", "AdamSegments", "all_16_byte_aligned",
           "auto_chunk", "chunk_spans", "sm_count"]

# Elements per row of the chunk table: one Triton program updates at most this many elements.
# Big enough that the per-program scalar work (two powf, a few divisions) is noise. On a GPU,
# AdamSegments.build shrinks it (down to MIN_CHUNK) for buffers too small to give every SM
# PROGRAMS_PER_SM programs at this size, so small shards still fill the machine.
CHUNK = 65536
MIN_CHUNK = 2048
PROGRAMS_PER_SM = 8

# Chunk boundaries inside a run fall on multiples of ALIGN elements. A program whose chunk starts
# and ends on such boundaries can prove it to the compiler, which then issues 16-byte vector loads
# (4 fp32, 8 bf16); the (at most two per run) short unaligned pieces at a run's ends take a
# scalar path.
ALIGN = 16


class AdamSegments:
    """Which weight decay applies where in a flat buffer, as a chunk table on the device.

    Build once per layout with :meth:`build` (or :meth:`from_views`), reuse every step.

    Attributes:
        runs: the normalized runs ``(start, length, weight_decay)`` (sorted, adjacent runs
            with equal decay merged, empty ones dropped); the torch backend works from these.
        starts, lengths: int64 device tensors, one row per chunk (``length <= chunk``).
        weight_decays: float32 device tensor, the decay of each chunk (the same float32
            value torch's kernel would use).
        chunk: the most elements of one chunk.
        end: one past the last covered element (a buffer must have at least this many).
        numel: how many elements the runs cover.
    """

    __slots__ = ("chunk", "end", "lengths", "numel", "runs", "starts", "weight_decays")

    def __init__(self, runs, starts, lengths, weight_decays, chunk):
        self.runs = runs
        self.starts = starts
        self.lengths = lengths
        self.weight_decays = weight_decays
        self.chunk = chunk
        self.end = max((s + n for s, n, _ in runs), default=0)
        self.numel = sum(n for _, n, _ in runs)

    @property
    def device(self) -> torch.device:
        return self.starts.device

    @property
    def num_chunks(self) -> int:
        return self.starts.numel()

    def __repr__(self):
        return (f"AdamSegments({len(self.runs)} runs, {self.num_chunks} chunks of <= {self.chunk}, "
                f"{self.numel} elements up to {self.end}, on {self.device})")

    @classmethod
    def build(cls, runs: Sequence[tuple[int, int, float]], device, *, chunk: int | None = None) -> AdamSegments:
        """Chunk table for ``runs`` of ``(start, length, weight_decay)`` in element units.

        Runs must not overlap (an element updated twice would be a silent bug); their order
        does not matter. ``chunk``: a positive multiple of ``ALIGN``; by default ``CHUNK``,
        less on a GPU for small buffers (see ``CHUNK``).
        """
        device = torch.device(device)
        runs = list(runs)
        if chunk is None:
            chunk = auto_chunk(sum(max(0, _as_int_or(r, 1)) for r in runs), device)
        if not isinstance(chunk, int) or chunk <= 0 or chunk % ALIGN:
            raise ValueError(f"chunk must be a positive multiple of {ALIGN}, got {chunk!r}")
        norm = []
        for i, run in enumerate(runs):
            try:
                start, length, wd = run
                start, length, wd = _as_int(start), _as_int(length), float(wd)
            except (TypeError, ValueError):
                raise ValueError(f"runs[{i}] must be (start: int, length: int, weight_decay: float), "
                                 f"got {run!r}") from None
            if start < 0 or length < 0:
                raise ValueError(f"runs[{i}] = {run!r}: start and length must be >= 0")
            if not math.isfinite(wd):
                raise ValueError(f"runs[{i}] = {run!r}: weight_decay must be finite")
            if length:
                norm.append((start, length, wd))
        norm.sort()
        merged: list[tuple[int, int, float]] = []
        for start, length, wd in norm:
            if merged:
                s0, n0, wd0 = merged[-1]
                if start < s0 + n0:
                    raise ValueError(f"runs overlap: [{s0}, {s0 + n0}) and [{start}, {start + length})")
                if start == s0 + n0 and wd == wd0:
                    merged[-1] = (s0, n0 + length, wd0)
                    continue
            merged.append((start, length, wd))

        rows = [(s, n, wd) for start, length, wd in merged for s, n in chunk_spans(start, length, chunk)]
        starts = torch.tensor([r[0] for r in rows], dtype=torch.int64, device=device)
        lengths = torch.tensor([r[1] for r in rows], dtype=torch.int64, device=device)
        wds = torch.tensor([r[2] for r in rows], dtype=torch.float32, device=device)
        return cls(tuple(merged), starts, lengths, wds, chunk)

    @classmethod
    def uniform(cls, numel: int, weight_decay: float, device, *, chunk: int | None = None) -> AdamSegments:
        """One run over a whole buffer of ``numel`` elements."""
        return cls.build([(0, numel, weight_decay)], device, chunk=chunk)

    @classmethod
    def from_views(cls, flat: torch.Tensor, views: Sequence[tuple[torch.Tensor, float]], *,
                   chunk: int | None = None) -> AdamSegments:
        """Runs from ``(view, weight_decay)`` pairs, each view a contiguous view into ``flat``
        (e.g. the per-parameter views of one flat shard), on ``flat``'s device."""
        if not isinstance(flat, torch.Tensor) or not flat.is_contiguous():
            raise ValueError("flat must be a contiguous tensor")
        base, item = flat.data_ptr(), flat.element_size()
        runs = []
        for i, (view, wd) in enumerate(views):
            if not isinstance(view, torch.Tensor):
                raise ValueError(f"views[{i}] is a {type(view).__name__}, expected a tensor")  # noqa: TRY004
            if view.numel() == 0:
                continue
            if view.dtype != flat.dtype or view.device != flat.device or not view.is_contiguous():
                raise ValueError(f"views[{i}] must be a contiguous {flat.dtype} view on {flat.device}")
            off = view.data_ptr() - base
            if off % item or off < 0 or off // item + view.numel() > flat.numel():
                raise ValueError(f"views[{i}] does not lie inside flat")
            runs.append((off // item, view.numel(), wd))
        return cls.build(runs, flat.device, chunk=chunk)


def chunk_spans(start: int, length: int, chunk: int) -> list[tuple[int, int]]:
    """``[start, start + length)`` as chunks ``(start, length)`` of at most ``chunk`` elements whose
    boundaries inside the run fall on multiples of `ALIGN` (a chunk table's rows for one run)."""
    end = start + length
    a = -(-start // ALIGN) * ALIGN  # first aligned boundary inside the run
    b = end // ALIGN * ALIGN  # last one
    if a >= b:  # too short for an aligned middle: scalar pieces
        return [(s, min(chunk, end - s)) for s in range(start, end, chunk)]
    rows = [(start, a - start)] if start < a else []
    rows.extend((s, min(chunk, b - s)) for s in range(a, b, chunk))
    if b < end:
        rows.append((b, end - b))
    return rows


def _as_int_or(run, i: int, default: int = 0) -> int:
    """``run[i]`` as an int if it is one (for sizing only: build validates runs properly)."""
    try:
        return _as_int(run[i])
    except (TypeError, ValueError, IndexError):
        return default


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def auto_chunk(total: int, device: torch.device) -> int:
    """CHUNK, or on a GPU the largest power of two >= MIN_CHUNK that still gives every SM
    PROGRAMS_PER_SM programs for ``total`` elements."""
    if device.type != "cuda" or total <= 0:
        return CHUNK
    want = PROGRAMS_PER_SM * sm_count(device)
    chunk = CHUNK
    while chunk > MIN_CHUNK and total // chunk < want:
        chunk //= 2
    return chunk


def _as_int(x) -> int:
    if isinstance(x, bool):
        raise TypeError("bool")
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.is_floating_point():
            raise TypeError("not an integer")
        return int(x.item())
    return operator.index(x)


class AdamRuns:
    """Many runs, each with its own buffers, as one chunk table: what one launch of
    `zfunc.kernels.gpu_adam.adam_runs_` updates.

    A run is four flat buffers of one length (param, exp_avg, exp_avg_sq and, optionally, a 16-bit
    copy of the param), given by their addresses, with a list of segments ``(start, length,
    weight_decay)`` inside it; the gradients' addresses (one per run) are set per call
    (`set_grads`): the tables of the state's buffers are built once, and a step moves only the
    gradients' addresses to the device, and only when they changed.

    The table holds addresses, not tensors: whoever builds it keeps the buffers alive and where they
    were, and checks so before each call (`zfunc.optim.fused_plan.DevicePlan` does, per step).

    Attributes:
        chunks: int64 device tensor, one row ``(run, start, length, aligned)`` per chunk of at most
            ``chunk`` elements (``aligned``: the run's buffers are 16-byte aligned and the chunk lies
            on the ALIGN grid).
        weight_decays: float32 device tensor, the decay of each chunk.
        bases: int64 device tensor, one row ``(param, exp_avg, exp_avg_sq, out)`` of addresses per run.
        grads: int64 device tensor, the gradients' address of each run (`set_grads`).
        out_dtype: the dtype of the copies (None: no copy), lengths: each run's, numel: their sum.
    """

    __slots__ = ("_cuda", "_grad_ptrs", "bases", "chunk", "chunks", "device", "grads", "grads_aligned", "launcher",
                 "lengths", "num_chunks", "numel", "out_dtype", "weight_decays")

    def __init__(self, chunks, weight_decays, bases, lengths, out_dtype, chunk):
        self.chunks, self.weight_decays, self.bases = chunks, weight_decays, bases
        self.lengths, self.out_dtype, self.chunk = lengths, out_dtype, chunk
        self.numel = sum(lengths)
        # (Read once: each launch asks for them, and the tables never change.)
        self.device: torch.device = chunks.device
        self.num_chunks: int = chunks.shape[0]
        self.grads = torch.zeros(len(lengths), dtype=torch.int64, device=bases.device)
        self._cuda = self.grads.device.type == "cuda"
        self._grad_ptrs: list[int] | None = None
        self.grads_aligned = False  # whether every address set last is 16-byte aligned (`set_grads`)
        # What `zfunc.kernels.gpu_adam.adam_runs_` launches this table with (Triton interpreted or not, the kernel,
        # its block and warps), found at its first launch: the table does not change, nor what runs it.
        self.launcher: tuple | None = None

    def __repr__(self):
        return (f"AdamRuns({len(self.lengths)} runs, {self.num_chunks} chunks of <= {self.chunk}, "
                f"{self.numel} elements, on {self.device})")

    @classmethod
    def build(cls, bases: Sequence[tuple[int, int, int, int]], segments: Sequence[Sequence[tuple[int, int, float]]],
              lengths: Sequence[int], device, *, out_dtype: torch.dtype | None = None,
              chunk: int | None = None) -> AdamRuns:
        """The table of runs: ``bases[i]`` the addresses ``(param, exp_avg, exp_avg_sq, out)`` of run
        ``i`` (``out`` 0 without copies), ``segments[i]`` its ``(start, length, weight_decay)`` inside
        ``[0, lengths[i])`` (not overlapping; adjacent ones of one decay are merged)."""
        device = torch.device(device)
        if not (len(bases) == len(segments) == len(lengths)):
            raise ValueError(f"{len(bases)} bases, {len(segments)} segment lists and {len(lengths)} lengths: "
                             "give one of each per run")
        if chunk is None:
            chunk = auto_chunk(sum(lengths), device)
        rows, wds = [], []
        for i, (base, segs, length) in enumerate(zip(bases, segments, lengths)):
            aligned = all(b % 16 == 0 for b in base[:3]) and (out_dtype is None or base[3] % 16 == 0)
            table = AdamSegments.build(segs, "cpu", chunk=chunk)  # validated, sorted, merged
            if table.end > length:
                raise ValueError(f"run {i}: segments reach element {table.end}, the run has {length}")
            for start, n, wd in table.runs:
                for s, m in chunk_spans(start, n, chunk):
                    rows.append((i, s, m, int(aligned and s % ALIGN == 0 and m % ALIGN == 0)))
                    wds.append(wd)
        return cls(_to_device(torch.tensor(rows, dtype=torch.int64).reshape(-1, 4), device),
                   _to_device(torch.tensor(wds, dtype=torch.float32), device),
                   _to_device(torch.tensor([list(b) for b in bases], dtype=torch.int64).reshape(-1, 4), device),
                   tuple(int(n) for n in lengths), out_dtype, chunk)

    @property
    def grad_ptrs(self) -> list[int]:
        """The gradients' addresses set last (`set_grads`)."""
        if self._grad_ptrs is None:
            raise ValueError("no gradient addresses set: call set_grads first")
        return self._grad_ptrs

    def set_grads(self, ptrs: list[int], host: numpy.ndarray | None = None) -> None:
        """The gradients' addresses, one per run, for the next launches: copied to the device when they
        differ from the last ones (from pinned memory, without waiting: the caching host allocator keeps
        the source until the copy ran, and the copy is ordered before the launch on the stream). ``host``:
        ``ptrs`` as an int64 numpy array, where the caller has made one.

        Never while a CUDA graph is being captured on this stream: the captured copy would read a pinned
        buffer that is reused after the capture (`zfunc.optim.update_graph` sets them before each replay)."""
        if ptrs == self._grad_ptrs:
            return
        if len(ptrs) != len(self.lengths):
            raise ValueError(f"{len(ptrs)} gradient addresses for {len(self.lengths)} runs")
        cuda = self._cuda
        if cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("AdamRuns.set_grads while a CUDA graph is being captured: set the gradients' "
                               "addresses before the capture and before each replay")
        # (Through numpy, which reads a list of ints into an array from C several times faster than torch.tensor.)
        if host is None:
            host = numpy.array(ptrs, dtype=numpy.int64)
        self.grads.copy_(torch.from_numpy(host).pin_memory() if cuda else torch.from_numpy(host), non_blocking=cuda)
        self._grad_ptrs = list(ptrs)
        self.grads_aligned = all_16_byte_aligned(ptrs)  # (here, once per new addresses, not per launch)


def all_16_byte_aligned(ptrs) -> bool:
    """Whether every address is a multiple of 16 bytes (the kernel's ``GRADS_ALIGNED``: vector loads of the
    gradients), found from C: no remainder among them."""
    return not any(map(operator.mod, ptrs, itertools.repeat(16)))


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; to a GPU from pinned memory without waiting (a table built during a step, e.g.
    for gradients laid out anew, must not make the host wait for the queue)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
