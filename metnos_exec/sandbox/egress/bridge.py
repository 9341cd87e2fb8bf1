"""The namespace bridge, worker side: listening sockets inside a job's network namespace.

`listeners` asks the worker's bridge helper (`_bridge_helper`, one process per worker,
started at the first request and kept) to bind sockets inside the namespaces of a
sandbox process, and returns them: they listen on the job's loopback, and the worker
accepts on them in its own namespace. The helper is reached over a SOCK_SEQPACKET pair,
one request at a time (a lock), from a thread (the round trip, one fork of the small
helper, is about a millisecond, and must not stall the event loop). A helper that died
is replaced at the next request. It exits by itself when the worker does (end of file on
its socket).
"""

from __future__ import annotations

import array
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import anyio.to_thread

from ...errors import HostFault

__all__ = ("BridgeFailed", "held_fds", "helper_pids", "listeners", "stop_helper")

_HELPER: Final = Path(__file__).with_name("_bridge_helper.py")
#: How long one request may take (a fork, a few binds: normally about a millisecond).
_REQUEST_TIMEOUT_S: Final = 10.0
_MAX_FDS: Final = 253


class BridgeFailed(HostFault):
    """The listeners could not be made inside the job's namespace: the job must not run
    (its network would be nowhere, or worse, somewhere)."""


class _Helper:
    def __init__(self) -> None:
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

    def request(self, pid: int, tcp: Sequence[int], udp: Sequence[int]) -> list[socket.socket]:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:
            raise BridgeFailed(f"the job's sandbox process {pid} is gone: {exc}") from exc
        try:
            with self.lock:
                sock = self.ensure()
                data = json.dumps({"pid": pid, "tcp": list(tcp), "udp": list(udp)}).encode()
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
        finally:
            os.close(pidfd)
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


_helper = _Helper()


async def listeners(pid: int, tcp: Sequence[int], udp: Sequence[int] = ()) -> list[socket.socket]:
    """Sockets bound inside the network namespace of sandbox process `pid`: a TCP
    listener on ``0.0.0.0:port`` per `tcp` port, then a UDP socket per `udp` port
    (``IP_PKTINFO`` on), non-blocking, owned by the caller.

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
