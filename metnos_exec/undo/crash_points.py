"""Crash points and the pause hook: where a test makes a commit, an undo or a recovery stop.

Every step that changes the host or a journal (a ``mkdir``, a ``chmod``, one ``write``, a
``rename``...) calls `step` first; a test sets a crash point (`CRASH_ENV`, `crash_at`) and
the process dies there as a kill would (see `metnos_exec.undo.journal`). Nothing here
changes anything when no hook is set.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Final

__all__ = ("CRASH_ENV", "CRASH_EXIT", "PAUSE_ENV", "crash_at", "pause_for_test", "step")

#: Test hook (the crash-safety acceptance test): set to a path, the first commit that
#: reaches the middle of its ops creates that file and stops there for good, so the test
#: can SIGKILL the worker mid-commit. Later commits see the file and do not stop.
PAUSE_ENV: Final = "METNOS_TEST_PAUSE_COMMIT"


#: Test hook (the crash-point tests, ``tests/undo/test_crash_points.py``): ``N`` makes this
#: process die (``os._exit``: no clean-up, as a kill) just before its N-th step (from 0)
#: that changes the host or a journal (a ``mkdir``, a ``chmod``, one ``write`` of a file's
#: content, a ``rename``...); ``NAME:K``, before the K-th step called NAME. Read at import;
#: a test that forks sets it with `crash_at`.
CRASH_ENV: Final = "METNOS_TEST_CRASH_AT"
#: The exit status of a process the crash hook stopped.
CRASH_EXIT: Final = 86


@dataclass
class _CrashPoint:
    at: int
    name: str | None
    seen: int = 0


_crash: _CrashPoint | None = None


def crash_at(spec: str | None) -> None:
    """Set this process's crash point (see `CRASH_ENV`); ``None`` or ``""``: none."""
    global _crash
    if not spec:
        _crash = None
        return
    name, _, at = spec.rpartition(":")
    _crash = _CrashPoint(int(at), name or None)


def step(name: str) -> None:
    """The process is about to take step `name` (see `CRASH_ENV`)."""
    point = _crash
    if point is None or (point.name is not None and point.name != name):
        return
    if point.seen == point.at:
        os.write(2, f"metnos-test-crash: before step {point.at} ({name})\n".encode())
        os._exit(CRASH_EXIT)
    point.seen += 1


crash_at(os.environ.get(CRASH_ENV))


def pause_for_test(marker: str) -> None:
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    threading.Event().wait()  # until the test kills this process
