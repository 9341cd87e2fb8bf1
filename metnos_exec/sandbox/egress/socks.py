"""SOCKS5 on the job's loopback: CONNECT only, no authentication, ``socks5h`` semantics.

A name in the request (``socks5h://``, address type 3) is decided and resolved by the
worker, like every other; an address (``socks5://``, the client resolved it, through
the DNS stub at best) is decided as an address: only a hint naming it literally allows
it. A refusal is reply 2, "connection not allowed by ruleset" (RFC 1928): policy, not a
broken network. BIND and UDP ASSOCIATE are answered 7 (command not supported).
"""

from __future__ import annotations

import ipaddress

import anyio

from .policy import Refused
from .relay import Conn, JobTraffic, recv_some, send_all

__all__ = ("serve_socks",)

_OK, _FAIL, _RULESET, _UNREACHABLE, _REFUSED, _COMMAND, _ADDRESS = 0, 1, 2, 4, 5, 7, 8
_HANDSHAKE_TIMEOUT_S = 30.0


class _Closed(Exception):
    pass


async def _exactly(conn: Conn, n: int, buf: bytearray) -> bytes:
    while len(buf) < n:
        chunk = await recv_some(conn.sock, 4096)
        if not chunk:
            raise _Closed
        buf += chunk
    out = bytes(buf[:n])
    del buf[:n]
    return out


def _reply(code: int) -> bytes:
    return bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0])


async def serve_socks(traffic: JobTraffic, conn: Conn) -> None:
    """Answer one connection to the job's SOCKS5 proxy."""
    conn.via = "socks"
    buf = bytearray()
    try:
        with anyio.fail_after(_HANDSHAKE_TIMEOUT_S):
            version, count = await _exactly(conn, 2, buf)
            if version != 5:
                return
            methods = await _exactly(conn, count, buf)
            if 0 not in methods:
                await send_all(conn.sock, b"\x05\xff")
                return
            await send_all(conn.sock, b"\x05\x00")
            version, command, _rsv, kind = await _exactly(conn, 4, buf)
            if version != 5:
                return
            if kind == 1:
                host = str(ipaddress.IPv4Address(await _exactly(conn, 4, buf)))
            elif kind == 4:
                host = str(ipaddress.IPv6Address(await _exactly(conn, 16, buf)))
            elif kind == 3:
                (size,) = await _exactly(conn, 1, buf)
                host = (await _exactly(conn, size, buf)).decode("ascii", "replace")
            else:
                await send_all(conn.sock, _reply(_ADDRESS))
                return
            port = int.from_bytes(await _exactly(conn, 2, buf), "big")
    except (_Closed, TimeoutError, ValueError):
        return
    if command != 1:
        await send_all(conn.sock, _reply(_COMMAND))
        return
    decision = await traffic.decide(host, port)
    if isinstance(decision, Refused):
        traffic.refuse(conn.via, decision.host, port, decision.reason)
        await send_all(conn.sock, _reply(_RULESET))
        return
    try:
        upstream, address = await traffic.connect(decision)
    except OSError as exc:
        traffic.refuse(
            conn.via,
            decision.host,
            port,
            f"allowed by {decision.rule.source}, but {decision.host}:{port} could not be "
            f"reached: {exc}",
        )
        await send_all(conn.sock, _reply(_REFUSED))
        return
    try:
        await send_all(conn.sock, _reply(_OK))
        await traffic.pipe(conn, upstream, bytes(buf))
    finally:
        upstream.close()
        traffic.allow(conn, decision, address)
