"""One job's wall: its listeners, what each connection reaches, its environment, its records.

`Wall` is an async context manager that lives exactly as long as the job's run: entered
before bubblewrap starts, `attach`-ed while bubblewrap's sandbox process waits on its
block fd (the listeners exist before the job's first instruction), left when the job has
ended, which cancels every accept loop and relayed connection and closes their sockets:
no connection outlives its job.

Inside the job's namespace (its loopback only), the wall listens on:

===========================  ========================================================
where                        what
===========================  ========================================================
127.0.0.1:`proxy_port` TCP   the HTTP proxy (`http_proxy`); ``HTTP(S)_PROXY``
127.0.0.1:`socks_port` TCP   SOCKS5 (`socks`); ``ALL_PROXY=socks5h://...``
127.0.0.1:53 UDP and TCP     the DNS stub (`dns`)
127.1.x.y:80, :443 TCP       transparent capture of the stub's fake addresses (and
                             every port a name rule names)
address:port of each         a forward to that very address and port on the host
literal hint                 (``127.0.0.1:8080``), decided like any connection
===========================  ========================================================

Each listener binds its address and port exactly (``IP_FREEBIND``: the job's loopback
may not be up yet when they are made): a connection to any other address or port of the
job's namespace (``127.0.0.2:8080``, the proxy's port on another address, ``[::1]``)
finds nothing listening and is refused by the job's own kernel.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from types import TracebackType
from typing import Final

import anyio
import anyio.abc

from .bridge import BridgeFailed, listeners
from .capture import CAPTURE_PORTS, FAKE_NETWORK, FakeAddresses, serve_capture
from .dns import serve_dns_tcp, serve_dns_udp
from .http_proxy import refusal, relay, serve_http
from .policy import EgressPolicy, Refused, Resolver, system_resolver
from .record import EgressRecord
from .relay import Conn, JobTraffic, send_all
from .socks import serve_socks

__all__ = ("DNS_PORT", "Wall", "proxy_env")

#: Where the proxies listen in the job's namespace unless a literal hint takes the port.
PROXY_PORTS: Final = (3128, 3129, 3130, 3131)
SOCKS_PORTS: Final = (1080, 1081, 1082, 1083)
DNS_PORT: Final = 53
_LOOPBACK: Final = "127.0.0.1"
#: The most names one job's DNS stub gives a fake address (each costs a listener per
#: captured port in the worker); past it the stub answers SERVFAIL.
MAX_NAMES: Final = 64


def _pick(candidates: tuple[int, ...], taken: set[int]) -> int:
    port = next((p for p in candidates if p not in taken), None)
    if port is None:
        port = next(p for p in range(20000, 30000) if p not in taken)
    taken.add(port)
    return port


def proxy_env(proxy_port: int, socks_port: int) -> dict[str, str]:
    """The proxy variables a job behind the wall gets (upper and lower case, and the
    ones tools read on their own). No ``NO_PROXY``: a literal hint is reachable both
    directly (it is forwarded at its own address) and through the proxy, so no
    ``NO_PROXY`` convention can strand it."""
    http = f"http://{_LOOPBACK}:{proxy_port}"
    socks = f"socks5h://{_LOOPBACK}:{socks_port}"
    env: dict[str, str] = {}
    for key, value in (("HTTP_PROXY", http), ("HTTPS_PROXY", http), ("ALL_PROXY", socks)):
        env[key] = value
        env[key.lower()] = value
    # Tools with variables of their own: pip and npm read the above; git, curl, wget,
    # Python's urllib and requests too. Java and Gradle read none (their DNS and sockets
    # go through the stub and transparent capture instead).
    env["npm_config_proxy"] = http
    env["npm_config_https_proxy"] = http
    env["JAVA_TOOL_OPTIONS"] = (
        f"-Dhttp.proxyHost={_LOOPBACK} -Dhttp.proxyPort={proxy_port} "
        f"-Dhttps.proxyHost={_LOOPBACK} -Dhttps.proxyPort={proxy_port}"
    )
    return env


class Wall:
    """The wall of one job (see the module doc).

    Args:
        policy: the job's policy, fixed for its life.
        resolver: how the worker resolves names (default: its own ``getaddrinfo``).
    """

    def __init__(self, policy: EgressPolicy, resolver: Resolver = system_resolver) -> None:
        self.traffic = JobTraffic(policy, resolver)
        self.fake = FakeAddresses()
        #: Captured on the fake addresses: :80, :443 and every port a name rule names.
        self.capture_ports = tuple(
            sorted({*CAPTURE_PORTS, *(r.port for r in policy.allow if not r.literal and r.port)})
        )
        taken = {port for _addr, port in policy.literals()} | {DNS_PORT}
        self.proxy_port = _pick(PROXY_PORTS, taken)
        self.socks_port = _pick(SOCKS_PORTS, taken)
        self._literals = set(policy.literals())
        self._socks: list[socket.socket] = []
        self._tg: anyio.abc.TaskGroup | None = None
        self._pid: int | None = None
        #: Names whose fake address has its listeners (set once they are bound).
        self._names: dict[str, anyio.Event] = {}
        self.attached = False

    @property
    def records(self) -> tuple[EgressRecord, ...]:
        return tuple(self.traffic.records)

    def env(self) -> dict[str, str]:
        return proxy_env(self.proxy_port, self.socks_port)

    async def __aenter__(self) -> Wall:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        try:
            return await self._tg.__aexit__(exc_type, exc, tb)
        finally:
            for sock in self._socks:
                sock.close()
            self._socks.clear()
            self.traffic.log_summary()

    async def attach(self, pid: int) -> None:
        """Bind the listeners in the network namespace of sandbox process `pid` (before
        the job runs) and serve them: the proxies, the DNS stub, the literal hints and
        the fake addresses of the names the manifest names exactly (a name matched by a
        ``*.domain`` rule gets its own when the stub first answers it).

        Raises:
            BridgeFailed: they could not be made (the job must not run).
        """
        assert self._tg is not None
        self._pid = pid
        tcp: list[tuple[str, int]] = [
            (_LOOPBACK, self.proxy_port),
            (_LOOPBACK, self.socks_port),
            (_LOOPBACK, DNS_PORT),
            *((a, p) for a, p in self._literals if ":" not in a),
        ]
        names = [n for n in self.traffic.policy.names() if self.fake.address_for(n)]
        for name in names:
            address = self.fake.address_for(name)
            tcp += [(str(address), port) for port in self.capture_ports]
        made = await listeners(pid, tcp, [(_LOOPBACK, DNS_PORT)])
        self._socks.extend(made)
        for (_address, port), sock in zip(tcp, made, strict=False):
            self._tg.start_soon(self._accept, sock, port)
        self._tg.start_soon(serve_dns_udp, self.traffic, made[-1], self.fake, self.prepare)
        for name in names:
            self._names[name] = done = anyio.Event()
            done.set()
        self.attached = True

    async def prepare(self, name: str) -> bool:
        """Make sure `name`'s fake address has its listeners (the DNS stub calls this
        before it answers); ``False`` when they could not be made."""
        assert self._tg is not None and self._pid is not None
        ready = self._names.get(name)
        if ready is not None:
            await ready.wait()
            return self.fake.name_for(self.fake.address_for(name) or "") == name
        self._names[name] = ready = anyio.Event()
        try:
            address = self.fake.address_for(name)
            if address is None or len(self._names) > MAX_NAMES:
                return False
            binds = [(address, port) for port in self.capture_ports]
            try:
                made = await listeners(self._pid, binds)
            except BridgeFailed:
                return False
            self._socks.extend(made)
            for (_address, port), sock in zip(binds, made, strict=True):
                self._tg.start_soon(self._accept, sock, port)
            return True
        finally:
            ready.set()

    async def _accept(self, listener: socket.socket, port: int) -> None:
        assert self._tg is not None
        while True:
            # The job's next connection, taken at its rate (`JobTraffic.admit`): one that
            # floods the wall waits in its own listen backlog, costing the worker nothing.
            await self.traffic.admit()
            while True:
                try:
                    sock, _peer = listener.accept()
                    break
                except (BlockingIOError, InterruptedError):
                    await anyio.wait_readable(listener)
                except OSError:
                    # EMFILE and the like: the worker is short of fds; let the job's
                    # connection wait in the backlog rather than spin.
                    await anyio.sleep(0.05)
            sock.setblocking(False)
            # What the wall relays is already segmented by the other side: no Nagle
            # delay on top (a TLS handshake's small records waited for ACKs).
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._tg.start_soon(self._serve, sock, port)

    async def _serve(self, sock: socket.socket, port: int) -> None:
        conn = Conn(sock, "direct")
        try:
            local = sock.getsockname()[0]
            with self.traffic.slot() as ok:
                if not ok:
                    reason = (
                        f"the job has {self.traffic.policy.limits.connections} connections "
                        "open (or spent its byte budget); blocked by the executor's manifest"
                    )
                    self.traffic.refuse(conn.via, local, port, reason)
                    if local == _LOOPBACK and port == self.proxy_port:
                        # An HTTP client learns it is the limit (and may retry), not a
                        # broken proxy: the answer goes out before its request is read.
                        with anyio.move_on_after(1):
                            await send_all(
                                sock, refusal(local, port, reason, "503 Service Unavailable")
                            )
                    return
                await self._dispatch(conn, local, port)
        except OSError:
            pass  # the job closed or reset its end
        except Exception as exc:  # what a job sends must never end the wall
            self.traffic.refuse(
                conn.via, "?", port, f"the wall could not handle this connection ({exc!r:.200})"
            )
        finally:
            sock.close()

    async def _dispatch(self, conn: Conn, local: str, port: int) -> None:
        if local == _LOOPBACK and port == self.proxy_port:
            await serve_http(self.traffic, conn)
        elif local == _LOOPBACK and port == self.socks_port:
            await serve_socks(self.traffic, conn)
        elif local == _LOOPBACK and port == DNS_PORT:
            conn.via = "dns"
            await serve_dns_tcp(self.traffic, conn, self.fake, self.prepare)
        elif (local, port) in self._literals:
            conn.via = "forward"
            decision = await self.traffic.decide(local, port)
            if isinstance(decision, Refused):
                self.traffic.refuse(conn.via, decision.host, port, decision.reason)
                return
            await relay(self.traffic, conn, decision, b"")
        elif ipaddress.ip_address(local) in FAKE_NETWORK:
            await serve_capture(self.traffic, conn, self.fake, local, port)
        else:  # not reached: every listener is one of the above
            self.traffic.refuse(
                conn.via,
                local,
                port,
                f"nothing the manifest names is at {local}:{port}; blocked by the executor's "
                "manifest",
            )
