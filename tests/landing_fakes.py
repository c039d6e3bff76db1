"""Seams for gradients landing in page-locked host memory (`zfunc.tiers.landing`), on a machine without a GPU.

On a GPU each unit's gradient is copied straight into a page-locked host buffer on a copy stream, and whoever
reads it on the host waits for that copy's event first. Here the same code runs with two seams replaced: every
host-bound gradient "crosses" to the host, and a copy lands only when it is waited for (until then its buffer
holds NaN, what a reader that did not wait would see, or worse). Registration is counted, not done.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from zfunc.tiers import placement
from zfunc.tiers.landing import HostLanding
from zfunc.transforms import grad_accumulator


class _Copy:
    """The event of one deferred copy: ``synchronize`` makes it land."""

    def __init__(self, dest: torch.Tensor, src: torch.Tensor, landed: list) -> None:
        self.dest, self.src, self.landed = dest, src, landed

    def synchronize(self) -> None:
        self.dest.copy_(self.src)
        self.landed.append(self.dest.numel())


class DeferredLanding(HostLanding):
    """`HostLanding` without a GPU: the copy happens when its event is waited for."""

    made: ClassVar[list[DeferredLanding]] = []  # (every one made, newest last: what a test looks at)

    def __init__(self, device) -> None:  # (no stream)
        self.device, self.pending, self.issued, self.landed = device, {}, 0, []
        DeferredLanding.made.append(self)

    def copy(self, dest: torch.Tensor, grad: torch.Tensor) -> None:
        dest.fill_(float("nan"))
        self.note(dest, _Copy(dest, grad.clone(), self.landed))  # (the caller frees ``grad``: as record_stream)


class Registrations:
    """Fake ``cudaHostRegister``/``Unregister``: which addresses are page-locked now, and how often it was done."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.registered = self.unregistered = 0

    def register(self, ptr: int, nbytes: int) -> bool:
        assert ptr not in self.live, "registered twice"
        self.live[ptr] = nbytes
        self.registered += 1
        return True

    def unregister(self, ptr: int) -> None:
        del self.live[ptr]
        self.unregistered += 1


def landing_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> Registrations:
    """Install the seams (see above) for this test (or, in a forked worker, for the worker)."""
    registrations = Registrations()
    DeferredLanding.made = []
    monkeypatch.setattr(grad_accumulator, "HostLanding", DeferredLanding)
    monkeypatch.setattr(grad_accumulator, "crosses_to_host", lambda grad, dest: dest.type == "cpu")
    monkeypatch.setattr(placement, "register_host", registrations.register)
    monkeypatch.setattr(placement, "unregister_host", registrations.unregister)
    return registrations
