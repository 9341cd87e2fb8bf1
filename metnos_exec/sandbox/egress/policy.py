"""The one decision point: may this job open a connection to this host and port?

Pure and fixed for the job's whole life: an `EgressPolicy` is built once from the job's
active ``network:*`` hints (`policy_for`) before the job starts and never changes after
(a filter that changed mid-job failed open elsewhere). Every connection the wall relays
(HTTP proxy, SOCKS5, transparent capture, a literal-address forward) asks `authorize`,
which fails closed:

=====================  ==================================================================
step                   rule
=====================  ==================================================================
normalise              lower case, no trailing dot, brackets off an IPv6 literal; a name
                       with other characters than letters, digits, ``-``, ``_`` and ``.``
                       is refused (no percent-encoding or spaces smuggled into a match)
deny                   an operator's deny pattern matching the name, or any address it
                       resolves to, refuses (deny wins over every allow)
allow                  a rule whose host is the name exactly, or ``*.domain`` with the
                       name a subdomain (never the apex), or ``*``; and whose port is
                       the connection's (``network:https`` 443, ``network:http`` 80,
                       unless the hint names a port)
literal                a rule naming an address (``127.0.0.1:8080``) matches only that
                       address written as such: it is connected to as is, no lookup
resolve                any other name is resolved by the worker (`Resolver`, injectable);
                       one resolving to a loopback, private, link-local (cloud metadata),
                       shared, reserved or multicast address is refused whole
connect                only to the addresses checked here (no second lookup between the
                       check and the connection: DNS rebinding cannot slip in)
=====================  ==================================================================
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Final

import anyio
import msgspec

__all__ = (
    "DEFAULT_PORTS",
    "Authorized",
    "EgressLimits",
    "EgressPolicy",
    "Refused",
    "Resolver",
    "Rule",
    "authorize",
    "is_public",
    "normalise_host",
    "policy_for",
    "system_resolver",
)

#: The port a hint without one stands for, per capability mode. A mode not listed here
#: (``network:tcp``, say) grants a connection only where its hint names the port.
DEFAULT_PORTS: Final = {"https": 443, "http": 80}

_NAME: Final = re.compile(r"^[a-z0-9_\-]+(\.[a-z0-9_\-]+)*$")

#: What a refusal tells the job: the wall is policy, not a broken network (agents retried
#: with ``--noproxy`` when a refusal did not say so).
POLICY_NOTE: Final = "blocked by the executor's manifest"


class EgressLimits(msgspec.Struct, frozen=True):
    """Bounds on one job's traffic through the wall.

    Attributes:
        connections: connections open at once; one more is refused (not queued).
        bytes: bytes relayed in both directions over the job's life; past it every
            connection of the job is closed and new ones refused.
        idle_timeout_s: a connection with no byte either way for this long is closed.
        connect_timeout_s: how long the worker tries to reach an allowed host.
        rate: new connections (and DNS questions) per second the wall takes from the
            job, after a first `burst`; past it the wall takes the next one later (it
            waits in the job's own listen backlog, costing the worker nothing), so a job
            that floods the wall cannot take the worker's time from the other jobs.
        burst: how many it takes at once before `rate` applies.
    """

    connections: int = 32
    bytes: int = 1024 * 1024 * 1024
    idle_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    rate: float = 100.0
    burst: int = 200


class Rule(msgspec.Struct, frozen=True):
    """One allowed (or denied) destination.

    Attributes:
        host: a name (``api.example.com``), a wildcard (``*.example.com``: subdomains at
            any depth, not the apex; ``*``: any name) or an address literal.
        port: the port; ``None`` (deny patterns only): every port.
        source: where the rule came from, for reasons (``network:https example.com``).
    """

    host: str
    port: int | None
    source: str = ""

    @property
    def literal(self) -> bool:
        """The rule names an address, not a name."""
        return _address(self.host) is not None

    def matches(self, host: str, port: int) -> bool:
        """Whether normalised `host` and `port` fall under this rule."""
        if self.port is not None and self.port != port:
            return False
        if self.literal:
            return host == self.host
        if _address(host) is not None:
            return False  # an address never matches a name rule, nor a wildcard
        if self.host == "*":
            return True
        if self.host.startswith("*."):
            return host.endswith(self.host[1:]) and len(host) > len(self.host) - 1
        return host == self.host

    def describe(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"


class Authorized(msgspec.Struct, frozen=True):
    """A connection the wall may open: to `addresses` only, in order."""

    host: str
    port: int
    rule: Rule
    addresses: tuple[str, ...]


class Refused(msgspec.Struct, frozen=True):
    """A connection the wall refuses, and why (a sentence that says it is policy)."""

    host: str
    port: int
    reason: str


class EgressPolicy(msgspec.Struct, frozen=True):
    """Where one job may connect; fixed for its life.

    Attributes:
        allow: the manifest's destinations.
        deny: the operator's patterns; they win over `allow`.
        limits: the bounds on the job's traffic.
        trusted: networks (``127.0.0.0/8``) the operator lets an allowed *name* resolve
            into although they are not public: a resolver the operator controls (an
            on-premises API, the tests' loopback servers). Empty by default.
    """

    allow: tuple[Rule, ...]
    deny: tuple[Rule, ...] = ()
    limits: EgressLimits = msgspec.field(default_factory=EgressLimits)
    trusted: tuple[str, ...] = ()

    def trusts(self, address: str) -> bool:
        ip = _address(address)
        return ip is not None and any(
            ip in ipaddress.ip_network(net, strict=False) for net in self.trusted
        )

    def rule_for(self, host: str, port: int) -> Rule | None:
        """The first allow rule for normalised `host` and `port` (deny not consulted)."""
        return next((r for r in self.allow if r.matches(host, port)), None)

    def denied(self, host: str, port: int) -> Rule | None:
        return next((r for r in self.deny if r.matches(host, port)), None)

    def literals(self) -> tuple[tuple[str, int], ...]:
        """Every (address, port) a rule names literally, de-duplicated, in order."""
        seen: dict[tuple[str, int], None] = {}
        for rule in self.allow:
            if rule.literal and rule.port is not None:
                seen.setdefault((rule.host, rule.port), None)
        return tuple(seen)

    def names(self) -> tuple[str, ...]:
        """Every exact name an allow rule names (what the DNS stub may answer)."""
        return tuple(
            dict.fromkeys(r.host for r in self.allow if not r.literal and "*" not in r.host)
        )

    def summary(self) -> str:
        """The allowed destinations, for the containment report."""
        return ", ".join(dict.fromkeys(r.describe() for r in self.allow)) or "nowhere"


#: Resolves a name to the addresses to try, as strings: the worker's lookup, injectable
#: (tests use one they control, never a real DNS server).
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


async def system_resolver(host: str, port: int) -> Sequence[str]:
    """The worker's own resolver (``getaddrinfo``), TCP addresses in its order."""
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return tuple(dict.fromkeys(str(info[4][0]) for info in infos))


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def normalise_host(host: str) -> str | None:
    """`host` in the form rules compare with, or ``None`` when it is not a plain name or
    address (then the connection is refused)."""
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    address = _address(host)
    if address is not None:
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(address)
    host = host.removesuffix(".")
    if not host or len(host) > 253 or not _NAME.match(host):
        return None
    return host


def is_public(address: str) -> bool:
    """Whether `address` is an ordinary public unicast address: not loopback, private,
    link-local (where cloud metadata lives), shared (100.64/10), reserved, unspecified or
    multicast. An IPv4-mapped IPv6 address counts as the IPv4 one it carries."""
    ip = _address(address)
    if ip is None:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast and not ip.is_unspecified


def _kind(address: str) -> str:
    ip = _address(address)
    if ip is None:
        return "not an address"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for kind in ("loopback", "link_local", "private", "multicast", "unspecified", "reserved"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    return "not public"


async def authorize(
    policy: EgressPolicy, host: str, port: int, resolver: Resolver = system_resolver
) -> Authorized | Refused:
    """Decide one connection (see the module table). Never raises for a bad destination:
    a name that does not resolve is a `Refused` too."""
    name = normalise_host(host)
    shown = host if name is None else name
    if name is None:
        return Refused(shown, port, f"{host!r} is not a host name or address; {POLICY_NOTE}")
    if not 0 < port < 65536:
        return Refused(shown, port, f"port {port} is out of range; {POLICY_NOTE}")
    denied = policy.denied(name, port)
    if denied is not None:
        return Refused(
            name, port, f"{name}:{port} is on the operator's deny list ({denied.describe()})"
        )
    rule = policy.rule_for(name, port)
    if rule is None:
        return Refused(
            name,
            port,
            f"{_show(name, port)} is not among the hosts the manifest names "
            f"({policy.summary()}); {POLICY_NOTE}",
        )
    if rule.literal:
        return Authorized(name, port, rule, (name,))
    try:
        found = tuple(await resolver(name, port))
    except OSError as exc:
        return Refused(name, port, f"{name} does not resolve ({exc})")
    addresses = tuple(dict.fromkeys(a for a in (normalise_host(a) for a in found) if a))
    if not addresses:
        return Refused(name, port, f"{name} does not resolve")
    for address in addresses:
        if not is_public(address) and not policy.trusts(address):
            return Refused(
                name,
                port,
                f"{name} resolves to {address} ({_kind(address)}), which only a hint naming "
                f"that address may reach; {POLICY_NOTE}",
            )
        denied = policy.denied(address, port)
        if denied is not None:
            return Refused(name, port, f"{name} resolves to {address}, on the operator's deny list")
    return Authorized(name, port, rule, addresses)


def _show(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split_hint(hint: str) -> tuple[str, int | None] | None:
    """``host``, ``host:port``, ``[v6]:port`` → (host, port); ``None`` when malformed."""
    hint = hint.strip()
    port_s = ""
    if hint.startswith("["):
        end = hint.find("]")
        if end < 0:
            return None
        rest = hint[end + 1 :]
        if rest and not rest.startswith(":"):
            return None
        host, port_s = hint[1:end], rest[1:]
    elif hint.count(":") == 1:
        host, _, port_s = hint.partition(":")
    else:
        host = hint
    port: int | None = None
    if port_s:
        if not port_s.isdigit() or not 0 < int(port_s) < 65536:
            return None
        port = int(port_s)
    if host in ("*",) or host.startswith("*."):
        rest_name = normalise_host(host[2:]) if host != "*" else "*"
        return None if rest_name is None else ("*" if host == "*" else "*." + rest_name, port)
    name = normalise_host(host)
    return None if name is None else (name, port)


def policy_for(
    hints: Iterable[tuple[str, str]],
    *,
    deny: Iterable[str] = (),
    limits: EgressLimits | None = None,
    trusted: Iterable[str] = (),
) -> EgressPolicy:
    """The policy for a job's active network hints.

    Args:
        hints: ``(mode, hint)`` per active ``network:<mode>`` capability and hint.
        deny: the operator's deny patterns (same syntax; without a port: every port).
        limits: the job's traffic bounds (default `EgressLimits`).
        trusted: see `EgressPolicy.trusted`.

    A malformed hint, or one of a mode without a default port that names none, grants
    nothing (fail closed); the first wall (argument vetting) refuses arguments under it.
    """
    allow: list[Rule] = []
    for mode, hint in hints:
        parsed = _split_hint(hint)
        if parsed is None:
            continue
        host, port = parsed
        port = DEFAULT_PORTS.get(mode) if port is None else port
        if port is None:
            continue
        allow.append(Rule(host, port, f"network:{mode} {hint}"))
    denied: list[Rule] = []
    for pattern in deny:
        parsed = _split_hint(pattern)
        if parsed is not None:
            denied.append(Rule(parsed[0], parsed[1], f"deny {pattern}"))
    return EgressPolicy(
        allow=tuple(dict.fromkeys(allow)),
        deny=tuple(denied),
        limits=EgressLimits() if limits is None else limits,
        trusted=tuple(str(ipaddress.ip_network(n, strict=False)) for n in trusted),
    )
