"""The lock every committer of a host folder holds, across processes and users.

A commit, an undo and a roll-back each check that a path is still what they planned
(`metnos_exec.undo.journal`: fingerprints), then replace it. Two of them running at once in
two processes (three workers appending to one file) could both pass the check against
the same old file, and the second replace dropped the first's change while both reported
``succeeded``. A lock inside one worker (``Staging.commit_lock``) does not reach another
worker, another queue's worker (another state folder) or another user's.

So every committer holds `FolderLock` over the folders it changes, from its first check
until its change is settled (kept or rolled back: a commit that may still be rolled back
must not have another's layered on top, whose roll-back would then leave a mix), and a
job is staged over a folder only once no commit on it is unsettled (`wait_settled`).

==========================================  ===============================================
rule                                        threat
==========================================  ===============================================
``flock(LOCK_EX)`` on each root folder's    two committers of one folder interleaving check
own inode (an fd opened on the folder)      and replace (a lost update). The lock is the
                                            inode's, so it holds for any process, any
                                            state folder, any uid that can open the folder,
                                            and through bind mounts of it
``flock(LOCK_SH)`` on each ancestor of a    nested roots: a job on ``/data`` and one on
root                                        ``/data/sub`` changing the same file
Locks are taken in path order, ancestors    two committers of overlapping roots each
first                                       holding one lock and waiting for the other's
A lock not had within `WAIT_S` is a host    a folder locked for ever (a hung or hostile
fault (the job is retried), never a wait    process holding it)
for ever
==========================================  ===============================================

What it does not hold: an ancestor the worker cannot open (no read permission, e.g. a
0711 home) is not locked, so nested roots below it are not kept apart from another user's
worker; a filesystem where ``flock`` on a folder fails (NFS translates ``flock`` to byte
locks a read-only folder fd cannot take) commits without it, said as ``worker.error``:
workers on several machines sharing a folder over the network are not kept apart.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import posixpath
import time
from collections.abc import Iterable
from typing import Final

from ..errors import HostFault
from ..logs import get_logger

__all__ = ("WAIT_S", "FolderLock", "wait_settled")

#: How long a committer waits for another's commit of the same folder.
WAIT_S: Final = 120.0
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
#: Poll period bounds while waiting (flock cannot be waited on with a deadline).
_POLL_MIN_S: Final = 0.001
_POLL_MAX_S: Final = 0.05

_log = get_logger()


def _targets(roots: Iterable[str]) -> list[tuple[str, int]]:
    """``(folder, LOCK_EX | LOCK_SH)`` in lock order: every root exclusive, every
    ancestor of one shared (exclusive wins where a folder is both)."""
    modes: dict[str, int] = {}
    for root in roots:
        root = posixpath.normpath(root)
        modes[root] = fcntl.LOCK_EX
        parent = posixpath.dirname(root)
        while True:
            modes.setdefault(parent, fcntl.LOCK_SH)
            if parent == "/":
                break
            parent = posixpath.dirname(parent)
    return sorted(modes.items())


class FolderLock:
    """The lock over `roots` (see the module docstring); blocking, run it in a thread.

    Args:
        roots: absolute folders the holder changes.
        wait_s: give up after this long.

    Raises:
        HostFault: another committer held a folder for `wait_s`.
    """

    def __init__(self, roots: Iterable[str], *, wait_s: float = WAIT_S) -> None:
        self.roots = tuple(roots)
        self._fds: list[int] = []
        deadline = time.monotonic() + wait_s
        try:
            for folder, mode in _targets(self.roots):
                self._take(folder, mode, deadline, wait_s)
        except BaseException:
            self.release()
            raise

    def _take(self, folder: str, mode: int, deadline: float, wait_s: float) -> None:
        try:
            fd = os.open(folder, _DIR_FLAGS)
        except OSError as exc:
            if mode == fcntl.LOCK_SH or exc.errno != errno.EACCES:
                # An ancestor we may not read, or a root gone or swapped (the commit
                # itself refuses those, with the reason): nothing to hold.
                return
            raise HostFault(f"cannot lock the folder {folder} for the commit: {exc}") from exc
        self._fds.append(fd)
        pause = _POLL_MIN_S
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            except OSError as exc:
                # Not a lock held by someone: this filesystem has no folder locks.
                _log.warning(
                    "worker.error",
                    error=f"the folder {folder} cannot be locked ({exc.strerror}): its "
                    "commits are not kept apart from other workers' here",
                )
                return
            if time.monotonic() >= deadline:
                raise HostFault(
                    f"the folder {folder} was being changed by another commit (or held "
                    f"locked by another process) for {wait_s:g} s; nothing was applied"
                )
            time.sleep(pause)  # flock has no timeout: polled, with backoff
            pause = min(pause * 2, _POLL_MAX_S)

    def release(self) -> None:
        """Let go (idempotent)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the only fd of an open file drops its flock

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def wait_settled(roots: Iterable[str], *, wait_s: float = WAIT_S) -> None:
    """Return once no commit on `roots` is unsettled (blocking; run it in a thread).

    Raises:
        HostFault: one stayed unsettled for `wait_s`.
    """
    FolderLock(roots, wait_s=wait_s).release()
