"""Scratch directories: created fresh, marked as zfunc's, removed file by file, found again after a crash.

A `DiskStore` keeps its files in ``<parent>/zfunc-<pid>-<8 hex digits>/``,
created with ``mkdir`` (so it is new: never a directory that existed), holding
a marker file `MARKER` written first. The marker records who created it:
pid, that process's start time (``/proc/<pid>/stat``, clock ticks since
boot), the boot id, the pid namespace and the host name. Data files have
names of the form `DATA_FILE` (``000003-unit.3.master.bin``).

Removal deletes only what zfunc wrote: the marker and files whose names
match `DATA_FILE` (in a live store: only the files it created itself). Any
other entry is foreign: it is left, so is the directory, and a warning says
so.

Stale directories (their process was SIGKILLed, or died before its
finalizer ran) are found by `find_stale`. A directory counts as *dead*
only when its marker proves it: same host, and either a different boot id
(the machine rebooted since), or the same boot id and pid namespace and the
pid is gone or now belongs to a process with another start time. A
directory with no readable marker, from another host, or from another pid
namespace (a container sharing the disk: its pids are not ours to check)
is never called dead. `DiskStore` logs a warning naming the dead ones and
removes them only when asked (``stale="remove"``, or `remove_stale`): a
scratch directory may be on a disk that several containers share, and
deleting a run's state is not a default to take lightly.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger("zfunc.tiers")

MARKER = ".zfunc-scratch.json"
DIR_NAME = re.compile(r"zfunc-(\d+)-([0-9a-f]{8})")
DATA_FILE = re.compile(r"\d{6}-[A-Za-z0-9._-]{0,64}\.bin")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class Owner:
    """The process that created a scratch directory, as recorded in its marker."""

    pid: int
    start_ticks: int | None  # /proc/<pid>/stat field 22: tells a reused pid from the original
    boot_id: str | None
    pid_ns: str | None  # pids are only comparable within one namespace
    host: str


@dataclass(frozen=True)
class StaleDir:
    """A scratch directory whose creator is proven dead. ``foreign``: entries zfunc did not write."""

    path: Path
    pid: int
    nbytes: int
    foreign: tuple[str, ...]


def data_file_name(index: int, name: str) -> str:
    """File name for a store's ``index``-th tensor called ``name`` (readable, and a `DATA_FILE`)."""
    return f"{index:06d}-{_UNSAFE.sub('_', name)[:64]}.bin"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return int(stat.rsplit(")", 1)[1].split()[19])


def this_process() -> Owner:
    """The `Owner` record of the calling process."""
    boot = _read("/proc/sys/kernel/random/boot_id")
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = None
    pid = os.getpid()
    return Owner(pid, _start_ticks(pid), boot.strip() if boot else None, ns, socket.gethostname())


def liveness(owner: Owner, me: Owner | None = None) -> Literal["alive", "dead", "unknown"]:
    """Whether ``owner`` still runs, judged from the calling process ``me`` (see module doc)."""
    me = me or this_process()
    if owner.host != me.host:
        return "unknown"
    if owner.boot_id and me.boot_id and owner.boot_id != me.boot_id:
        return "dead"
    if owner.boot_id != me.boot_id or owner.pid_ns is None or owner.pid_ns != me.pid_ns:
        return "unknown"
    ticks = _start_ticks(owner.pid)
    if ticks is None and not os.path.exists(f"/proc/{owner.pid}"):
        return "dead"
    if owner.start_ticks is not None and ticks is not None and ticks != owner.start_ticks:
        return "dead"  # the pid was reused by a newer process
    return "alive"


def create(parent: str | os.PathLike) -> tuple[Path, Owner]:
    """Make a fresh scratch directory under ``parent`` (which must exist) and write its marker."""
    parent = Path(parent)
    if not parent.is_dir():
        raise FileNotFoundError(f"scratch parent directory {str(parent)!r} does not exist (or is not a "
                                f"directory): create it first, on a local NVMe drive")
    owner = this_process()
    for _ in range(16):
        path = parent / f"zfunc-{owner.pid}-{secrets.token_hex(4)}"
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        break
    else:  # pragma: no cover - 16 collisions of 32 random bits
        raise FileExistsError(f"could not create a fresh directory under {parent}")
    record = {"zfunc_scratch": 1, "created": time.time(), **owner.__dict__}
    fd = os.open(path / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    return path, owner


def read_owner(path: Path) -> Owner | None:
    """The `Owner` in ``path``'s marker, or None when there is no readable, well-formed marker."""
    text = _read(str(path / MARKER))
    try:
        rec = json.loads(text) if text is not None else None
        if not isinstance(rec, dict) or rec.get("zfunc_scratch") != 1:
            return None
        return Owner(int(rec["pid"]), rec["start_ticks"], rec["boot_id"], rec["pid_ns"], str(rec["host"]))
    except (ValueError, KeyError, TypeError):
        return None


def remove(path: Path, files: set[str] | None = None) -> tuple[str, ...]:
    """Delete the marker and zfunc's data files in ``path``, then ``path`` itself if it is empty.

    ``files``: the names to delete (a live store's own list); None: every
    `DATA_FILE` (a stale directory). Returns the foreign entries left behind
    (the directory stays when there are any). Missing files are skipped.
    """
    try:
        entries = os.listdir(path)
    except FileNotFoundError:
        return ()
    ours = (lambda e: e in files) if files is not None else DATA_FILE.fullmatch
    foreign = tuple(sorted(e for e in entries if e != MARKER and not ours(e)))
    for e in entries:
        if e == MARKER or ours(e):
            try:
                os.unlink(path / e)
            except FileNotFoundError:
                pass
    if not foreign:
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError:  # an entry appeared meanwhile
            foreign = tuple(sorted(os.listdir(path)))
    if foreign:
        warnings.warn(f"zfunc scratch directory {path} holds entries zfunc did not write, left in place "
                      f"(with the directory): {', '.join(foreign[:10])}"
                      f"{' ...' if len(foreign) > 10 else ''}", stacklevel=3)
    return foreign


def _size(path: Path) -> int:
    total = 0
    for e in os.scandir(path):
        try:
            total += e.stat(follow_symlinks=False).st_blocks * 512
        except OSError:
            pass
    return total


def find_stale(parent: str | os.PathLike) -> list[StaleDir]:
    """Scratch directories under ``parent`` whose creators are proven dead (see module doc)."""
    me = this_process()
    found = []
    try:
        entries = sorted(os.scandir(parent), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    for e in entries:
        m = DIR_NAME.fullmatch(e.name)
        if not m or not e.is_dir(follow_symlinks=False):
            continue
        path = Path(e.path)
        owner = read_owner(path)
        if owner is None or owner.pid != int(m.group(1)) or liveness(owner, me) != "dead":
            continue
        foreign = tuple(sorted(x for x in os.listdir(path) if x != MARKER and not DATA_FILE.fullmatch(x)))
        found.append(StaleDir(path, owner.pid, _size(path), foreign))
    return found


def remove_stale(parent: str | os.PathLike) -> list[Path]:
    """Remove the scratch directories under ``parent`` that `find_stale` reports. Returns those removed.

    Only the marker and zfunc's data files are deleted; a directory that
    also holds foreign entries keeps them (and stays), with a warning.
    """
    removed = []
    for s in find_stale(parent):
        if not remove(s.path):
            log.warning("removed stale zfunc scratch directory %s (pid %d, %.2f GiB)", s.path, s.pid,
                        s.nbytes / 2**30)
            removed.append(s.path)
    return removed


def report_stale(parent: str | os.PathLike, action: Literal["warn", "remove", "ignore"]) -> list[StaleDir]:
    """`DiskStore`'s start-up check: warn about (or remove) dead scratch dirs. Returns those left."""
    if action == "ignore":
        return []
    if action == "remove":
        remove_stale(parent)
    stale = find_stale(parent)
    if stale:
        listing = "; ".join(f"{s.path} (pid {s.pid}, {s.nbytes / 2**30:.2f} GiB"
                            f"{', with foreign files' if s.foreign else ''})" for s in stale)
        log.warning("%d scratch director%s of dead zfunc processes under %s: %s. Remove them with "
                    "zfunc.tiers.remove_stale(%r) or DiskStore(..., stale='remove').", len(stale),
                    "y" if len(stale) == 1 else "ies", parent, listing, str(parent))
    return stale
