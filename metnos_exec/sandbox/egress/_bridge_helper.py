"""The namespace bridge's helper process: listeners made inside a job's network namespace.

Not imported by the worker: it runs as ``python -I -S _bridge_helper.py FD`` (builtin and
standard modules only), started once per worker (`bridge`), single-threaded. Why a
process of its own: entering a job's *user* namespace (which an unprivileged worker must
do to hold CAP_NET_BIND_SERVICE and CAP_SYS_ADMIN over the job's network namespace) is
refused to a multithreaded process, and the worker has threads; and a fresh fork of the
worker costs ~20 ms, a fork of this small process about one.

Protocol on the SOCK_SEQPACKET socket ``FD``, one request at a time: the worker sends
``{"pid": N, "tcp": [port, ...], "udp": [port, ...]}`` with a pidfd of the job's sandbox
process ``N`` (SCM_RIGHTS). The helper forks; the child enters that process's network
namespace and the user namespace owning it, binds a TCP listener on ``0.0.0.0:port``
for each ``tcp`` port and a UDP socket for each ``udp`` one, sends
``{"ok": true}`` with their fds (in request order, TCP first) and exits; on any error
``{"ok": false, "error": "..."}`` and no fd. The helper reaps the child and waits for the
next request; end of file on ``FD`` (the worker is gone) makes it exit.

Why ``0.0.0.0``: the job's namespace has nothing but its loopback, so the wildcard means
127.0.0.0/8 there; it binds before bubblewrap has brought that loopback up, and one
listener per port catches every 127.x.y.z address (transparent capture's fake addresses
included). The worker tells them apart by each connection's local address.
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
IP_PKTINFO = 8
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int, kind: int, what: str) -> None:
    if _libc.setns(fd, kind) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns into the job's {what} namespace: {os.strerror(err)}")


def _listeners(pid: int, pidfd: int, tcp: list[int], udp: list[int]) -> list[socket.socket]:
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
    for port in tcp:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        made.append(s)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
        s.listen(128)
    for port in udp:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        made.append(s)
        # The destination of each datagram, to answer from the address it was sent to.
        s.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
        s.bind(("0.0.0.0", port))
    return made


def _serve_one(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    pid = os.fork()
    if pid == 0:
        code = 0
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
        os._exit(code)
    for fd in fds:
        os.close(fd)
    os.waitpid(pid, 0)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    space = socket.CMSG_SPACE(array.array("i").itemsize * 4)
    while True:
        try:
            data, ancdata, _flags, _addr = sock.recvmsg(_MAX_MSG, space)
        except InterruptedError:
            continue
        except OSError:
            return
        fds: list[int] = []
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                fds.extend(got)
        if not data:
            for fd in fds:
                os.close(fd)
            return
        _serve_one(sock, data, fds)


if __name__ == "__main__":
    main()
