"""The allow-listed DNS stub on the job's ``127.0.0.1:53`` (UDP and TCP).

The job's ``/etc/resolv.conf`` names it (the bwrap arm binds a generated one over the
host's, and an ``/etc/hosts`` with ``localhost`` only). It answers a name an allow rule
matches (for any of its ports) with that name's fake address (`capture`): an ``A``
record, and no ``AAAA`` (so clients take the IPv4 one); every other name gets
``REFUSED``, and nothing is ever asked of a real DNS server on the job's behalf (a lookup
is a channel out: ``secret.attacker.example``). Questions to another loopback address
than 127.0.0.1 are not answered.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import struct
import tempfile
from collections.abc import Awaitable, Callable

import anyio

from .capture import FakeAddresses
from .policy import normalise_host
from .relay import Conn, JobTraffic, recv_some, send_all

__all__ = ("Prepare", "answer", "guest_files", "serve_dns_tcp", "serve_dns_udp")

#: Called with an allowed name before its answer: its fake address must be listening
#: (`wall.Wall.prepare`); ``False``: it could not be (the answer is SERVFAIL).
Prepare = Callable[[str], Awaitable[bool]]

_A, _AAAA = 1, 28
_NOERROR, _FORMERR, _SERVFAIL, _REFUSED = 0, 1, 2, 5
_TTL = 60
_STUB = socket.inet_aton("127.0.0.1")
#: <linux/in.h>; Python's socket module does not name it.
_IP_PKTINFO = 8


def _question(query: bytes) -> tuple[str, int, int] | None:
    """(name, type, end offset of the question) of a one-question query, else ``None``."""
    if len(query) < 12:
        return None
    _id, flags, qd, _an, _ns, _ar = struct.unpack("!HHHHHH", query[:12])
    if flags & 0x8000 or qd != 1:
        return None
    labels: list[str] = []
    p = 12
    while True:
        if p >= len(query):
            return None
        size = query[p]
        if size == 0:
            p += 1
            break
        if size & 0xC0:  # no compression in a question
            return None
        label = query[p + 1 : p + 1 + size]
        if len(label) != size:
            return None
        try:
            labels.append(label.decode("ascii"))
        except UnicodeDecodeError:
            return None
        p += 1 + size
    if p + 4 > len(query):
        return None
    qtype, _qclass = struct.unpack("!HH", query[p : p + 4])
    return ".".join(labels), qtype, p + 4


def _allowed(traffic: JobTraffic, name: str) -> bool:
    policy = traffic.policy
    for rule in policy.allow:
        if rule.literal or rule.port is None:
            continue
        if rule.matches(name, rule.port) and policy.denied(name, rule.port) is None:
            return True
    return False


def answer(
    traffic: JobTraffic, fake: FakeAddresses, query: bytes
) -> tuple[bytes | None, str | None, bool]:
    """The reply to `query`, the name asked, and whether it was allowed (``None`` reply:
    not a query this stub answers)."""
    parsed = _question(query)
    if parsed is None:
        if len(query) < 12:
            return None, None, False
        return _header(query, _FORMERR, 0) + b"", None, False
    raw, qtype, end = parsed
    question = query[12:end]
    name = normalise_host(raw)
    if name is None or not _allowed(traffic, name):
        return _header(query, _REFUSED, 0) + question, raw, False
    if qtype != _A:
        return _header(query, _NOERROR, 0) + question, name, True
    address = fake.address_for(name)
    if address is None:
        return _header(query, _SERVFAIL, 0) + question, name, False
    record = struct.pack("!HHHIH", 0xC00C, _A, 1, _TTL, 4) + socket.inet_aton(address)
    return _header(query, _NOERROR, 1) + question + record, name, True


def _header(query: bytes, rcode: int, answers: int) -> bytes:
    (qid, flags) = struct.unpack("!HH", query[:4])
    # QR, the query's opcode and RD, RA; the rcode.
    out_flags = 0x8000 | (flags & 0x7900) | 0x0080 | rcode
    qd = 1 if rcode != _FORMERR else 0
    return struct.pack("!HHHHHH", qid, out_flags, qd, answers, 0, 0)


def _note(traffic: JobTraffic, name: str | None, allowed: bool) -> None:
    if name is not None and not allowed:
        traffic.refuse(
            "dns",
            name,
            53,
            "the DNS stub answers only the manifest's hosts; blocked by the executor's manifest",
        )


async def _answer(
    traffic: JobTraffic, fake: FakeAddresses, prepare: Prepare, query: bytes
) -> bytes | None:
    parsed = _question(query)
    name = None if parsed is None else normalise_host(parsed[0])
    if name is not None and _allowed(traffic, name) and not await prepare(name):
        return _header(query, _SERVFAIL, 0) + query[12 : parsed[2]] if parsed else None
    reply, asked, allowed = answer(traffic, fake, query)
    _note(traffic, asked, allowed)
    return reply


async def serve_dns_udp(
    traffic: JobTraffic, sock: socket.socket, fake: FakeAddresses, prepare: Prepare
) -> None:
    """Answer datagrams sent to 127.0.0.1:53 until cancelled."""
    space = socket.CMSG_SPACE(12)
    while True:
        await traffic.admit()  # a question costs as much of the job's rate as a connection
        while True:
            try:
                query, ancdata, _flags, peer = sock.recvmsg(4096, space)
                break
            except (BlockingIOError, InterruptedError):
                await anyio.wait_readable(sock)
            except OSError:
                continue
        dest = next(
            (
                d[8:12]
                for level, kind, d in ancdata
                if level == socket.IPPROTO_IP and kind == _IP_PKTINFO
            ),
            None,
        )
        if dest not in (None, _STUB):
            continue
        reply = await _answer(traffic, fake, prepare, query)
        if reply is not None:
            with contextlib.suppress(OSError):
                sock.sendto(reply, peer)


async def serve_dns_tcp(
    traffic: JobTraffic, conn: Conn, fake: FakeAddresses, prepare: Prepare
) -> None:
    """Answer length-prefixed queries on one TCP connection until it closes or idles."""
    buf = b""
    while True:
        with anyio.move_on_after(traffic.policy.limits.idle_timeout_s) as waited:
            chunk = await recv_some(conn.sock, 4096)
        if waited.cancelled_caught or not chunk:
            return
        buf += chunk
        while len(buf) >= 2:
            size = int.from_bytes(buf[:2], "big")
            if len(buf) < 2 + size:
                break
            query, buf = buf[2 : 2 + size], buf[2 + size :]
            reply = await _answer(traffic, fake, prepare, query)
            if reply is None:
                return
            await send_all(conn.sock, len(reply).to_bytes(2, "big") + reply)
        if len(buf) > 65537:
            return


#: What the job's resolver files say: the stub, and ``localhost`` only (the host's own
#: ``/etc/hosts`` may name machines of its network).
RESOLV_CONF = "nameserver 127.0.0.1\noptions attempts:1 timeout:2\n"
HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
_files: tuple[tuple[str, str], ...] | None = None


def guest_files() -> tuple[tuple[str, str], ...]:
    """``(host file, guest path)`` for the job's ``/etc/resolv.conf`` and ``/etc/hosts``,
    written once per process in a private folder every uid may read (a root worker's job
    runs as its slot's uid)."""
    global _files
    if _files is None:
        folder = tempfile.mkdtemp(prefix="metnos-egress-")
        # Gone with the process (a worker that is SIGKILLed leaves these two small files).
        atexit.register(shutil.rmtree, folder, True)
        os.chmod(folder, 0o755)
        out = []
        for name, text in (("resolv.conf", RESOLV_CONF), ("hosts", HOSTS)):
            path = os.path.join(folder, name)
            with open(path, "x", encoding="ascii") as f:
                f.write(text)
            os.chmod(path, 0o644)
            out.append((path, f"/etc/{name}"))
        _files = tuple(out)
    return _files
