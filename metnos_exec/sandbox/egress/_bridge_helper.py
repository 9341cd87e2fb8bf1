"""The namespace bridge's helper process: listeners made inside a job's network namespace.

Not imported by the worker: it runs as ``python -I -S _bridge_helper.py FD`` (builtin and
standard modules only), started once per worker (`bridge`), single-threaded. Why a
process of its own: entering a job's *user* namespace (which an unprivileged worker must
do to hold CAP_NET_BIND_SERVICE and CAP_SYS_ADMIN over the job's network namespace) is
refused to a multithreaded process, and the worker has threads; and a fresh fork of the
worker costs ~20 ms, a fork of this small process about one.

Protocol on the SOCK_SEQPACKET socket ``FD``, one request at a time: the worker sends
``{"pid": N, "tcp": [[address, port], ...], "udp": [[address, port], ...]}`` with a
pidfd of the job's sandbox process ``N`` (SCM_RIGHTS). The helper hands it to a child
it forked ahead (`_spare`); the child enters that process's network namespace and the
user namespace owning it, binds a TCP listener on each ``tcp`` address and port and a
UDP socket on each ``udp`` one (``IP_FREEBIND``: the job's loopback may not be up yet),
sends ``{"ok": true}`` with their fds (in request order, TCP first) and exits; on any
error ``{"ok": false, "error": "..."}`` and no fd. The helper reaps the child, forks the
next spare and waits for the next request; end of file on ``FD`` (the worker is gone)
makes it exit, and its spare with it.

Each listener binds one address and port of the job's loopback exactly: a connection to
any other (``127.0.0.2``, the proxy's port on another address) finds nothing and is
refused by the job's own kernel.
"""

import array
import contextlib
import ctypes
import fcntl
import json
import os
import signal
import socket
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
#: ioctl(2) on a namespace fd: an fd of the user namespace owning it (<linux/nsfs.h>).
NS_GET_USERNS = 0xB701
_MAX_MSG = 4096
#: <linux/in.h>; Python's socket module does not name it.
IP_FREEBIND = 15
# int setns(int fd, int nstype), typed: this script is run by path and cannot import
# `metnos_exec._libc`, whose reason it shares (an untyped call passes ints as C ints).
_setns_call = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_int, use_errno=True)(
    ("setns", ctypes.CDLL(None, use_errno=True))
)


def _setns(fd: int, kind: int, what: str) -> None:
    if _setns_call(fd, kind) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns into the job's {what} namespace: {os.strerror(err)}")


def _listeners(
    pid: int, pidfd: int, tcp: list[list[object]], udp: list[list[object]]
) -> list[socket.socket]:
    net = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    # The pid still names the process the worker holds a pidfd on (not a reused one).
    signal.pidfd_send_signal(pidfd, 0)
    # The user namespace that *owns* the network namespace: bubblewrap's outer one. The
    # sandbox process itself may sit in a nested one (``--disable-userns`` makes it),
    # whose capabilities do not reach the network namespace.
    owner = fcntl.ioctl(net, NS_GET_USERNS)
    _setns(owner, CLONE_NEWUSER, "user")
    _setns(net, CLONE_NEWNET, "network")
    made: list[socket.socket] = []
    for kind, binds in ((socket.SOCK_STREAM, tcp), (socket.SOCK_DGRAM, udp)):
        for address, port in binds:
            s = socket.socket(socket.AF_INET, kind)
            made.append(s)
            # The job's loopback may not be up yet (bubblewrap brings it up meanwhile).
            s.setsockopt(socket.IPPROTO_IP, IP_FREEBIND, 1)
            if kind == socket.SOCK_STREAM:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((str(address), int(str(port))))
            if kind == socket.SOCK_STREAM:
                s.listen(128)
    return made


def _spare(sock: socket.socket) -> tuple[int, socket.socket]:
    """A child forked ahead of the next request: it waits on its channel, serves one
    request (the namespaces entered cannot be left), answers the worker directly on
    `sock` and exits. Forking ahead keeps the fork off the job's start (~1 ms, more on
    a loaded machine)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid:
        theirs.close()
        return pid, ours
    ours.close()
    code = 0
    try:
        data, fds = _recv(theirs)
        if not data:
            os._exit(0)  # the helper is stopping
        try:
            request = json.loads(data)
            if len(fds) != 1:
                raise ValueError(f"{len(fds)} fds with the request (want one pidfd)")
            made = _listeners(
                int(request["pid"]), fds[0], list(request["tcp"]), list(request["udp"])
            )
            out = array.array("i", [s.fileno() for s in made])
            sock.sendmsg([b'{"ok": true}'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, out)])
        except BaseException as exc:  # every failure is an answer, never a hang
            code = 1
            with contextlib.suppress(OSError):
                sock.send(json.dumps({"ok": False, "error": str(exc)}).encode())
    finally:
        os._exit(code)


def _recv(sock: socket.socket) -> tuple[bytes, list[int]]:
    space = socket.CMSG_SPACE(array.array("i").itemsize * 4)
    while True:
        try:
            data, ancdata, _flags, _addr = sock.recvmsg(_MAX_MSG, space)
            break
        except InterruptedError:
            continue
        except OSError:
            return b"", []
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            fds.extend(got)
    return data, fds


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    pid, chan = _spare(sock)
    try:
        while True:
            data, fds = _recv(sock)
            if not data:
                for fd in fds:
                    os.close(fd)
                return
            try:
                chan.sendmsg(
                    [data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                )
            finally:
                for fd in fds:
                    os.close(fd)
            os.waitpid(pid, 0)
            chan.close()
            pid, chan = _spare(sock)
    finally:
        chan.close()  # the spare reads end of file and exits
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
