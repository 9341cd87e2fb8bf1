"""The namespace bridge, worker side: listening sockets inside a job's network namespace.

`listeners` binds sockets inside the network namespace of a sandbox process and returns
them: they listen on the job's loopback, and the worker accepts on them in its own
namespace. A root worker does it on a thread of its own, which enters the namespace and
comes back (`_in_a_thread`, ~0.5 ms with the thread's start). Any other worker asks its
bridge helper (`_bridge_helper`, one process per worker, started at the first request
and kept), whose spare child enters the job's user namespace (which a multithreaded
process may not) and hands the sockets back over a SOCK_SEQPACKET pair, one request at a
time (a lock), from an anyio worker thread so the event loop never waits on it. A helper
that died is replaced at the next request; it exits by itself when the worker does (end
of file on its socket).
"""

from __future__ import annotations

import array
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import anyio.to_thread

from ..._libc import function
from ...errors import HostFault

#: One socket to make: (address, port) on the job's loopback.
Bind = tuple[str, int]

__all__ = ("BridgeFailed", "held_fds", "helper_pids", "listeners", "stop_helper")

_HELPER: Final = Path(__file__).with_name("_bridge_helper.py")
#: How long one request may take (a fork, a few binds: normally about a millisecond).
_REQUEST_TIMEOUT_S: Final = 10.0
_MAX_FDS: Final = 253
#: <linux/in.h>; Python's socket module does not name it.
_IP_FREEBIND: Final = 15


class BridgeFailed(HostFault):
    """The listeners could not be made inside the job's namespace: the job must not run
    (its network would be nowhere, or worse, somewhere)."""


class _Helper:
    def __init__(self) -> None:
        #: A root worker's thread may enter a job's network namespace and come back
        #: (setns of a network namespace is per thread; it needs CAP_SYS_ADMIN over the
        #: job's namespace and ours, which only root holds): no process hop at all.
        self.threads_may_enter = os.geteuid() == 0
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None

    def ensure(self) -> socket.socket:
        if self.sock is not None and self.proc is not None and self.proc.poll() is None:
            return self.sock
        self.stop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # A plain child: it exits when our end of the socket closes (no parent-death
            # signal, which would tie it to whichever thread spawned it).
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(_HELPER), str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={},
            )
        except OSError as exc:
            ours.close()
            raise BridgeFailed(f"cannot start the network bridge helper: {exc}") from exc
        finally:
            theirs.close()
        ours.settimeout(_REQUEST_TIMEOUT_S)
        self.sock = ours
        return ours

    def stop(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def request(self, pid: int, tcp: Sequence[Bind], udp: Sequence[Bind]) -> list[socket.socket]:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:
            raise BridgeFailed(f"the job's sandbox process {pid} is gone: {exc}") from exc
        try:
            if self.threads_may_enter:
                try:
                    return _in_a_thread(pid, pidfd, tcp, udp)
                except PermissionError:
                    # No CAP_SYS_ADMIN here after all (a container's bounding set).
                    self.threads_may_enter = False
            return self._ask_helper(pid, pidfd, tcp, udp)
        finally:
            os.close(pidfd)

    def _ask_helper(
        self, pid: int, pidfd: int, tcp: Sequence[Bind], udp: Sequence[Bind]
    ) -> list[socket.socket]:
        with self.lock:
            sock = self.ensure()
            data = json.dumps(
                {"pid": pid, "tcp": [list(b) for b in tcp], "udp": [list(b) for b in udp]}
            ).encode()
            try:
                sock.sendmsg(
                    [data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [pidfd]))]
                )
                reply, ancdata, _flags, _addr = sock.recvmsg(
                    4096, socket.CMSG_SPACE(array.array("i").itemsize * _MAX_FDS)
                )
            except OSError as exc:  # a timeout included: the helper is replaced
                self.stop()
                raise BridgeFailed(f"the network bridge helper failed: {exc}") from exc
        fds: list[int] = []
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                fds.extend(got)
        socks = [socket.socket(fileno=fd) for fd in fds]
        doc = json.loads(reply) if reply else {"ok": False, "error": "the helper exited"}
        if not doc.get("ok") or len(socks) != len(tcp) + len(udp):
            for s in socks:
                s.close()
            raise BridgeFailed(
                "cannot make the job's network listeners: "
                f"{doc.get('error', f'{len(socks)} sockets in the reply')}"
            )
        for s in socks:
            s.setblocking(False)
        return socks


_CLONE_NEWNET: Final = 0x40000000
#: int setns(int fd, int nstype), typed (see `metnos_exec._libc`).
_libc_setns = function("setns", ctypes.c_int, ctypes.c_int, ctypes.c_int)


def _setns(fd: int) -> None:
    if _libc_setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns into a network namespace: {os.strerror(err)}")


def _bind_in(pid: int, pidfd: int, tcp: Sequence[Bind], udp: Sequence[Bind]) -> list[socket.socket]:
    """On a thread of its own (it dies with it if it cannot come back): enter the job's
    network namespace, bind, return to ours."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        net = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            signal.pidfd_send_signal(pidfd, 0)  # still the process we hold, not a reused pid
            _setns(net)
        finally:
            os.close(net)
        made: list[socket.socket] = []
        try:
            for kind, binds in ((socket.SOCK_STREAM, tcp), (socket.SOCK_DGRAM, udp)):
                for address, port in binds:
                    s = socket.socket(socket.AF_INET, kind)
                    made.append(s)
                    # The job's loopback may not be up yet (bubblewrap brings it up).
                    s.setsockopt(socket.IPPROTO_IP, _IP_FREEBIND, 1)
                    if kind == socket.SOCK_STREAM:
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind((address, port))
                    if kind == socket.SOCK_STREAM:
                        s.listen(128)
        except BaseException:
            for s in made:
                s.close()
            raise
        finally:
            _setns(own)
    finally:
        os.close(own)
    for s in made:
        s.setblocking(False)
    return made


def _in_a_thread(
    pid: int, pidfd: int, tcp: Sequence[Bind], udp: Sequence[Bind]
) -> list[socket.socket]:
    """`_bind_in` on a fresh thread, never on a pooled one: a thread that could not
    return to our namespace ends (with it the namespace it was in), never to run a lookup
    or a connection of the worker's from inside a job's."""
    box: list[list[socket.socket] | BaseException] = []

    def run() -> None:
        try:
            box.append(_bind_in(pid, pidfd, tcp, udp))
        except BaseException as exc:  # handed to the caller
            box.append(exc)

    thread = threading.Thread(target=run, name="metnos-egress-bind")
    thread.start()
    thread.join()
    got = box[0]
    if isinstance(got, PermissionError):
        raise got
    if isinstance(got, BaseException):
        raise BridgeFailed(f"cannot make the job's network listeners: {got}") from got
    return got


_helper = _Helper()


async def listeners(pid: int, tcp: Sequence[Bind], udp: Sequence[Bind] = ()) -> list[socket.socket]:
    """Sockets bound inside the network namespace of sandbox process `pid`: a TCP
    listener on each `tcp` (address, port), then a UDP socket on each `udp` one,
    non-blocking, owned by the caller.

    Raises:
        BridgeFailed: the helper could not make them (the process is gone, a port is
            taken, namespaces cannot be entered here).
    """
    return await anyio.to_thread.run_sync(_helper.request, pid, tuple(tcp), tuple(udp))


def stop_helper() -> None:
    """Stop the helper (tests; a worker's exits with it)."""
    with _helper.lock:
        _helper.stop()


def helper_pids() -> set[int]:
    """The helper's pid while it runs (a long-lived child on purpose)."""
    proc = _helper.proc
    return set() if proc is None or proc.poll() is not None else {proc.pid}


def held_fds() -> set[int]:
    """The worker's end of the helper's socket (held on purpose for the process's life)."""
    sock = _helper.sock
    return set() if sock is None or sock.fileno() < 0 else {sock.fileno()}
