"""The C library calls the worker makes through ctypes, each with its argument types.

Why every one declares them: ctypes converts an undeclared Python int to a C ``int``. For
a variadic function such as ``syscall(long number, ...)`` or ``prctl(int, ...)`` nothing
tells it otherwise, so a pointer passed as an int (``ctypes.addressof``) was cut to its
low 32 bits, and the kernel answered ``EFAULT`` (issue 15: a root worker with
supplementary groups died at its first job, restoring them with ``setgroups``). Here each
call is a prototype of its own (`function`, `syscall`), so the types travel with it and
a second use of the same symbol with other types cannot change the first one's.

The stdlib-only scripts the worker starts by path (``_reaper.py``, ``undo/_nshelper.py``,
``sandbox/_landlock_guest.py``) cannot import this module; they declare their few calls
the same way in their own file.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

__all__ = ("function", "syscall")

_libc = ctypes.CDLL(None, use_errno=True)


def function(name: str, restype: Any, *argtypes: Any) -> Callable[..., Any]:
    """The libc function `name`, typed: ``restype name(argtypes...)``, errno kept for
    ``ctypes.get_errno()``. Resolved now, so calling it never takes the loader's lock
    (safe between fork and exec)."""
    proto = ctypes.CFUNCTYPE(restype, *argtypes, use_errno=True)
    return proto((name, _libc))


def syscall(number: int, *argtypes: Any) -> Callable[..., int]:
    """The raw system call `number` with these argument types (through libc's
    ``syscall``, which passes each as a machine word): returns its result, ``-1`` with
    errno set on failure."""
    call = function("syscall", ctypes.c_long, ctypes.c_long, *argtypes)

    def invoke(*args: Any) -> int:
        return int(call(number, *args))

    return invoke
