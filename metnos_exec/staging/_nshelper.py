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
  "ino"}]}``: mount a tmpfs of that size at ``BASE/ID/t`` and, for root ``i``, an overlay
  at ``BASE/ID/i`` (lower: the root, upper ``t/u<i>``, work ``t/w<i>``). Each root is
  opened here with ``O_NOFOLLOW`` and must be the very folder (device, inode) the worker
  checked. Reply ``{"ok": true}`` with an fd on ``BASE/ID/t`` (SCM_RIGHTS), or
  ``{"ok": false, "error": "..."}`` with nothing left mounted.
- ``{"op": "release", "id": ID}``: detach and remove what ``stage`` made. No reply.

End of file on the socket (the worker exited, even by SIGKILL) ends the helper, and with it
the namespaces and every mount in them.
"""

from __future__ import annotations

import array
import ctypes
import json
import os
import shutil
import socket
import sys
from typing import Any

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_REC = 0x4000
_MS_SLAVE = 1 << 19
_MNT_DETACH = 0x2
_MAX_MSG = 65536

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None
) -> None:
    _check(
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount {fstype or ''} on {target}",
    )


def _umount(target: str) -> None:
    _libc.umount2(target.encode(), _MNT_DETACH)


def _enter_namespaces() -> bool:
    """A mount namespace (and a user namespace when not root); returns whether a user
    namespace was made (overlay then keeps its metadata in ``user.`` xattrs)."""
    uid, gid = os.getuid(), os.getgid()
    userns = os.geteuid() != 0
    _check(_libc.unshare(_CLONE_NEWNS | (_CLONE_NEWUSER if userns else 0)), "unshare")
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

    def stage(self, job_id: str, size: int, inodes: int, roots: list[dict[str, Any]]) -> int:
        if not job_id or "/" in job_id or job_id.startswith("."):
            raise ValueError(f"bad job id {job_id!r}")
        top = os.path.join(self.base, job_id)
        mounted: list[str] = []
        self.jobs[job_id] = (top, mounted)
        try:
            os.mkdir(top, 0o700)
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
            for i, root in enumerate(roots):
                lower = os.open(root["path"], os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
                try:
                    st = os.fstat(lower)
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
                    # a mode change by the job is a real difference.
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
                    _mount("overlay", target, "overlay", _MS_NOSUID | _MS_NODEV, options)
                    mounted.append(target)
                finally:
                    os.close(lower)
            return os.open(tmp, os.O_PATH | os.O_DIRECTORY)
        except BaseException:
            self.release(job_id)
            raise

    def release(self, job_id: str) -> None:
        found = self.jobs.pop(job_id, None)
        if found is None:
            return
        top, mounted = found
        for target in reversed(mounted):
            _umount(target)
        shutil.rmtree(top, ignore_errors=True)


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
    fd = stager.stage("probe", 1 << 20, 64, [{"path": lower, "dev": st.st_dev, "ino": st.st_ino}])
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
        _mount("tmpfs", base, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0700")
        stager = _Stager(base, userns)
        _probe(stager)
    except Exception as exc:
        _send(sock, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return 1
    _send(sock, {"ok": True, "userns": userns})
    while True:
        data = sock.recv(_MAX_MSG)
        if not data:
            return 0  # the worker is gone
        request = json.loads(data)
        op = request.get("op")
        if op == "release":
            stager.release(request["id"])
            continue
        if op != "stage":
            _send(sock, {"ok": False, "error": f"unknown op {op!r}"})
            continue
        try:
            fd = stager.stage(request["id"], request["size"], request["inodes"], request["roots"])
        except Exception as exc:
            _send(sock, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            continue
        try:
            _send(sock, {"ok": True}, (fd,))
        finally:
            os.close(fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
