"""Folders a job mounts, reached without following a symlink, and bound from an open fd.

The threat (issue 8): executor A may write ``~/X/swap/**``; executor B declares
``~/X/swap/inner/**``. A job of A replaced ``inner`` by a symlink to the worker's home, and
B's next job got the whole home bound read-write, while its report said files ``kept``.
A hint names a folder; if a symlink stands anywhere on the way to it, the folder mounted
is someone else's choice.

The rules, each tested (``tests/sandbox/test_mount_sources.py``, and the escape itself in
``tests/sandbox/test_bwrap_escapes.py``):

* **Trusted roots.** ``~`` is the job's home as the worker was configured with it, taken
  as a real path once (`metnos_exec.plan`); an absolute hint starts at ``/``. Below that,
  no component of a hint's folder may be a symlink: argument vetting, mount planning and
  the arm all refuse such a job with `SymlinkedFolder` (``E_SYMLINKED_FOLDER``), naming
  the link. A symlink *inside* a hint's folder is the executor's business: arguments are
  resolved through it and must still land under the hint (`metnos_exec.capabilities`),
  and the kernel resolves it inside the sandbox, where only the mounts exist.
* **Checked where it is mounted.** Planning checks with ``lstat`` (a clear refusal
  early); the bwrap arm then opens every job mount source again (`open_source`:
  ``openat2`` with ``RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS``, ``O_PATH``, so nothing
  is read and no device is opened), and bubblewrap binds from that fd (``--bind-fd`` /
  ``--ro-bind-fd``), checking after the mount that it mounted that very inode. A swap
  between planning and mounting is refused, never mounted.
* **The fds** are ``O_CLOEXEC``, handed to bubblewrap only (`ProcessSpec.pass_fds`), and
  closed by the worker once bubblewrap runs; bubblewrap closes its copies before the guest
  starts (the guest and bubblewrap's init hold only their stdio: tested).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat

from ..errors import SymlinkedFolder

__all__ = (
    "open_source",
    "symlink_on_path",
    "check_folder",
)

# openat2(2): the same number on every architecture (Linux >= 5.6).
_SYS_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04

_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = (
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    )


#: Whether this kernel has openat2 (probed on first use; ``None``: not yet).
_have_openat2: list[bool] = []


def _openat2(path: str, flags: int, resolve: int) -> int:
    how = _OpenHow(flags, 0, resolve)
    fd = int(
        _libc.syscall(_SYS_OPENAT2, -100, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
    )  # -100: AT_FDCWD (the path is absolute)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def _walk_open(path: str, flags: int) -> int:
    """`open_source` without openat2 (Linux < 5.6): one component at a time from ``/``,
    each opened ``O_PATH | O_NOFOLLOW`` relative to the last, so a symlink is met as
    itself (and refused) and the chain of fds leaves no window either."""
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        parts = [p for p in path.split("/") if p]
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            nxt = os.open(
                part, (flags if last else os.O_PATH) | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
            )
            os.close(fd)
            fd = nxt
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
        out, fd = fd, -1
        return out
    finally:
        if fd >= 0:
            os.close(fd)


def open_source(path: str) -> int:
    """Open the absolute `path` as an ``O_PATH`` fd, refusing any symlink on the way.

    Returns:
        The fd (``O_CLOEXEC``); the caller closes it.

    Raises:
        SymlinkedFolder: a component of `path` (the last one included) is a symlink.
        FileNotFoundError: `path` does not exist.
        OSError: anything else the kernel refused.
    """
    if not os.path.isabs(path):
        raise ValueError(f"mount source {path!r} must be absolute")
    flags = os.O_PATH | os.O_CLOEXEC
    try:
        if not _have_openat2:
            try:
                fd = _openat2(path, flags, _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
            except OSError as exc:
                if exc.errno != errno.ENOSYS:
                    _have_openat2.append(True)
                    raise
                _have_openat2.append(False)
            else:
                _have_openat2.append(True)
                return fd
        if _have_openat2[0]:
            return _openat2(path, flags, _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
        return _walk_open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            link = symlink_on_path(path) or path
            raise SymlinkedFolder(_message(path, link)) from None
        raise


def symlink_on_path(path: str) -> str | None:
    """The first component of the absolute `path` that is a symlink (``None``: none, up
    to the first component that does not exist)."""
    current = ""
    for part in (p for p in path.split("/") if p):
        current += "/" + part
        try:
            st = os.lstat(current)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            return current
    return None


def _message(path: str, link: str) -> str:
    with contextlib.suppress(OSError):
        link = f"{link} (-> {os.readlink(link)})"
    return (
        f"{path} is reached through the symlink {link}, so it is not the folder its hint "
        "names; nothing ran. Declare the real path, or remove the link if you did not "
        "make it"
    )


def check_folder(path: str) -> bool:
    """Whether `path` exists, refusing it when a symlink stands on the way (see the
    module docstring; planning's early check, `open_source` is the one that binds).

    Raises:
        SymlinkedFolder: naming the symlink.
    """
    link = symlink_on_path(path)
    if link is not None:
        raise SymlinkedFolder(_message(path, link))
    return os.path.lexists(path)
