"""The wall's pieces in-process (no bwrap): the SNI reader, the DNS stub's answers, the
HTTP proxy and SOCKS5 over socket pairs, and the traffic limits. Every upstream is a
server on 127.0.0.1; names resolve through the test's resolver."""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Sequence

import anyio
import anyio.abc
import pytest

from metnos_exec.sandbox.egress import EgressLimits, policy_for
from metnos_exec.sandbox.egress.capture import FakeAddresses
from metnos_exec.sandbox.egress.dns import answer
from metnos_exec.sandbox.egress.http_proxy import serve_http
from metnos_exec.sandbox.egress.relay import Conn, JobTraffic, recv_some, send_all
from metnos_exec.sandbox.egress.socks import serve_socks
from metnos_exec.sandbox.egress.tls import client_hello
from metnos_exec.sandbox.egress.wall import Wall

pytestmark = pytest.mark.anyio


def hello_bytes(server_name: str) -> bytes:
    """A real ClientHello from Python's ssl module (memory BIOs: nothing is sent)."""
    ctx = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_client_hello_sni() -> None:
    data = hello_bytes("api.example.test")
    assert client_hello(data) == ("sni", "api.example.test")
    assert client_hello(data[:3]) == ("need", None)
    assert client_hello(data[:40]) == ("need", None)
    assert client_hello(b"GET / HTTP/1.1\r\n") == ("not_tls", None)
    broken = bytearray(data)
    broken[5] = 2  # not a ClientHello
    assert client_hello(bytes(broken)) == ("malformed", None)


async def resolver(host: str, port: int) -> Sequence[str]:
    return {"api.example.test": ("127.0.0.1",)}.get(host, ())


def query(name: str, qtype: int = 1) -> bytes:
    q = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return b"\xab\xcd\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + q + struct.pack("!HH", qtype, 1)


def test_dns_answers_allowed_names_only() -> None:
    traffic = JobTraffic(
        policy_for([("https", "api.example.test"), ("https", "*.cdn.test")]), resolver
    )
    fake = FakeAddresses()
    reply, name, allowed = answer(traffic, fake, query("api.example.test"))
    assert allowed and name == "api.example.test" and reply is not None
    assert reply[:2] == b"\xab\xcd" and reply[3] & 0x0F == 0  # NOERROR
    assert struct.unpack("!H", reply[6:8])[0] == 1  # one answer
    assert socket.inet_ntoa(reply[-4:]) == fake.address_for("api.example.test")
    assert fake.address_for(
        "api.example.test",
    ).startswith("127.1.")  # type: ignore[union-attr]
    # The same name keeps its address; a wildcard name gets its own.
    again, _, _ = answer(traffic, fake, query("API.Example.TEST"))
    assert again is not None and again[-4:] == reply[-4:]
    other, _, ok = answer(traffic, fake, query("a.cdn.test"))
    assert ok and other is not None and other[-4:] != reply[-4:]
    # AAAA: no record (clients take the A one); other names: REFUSED, no lookup.
    v6, _, ok = answer(traffic, fake, query("api.example.test", 28))
    assert ok and v6 is not None and struct.unpack("!H", v6[6:8])[0] == 0
    for refused in ("evil.test", "api.example.test.evil", "cdn.test"):
        got, _, ok = answer(traffic, fake, query(refused))
        assert not ok and got is not None and got[3] & 0x0F == 5, refused


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[int, list[bytes]]]:
    """A loopback server that sends 64 KiB chunks until told, and keeps what it got."""
    got: list[bytes] = []

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                while True:
                    data = await stream.receive(65536)
                    got.append(data)
                    if b"flood" in data:
                        while True:
                            await stream.send(b"x" * 65536)
                    await stream.send(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        yield port, got
        tg.cancel_scope.cancel()


async def exchange(traffic: JobTraffic, serve, data: bytes, *, until: bytes = b"") -> bytes:  # type: ignore[no-untyped-def]
    """Run one proxy connection over a socket pair: send `data`, read until `until` or
    the end."""
    job, wall = socket.socketpair()
    job.setblocking(False)
    wall.setblocking(False)
    out = b""

    async def served() -> None:
        try:
            await serve(traffic, Conn(wall, "direct"))
        finally:
            wall.close()  # as the wall does when a connection's handler returns

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(served)
            await send_all(job, data)
            with anyio.fail_after(10):
                while until not in out or not until:
                    chunk = await recv_some(job)
                    if not chunk:
                        break
                    out += chunk
                    if until and until in out:
                        break
            tg.cancel_scope.cancel()
    finally:
        job.close()
        wall.close()
    return out


async def test_http_proxy_refusal_names_policy(upstream: tuple[int, list[bytes]]) -> None:
    port, got = upstream
    traffic = JobTraffic(policy_for([("http", f"127.0.0.1:{port}")]), resolver)
    out = await exchange(traffic, serve_http, b"CONNECT 127.0.0.1:6379 HTTP/1.1\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 403")
    assert (
        b"X-Metnos-Egress: refused; host=127.0.0.1:6379; blocked by the executor's manifest" in out
    )
    assert b"blocked by the executor's manifest" in out.split(b"\r\n\r\n", 1)[1]
    # absolute-form is forwarded in origin form, proxy headers dropped
    request = (
        f"GET http://127.0.0.1:{port}/a?b=1 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Proxy-Authorization: secret\r\n\r\n"
    ).encode()
    out = await exchange(traffic, serve_http, request, until=b"ok")
    assert out.startswith(b"HTTP/1.0 200 OK")
    assert got[-1].startswith(b"GET /a?b=1 HTTP/1.1\r\n") and b"secret" not in got[-1]
    # a Host header naming another site behind the allowed address is refused
    smuggled = f"GET http://127.0.0.1:{port}/ HTTP/1.1\r\nHost: evil.test\r\n\r\n".encode()
    out = await exchange(traffic, serve_http, smuggled)
    assert out.startswith(b"HTTP/1.1 403") and b"Host header" in out


async def test_socks_refusal_is_ruleset(upstream: tuple[int, list[bytes]]) -> None:
    port, _ = upstream
    traffic = JobTraffic(policy_for([("http", f"127.0.0.1:{port}")]), resolver)
    hello = b"\x05\x01\x00"
    refused = hello + b"\x05\x01\x00\x01" + socket.inet_aton("127.0.0.1") + struct.pack("!H", 6379)
    out = await exchange(traffic, serve_socks, refused)
    assert out[:2] == b"\x05\x00" and out[2:4] == b"\x05\x02"  # not allowed by ruleset
    allowed = hello + b"\x05\x01\x00\x01" + socket.inet_aton("127.0.0.1") + struct.pack("!H", port)
    out = await exchange(traffic, serve_socks, allowed + b"GET / HTTP/1.0\r\n\r\n", until=b"ok")
    assert out[2:4] == b"\x05\x00" and out.endswith(b"ok")
    udp = hello + b"\x05\x03\x00\x01" + socket.inet_aton("127.0.0.1") + struct.pack("!H", port)
    out = await exchange(traffic, serve_socks, udp)
    assert out[2:4] == b"\x05\x07"  # command not supported


async def test_byte_budget_closes_the_connection(upstream: tuple[int, list[bytes]]) -> None:
    port, _ = upstream
    limits = EgressLimits(bytes=256 * 1024)
    traffic = JobTraffic(policy_for([("http", f"127.0.0.1:{port}")], limits=limits), resolver)
    request = f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\nflood".encode()
    out = await exchange(traffic, serve_http, request)
    body = out.split(b"\r\n\r\n", 1)[1]
    assert len(body) <= 256 * 1024  # the flood stopped at the budget
    assert traffic.spent.is_set() and traffic.bytes <= limits.bytes
    assert traffic.records[-1].allowed and traffic.records[-1].received == len(body)
    # past the budget every new connection is refused
    with traffic.slot() as ok:
        assert not ok


async def test_idle_connections_are_closed(upstream: tuple[int, list[bytes]]) -> None:
    port, _ = upstream
    limits = EgressLimits(idle_timeout_s=0.3)
    traffic = JobTraffic(policy_for([("http", f"127.0.0.1:{port}")], limits=limits), resolver)
    with anyio.fail_after(5):
        out = await exchange(
            traffic, serve_http, f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode()
        )
    assert out.startswith(b"HTTP/1.1 200")  # then nothing either way: closed by the wall


def test_connections_at_once_are_bounded() -> None:
    traffic = JobTraffic(
        policy_for([("http", "127.0.0.1:1")], limits=EgressLimits(connections=2)), resolver
    )
    with traffic.slot() as a, traffic.slot() as b, traffic.slot() as c:
        assert (a, b, c) == (True, True, False)
    with traffic.slot() as d:
        assert d


async def bulk_through_relay(traffic: JobTraffic, port: int, up: bytes, down_n: int) -> bytes:
    """`up` sent through a relayed connection to a loopback server that answers with
    `down_n` bytes of its own once it has read all of `up`; what came back."""
    job, wall = socket.socketpair()
    for s in (job, wall):
        s.setblocking(False)
    upstream = socket.create_connection(("127.0.0.1", port))
    upstream.setblocking(False)
    got = bytearray()

    async def reader() -> None:
        while chunk := await recv_some(job):
            got.extend(chunk)

    async def relayed() -> None:
        try:
            await traffic.pipe(Conn(wall, "direct"), upstream)
        finally:
            wall.close()  # as the wall does when a connection's handler returns
            upstream.close()

    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(relayed)
                tg.start_soon(reader)
                await send_all(job, struct.pack("!QQ", len(up), down_n) + up)
                job.shutdown(socket.SHUT_WR)
    finally:
        for s in (job, wall, upstream):
            s.close()
    return bytes(got)


@pytest.fixture
async def bulk_server() -> AsyncIterator[tuple[int, list[bytes]]]:
    """Reads a length-prefixed upload, keeps it, answers with a counted pattern."""
    uploads: list[bytes] = []

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            head = b""
            while len(head) < 16:
                head += await stream.receive(16 - len(head))
            n_up, n_down = struct.unpack("!QQ", head)
            body = bytearray()
            while len(body) < n_up:
                body += await stream.receive(1 << 20)
            uploads.append(bytes(body))
            block = pattern(1 << 20)
            sent = 0
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                while sent < n_down:  # until the relay stops it (the budget test)
                    await stream.send(block[: min(len(block), n_down - sent)])
                    sent += min(len(block), n_down - sent)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        yield port, uploads
        tg.cancel_scope.cancel()


def pattern(n: int) -> bytes:
    """`n` bytes no two 8-byte words of which are alike (a reordered or repeated piece
    shows)."""
    return b"".join(struct.pack("!Q", i) for i in range(n // 8))


async def test_bulk_transfers_both_ways_arrive_exact_and_counted(
    bulk_server: tuple[int, list[bytes]],
) -> None:
    # Past the first MiB a direction's pipe grows (`_BULK_PIPE`): the bytes either side of
    # the change, both directions at once, arrive in order, each counted once.
    port, uploads = bulk_server
    traffic = JobTraffic(policy_for([("http", f"127.0.0.1:{port}")]), resolver)
    up = pattern(9 << 20)[::-1]
    down = await bulk_through_relay(traffic, port, up, 24 << 20)
    assert uploads == [up]
    assert down == pattern(1 << 20) * 24
    assert traffic.bytes == len(up) + 16 + len(down)


async def test_byte_budget_holds_in_a_bulk_transfer(bulk_server: tuple[int, list[bytes]]) -> None:
    port, _ = bulk_server
    limits = EgressLimits(bytes=5 << 20)
    traffic = JobTraffic(policy_for([("http", f"127.0.0.1:{port}")], limits=limits), resolver)
    down = await bulk_through_relay(traffic, port, b"", 64 << 20)
    assert traffic.spent.is_set()
    assert len(down) + 16 == traffic.bytes <= limits.bytes
    assert down == (pattern(1 << 20) * 5)[: len(down)]


async def test_the_proxy_answers_503_at_the_connection_limit() -> None:
    # A job at its connection limit: its HTTP client reads a 503 naming the limit as
    # policy (it may retry later), not a proxy that hangs up.
    wall = Wall(policy_for([("http", "127.0.0.1:1")], limits=EgressLimits(connections=1)))
    listener = socket.create_server(("127.0.0.1", 0))
    job = socket.create_connection(listener.getsockname())
    mine, _ = listener.accept()
    mine.setblocking(False)
    try:
        with wall.traffic.slot() as taken:
            assert taken
            with anyio.fail_after(5):
                await wall._serve(mine, wall.proxy_port)
        answer = job.recv(65536)
    finally:
        for s in (job, mine, listener):
            s.close()
    assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"Retry-After: 1\r\n" in answer
    assert b"X-Metnos-Egress: refused;" in answer and b"1 connections open" in answer
    assert wall.records[-1].allowed is False


async def test_a_job_that_floods_the_wall_is_taken_at_its_rate() -> None:
    # 40 connections at once from a job whose rate is 20/s after a burst of 5: the wall
    # takes (and answers) them at that pace; the rest wait in the job's own backlog, not
    # in the worker. The bounds are the claim: load can only make the wall slower.
    rate, burst, n = 20.0, 5, 40
    policy = policy_for([("http", "127.0.0.1:1")], limits=EgressLimits(rate=rate, burst=burst))
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    try:
        async with Wall(policy) as wall:
            assert wall._tg is not None
            start = anyio.current_time()
            wall._tg.start_soon(wall._accept, listener, port)
            with anyio.fail_after(30):
                seen = []
                while len(wall.records) < n:
                    await anyio.sleep(0.02)  # polling what the wall recorded, deadline above
                    elapsed = anyio.current_time() - start
                    seen.append((elapsed, len(wall.records)))
            took = anyio.current_time() - start
            assert wall.traffic.throttled > 0
    finally:
        for c in [*clients, listener]:
            c.close()
    for elapsed, count in seen:  # never ahead of the bucket (one wake-up of slack)
        assert count <= burst + rate * elapsed + 1, (elapsed, count)
    assert took >= (n - burst) / rate * 0.95


def test_a_flood_of_refusals_is_logged_by_its_first_and_a_count() -> None:
    # Each refused connection was a log line: a flooding job cost the worker a write per
    # connection. The first LOGGED_REFUSALS are logged, the rest said once, counted.
    from structlog.testing import capture_logs

    from metnos_exec.sandbox.egress.relay import LOGGED_REFUSALS

    traffic = JobTraffic(policy_for([("http", "127.0.0.1:1")]), resolver)
    with capture_logs() as logs:
        for _ in range(LOGGED_REFUSALS + 30):
            traffic.refuse("direct", "127.0.0.1", 6379, "not named; blocked by the manifest")
        traffic.log_summary()
    refused = [r for r in logs if r["event"] == "egress.refused"]
    assert len(refused) == LOGGED_REFUSALS + 1
    assert refused[-1]["suppressed"] == 30 and "30 more" in refused[-1]["reason"]
    assert len(traffic.records) == LOGGED_REFUSALS + 30  # the result lists them all
