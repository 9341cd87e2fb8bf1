"""Being woken by another process's write to a queue file (inotify), instead of the poll.

A store in one file cannot signal other processes, so an idle worker and a client waiting
for a result used to look again every ``poll_interval_s`` (50 ms): a tool call through an
idle worker took one poll period however fast its job was (issue 22, measured 51 ms for an
echo job). Every commit in WAL mode appends to the ``-wal`` file beside the database, so
a watch on the folder for writes to that one name (inotify ``IN_MODIFY``; ``IN_CREATE``
and ``IN_MOVED_TO`` for a WAL made or replaced) tells a waiter that something changed
wherever the writer runs on this machine: another process, another user, another mount
namespace of the same file system.

What it is not: a replacement for the poll. The poll stays, at the same period, for what
inotify cannot see (a network file system, a folder the kernel will not watch, an inotify
instance limit reached): a wake-up is an early look, never the only one. Its cost: a wake
for every commit to the file (heartbeats and leases of other workers too), so a waiter
looks at most once per `_MIN_GAP_S` however busy the queue is; idle, a watch costs
nothing (the fd sleeps in the kernel).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import struct
import time
from pathlib import Path
from typing import Final

import anyio

from .. import _libc

__all__ = ("FileWatch",)

_IN_NONBLOCK: Final = os.O_NONBLOCK
_IN_CLOEXEC: Final = os.O_CLOEXEC
_IN_MODIFY: Final = 0x002
_IN_MOVED_TO: Final = 0x080
_IN_CREATE: Final = 0x100
_IN_Q_OVERFLOW: Final = 0x4000
_HEADER: Final = struct.Struct("iIII")  # wd, mask, cookie, len (then the name, NUL-padded)

#: A waiter woken by a write looks at most this often: on a busy queue (thousands of
#: commits a second) it reads a few hundred times a second, not once per commit.
_MIN_GAP_S: Final = 0.002

_init1 = _libc.function("inotify_init1", ctypes.c_int, ctypes.c_int)
_add_watch = _libc.function(
    "inotify_add_watch", ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32
)


class FileWatch:
    """Writes to some files of one folder, as a readable fd; made by `open`, closed by
    `close` (idempotent). One task waits on it at a time (`changed`)."""

    def __init__(self, fd: int, names: frozenset[bytes]) -> None:
        self._fd = fd
        self._names = names
        self._last = 0.0

    @classmethod
    def open(cls, files: tuple[Path, ...]) -> FileWatch | None:
        """A watch for writes to `files` (all in one folder), or None where the kernel
        gives none (no inotify, the instance limit reached, the folder unwatchable): the
        caller then only polls."""
        folder = files[0].parent
        fd = _init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            return None
        mask = _IN_MODIFY | _IN_CREATE | _IN_MOVED_TO
        if _add_watch(fd, os.fsencode(folder), mask) < 0:
            os.close(fd)
            return None
        return cls(fd, frozenset(os.fsencode(f.name) for f in files))

    def _drain(self) -> bool:
        """Read what the kernel queued; True when one event names a watched file (or the
        queue overflowed, which may have dropped one)."""
        hit = False
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                return hit
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise
            if not data:
                return hit
            at = 0
            while at + _HEADER.size <= len(data):
                _wd, mask, _cookie, size = _HEADER.unpack_from(data, at)
                name = data[at + _HEADER.size : at + _HEADER.size + size].rstrip(b"\0")
                at += _HEADER.size + size
                if mask & _IN_Q_OVERFLOW or name in self._names:
                    hit = True

    async def changed(self) -> None:
        """Return once a watched file was written since the last return (at once if it
        already was), no sooner than `_MIN_GAP_S` after the last return."""
        while not self._drain():
            await anyio.wait_readable(self._fd)
        gap = self._last + _MIN_GAP_S - time.monotonic()
        if gap > 0:
            await anyio.sleep(gap)
            self._drain()  # what came during the gap is covered by the look that follows
        self._last = time.monotonic()

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            with contextlib.suppress(OSError):
                os.close(fd)
