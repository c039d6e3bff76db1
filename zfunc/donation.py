"""Donation: a transformed step consumes the state it is given, and reports at the state's next use what it found.

A transformed step updates its state's buffers in place (that is how it keeps
ZeRO's memory), as JAX's ``donate_argnums`` allows: after ``new = step(state,
batch)`` the old ``state`` is dead, and using it through zfunc raises
(`Donation`, `check_alive`). What a step found on the device and must report
(a NaN loss: `Finding`) is not read while the step runs, which would make the
host wait for the GPU; it is copied to the host behind an event (`Pending`)
and raised at the next use of the state the step returned (`check_alive`).

The interpreter (`zfunc.interpret`) runs steps and uses these; this module
knows nothing of transforms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch


class Finding(NamedTuple):
    """An error a step found on the device, e.g. a NaN loss: raised at the next use of the state it returned.

    ``values``: a 1-D float64 tensor on the device (another is cast) whose first element is nonzero when the
    error happened (the rest are whatever ``explain`` needs to say what happened, e.g. the loss);
    ``explain(values, step)`` makes the exception from their host copy and the step number (``state.step`` of
    the state the step was given). The step that found it skipped its update on the device (`StepContext.skip_update_if`), so
    the state it returned holds the values of the state it was given.
    """

    values: torch.Tensor
    explain: Callable[[list[float], int], BaseException]


class Pending:
    """The findings of one step, copied to the host behind a CUDA event as the step is issued (no wait),
    read at the next use of the state the step returned (`check_alive`). That read waits at most for the
    part of the previous step that made the values (a forward), long done by then."""

    def __init__(self, findings: list[Finding], step: torch.Tensor) -> None:
        self.explains = [f.explain for f in findings]
        self.sizes = [f.values.numel() for f in findings]
        device = findings[0].values.device
        # One float64 buffer of every finding's values and the step number, by one ``cat`` that promotes the step
        # (the findings' values are float64 already: a cast, reshape or detach of each would be a launch more).
        step = step.reshape(1) if step.device == device else step.reshape(1).to(device)
        values = torch.cat([*map(_float64_values, findings), step])
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host, self.ready = values, None

    def raise_if_found(self) -> None:
        """Raise the first finding whose flag is set (reads the host copy; waits for its event only)."""
        if self.ready is not None and not self.ready.query():  # (by the next call, it almost always is done)
            self.ready.synchronize()
        values = self.host.tolist()  # a host tensor: no device sync
        step, start = int(values[-1]), 0
        for explain, size in zip(self.explains, self.sizes):
            mine = values[start:start + size]
            start += size
            if mine[0]:
                raise explain(mine, step)


def _float64_values(finding: Finding) -> torch.Tensor:
    """A finding's values as `Finding` asks for them (1-D float64, no gradient), made so where they are not."""
    values = finding.values
    if values.dtype == torch.float64 and values.dim() == 1 and not values.requires_grad:
        return values
    return values.detach().reshape(-1).to(torch.float64)


class CopiesStamp(NamedTuple):
    """The tensors a stack keeps consistent with each other (`zfunc.interpret.check_copies`), as a step left them:
    each transform's key of them (with its class: ``(owner, key)``, ``owner.copy_names(key)`` names them), and
    their identities and versions, in order. Where some dicts hold exactly those tensors: ``tags``, their version
    tags (`zfunc.tree.dict_tags`, with each owner), ``bases``, the tensors whose versions are theirs
    (`zfunc.tree.VersionBases`; None where the tensors share no counter), and ``base_versions``, those versions,
    read with ``versions``; else None. Holds no tensor (weak references only)."""

    keys: tuple
    ids: list[int]
    versions: list[int]
    tags: tuple | None = None
    bases: Any = None
    base_versions: list[int] | None = None


class Donation:
    """Whether a state is still usable; a step marks the state it consumed as dead.

    Transformed steps update the state's buffers in place (that is how they
    keep ZeRO's memory), so after ``new = step(state, batch)`` the old
    ``state`` holds half-old, half-new values. Using it again through zfunc
    raises instead of computing on them.
    """

    __slots__ = ("dead", "pending", "stamp")

    def __init__(self) -> None:
        self.dead: str | None = None  # None: alive; else what consumed it
        # The tensors a stack keeps consistent with each other (`Transform.copied`) as the step that returned
        # the state left them; None: not recorded (a copy, a restored template).
        self.stamp: CopiesStamp | None = None
        # What the step that returned the state found on the device (`Pending`), raised at its next use.
        self.pending: Pending | None = None

    def __deepcopy__(self, memo) -> Donation:
        copied = Donation()  # (a deep copy holds other tensors: the stamp does not describe them)
        copied.dead, copied.pending = self.dead, self.pending
        return copied


def defer_findings(state, pending: Pending) -> None:
    """Keep ``pending`` on ``state``, to be raised at its next use (`check_alive`)."""
    donation = getattr(state, "donation", None)
    if isinstance(donation, Donation):
        donation.pending = pending
    else:  # a state that cannot carry them: read now
        pending.raise_if_found()


def forget_copies(state) -> None:
    """Drop ``state``'s record of its copies: zfunc wrote into its tensors outside a step (a restore, a
    pretrained load), consistently; the next step records them afresh."""
    donation = getattr(state, "donation", None)
    if isinstance(donation, Donation):
        donation.stamp = None


def consume(state, by: str) -> None:
    """Mark ``state`` dead (consumed by ``by``), if it is a state that tracks donation."""
    donation = getattr(state, "donation", None)
    if isinstance(donation, Donation) and donation.dead is None:
        donation.dead = by


def check_laid_out_by(state, names: set[str], what) -> None:
    """Refuse a state laid out by transforms that ``what`` (a step; formatted only for the error, never
    while torch.compile traces) does not have.

    A transform keeps its own state in ``state.extras[its name]`` (the fp32
    master, the shard layout); a step without that transform would silently
    train the wrong tensors (the compute copy instead of the master, say).
    """
    extras = getattr(state, "extras", None)
    foreign = sorted(k for k in extras if k not in names) if isinstance(extras, dict) else []
    if foreign:
        raise ValueError(
            f"this state was laid out by {', '.join(foreign)} (state.extras holds their state), but it is run "
            f"by {what}, which does not have {'them' if len(foreign) > 1 else 'it'}: the step would train the "
            "wrong tensors. Run it with the transformed step that made it (step.init(...) then step(state, "
            "batch)); to change transforms, start from step.gather(state) or restore a checkpoint into the new "
            "step's init (zfunc.io.restore(dir, like=new_step.init(...))).")


def check_alive(state, what: str) -> None:
    """Raise a clear error if ``state`` was consumed by an earlier step, or if the step that returned it found
    an error on the device (a NaN loss: `Finding`; raised once, the state is usable afterwards)."""
    donation = getattr(state, "donation", None)
    if isinstance(donation, Donation) and donation.pending is not None:
        if torch.compiler.is_dynamo_compiling():
            # A state from an eager step given to a compiled one: its findings are read as dynamo traces (the host
            # copy's read cannot be traced; its values are known). A finding stops the trace with its message
            # (dynamo raises it as the error of an exception it observed), once: the state is usable afterwards.
            message = _found_at_trace(donation)
            if message is not None:
                raise FloatingPointError(message)
        else:
            pending, donation.pending = donation.pending, None
            pending.raise_if_found()
    if isinstance(donation, Donation) and donation.dead is not None:
        raise ValueError(
            f"{what} was given a state that {donation.dead} already consumed: a transformed step updates the "
            "state it is given in place (donation, as in JAX), so that state is dead. Use the state the step "
            "returned; to keep a snapshot, copy it before the step with copy.deepcopy(state) (which keeps the "
            "buffers the layout shares, e.g. shard's flat per-unit buffers; a per-tensor clone loses them) or "
            "take step.gather(state).")


@torch._dynamo.assume_constant_result  # run as Python while dynamo traces, its result a constant of the trace
def _found_at_trace(donation: Donation) -> str | None:
    """The message of the first finding ``donation`` holds (every finding's error is a FloatingPointError), or
    None; the findings dropped (here, in Python: a trace stopped by the error keeps none of its side effects)."""
    pending, donation.pending = donation.pending, None
    try:
        pending.raise_if_found()
    except FloatingPointError as err:
        return str(err)
    return None
