"""The eager recompute: a block's forward builds the ordinary autograd graph, but what its ops save for
backward is replaced by small indices and recomputed when backward first needs it.

`run_recomputed(run, devices)` returns ``run()``. While ``run`` executes (with grad enabled), every tensor
an op saves for backward is replaced, through saved-tensor hooks, by its position in the order of saving;
only its number of elements and dtype are kept (ints and dtypes: nothing the garbage collector tracks, so a
step's hundreds of saved tensors add no collections). The graph itself is the ordinary one, so every tensor
that leaves the block, through its return value or on the side (a forward hook, a list), gets exact
gradients, as without recompute.

When backward first unpacks one of those positions, ``run`` is executed again once, with the forward's RNG
states (dropout draws the same masks) and autocast settings, under hooks that record what it saves, in
order; the recompute stops as soon as the last position is recorded (what follows in the block saves
nothing backward needs). Each recorded tensor is dropped from the record when it is unpacked, so the
memory of a block's activations falls as its backward proceeds, as without recompute. ``run`` itself
(`zfunc.recompute`) refuses inputs and parameters modified in place since the forward.

What this does not keep from torch's non-reentrant ``torch.utils.checkpoint`` (whose semantics these are)
is its Python per saved tensor (a holder and a weak reference per tensor, a metadata dictionary, a
comparison of all of them): here packing one tensor appends its size and dtype to two lists, and the
recompute compares each with what it records.

Errors, each a ``RuntimeError`` naming what differs: the recompute saves a tensor of another size or
dtype than the forward did at that position, or fewer tensors (a forward that took another path: a
branch on a value, a random choice outside torch's RNG); a position unpacked twice in one backward pass
(``ctx.saved_tensors`` read twice in a custom Function's backward). A second backward pass through the
same graph (``retain_graph=True``) recomputes the block again for that pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

_current_graph_task = torch._C._current_graph_task_id


class _StopRecompute(Exception):
    """Raised by the recompute's pack hook once it has recorded the last tensor the forward saved."""


def run_recomputed(run: Callable[[], Any], devices: Iterable[torch.device]) -> Any:
    """``run()``, keeping none of the tensors its ops save for backward: they are recomputed by calling
    ``run()`` again when backward first needs one (see the module docstring).

    Args:
      run: the block, closed over its inputs and parameters; called once now and once per backward pass
        that reaches it; it must compute the same thing each time given the same RNG state.
      devices: the accelerator devices ``run`` computes on, whose RNG states are replayed (the CPU's
        always is).
    Returns:
      What ``run()`` returns.
    """
    if not torch.is_grad_enabled():  # nothing is saved, nothing to recompute
        return run()
    frame = _Frame(run, devices)
    numels, add_numel, add_dtype = frame.numels, frame.numels.append, frame.dtypes.append

    def pack(t: torch.Tensor) -> int:
        add_numel(t.numel())
        add_dtype(t.dtype)
        return len(numels) - 1

    with saved_tensors_hooks(pack, frame.unpack):
        return run()


class _Frame:
    """One recomputed call: the size and dtype of each tensor its forward saved, in order, and the
    recomputed tensors of the backward pass now running that were not unpacked yet."""

    __slots__ = ("autocast", "dtypes", "numels", "recomputed", "rng", "run", "task")

    def __init__(self, run: Callable[[], Any], devices: Iterable[torch.device]) -> None:
        self.run = run
        self.numels: list[int] = []
        self.dtypes: list[torch.dtype] = []
        self.recomputed: list[torch.Tensor | None] = []
        self.task = None  # the backward pass (graph task) `recomputed` was made for
        self.rng = RngStates(devices)
        self.autocast = _autocast_settings()

    def unpack(self, index: int) -> torch.Tensor:
        task = _current_graph_task()
        if task != self.task:
            self._recompute(task)
        t = self.recomputed[index]
        if t is None:
            raise RuntimeError(
                "a tensor saved in a recomputed block was unpacked twice in one backward pass (a custom "
                "autograd Function reading ctx.saved_tensors twice?); the recompute hands each saved tensor "
                "out once, then drops it. Read ctx.saved_tensors once in backward.")
        self.recomputed[index] = None
        return t

    def _recompute(self, task: int) -> None:
        numels, dtypes = self.numels, self.dtypes
        expected = len(numels)
        recorded: list[torch.Tensor | None] = []
        append = recorded.append

        def pack(t: torch.Tensor) -> torch.Tensor:
            n = len(recorded)
            if t.numel() != numels[n] or t.dtype != dtypes[n]:
                raise RuntimeError(
                    f"the recompute of a block saved, as its tensor {n} for backward, a {tuple(t.shape)} "
                    f"{t.dtype} tensor where the forward saved one of {numels[n]} elements of {dtypes[n]}: "
                    "the block took another path when run again (a branch on a tensor's value, randomness "
                    "outside torch's RNG, a module whose state changed since the forward). Make the block "
                    "compute the same thing when run twice, or leave it out of the recompute.")
            # An alias without autograd history, for the record and for the recompute's own node (which is
            # never differentiated): ``t`` itself may be that node's output, and a node keeping its own output
            # is a reference cycle through C++ that nothing collects.
            kept = t.detach()
            append(kept)
            if n + 1 == expected:
                raise _StopRecompute  # the rest of the block saves nothing backward needs
            return kept

        now = RngStates(self.rng.devices)
        self.rng.restore()
        try:
            with saved_tensors_hooks(pack, _same), torch.enable_grad(), _Autocast(self.autocast):
                self.run()
        except _StopRecompute:
            pass
        finally:
            now.restore()
        if len(recorded) != expected:
            raise RuntimeError(
                f"the recompute of a block saved only {len(recorded)} of the {expected} tensors its forward saved "
                "for backward: the block took another path when run again (a branch on a tensor's value, "
                "randomness outside torch's RNG, a module whose state changed since the forward). Make the "
                "block compute the same thing when run twice, or leave it out of the recompute.")
        self.recomputed, self.task = recorded, task


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class RngStates:
    """The CPU's RNG state and those of ``devices`` (CUDA devices, once CUDA is initialized), captured to
    replay dropout: ``restore()`` sets them back (both recompute routes, `zfunc.recompute`)."""

    __slots__ = ("cpu", "cuda", "devices")

    def __init__(self, devices: Iterable[torch.device]) -> None:
        self.cpu = torch.get_rng_state()
        if torch.cuda.is_initialized():
            self.devices = tuple(d for d in devices if d.type == "cuda")
            self.cuda = [torch.cuda.get_rng_state(d) for d in self.devices]
        else:
            self.devices, self.cuda = (), []

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for d, state in zip(self.devices, self.cuda):
            torch.cuda.set_rng_state(state, d)


def _autocast_settings() -> tuple | None:
    """The autocast settings of the CPU and CUDA now, or None where neither is on (the common case: one
    call each)."""
    if not (torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")):
        return None
    cache = torch.is_autocast_cache_enabled()
    return tuple((kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind), cache)
                 for kind in ("cuda", "cpu"))


class _Autocast:
    """Autocast as the forward had it (nothing when it was off)."""

    def __init__(self, settings: tuple | None) -> None:
        self.contexts = [] if settings is None else [
            torch.autocast(kind, enabled=on, dtype=dtype, cache_enabled=cache) for kind, on, dtype, cache in settings
            if kind == "cpu" or torch.cuda.is_available()]

    def __enter__(self) -> None:
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc) -> None:
        for c in reversed(self.contexts):
            c.__exit__(*exc)
