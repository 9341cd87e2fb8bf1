"""The staging namespace helper: one small process per worker that owns the overlays.

Run as ``python -I -S _nshelper.py BASE FD`` with fd FD a ``SOCK_SEQPACKET`` socket to the
worker; standard library only (it is executed as a file, never imported), single-threaded
(a multithreaded process cannot enter a new user namespace: that is why this is a process
and not a thread of the worker).

At start it enters a mount namespace of its own (and, unless it runs as root, a user
namespace mapping only its own uid and gid: an unprivileged overlay needs one), makes every
mount a slave (host mounts still appear here, ours never leak out), and covers ``BASE``
(a folder of the worker's state dir) with a small tmpfs that holds only mount points.
bubblewrap is later started *inside* these namespaces (``nsenter``), so it can bind the
overlays below ``BASE`` over the job's real folders.

Protocol (JSON messages; one request, at most one reply):

- hello (sent first): ``{"ok": true, "userns": bool}`` after a probe overlay worked, or
  ``{"ok": false, "error": "..."}``, then exit.
- ``{"op": "stage", "id": ID, "size": BYTES, "inodes": N, "roots": [{"path", "dev",
  "ino"}], "lowers": L, "sources": S, "gid": G}``: mount a tmpfs of that size at
  ``BASE/ID/t`` and, for root ``i``, an overlay at ``BASE/ID/i`` (lower: the root, upper
  ``t/u<i>``, work ``t/w<i>``). Each root must be the very folder (device, inode) the
  worker checked: opened here with ``O_NOFOLLOW``, or, when ``L`` (the number of roots)
  detached mounts come with the request (SCM_RIGHTS, in root order: the worker's
  idmapped clones of the roots, for a job that runs as a slot's uid), that clone,
  attached at ``BASE/ID/.l/i`` (a folder only root may enter) and used as the lower layer.
  The ``S`` detached mounts after them (the job's other mount sources, idmapped too) are
  attached at ``BASE/ID/s<k>``. ``G`` (or ``null``): the group that may enter
  ``BASE/ID`` (the slot's: bubblewrap, run as the slot's uid, binds from there), else
  only root may. Reply ``{"ok": true}`` with an fd on ``BASE/ID/t`` and an ``O_PATH`` fd
  on each ``s<k>`` (SCM_RIGHTS), or ``{"ok": false, "error": "..."}`` with nothing left
  mounted (``"idmap": true`` when an idmapped layer was what failed).
- ``{"op": "release", "id": ID}``: detach and remove what ``stage`` made. No reply.

End of file on the socket (the worker exited, even by SIGKILL) ends the helper, and with it
the namespaces and every mount in them.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import json
import os
import socket
import stat
import sys
from collections.abc import Sequence
from typing import Any


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


def _open_no_symlinks(path: str) -> int:
    """An ``O_PATH`` fd on the folder `path`, refusing a symlink on any component (as
    `metnos_exec.sandbox.mount_sources.open_source` does on the worker's side): openat2
    with ``RESOLVE_NO_SYMLINKS``, else one ``O_NOFOLLOW`` component at a time."""
    flags = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
    how = _OpenHow(flags, 0, 0x04 | 0x02)  # RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
    # openat2(2): 437 on every architecture; -100: AT_FDCWD (the path is absolute).
    fd = int(_sys_openat2(437, -100, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how)))
    if fd >= 0:
        return fd
    err = ctypes.get_errno()
    if err != 38:  # ENOSYS: a kernel before 5.6
        raise OSError(err, f"{path}: {os.strerror(err)} (a symlink on the way?)")
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in [p for p in path.split("/") if p]:
            nxt = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                raise OSError(40, f"{path}: a symlink on the way")  # ELOOP
        out, fd = fd, -1
        return out
    finally:
        if fd >= 0:
            os.close(fd)


_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_REC = 0x4000
_MS_SLAVE = 1 << 19
_MNT_DETACH = 0x2
_MAX_MSG = 65536
#: File descriptors one message may carry (SCM_MAX_FD).
_MAX_FDS = 253
# move_mount(2) (the same number on every architecture) and its flag.
_SYS_MOVE_MOUNT = 429
_MOVE_MOUNT_F_EMPTY_PATH = 0x4

_libc = ctypes.CDLL(None, use_errno=True)


def _fn(name: str, restype: Any, *argtypes: Any) -> Any:
    """libc's `name`, every argument typed: an undeclared int goes in as a C ``int``
    (what `metnos_exec._libc` does for the worker; this file is run by path)."""
    return ctypes.CFUNCTYPE(restype, *argtypes, use_errno=True)((name, _libc))


_c_str = ctypes.c_char_p
_mount_fn = _fn("mount", ctypes.c_int, _c_str, _c_str, _c_str, ctypes.c_ulong, _c_str)
_umount2 = _fn("umount2", ctypes.c_int, _c_str, ctypes.c_int)
_unshare = _fn("unshare", ctypes.c_int, ctypes.c_int)
_sys_openat2 = _fn(
    "syscall",
    ctypes.c_long,
    ctypes.c_long,
    ctypes.c_int,
    _c_str,
    ctypes.POINTER(_OpenHow),
    ctypes.c_size_t,
)
_sys_move_mount = _fn(
    "syscall",
    ctypes.c_long,
    ctypes.c_long,
    ctypes.c_int,
    _c_str,
    ctypes.c_int,
    _c_str,
    ctypes.c_uint,
)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None
) -> None:
    _check(
        _mount_fn(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount {fstype or ''} on {target}",
    )


def _umount(target: str) -> None:
    _umount2(target.encode(), _MNT_DETACH)


def _attach(mount_fd: int, target: str) -> None:
    """Attach the detached mount `mount_fd` (made by the worker, in its own namespace)
    at `target`, here."""
    ret = _sys_move_mount(
        _SYS_MOVE_MOUNT, mount_fd, b"", -100, target.encode(), _MOVE_MOUNT_F_EMPTY_PATH
    )
    _check(0 if ret == 0 else -1, f"attach a mount at {target}")


class IdmapFailed(OSError):
    """An idmapped layer (a slot uid's job) could not be used: the worker may stage the
    job again without them, as root."""


def _enter_namespaces() -> bool:
    """A mount namespace (and a user namespace when not root); returns whether a user
    namespace was made (overlay then keeps its metadata in ``user.`` xattrs)."""
    uid, gid = os.getuid(), os.getgid()
    userns = os.geteuid() != 0
    _check(_unshare(_CLONE_NEWNS | (_CLONE_NEWUSER if userns else 0)), "unshare")
    if userns:
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    _mount(None, "/", None, _MS_REC | _MS_SLAVE, None)
    return userns


class _Stager:
    def __init__(self, base: str, userns: bool) -> None:
        self.base = base
        self.userns = userns
        self.jobs: dict[str, tuple[str, list[str]]] = {}

    def stage(
        self,
        job_id: str,
        size: int,
        inodes: int,
        roots: list[dict[str, Any]],
        *,
        lowers: list[int] | None = None,
        sources: list[int] | None = None,
        gid: int | None = None,
    ) -> list[int]:
        if not job_id or "/" in job_id or job_id.startswith("."):
            raise ValueError(f"bad job id {job_id!r}")
        if lowers and len(lowers) != len(roots):
            raise ValueError(f"{len(lowers)} lower layers for {len(roots)} roots")
        top = os.path.join(self.base, job_id)
        mounted: list[str] = []
        self.jobs[job_id] = (top, mounted)
        opened: list[int] = []
        try:
            tmp = self._make_top(top, size, inodes, mounted, lowers=bool(lowers), gid=gid)
            for i, root in enumerate(roots):
                self._mount_root(top, tmp, i, root, mounted, lowers[i] if lowers else None)
            opened.append(os.open(tmp, os.O_PATH | os.O_DIRECTORY))
            self._attach_sources(top, sources or (), mounted, opened)
            return opened
        except BaseException:
            for fd in opened:
                os.close(fd)
            self.release(job_id)
            raise

    def _make_top(
        self, top: str, size: int, inodes: int, mounted: list[str], *, lowers: bool, gid: int | None
    ) -> str:
        """The job's folder, and in it the tmpfs its upper layers live on (returned)."""
        os.mkdir(top, 0o700)
        if gid is not None:
            # Entered by bubblewrap as the slot's uid (in the slot's group), which binds
            # the overlays and the sources from here; by no other uid but root.
            os.chown(top, 0, gid)
            os.chmod(top, 0o710)
        if lowers:
            os.mkdir(os.path.join(top, ".l"), 0o700)
        tmp = os.path.join(top, "t")
        os.mkdir(tmp, 0o700)
        _mount(
            "tmpfs",
            tmp,
            "tmpfs",
            _MS_NOSUID | _MS_NODEV,
            f"size={int(size)},nr_inodes={int(inodes)},mode=0700",
        )
        mounted.append(tmp)
        return tmp

    def _mount_root(
        self,
        top: str,
        tmp: str,
        i: int,
        root: dict[str, Any],
        mounted: list[str],
        clone: int | None,
    ) -> None:
        """Mount root `i`'s overlay at ``top/i``; `clone`: the worker's idmapped clone of
        the root, its lower layer (``None``: the root itself, opened by path)."""
        if clone is not None:
            # The worker's idmapped clone of the root: checked like a path would
            # be, then attached where only root may go (it is the real folder).
            st = os.fstat(clone)
            lowerdir = os.path.join(top, ".l", str(i))
            os.mkdir(lowerdir, 0o700)
            try:
                _attach(clone, lowerdir)
            except OSError as exc:
                raise IdmapFailed(exc.errno, str(exc)) from None
            mounted.append(lowerdir)
            lower = os.open(lowerdir, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
        else:
            lower = _open_no_symlinks(root["path"])
            st = os.fstat(lower)
        try:
            if (st.st_dev, st.st_ino) != (root["dev"], root["ino"]):
                raise OSError(f"{root['path']} changed since the worker checked it")
            upper, work, target = (
                os.path.join(tmp, f"u{i}"),
                os.path.join(tmp, f"w{i}"),
                os.path.join(top, str(i)),
            )
            for folder in (upper, work, target):
                os.mkdir(folder, 0o700)
            # The overlay's root takes its mode (and owner) from the upper root:
            # give it the real folder's, so the guest sees the folder as it is and
            # a mode change by the job is a real difference. Through an idmapped
            # lower, the owner as the clone shows it (root's folder: the slot's).
            os.chmod(upper, st.st_mode & 0o7777)
            if not self.userns:
                os.chown(upper, st.st_uid, st.st_gid)
            # An overlay keeps its own metadata (whiteouts, opaque folders) in
            # xattrs: user.* inside a user namespace, trusted.* for root.
            # No redirects (nofollow: neither made nor followed; "off" would
            # still follow, which userxattr refuses) and no metacopy: every change
            # is a plain file in the upper folder (renaming a lower folder fails
            # with EXDEV, and tools copy instead), which the commit reads as is.
            options = (
                f"lowerdir=/proc/self/fd/{lower},upperdir={upper},workdir={work},"
                "redirect_dir=nofollow,metacopy=off,index=off"
            )
            if self.userns:
                options += ",userxattr"
            try:
                _mount("overlay", target, "overlay", _MS_NOSUID | _MS_NODEV, options)
            except OSError as exc:
                if clone is not None:
                    raise IdmapFailed(exc.errno, str(exc)) from None
                raise
            mounted.append(target)
        finally:
            os.close(lower)

    def _attach_sources(
        self, top: str, sources: Sequence[int], mounted: list[str], opened: list[int]
    ) -> None:
        """Attach the worker's idmapped clones of the job's other sources at ``top/s<k>``
        (their fds into `opened`)."""
        for k, source in enumerate(sources):
            # A file or a folder: its mount point must be the same kind.
            point = os.path.join(top, f"s{k}")
            if stat.S_ISDIR(os.fstat(source).st_mode):
                os.mkdir(point, 0o700)
            else:
                os.close(os.open(point, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            try:
                _attach(source, point)
            except OSError as exc:
                raise IdmapFailed(exc.errno, str(exc)) from None
            mounted.append(point)
            opened.append(os.open(point, os.O_PATH | os.O_NOFOLLOW))

    def release(self, job_id: str) -> None:
        found = self.jobs.pop(job_id, None)
        if found is None:
            return
        top, mounted = found
        for target in reversed(mounted):
            _umount(target)
        # Never a recursive delete: a mount point still attached would hold a real folder
        # (an idmapped lower is the user's own). Detached, each is an empty folder or file
        # on BASE's tmpfs (rmdir and unlink refuse one still attached: EBUSY); whatever
        # stays is in this namespace only, and goes with it.
        for folder in (os.path.join(top, ".l"), top):
            try:
                names = os.listdir(folder)
            except OSError:
                continue
            for name in names:
                path = os.path.join(folder, name)
                with contextlib.suppress(OSError):
                    if stat.S_ISDIR(os.lstat(path).st_mode):
                        os.rmdir(path)
                    else:
                        os.unlink(path)
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def _send(sock: socket.socket, doc: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(doc).encode()
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


def _probe(stager: _Stager) -> None:
    """Stage, write through and release one overlay: the kernel really lets us."""
    lower = os.path.join(stager.base, ".probe")
    os.mkdir(lower, 0o700)
    st = os.stat(lower)
    (fd,) = stager.stage(
        "probe", 1 << 20, 64, [{"path": lower, "dev": st.st_dev, "ino": st.st_ino}]
    )
    try:
        with open(os.path.join(stager.base, "probe", "0", "x"), "w") as f:
            f.write("x")
        if not os.path.exists(os.path.join(stager.base, "probe", "t", "u0", "x")):
            raise OSError("the probe overlay did not write into its upper folder")
    finally:
        os.close(fd)
        stager.release("probe")
        os.rmdir(lower)


def main(argv: list[str]) -> int:
    base = argv[1]
    sock = socket.socket(fileno=int(argv[2]))
    try:
        userns = _enter_namespaces()
        # A root helper's jobs may run as slot uids, whose bubblewrap binds from below
        # here: they may pass through (each job's own folder is closed to all but its
        # slot's group). The worker's base folder on the host is 0711 for them too.
        mode = "0700" if userns else "0711"
        _mount("tmpfs", base, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size=1m,mode={mode}")
        stager = _Stager(base, userns)
        _probe(stager)
    except Exception as exc:
        _send(sock, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return 1
    _send(sock, {"ok": True, "userns": userns})
    while True:
        data, fds = _recv(sock)
        if not data:
            return 0  # the worker is gone
        try:
            _serve(sock, stager, json.loads(data), fds)
        finally:
            for fd in fds:
                os.close(fd)  # a clone never attached is unmounted with its last fd


def _recv(sock: socket.socket) -> tuple[bytes, list[int]]:
    data, ancdata, _flags, _addr = sock.recvmsg(
        _MAX_MSG, socket.CMSG_SPACE(array.array("i").itemsize * _MAX_FDS)
    )
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            fds.extend(got)
    return data, fds


def _serve(sock: socket.socket, stager: _Stager, request: dict[str, Any], fds: list[int]) -> None:
    op = request.get("op")
    if op == "release":
        stager.release(request["id"])
        return
    if op != "stage":
        _send(sock, {"ok": False, "error": f"unknown op {op!r}"})
        return
    n_lowers = int(request.get("lowers", 0))
    n_sources = int(request.get("sources", 0))
    if len(fds) != n_lowers + n_sources:
        _send(sock, {"ok": False, "error": f"{len(fds)} fds for {n_lowers} + {n_sources}"})
        return
    try:
        opened = stager.stage(
            request["id"],
            request["size"],
            request["inodes"],
            request["roots"],
            lowers=fds[:n_lowers],
            sources=fds[n_lowers:],
            gid=request.get("gid"),
        )
    except Exception as exc:
        reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        if isinstance(exc, IdmapFailed):
            reply["idmap"] = True
        _send(sock, reply)
        return
    try:
        _send(sock, {"ok": True}, tuple(opened))
    finally:
        for fd in opened:
            os.close(fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
