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

import atexit
import contextlib
import ctypes
import errno
import os
import stat
import threading

from .. import _libc
from ..errors import SymlinkedFolder

__all__ = (
    "STAGE_ROOT",
    "StagedSources",
    "check_folder",
    "idmapped_clone",
    "open_source",
    "symlink_on_path",
)

# openat2(2): the same number on every architecture (Linux >= 5.6).
_SYS_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04


class _OpenHow(ctypes.Structure):
    _fields_ = (
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    )


# Typed (`metnos_exec._libc`): an untyped syscall() takes every int as a C int.
_sys_openat2 = _libc.syscall(
    _SYS_OPENAT2, ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(_OpenHow), ctypes.c_size_t
)
_umount2 = _libc.function("umount2", ctypes.c_int, ctypes.c_char_p, ctypes.c_int)
_mount = _libc.function(
    "mount",
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
)


#: Whether this kernel has openat2 (probed on first use; ``None``: not yet).
_have_openat2: list[bool] = []


def _openat2(path: str, flags: int, resolve: int) -> int:
    how = _OpenHow(flags, 0, resolve)
    fd = int(
        _sys_openat2(-100, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
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
    if _have_openat2 != [False] and os.path.isabs(path):
        # The common answer in one syscall (planning checks the executor's folder for
        # every job: 12 -> 3 us): openat2 refusing every symlink opens it only if no
        # component is one. Any refusal (a symlink, a missing component, no permission,
        # no openat2) is left to the walk below, which says which it is as before.
        try:
            fd = _openat2(
                path, os.O_PATH | os.O_CLOEXEC, _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS
            )
        except OSError as exc:
            if exc.errno == errno.ENOSYS:
                _have_openat2[:] = [False]
        else:
            os.close(fd)
            return True
    link = symlink_on_path(path)
    if link is not None:
        raise SymlinkedFolder(_message(path, link))
    return os.path.lexists(path)


# --- idmapped staging for a root worker's slot uids ----------------------------------------

# The new mount API: the same numbers on every architecture (Linux >= 5.2 / 5.12).
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_MOUNT_SETATTR = 442
_OPEN_TREE_CLONE = 0x1
_AT_EMPTY_PATH = 0x1000
_AT_RECURSIVE = 0x8000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_IDMAP = 0x00100000
_MNT_DETACH = 0x2
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_PRIVATE = 0x40000

#: Where a root worker attaches its slots' idmapped mounts: ``<STAGE_ROOT>/<worker pid>/
#: <slot uid>/<n>``, a private mount point (nothing attached below propagates anywhere).
STAGE_ROOT = "/run/metnos-exec/mnt"


class _MountAttr(ctypes.Structure):
    _fields_ = (
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    )


_sys_open_tree = _libc.syscall(_SYS_OPEN_TREE, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
_sys_mount_setattr = _libc.syscall(
    _SYS_MOUNT_SETATTR,
    ctypes.c_int,
    ctypes.c_char_p,
    ctypes.c_uint,
    ctypes.POINTER(_MountAttr),
    ctypes.c_size_t,
)
_sys_move_mount = _libc.syscall(
    _SYS_MOVE_MOUNT, ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint
)


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _mount_points() -> list[str]:
    """This mount namespace's mount points (``/proc/self/mountinfo``, octal escapes kept
    as they are: ours never need them)."""
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        return [line.split()[4] for line in f if line.strip()]


def _umount(path: str) -> None:
    # MNT_DETACH: never EBUSY; EINVAL: nothing mounted there (already gone).
    if _umount2(os.fsencode(path), _MNT_DETACH) != 0 and ctypes.get_errno() != errno.EINVAL:
        err = ctypes.get_errno()
        raise OSError(err, f"umount {path}: {os.strerror(err)}")


def _sweep(root: str) -> None:
    """Detach what dead workers left under `root` and remove their (empty) mount points.

    Never removes anything recursively: a mount point still attached would hold a user's
    folder; only ``rmdir``/``unlink`` of what is verifiably empty and unmounted.
    """
    try:
        owners = os.listdir(root)
    except OSError:
        return
    mounted = _mount_points()
    for owner in owners:
        if not owner.isdigit() or os.path.exists(f"/proc/{owner}"):
            continue
        base = os.path.join(root, owner)
        for point in sorted((m for m in mounted if m.startswith(base + "/")), reverse=True):
            with contextlib.suppress(OSError):
                _umount(point)
        _remove_mount_points(base)


def _remove_mount_points(base: str) -> None:
    """Remove the mount points under `base`, and `base`, once detached: ``unlink`` of the
    file ones, ``rmdir`` of the folders (which fails on anything not empty), never a
    recursive delete that could reach through a mount still attached."""
    if any(m.startswith(base + "/") for m in _mount_points()):
        return
    for top, dirs, files in os.walk(base, topdown=False):
        for name in files:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(top, name))
        for name in dirs:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(top, name))
    with contextlib.suppress(OSError):
        os.rmdir(base)


_stage_lock = threading.Lock()
_stage_ready: list[str] = []


def _stage_dir(uid: int, gid: int) -> str:
    """This worker's folder for slot `uid`'s mount points (made once; stale ones swept)."""
    with _stage_lock:
        if not _stage_ready:
            for path in (os.path.dirname(STAGE_ROOT), STAGE_ROOT):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path, 0o711)
                st = os.lstat(path)
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
                    raise OSError(f"{path} is not a root-owned folder")
                os.chmod(path, 0o711)
            if STAGE_ROOT not in _mount_points():
                # A private mount point of its own: what we attach below it is never
                # propagated to other mount namespaces (a shared /run would).
                _check(_mount(os.fsencode(STAGE_ROOT), os.fsencode(STAGE_ROOT), None,
                                   _MS_BIND, None), f"bind {STAGE_ROOT}")  # fmt: skip
            _check(_mount(None, os.fsencode(STAGE_ROOT), None, _MS_PRIVATE, None),
                   f"make {STAGE_ROOT} private")  # fmt: skip
            _sweep(STAGE_ROOT)
            _stage_ready.append(STAGE_ROOT)
        mine = os.path.join(STAGE_ROOT, str(os.getpid()))
        with contextlib.suppress(FileExistsError):
            os.mkdir(mine, 0o711)
        slot = os.path.join(mine, str(uid))
        with contextlib.suppress(FileExistsError):
            os.mkdir(slot, 0o710)
        # Searchable by the slot's group only: bubblewrap, running as the slot's uid,
        # resolves the mount points by path; no other local user needs to.
        os.chown(slot, 0, gid)
        os.chmod(slot, 0o710)
        return slot


def _remove_own_stage() -> None:
    """At exit: this worker's (empty, detached) mount points go; a worker killed before
    this leaves them to the next one's sweep."""
    mine = os.path.join(STAGE_ROOT, str(os.getpid()))
    if _stage_ready and os.path.isdir(mine):
        _remove_mount_points(mine)


atexit.register(_remove_own_stage)


def idmapped_clone(fd: int, userns_fd: int, *, recursive: bool = True, what: str = "") -> int:
    """A detached clone of the mount tree at `fd` (an ``O_PATH`` fd from `open_source`),
    idmapped with the user namespace `userns_fd` (a slot's: root's files shown as the
    slot uid's); the fd of the detached mount, ``O_CLOEXEC``. Nothing is attached: the
    caller attaches it (``move_mount``), here or, handed over, in another mount namespace
    (the staging helper's), or closes it, which unmounts it.

    Args:
        recursive: clone the mounts below `fd` too (what a bind shows), else only its own.
        what: the path, for error messages.

    Raises:
        OSError: the kernel or the filesystem refused (no idmapped mounts there, say).
    """
    flags = _OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_EMPTY_PATH
    if recursive:
        flags |= _AT_RECURSIVE
    clone = _check(_sys_open_tree(fd, b"", flags), f"open_tree {what}")
    try:
        attr = _MountAttr(_MOUNT_ATTR_IDMAP, 0, 0, userns_fd)
        at = _AT_EMPTY_PATH | (_AT_RECURSIVE if recursive else 0)
        _check(
            _sys_mount_setattr(clone, b"", at, ctypes.byref(attr), ctypes.sizeof(attr)),
            f"idmapped mount of {what}",
        )
    except BaseException:
        os.close(clone)
        raise
    return clone


class StagedSources:
    """A root worker's mount sources for one job of a slot uid: each an idmapped clone
    (uid and gid 0 shown as the slot's) attached under `STAGE_ROOT`, where bubblewrap,
    running as that uid, can reach it; `fds` are ``O_PATH`` fds of the attached roots, to
    bind from. `close` detaches them.

    Why idmapped: the job's folders belong to the root worker's user (root); the slot's
    uid keeps the owner rights on them the job had as root, and nothing else of root's.
    What the job creates there is root's on disk, as before.
    """

    def __init__(self, sources: dict[str, int], uid: int, gid: int, userns_fd: int) -> None:
        """Stage every source (host path → fd from `open_source`).

        Raises:
            OSError: the kernel or a filesystem refused (no idmapped mounts there, say):
                nothing stays attached, the caller runs the job as root instead.
        """
        self.fds: dict[str, int] = {}
        self._points: list[str] = []
        folder = _stage_dir(uid, gid)
        try:
            for n, (path, fd) in enumerate(sources.items()):
                is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
                point = os.path.join(folder, str(n) if is_dir else f"{n}.f")
                if is_dir:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(point, 0o700)
                else:
                    os.close(os.open(point, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
                clone = idmapped_clone(fd, userns_fd, what=path)
                try:
                    _check(
                        _sys_move_mount(
                            clone, b"", -100, os.fsencode(point), _MOVE_MOUNT_F_EMPTY_PATH
                        ),
                        f"attach {path}",
                    )  # fmt: skip
                finally:
                    os.close(clone)
                self._points.append(point)
                self.fds[path] = os.open(point, os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Detach every staged mount (the sandbox keeps its own copies) and close fds."""
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}
        points, self._points = self._points, []
        for point in points:
            with contextlib.suppress(OSError):
                _umount(point)
