"""Rank 0's part of a save: the directory lock, the checks before writing, and the commit by renames.

Only what zfunc provably wrote is ever replaced or deleted (see
`zfunc.io.manifest.why_not_ours`): a foreign ``latest`` or ``step_*``
directory stops a save before it writes anything, and `keep` leaves foreign
directories alone with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import socket
import warnings
from pathlib import Path

from zfunc.io.format import LATEST, MANIFEST, CheckpointError, fsync_dir, write_text_atomic
from zfunc.io.manifest import is_debris, latest_text, read_latest, validate, why_not_ours, write_manifest

LOCK = ".zfunc.lock"
STEP_DIR = re.compile(r"step_(\d+)")
PARKED = re.compile(r"step_(\d+)\.old-[0-9a-f]+")  # a checkpoint set aside while its step is saved again
STALE = re.compile(r"step_\d+\.(tmp|del|old)-[0-9a-f]+|latest\.tmp-[0-9a-f]+")
HOLDER_BYTES = 128  # the lock file's content: who holds it
HOLDER = re.compile(r"pid \d+ on \S*")
UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


class SaveLock:
    """An exclusive advisory lock (`fcntl.flock`) on ``directory/.zfunc.lock``, held for a whole save.

    A second save into the same directory (another job, another process)
    fails at once instead of racing the first one's renames. The kernel
    releases a flock when its holder exits, however it exits (SIGKILL
    included), so a killed save never leaves a stale lock. The file itself
    stays (deleting it would let two savers lock two different files); it
    holds the holder's pid and host, for the loser's message. Filesystems
    without flock (some Lustre mounts) get a warning and no lock.
    """

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK
        try:
            self.fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise CheckpointError(f"save: cannot create the lock file {self.path} ({e.strerror})") from None
        content = self._holder()
        if os.fstat(self.fd).st_size > HOLDER_BYTES or (content and not HOLDER.fullmatch(content)):
            os.close(self.fd)
            self.fd = None
            raise CheckpointError(f"save: {self.path} exists and is not zfunc's lock file; zfunc neither uses nor "
                                  "overwrites it: move it away, or save elsewhere")
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = self._holder()
            os.close(self.fd)
            self.fd = None
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise CheckpointError(
                    f"save: another save is writing into {directory} ({holder or 'its holder is unknown'}; it holds "
                    f"{self.path}). One save per directory at a time: wait for it, or save elsewhere") from None
            if e.errno not in UNSUPPORTED:
                raise CheckpointError(f"save: cannot lock {self.path} ({e.strerror})") from None
            warnings.warn(f"save: the filesystem of {directory} does not support file locks ({e.strerror}); make "
                          "sure only one save writes into it at a time", stacklevel=3)
            return
        holder = f"pid {os.getpid()} on {socket.gethostname()}"[:HOLDER_BYTES - 1]
        os.pwrite(self.fd, holder.ljust(HOLDER_BYTES - 1).encode() + b"\n", 0)  # fixed width: no truncate

    def _holder(self) -> str:
        try:
            return os.pread(self.fd, HOLDER_BYTES + 1, 0).decode("utf-8", errors="replace").strip()
        except OSError:
            return ""

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = None


def prepare(directory: Path, name: str) -> SaveLock:
    """Create ``directory``, lock it, and check nothing foreign is in the way of saving ``name`` there."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise CheckpointError(f"save: {directory} exists and is not a directory") from None
    except OSError as e:
        raise CheckpointError(f"save: cannot create {directory} ({e.strerror})") from None
    lock = SaveLock(directory)
    try:
        read_latest(directory)  # raises if `latest` is not zfunc's: it will be replaced
        final = directory / name
        if os.path.lexists(final):
            reason = why_not_ours(final)
            if reason is not None:
                raise CheckpointError(f"save: {final} exists and cannot be shown to be a checkpoint zfunc wrote "
                                      f"({reason}); refusing to replace it: move it away, or save elsewhere")
    except BaseException:
        lock.release()
        raise
    return lock


def commit(directory: Path, tmp: Path, name: str, manifest: dict, keep: int | None, token: str) -> None:
    """Make ``tmp`` the checkpoint ``name`` and point ``latest`` at it; every moment leaves a complete one.

    Then (``keep``) delete the oldest of zfunc's own checkpoints beyond
    ``keep`` and the debris of saves killed earlier; the lock guarantees no
    other save is under way, so nothing deleted is in use.
    """
    validate(manifest, tmp / MANIFEST)  # what a reader will check, checked before it is committed
    digest = write_manifest(tmp, manifest)
    fsync_dir(tmp)
    final = directory / name
    old = None
    if os.path.lexists(final):  # the same step saved again: swap, keeping the old one until the new one is in place
        old = directory / f"{name}.old-{token}"
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(directory)
    write_text_atomic(directory / LATEST, latest_text(name, digest), token)
    if old is not None:
        remove(old, token)
    left_alone = _prune(directory, name, keep, token) if keep is not None else []
    for p in directory.iterdir():  # debris of saves killed earlier (the lock: no other save is under way)
        if STALE.fullmatch(p.name) and token not in p.name:
            if is_debris(p):
                remove(p, token)
            else:
                left_alone.append(f"{p} (not only zfunc's files)")
    if left_alone:
        warnings.warn(f"save into {directory}: left alone what zfunc cannot show it wrote: "
                      + "; ".join(left_alone), stacklevel=3)


def _prune(directory: Path, name: str, keep: int, token: str) -> list[str]:
    """Delete all but the newest ``keep - 1`` of zfunc's checkpoints besides ``name``; returns what it left alone."""
    ours, foreign = [], []
    for p in directory.iterdir():
        m = STEP_DIR.fullmatch(p.name)
        if m is None or p.name == name or not (p / MANIFEST).exists():
            continue
        reason = why_not_ours(p)
        if reason is None:
            ours.append((int(m.group(1)), p))
        else:
            foreign.append(f"{p} ({reason})")
    ours.sort()
    for _, p in ours[:max(0, len(ours) - (keep - 1))]:
        remove(p, token)
    return foreign


def remove(path: Path, token: str) -> None:
    """Delete a file or a checkpoint: renamed out of sight first, so a half-deleted one is never taken for whole."""
    if path.is_dir() and not path.is_symlink():
        step = STEP_DIR.match(path.name)
        gone = path.with_name(f"{step.group(0)}.del-{token}") if step else path
        if gone != path:
            os.replace(path, gone)
        shutil.rmtree(gone, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
