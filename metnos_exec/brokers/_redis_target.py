"""Which Redis a broker URL names, and the coredis client that reaches it.

Three forms (issue 18, item 12):

* ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS): one server, as
  before; the URL goes to coredis as it is (without our query options).
* ``redis+cluster://[user:password@]host:port[,host:port...]``: a Redis Cluster, found
  from any of the nodes listed (the startup nodes; the client learns the rest and follows
  slots as they move). No database number: a cluster has only database 0.
* ``redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]``: the primary
  of ``service`` as the sentinels listed name it, found again after a failover. The
  credentials are the data servers'; the sentinels get them too only with
  ``?sentinel_auth=yes`` (a sentinel without a password refuses an ``AUTH``).

coredis itself reads a cluster URL with one startup node only and has no Sentinel URL,
hence these forms (the ``+`` scheme style of other Redis clients). A malformed one is a
`ValueError` here, said by `open_broker` as ``E_BAD_BROKER_URL``, before any connection.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal
from urllib.parse import urlsplit, urlunsplit

import anyio
import coredis
import coredis.retry
from coredis._utils import hash_slot
from coredis.connection import TCPLocation
from coredis.connection._sentinel import SentinelManagedConnection
from coredis.pool._sentinel import SentinelConnectionPool

__all__ = ("SCHEMES", "RedisTarget", "parse_target")

#: The URL schemes of the Redis broker, by the kind of deployment each names.
SCHEMES: Final = {
    "redis": "server",
    "rediss": "server",
    "redis+cluster": "cluster",
    "redis+sentinel": "sentinel",
}

_DEFAULT_PORT: Final = {"server": 6379, "cluster": 6379, "sentinel": 26379}

Kind = Literal["server", "cluster", "sentinel"]


@dataclass(frozen=True)
class RedisTarget:
    """What a Redis broker URL names (the module docstring)."""

    kind: Kind
    url: str  # without the query (a ``redis://`` URL is handed to coredis as it is)
    hosts: tuple[tuple[str, int], ...]
    username: str | None
    password: str | None
    db: int
    service: str = ""
    sentinel_auth: bool = False

    @property
    def where(self) -> str:
        """The deployment for messages and logs: never the password."""
        scheme = urlsplit(self.url).scheme
        hosts = ",".join(_host(h, p) for h, p in self.hosts)
        return f"{scheme}://{hosts}" + (f"/{self.service}" if self.service else "")

    def queue_id(self, prefix: str) -> str:
        """One queue's identity (`Broker.queue_id`): the same whichever order the hosts
        are listed in, and without credentials."""
        hosts = ",".join(sorted(_host(h.lower(), p) for h, p in self.hosts))
        if self.kind == "server":
            return f"redis://{hosts}/{self.db}?prefix={prefix}"
        path = f"/{self.service}/{self.db}" if self.kind == "sentinel" else ""
        return f"redis+{self.kind}://{hosts}{path}?prefix={prefix}"

    def client(
        self,
        *,
        connect_timeout: float,
        stream_timeout: float,
        connected: Callable[[type[Any]], type[Any]] | None = None,
        anonymous: bool = False,
    ) -> tuple[Any, list[contextlib.AbstractAsyncContextManager[Any]]]:
        """A coredis client of this deployment and what must be entered, in order, to
        use it (the client last). Our own retries know which calls may be resent, so the
        client's are off. `connected` wraps the connection class (`closing_buffers`).
        `anonymous`: no user or password for the data servers (`open_access`)."""
        user, password = (None, None) if anonymous else (self.username, self.password)
        common: dict[str, Any] = {
            "decode_responses": False,
            "connect_timeout": connect_timeout,
            "stream_timeout": stream_timeout,
        }
        retry = coredis.retry.NoRetryPolicy()
        if self.kind == "server":
            url = self.url
            if anonymous:
                parts = urlsplit(url)
                url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
            single: coredis.Redis[bytes] = coredis.Redis.from_url(url, retry_policy=retry, **common)
            if connected is not None:
                pool = single.connection_pool
                pool.connection_class = connected(pool.connection_class)
            return single, [single]
        if self.kind == "cluster":
            cluster: coredis.RedisCluster[bytes] = coredis.RedisCluster(
                startup_nodes=[TCPLocation(h, p) for h, p in self.hosts],
                username=user,
                password=password,
                retry_policy=retry,
                # CONFIG may be refused (an ACL user, a managed cluster): do not ask it.
                skip_full_coverage_check=True,
                **common,
            )
            if connected is not None:
                cpool = cluster.connection_pool
                cpool.connection_class = connected(cpool.connection_class)
            return cluster, [_ClusterOpening(cluster, self.hosts, connect_timeout), cluster]
        auth = {"username": self.username, "password": self.password} if self.sentinel_auth else {}
        sentinel: coredis.Sentinel[bytes] = coredis.Sentinel(
            [TCPLocation(h, p) for h, p in self.hosts],
            sentinel_kwargs={"connect_timeout": connect_timeout, **auth},
            username=user,
            password=password,
            db=self.db,
            connect_timeout=connect_timeout,
            stream_timeout=stream_timeout,
        )
        primary = sentinel.primary_for(self.service, connection_pool_class=_ClosingSentinelPool)
        primary.connection_pool.wrap = connected  # type: ignore[attr-defined]
        return primary, [sentinel, primary]

    @contextlib.asynccontextmanager
    async def queue_node(
        self, client: Any, key: str, *, connect_timeout: float
    ) -> AsyncIterator[coredis.Redis[bytes]]:
        """A client of the server holding `key` (the queue's: every key of a queue is in
        one slot): for commands about the server rather than a key (``INFO``, ``CONFIG
        GET``), which a cluster client would send to any node. `client` itself unless a
        cluster."""
        if self.kind != "cluster":
            yield client
            return
        pool = client.connection_pool
        node = pool.cluster_layout.node_for_slot(hash_slot(key.encode()))
        one: coredis.Redis[bytes] = coredis.Redis(
            node.host,
            node.port,
            username=self.username,
            password=self.password,
            decode_responses=False,
            connect_timeout=connect_timeout,
            stream_timeout=connect_timeout,
            retry_policy=coredis.retry.NoRetryPolicy(),
        )
        async with one:
            yield one


class _ClusterOpening(contextlib.AbstractAsyncContextManager[None]):
    """Entered before a cluster client, for two leaks of coredis 6.9's. Its layout's
    error stream is made with the client and never closed, which warns (``Unclosed
    <MemoryObjectSendStream>``) for every client, entered or not: here it is made at
    enter and closed at exit. And its discovery's connections leave their buffers
    unclosed when they fail (as `closing_buffers` says), once per try: so the startup
    nodes are probed first, and none answering is an `OSError` without coredis."""

    def __init__(self, cluster: Any, hosts: Sequence[tuple[str, int]], timeout: float) -> None:
        self._layout = cluster.connection_pool.cluster_layout
        self._hosts = hosts
        self._timeout = timeout
        self._close()

    def _close(self) -> None:
        for stream in self._layout._error_stream:
            stream.close()

    async def __aenter__(self) -> None:
        errors: list[str] = []
        for host, port in self._hosts:
            try:
                with anyio.fail_after(self._timeout):
                    stream = await anyio.connect_tcp(host, port)
            except (OSError, TimeoutError) as exc:
                errors.append(f"{_host(host, port)}: {exc or type(exc).__name__}")
                continue
            await stream.aclose()
            break
        else:
            raise ConnectionRefusedError(f"no startup node answers ({'; '.join(errors)})")
        size = self._layout._error_threshold * 2
        self._layout._error_stream = anyio.create_memory_object_stream[Any](size)

    async def __aexit__(self, *exc: object) -> None:
        self._close()


class _ClosingSentinelPool(SentinelConnectionPool):
    """The Sentinel pool with our connection class wrapper (`closing_buffers`): coredis's
    builds its connections itself, not from ``connection_class``."""

    wrap: Callable[[type[Any]], type[Any]] | None = None

    async def _construct_connection(self) -> SentinelManagedConnection:
        if self.wrap is None:
            return await super()._construct_connection()
        location = await self.get_primary_location()
        cls = self.wrap(SentinelManagedConnection)
        conn: SentinelManagedConnection = cls(
            location, self.service_name, self.is_primary, **self.connection_kwargs
        )
        return conn


def _host(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _hosts(text: str, kind: Kind) -> tuple[tuple[str, int], ...]:
    """``host:port[,host:port...]`` (``[::1]:7000`` for IPv6; the port may be left out)."""
    out: list[tuple[str, int]] = []
    for item in text.split(","):
        try:
            one = urlsplit(f"//{item}")
            host, port = one.hostname, one.port
        except ValueError as exc:
            raise ValueError(f"host {item!r}: {exc}") from None
        if not host:
            raise ValueError(f"a host is missing in {text!r} (host:port[,host:port...])")
        out.append((host, port or _DEFAULT_PORT[kind]))
    return tuple(out)


def parse_target(url: str, *, sentinel_auth: bool = False) -> RedisTarget:
    """The deployment `url` names (without its query).

    Raises:
        ValueError: not a Redis URL of a form the broker knows, or malformed (the
            message names what is wrong; never the password).
    """
    parts = urlsplit(url)
    kind: Kind | None = SCHEMES.get(parts.scheme)  # type: ignore[assignment]
    if kind is None:
        raise ValueError("expected redis://, rediss://, redis+cluster:// or redis+sentinel://")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    user, has_password, password = userinfo.partition(":")
    base = urlunsplit(parts._replace(query="", fragment=""))
    hosts = _hosts(hostlist, kind) if hostlist or kind != "server" else (("localhost", 6379),)
    if kind == "server":
        if len(hosts) > 1:
            raise ValueError(
                "one server per redis:// URL; several nodes are redis+cluster://"
                " or redis+sentinel://"
            )
        return RedisTarget(kind, base, hosts, parts.username, parts.password, _db(parts.path))
    segments = [s for s in parts.path.split("/") if s]
    service, db = "", 0
    if kind == "cluster":
        if segments and segments != ["0"]:
            raise ValueError(
                f"a cluster has only database 0, got the path {parts.path!r} "
                "(redis+cluster://host:port[,host:port...])"
            )
    else:
        if not segments or len(segments) > 2:
            raise ValueError(
                "a Sentinel URL names its service: "
                "redis+sentinel://host:port[,host:port...]/service[/db]"
            )
        service = segments[0]
        db = _db(segments[1] if len(segments) > 1 else "0")
    return RedisTarget(
        kind,
        base,
        hosts,
        user or None,
        password if has_password else None,
        db,
        service=service,
        sentinel_auth=sentinel_auth,
    )


def _db(path: str) -> int:
    text = path.strip("/") or "0"
    if not text.isdigit():
        raise ValueError(f"the database is a number, got {text!r}")
    return int(text)
