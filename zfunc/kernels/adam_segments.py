"""`AdamSegments`: which weight decay applies where in a flat buffer, as a chunk table.

The table `zfunc.kernels.gpu_adam.adam_flat_` launches over: one row per
chunk of at most `CHUNK` elements (start, length, weight decay), built once
per layout and reused every step. Kept apart from the kernels' API because it
is plain bookkeeping: runs in, validated, merged and split at `ALIGN`
boundaries, out as device tensors.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Sequence

import torch

__all__ = ["ALIGN", "CHUNK", "MIN_CHUNK", "PROGRAMS_PER_SM", "AdamSegments", "sm_count"]

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
            chunk = _auto_chunk(sum(max(0, _as_int_or(r, 1)) for r in runs), device)
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

        rows: list[tuple[int, int, float]] = []
        for start, length, wd in merged:
            end = start + length
            a = -(-start // ALIGN) * ALIGN  # first aligned boundary inside the run
            b = end // ALIGN * ALIGN  # last one
            if a >= b:  # too short for an aligned middle: scalar pieces
                rows.extend((s, min(chunk, end - s), wd) for s in range(start, end, chunk))
                continue
            if start < a:
                rows.append((start, a - start, wd))
            rows.extend((s, min(chunk, b - s), wd) for s in range(a, b, chunk))
            if b < end:
                rows.append((b, end - b, wd))

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


def _auto_chunk(total: int, device: torch.device) -> int:
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
