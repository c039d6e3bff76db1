"""How the ranks of a save or restore meet: tagged, timeout-bounded exchanges of JSON through `zfunc.dist`.

Every exchange carries the operation and the phase it belongs to, so a rank
that is somewhere else (in `restore` while the others save, or in another
phase) is named in an error on every rank instead of being paired with the
wrong data. A rank that never comes (``if rank == 0: save(...)``) makes the
others raise `zfunc.dist.CollectiveError` after ``group.timeout`` seconds
(``$ZFUNC_TIMEOUT_S``), saying that every rank must call it.

Phases that move data (writing, hashing, deleting old checkpoints) may take
long on a slow filesystem, so their exchanges wait the group's timeout plus
the time to move their bytes at `SLOWEST_IO` bytes per second (`io_seconds`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zfunc import dist
from zfunc.io.format import CheckpointError

SLOWEST_IO = 16 << 20  # bytes/s: a filesystem slower than this makes a save look hung


def io_seconds(nbytes: int) -> float:
    """How long moving ``nbytes`` may take on the slowest filesystem a save is expected to meet."""
    return nbytes / SLOWEST_IO


def exchange(op: str, phase: str, obj: Any, group: dist.Group, extra_s: float = 0.0) -> list[Any]:
    """Every rank's ``obj`` (JSON-able), in rank order, after checking all ranks are at ``op``'s ``phase``.

    Waits at most ``group.timeout + extra_s`` seconds for the other ranks (`zfunc.dist.CollectiveError`).
    """
    if extra_s:
        group = dataclasses.replace(group, timeout=group.timeout + extra_s)
    waiting = f"zf.io.{op} ({phase}): every rank of the process group must call zf.io.{op}, not only rank 0"
    here = f"zf.io.{op} ({phase})"
    try:  # (a fixed-size exchange first, so that a rank in another call meets this one: `zfunc.dist.announce`)
        dist.announce(group, here, waiting)
    except dist.CallMismatch as err:
        elsewhere = [f"rank {r} is in {call.removeprefix('zf.io.')}" for r, call in enumerate(err.calls)
                     if call != here]
        raise CheckpointError(f"zf.io.{op} ({phase}) on rank {group.rank}: {'; '.join(elsewhere[:4])}: every rank "
                              f"must call zf.io.{op} at the same point of the program") from None
    # (the announce above already checked that every rank is at this op and phase)
    return dist.all_gather_json(obj, group, waiting)


def raise_if_failed(op: str, errors: list[Any], rank: int, hint: str = "") -> None:
    """Raise the same `CheckpointError` on every rank if any rank reported an error (a string)."""
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if not failed:
        return
    own = errors[rank]
    if own and len(failed) == 1:
        raise CheckpointError(own + hint)
    lines = "\n".join(f"  rank {r}: {e}" for r, e in failed)
    raise CheckpointError(f"{op} failed on {len(failed)} of {len(errors)} ranks:\n{lines}{hint}")
