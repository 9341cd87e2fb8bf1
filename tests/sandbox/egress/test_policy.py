"""The egress decision point: pure, with a resolver the tests control (never real DNS)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from metnos_exec.sandbox.egress import (
    Authorized,
    Refused,
    authorize,
    is_public,
    normalise_host,
    policy_for,
)

pytestmark = pytest.mark.anyio

#: What the test's resolver answers (documentation and loopback/metadata addresses only:
#: nothing here is ever connected to).
ZONE: dict[str, tuple[str, ...]] = {
    "api.example.com": ("93.184.216.34",),
    "a.b.example.com": ("93.184.216.35",),
    "example.com": ("93.184.216.34",),
    "rebind.example.com": ("93.184.216.34", "127.0.0.1"),
    "loop.example.com": ("127.0.0.1",),
    "meta.example.com": ("169.254.169.254",),
    "lan.example.com": ("10.1.2.3",),
    "v6loop.example.com": ("::1",),
    "mapped.example.com": ("::ffff:127.0.0.1",),
    "mcast.example.com": ("224.0.0.251",),
    "cgnat.example.com": ("100.100.100.200",),
}
asked: list[str] = []


async def resolver(host: str, port: int) -> Sequence[str]:
    asked.append(host)
    try:
        return ZONE[host]
    except KeyError:
        raise OSError(f"no such name {host}") from None


POLICY = policy_for(
    [
        ("https", "api.example.com"),
        ("https", "*.example.com"),
        ("http", "example.com"),
        ("http", "127.0.0.1:8080"),
        ("https", "example.org:8443"),
    ],
    deny=["blocked.example.com"],
)


async def decide(host: str, port: int) -> Authorized | Refused:
    return await authorize(POLICY, host, port, resolver)


@pytest.mark.parametrize(
    ("host", "port"),
    [
        ("api.example.com", 443),
        ("API.Example.COM.", 443),  # case and the root dot do not matter
        ("a.b.example.com", 443),  # *.domain: any depth
        ("example.com", 80),  # network:http → 80
        ("127.0.0.1", 8080),  # a literal hint: as written, no lookup
    ],
)
async def test_allowed(host: str, port: int) -> None:
    got = await decide(host, port)
    assert isinstance(got, Authorized), got
    assert got.port == port


@pytest.mark.parametrize(
    ("host", "port", "why"),
    [
        ("api.example.com", 80, "not among"),  # network:https: 443 only
        ("example.com", 443, "not among"),  # *.example.com is not the apex; http only
        ("api.example.com.evil", 443, "not among"),  # look-alike
        ("evilexample.com", 443, "not among"),  # suffix without the dot
        ("example.org", 443, "not among"),  # the hint names 8443
        ("127.0.0.1", 6379, "not among"),  # the broker's Redis
        ("127.0.0.2", 8080, "not among"),  # another loopback address
        ("localhost", 8080, "not among"),  # a name for the literal: not the literal
        ("2130706433", 443, "not among"),
        ("blocked.example.com", 443, "deny list"),  # deny wins over *.example.com
        ("loop.example.com", 443, "loopback"),
        ("meta.example.com", 443, "link-local"),
        ("lan.example.com", 443, "private"),
        ("v6loop.example.com", 443, "loopback"),
        ("mapped.example.com", 443, "loopback"),
        ("mcast.example.com", 443, "multicast"),
        ("cgnat.example.com", 443, "which only a hint naming"),
        ("rebind.example.com", 443, "127.0.0.1"),  # one bad address refuses the name
        ("missing.example.com", 443, "does not resolve"),
        ("api.example.com/x", 443, "not a host name"),
        ("api example.com", 443, "not a host name"),
        ("api.example.com", 0, "out of range"),
    ],
)
async def test_refused(host: str, port: int, why: str) -> None:
    got = await decide(host, port)
    assert isinstance(got, Refused), got
    assert why in got.reason


async def test_refusals_say_they_are_policy() -> None:
    got = await decide("evil.test", 443)
    assert isinstance(got, Refused)
    assert "blocked by the executor's manifest" in got.reason
    assert "api.example.com:443" in got.reason  # and what is allowed


async def test_connects_to_the_checked_addresses() -> None:
    got = await decide("api.example.com", 443)
    assert isinstance(got, Authorized)
    assert got.addresses == ("93.184.216.34",)
    assert got.rule.source == "network:https api.example.com"


async def test_literal_is_not_looked_up_and_names_are() -> None:
    asked.clear()
    assert isinstance(await decide("127.0.0.1", 8080), Authorized)
    assert asked == []
    await decide("api.example.com", 443)
    assert asked == ["api.example.com"]


async def test_refused_before_lookup() -> None:
    """A name no rule allows is never looked up (no DNS leak of what the job asks)."""
    asked.clear()
    await decide("exfil-secret.attacker.test", 443)
    await decide("blocked.example.com", 443)
    assert asked == []


async def test_deny_by_resolved_address() -> None:
    policy = policy_for([("https", "*.example.com")], deny=["93.184.216.35"])
    got = await authorize(policy, "a.b.example.com", 443, resolver)
    assert isinstance(got, Refused) and "deny list" in got.reason


async def test_star_allows_public_names_only() -> None:
    policy = policy_for([("https", "*")])
    assert isinstance(await authorize(policy, "api.example.com", 443, resolver), Authorized)
    assert isinstance(await authorize(policy, "loop.example.com", 443, resolver), Refused)
    assert isinstance(await authorize(policy, "127.0.0.1", 443, resolver), Refused)


def test_policy_shape() -> None:
    assert POLICY.literals() == (("127.0.0.1", 8080),)
    assert "api.example.com" in POLICY.names() and "example.com" in POLICY.names()
    assert "api.example.com:443" in POLICY.summary()
    # Malformed hints and modes without a port grant nothing.
    assert (
        policy_for([("https", "a b"), ("tcp", "x.example.com"), ("https", "h:99999")]).allow == ()
    )
    assert policy_for([("tcp", "x.example.com:22")]).allow[0].port == 22
    v6 = policy_for([("http", "[::1]:9000")])
    assert v6.literals() == (("::1", 9000),)


def test_normalise_and_public() -> None:
    assert normalise_host("[::FFFF:127.0.0.1]") == "127.0.0.1"
    assert normalise_host("Ex.COM.") == "ex.com"
    assert normalise_host("a%2eb") is None
    assert is_public("93.184.216.34")
    for addr in ("127.0.0.1", "10.0.0.1", "169.254.169.254", "::1", "fd00:ec2::254", "0.0.0.0"):
        assert not is_public(addr), addr


async def test_trusted_networks_let_names_resolve_there() -> None:
    """An operator's resolver may place an allowed name on loopback (the tests do)."""
    policy = policy_for([("https", "loop.example.com:8443")], trusted=["127.0.0.0/8"])
    got = await authorize(policy, "loop.example.com", 8443, resolver)
    assert isinstance(got, Authorized) and got.addresses == ("127.0.0.1",)
    # Trust widens where a name may land, never which names or ports are allowed.
    assert isinstance(await authorize(policy, "loop.example.com", 6379, resolver), Refused)
    assert isinstance(await authorize(policy, "meta.example.com", 8443, resolver), Refused)
