"""The HTTP proxy on the job's loopback: CONNECT and absolute-form requests.

One request per connection. CONNECT ``host:port`` opens a tunnel (a TLS ClientHello sent
into it must name the same host, `tls`); an absolute-form request (``GET http://host/p``)
is forwarded in origin form with ``Connection: close`` and the proxy headers removed, and
the answer relayed as is. The ``Host`` header must name the request's host (a different
one would reach another site behind the same address). A refusal is a ``403`` whose
``X-Metnos-Egress`` header and body say it is the executor's manifest, naming the host:
the job (or the agent reading its error) learns it is policy, not a broken network.
"""

from __future__ import annotations

import re
import socket
from urllib.parse import urlsplit

import anyio

from .policy import Authorized, Refused, normalise_host
from .relay import Conn, JobTraffic, recv_some, send_all
from .tls import MAX_HELLO, client_hello

__all__ = ("serve_http",)

#: The longest request head accepted (request line and headers).
MAX_HEAD = 64 * 1024
#: How long the job has to send its request head.
HEAD_TIMEOUT_S = 30.0
_TOKEN = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
#: Headers meant for the proxy (or for this hop only), never forwarded.
_HOP = frozenset(
    {b"proxy-connection", b"proxy-authorization", b"connection", b"keep-alive", b"te", b"upgrade"}
)


class _BadRequest(Exception):
    pass


async def _read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    buf = b""
    with anyio.fail_after(HEAD_TIMEOUT_S):
        while b"\r\n\r\n" not in buf:
            if len(buf) > MAX_HEAD:
                raise _BadRequest("request head too long")
            chunk = await recv_some(sock, 65536)
            if not chunk:
                raise _BadRequest("connection closed before the request head ended")
            buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head, rest


def _parse(head: bytes) -> tuple[bytes, bytes, bytes, list[tuple[bytes, bytes]]]:
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not _TOKEN.match(parts[0]) or not parts[2].startswith(b"HTTP/1."):
        raise _BadRequest("malformed request line")
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.match(name):
            raise _BadRequest("malformed header line")
        headers.append((name.lower(), value.strip()))
    return parts[0], parts[1], parts[2], headers


def _authority(text: str, default_port: int | None) -> tuple[str, int]:
    host, port = text, default_port
    if text.startswith("["):
        end = text.find("]")
        host, rest = text[: end + 1], text[end + 1 :]
        if rest:
            if not rest.startswith(":") or not rest[1:].isdigit():
                raise _BadRequest(f"bad authority {text!r}")
            port = int(rest[1:])
    elif ":" in text:
        host, _, port_s = text.rpartition(":")
        if not port_s.isdigit():
            raise _BadRequest(f"bad authority {text!r}")
        port = int(port_s)
    if port is None or not host:
        raise _BadRequest(f"no port in {text!r}")
    return host, port


def _response(status: str, body: str, extra: str = "") -> bytes:
    data = body.encode()
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n{extra}\r\n"
    ).encode() + data


def refusal(host: str, port: int, reason: str, status: str = "403 Forbidden") -> bytes:
    """The answer a refused request gets (header and body name the host and the rule):
    403 for a destination the manifest does not allow, 503 (with ``Retry-After``) for a
    job at its connection limit, which may succeed later."""
    safe = "".join(c for c in f"{host}:{port}" if 32 < ord(c) < 127)
    extra = "Retry-After: 1\r\n" if status.startswith("503") else ""
    return _response(
        status,
        f"metnos-exec egress: {reason}\n",
        f"X-Metnos-Egress: refused; host={safe}; blocked by the executor's manifest\r\n{extra}",
    )


async def serve_http(traffic: JobTraffic, conn: Conn) -> None:
    """Answer one connection to the job's HTTP proxy."""
    try:
        head, rest = await _read_head(conn.sock)
        method, target, version, headers = _parse(head)
        if method == b"CONNECT":
            conn.via = "connect"
            host, port = _authority(target.decode("ascii", "replace"), None)
        else:
            conn.via = "http"
            url = urlsplit(target.decode("ascii", "replace"))
            if url.scheme != "http" or not url.netloc or "@" in url.netloc:
                raise _BadRequest(
                    "only absolute-form http:// requests and CONNECT are proxied "
                    "(https goes through CONNECT)"
                )
            host, port = _authority(url.netloc, 80)
    except (_BadRequest, TimeoutError, UnicodeError, ValueError) as exc:
        await send_all(conn.sock, _response("400 Bad Request", f"metnos-exec egress: {exc}\n"))
        return
    decision = await traffic.decide(host, port)
    if isinstance(decision, Refused):
        traffic.refuse(conn.via, decision.host, port, decision.reason)
        await send_all(conn.sock, refusal(decision.host, port, decision.reason))
        return
    if method != b"CONNECT":
        sent_host = next((v for k, v in headers if k == b"host"), None)
        if sent_host is not None:
            try:
                h, p = _authority(sent_host.decode("ascii"), 80)
            except (_BadRequest, UnicodeError):
                h, p = "", 0
            if normalise_host(h) != decision.host or p != port:
                reason = (
                    f"the Host header names {sent_host.decode('ascii', 'replace')!r}, not "
                    f"{decision.host}:{port}; blocked by the executor's manifest"
                )
                traffic.refuse(conn.via, decision.host, port, reason)
                await send_all(conn.sock, refusal(decision.host, port, reason))
                return
    first = rest
    if method == b"CONNECT":
        await send_all(conn.sock, b"HTTP/1.1 200 Connection established\r\n\r\n")
        first, why = await check_sni(
            conn, decision, rest, min(5.0, traffic.policy.limits.idle_timeout_s)
        )
        if why is not None:
            traffic.refuse(conn.via, decision.host, port, why)
            return
    else:
        path = url.path or "/"
        if url.query:
            path += "?" + url.query
        lines = [method + b" " + path.encode("ascii") + b" " + version]
        lines += [k + b": " + v for k, v in headers if k not in _HOP]
        if not any(k == b"host" for k, _ in headers):
            lines.append(b"Host: " + url.netloc.encode("ascii"))
        lines.append(b"Connection: close")
        first = b"\r\n".join(lines) + b"\r\n\r\n" + rest
    await relay(traffic, conn, decision, first)


async def relay(traffic: JobTraffic, conn: Conn, ok: Authorized, first: bytes) -> None:
    """Connect to `ok`'s checked addresses and pipe; record the connection either way."""
    try:
        upstream, address = await traffic.connect(ok)
    except OSError as exc:
        reason = f"allowed by {ok.rule.source}, but {ok.host}:{ok.port} could not be reached: {exc}"
        traffic.refuse(conn.via, ok.host, ok.port, reason)
        if conn.via == "http":
            await send_all(
                conn.sock, _response("502 Bad Gateway", f"metnos-exec egress: {reason}\n")
            )
        return
    try:
        await traffic.pipe(conn, upstream, first)
    finally:
        upstream.close()
        traffic.allow(conn, ok, address)


async def check_sni(
    conn: Conn, ok: Authorized, data: bytes, wait: float = 5.0
) -> tuple[bytes, str | None]:
    """The first bytes of a tunnel (to send on), and why it is refused (``None``: not).

    Args:
        wait: how long the job may take to send them before they are let through
            unchecked (a server-speaks-first protocol sends none); half a hello then
            silence is refused.
    """
    with anyio.move_on_after(wait):
        while True:
            kind, name = client_hello(data)
            if kind != "need":
                break
            if len(data) > MAX_HELLO:
                kind = "malformed"
                break
            chunk = await recv_some(conn.sock, 65536)
            if not chunk:
                return data, None
            data += chunk
    kind, name = client_hello(data)
    if kind == "sni" and name is not None and normalise_host(name) != ok.host:
        return data, (
            f"the TLS ClientHello names {name!r}, not {ok.host}; blocked by the executor's manifest"
        )
    if kind == "malformed" or (kind == "need" and data):
        # Half a hello, then silence, must not pass unchecked (fail closed).
        return data, "a TLS ClientHello the wall cannot read; blocked by the executor's manifest"
    return data, None
