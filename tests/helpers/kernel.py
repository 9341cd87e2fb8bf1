"""Small probes of what the kernel grants this test process."""

from __future__ import annotations

import ctypes
import os


def inotify_refused() -> int:
    """0, or the errno that refused this process (its uid) a new inotify instance: the
    per-user quota a job may exhaust for its worker."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_CLOEXEC)
    if fd < 0:
        return ctypes.get_errno()
    os.close(fd)
    return 0
