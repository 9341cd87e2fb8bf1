"""The network wall from inside real bwrap jobs: every way out, each allowed only where the
manifest allows it (the claim behind the network axis ``kept``).

Servers bind to 127.0.0.1 only; names resolve through a resolver the test controls.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from metnos_exec.sandbox._types import ResourceLimits, SandboxJob, Success, Timeout
from metnos_exec.sandbox.bwrap import BwrapSandbox
from metnos_exec.sandbox.egress import EgressPolicy, policy_for
from metnos_exec.sandbox.flags import guest_python
from tests.conftest import need_privileged
from tests.sandbox.test_bwrap import need_bwrap

pytestmark = pytest.mark.anyio

ATTEMPTS = (Path(__file__).with_name("guest_attempts.py")).read_text()
NAME = "api.example.test"


class Server:
    """A loopback TCP server that answers every connection with an HTTP 200 and keeps
    what it was sent."""

    def __init__(self) -> None:
        self.port = 0
        self.received: list[bytes] = []
        self.connections = 0

    async def handle(self, stream: anyio.abc.SocketStream) -> None:
        self.connections += 1
        async with stream:
            try:
                data = await stream.receive(65536)
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return
            self.received.append(data)
            with contextlib.suppress(anyio.BrokenResourceError):
                await stream.send(b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\nhello")


@pytest.fixture
async def servers() -> AsyncIterator[tuple[Server, Server]]:
    """(the allowed server, a secret one the manifest never names)."""
    allowed, secret = Server(), Server()
    async with contextlib.AsyncExitStack() as stack:
        listeners = []
        for server in (allowed, secret):
            listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
            stack.push_async_callback(listener.aclose)  # after the task group below
            server.port = listener.extra(anyio.abc.SocketAttribute.local_port)
            listeners.append((listener, server))
        tg = await stack.enter_async_context(anyio.create_task_group())
        for listener, server in listeners:
            tg.start_soon(listener.serve, server.handle)
        yield allowed, secret
        tg.cancel_scope.cancel()


ZONE = {
    NAME: ("127.0.0.1",),
    "loop.example.test": ("127.0.0.1",),
    "meta.example.test": ("169.254.169.254",),
    "lan.example.test": ("10.0.0.7",),
}


async def resolver(host: str, port: int) -> Sequence[str]:
    try:
        return ZONE[host]
    except KeyError:
        raise OSError(f"{host}: no such name in the test's zone") from None


async def run_attempts(policy: EgressPolicy, cfg: dict[str, Any]) -> tuple[dict[str, str], Any]:
    need_bwrap()
    arm = BwrapSandbox(resolver=resolver)
    job = SandboxJob(
        argv=(guest_python(), "-c", ATTEMPTS, json.dumps(cfg)),
        network=True,
        egress=policy,
    )
    outcome = await arm.run(job)
    assert outcome.exit == Success(), outcome.stderr.decode()[-3000:]
    return json.loads(outcome.stdout), outcome


async def test_every_way_out(servers: tuple[Server, Server]) -> None:
    allowed, secret = servers
    # The allowed name resolves to the allowed server's address: trusted for this test
    # only (an operator's resolver may do so); the port is the allowed server's.
    policy = policy_for(
        [("http", f"127.0.0.1:{allowed.port}"), ("https", f"{NAME}:{allowed.port}")],
        trusted=["127.0.0.1/32"],
    )
    cfg = {"port": allowed.port, "secret": secret.port, "name": NAME, "name_port": allowed.port}
    got, outcome = await run_attempts(policy, cfg)

    # What the manifest names is reachable, every way.
    for key in ("literal_direct", "literal_urllib", "name_connect", "name_socks"):
        assert got[key].startswith("ok:"), (key, got[key])
    assert got["literal_direct"] == "ok:HTTP/1.0 200 OK"
    assert got["literal_urllib"] == "ok:200"
    assert got["capture"].startswith("ok:127.1.0."), got["capture"]  # proxy-unaware
    assert got["capture"].endswith("HTTP/1.0 200 OK")
    assert got["getent_allowed"].startswith("ok:127.1.0."), got["getent_allowed"]
    if "curl_literal" in got:
        assert got["curl_literal"] == "ok:hello"

    # Nothing else is.
    refused = [
        "secret_direct",
        "secret_urllib",
        "secret_connect",
        "secret_socks",
        "redis_direct",
        "redis_proxy",
        "other_loopback_address",
        "ipv6_loopback",
        "bash_dev_tcp",
        "getent_refused",
        "lookalike",
        "udp_other_53",
    ]
    refused += [k for k in ("curl_secret", "curl_secret_noproxy", "wget_secret") if k in got]
    for key in refused:
        assert not got[key].startswith("ok:"), (key, got[key])
    assert secret.connections == 0, "the secret server was reached"
    # A relayed CONNECT goes to the allowed host, which sees the inner request as bytes.
    assert any(b"CONNECT 127.0.0.1:%d" % secret.port in data for data in allowed.received)
    # SNI: the allowed name reached the server, the wrong one never did.
    assert any(NAME.encode() in data for data in allowed.received)
    assert not any(b"other.example.org" in data for data in allowed.received)

    # Refusals say they are policy.
    assert "403" in got["secret_connect"] and "manifest" in got["secret_connect"]
    assert got["secret_socks"] == "no:PermissionError:socks reply 2"
    if "curl_refusal_text" in got:
        text = got["curl_refusal_text"]
        assert "X-Metnos-Egress: refused" in text and "blocked by the executor's manifest" in text

    # The result lists the egress, allowed and refused, and the axis names the hosts.
    records = outcome.egress
    assert any(r.allowed and r.via == "forward" and r.received > 0 for r in records)
    assert any(r.allowed and r.via == "capture" for r in records)
    assert any(not r.allowed and r.port == secret.port for r in records)
    assert any(not r.allowed and r.port == 6379 for r in records)
    assert any(
        not r.allowed and "TLS ClientHello names 'other.example.org'" in r.reason for r in records
    )
    assert any(not r.allowed and r.via == "dns" and r.host == "evil.example.org" for r in records)
    network = outcome.containment.network
    assert network.state == "kept"
    assert f"egress limited to 127.0.0.1:{allowed.port}, {NAME}:{allowed.port}" in network.reason


async def test_names_resolving_inside_are_refused(servers: tuple[Server, Server]) -> None:
    """A name the manifest allows that resolves to loopback, link-local (metadata) or a
    private address is refused unless the hint names that address."""
    allowed, secret = servers
    names = ["loop.example.test", "meta.example.test", "lan.example.test"]
    policy = policy_for([("https", f"{n}:{secret.port}") for n in names])
    cfg = {
        "port": allowed.port,
        "secret": secret.port,
        "name": "loop.example.test",
        "name_port": secret.port,
        "names_refused": names,
    }
    got, outcome = await run_attempts(policy, cfg)
    for name in names:
        assert "403" in got[f"refused_name:{name}"], got[f"refused_name:{name}"]
        assert got[f"refused_name_socks:{name}"] == "no:PermissionError:socks reply 2"
    assert not got["capture"].startswith("ok:"), got["capture"]
    assert secret.connections == 0
    reasons = " ".join(r.reason for r in outcome.egress)
    assert "resolves to 127.0.0.1 (loopback)" in reasons
    assert "resolves to 169.254.169.254 (link-local)" in reasons
    assert "resolves to 10.0.0.7 (private)" in reasons


HOLD = """\
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), 5)
s.sendall(b"hold")
time.sleep(60)
"""


async def test_no_connection_outlives_its_job() -> None:
    """A job that holds a connection open and is killed at its timeout: the worker's side
    of the connection is closed when the run ends, not left to the idle timeout."""
    need_bwrap()
    closed = anyio.Event()
    got: list[bytes] = []

    async def handle(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                while True:
                    got.append(await stream.receive())
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                closed.set()

    async with await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0) as lst:
        port = lst.extra(anyio.abc.SocketAttribute.local_port)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lst.serve, handle)
            job = SandboxJob(
                argv=(guest_python(), "-c", HOLD, str(port)),
                network=True,
                egress=policy_for([("http", f"127.0.0.1:{port}")]),
                limits=ResourceLimits(wall_time_s=3.0),
            )
            outcome = await BwrapSandbox(resolver=resolver).run(job)
            assert isinstance(outcome.exit, Timeout), outcome
            assert got == [b"hold"]
            with anyio.fail_after(2):  # far below the 60 s idle timeout
                await closed.wait()
            tg.cancel_scope.cancel()
    assert [r.allowed for r in outcome.egress] == [True]


FETCH = """\
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), 5)
s.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
print(s.recv(100).decode().split("\\r\\n")[0])
"""


@pytest.mark.parametrize("thread", [True, False], ids=["thread", "helper"])
async def test_both_bridges(
    servers: tuple[Server, Server], monkeypatch: pytest.MonkeyPatch, thread: bool
) -> None:
    """Both ways of making the listeners work (a root worker's thread, the helper every
    other worker uses), whoever runs the suite."""
    from metnos_exec.sandbox.egress import bridge

    need_bwrap()
    if thread:
        need_privileged(os.geteuid() == 0, "a root worker's thread enters the namespace")
    monkeypatch.setattr(bridge._helper, "threads_may_enter", thread)
    allowed, _ = servers
    job = SandboxJob(
        argv=(guest_python(), "-c", FETCH, str(allowed.port)),
        network=True,
        egress=policy_for([("http", f"127.0.0.1:{allowed.port}")]),
    )
    outcome = await BwrapSandbox(resolver=resolver).run(job)
    assert outcome.exit == Success(), outcome.stderr.decode()[-2000:]
    assert outcome.stdout.decode().strip() == "HTTP/1.0 200 OK"
