"""Transparent capture: programs that ignore the proxy variables still reach allowed names.

The DNS stub (`dns`) answers an allowed name with a fake address of its own, one per
name, in ``127.1.0.0/16`` (`FakeAddresses`); the wall listens on ``:80`` and ``:443`` of
the job's whole loopback, so a plain ``socket.create_connection((name, 443))`` lands on
the worker, which maps the fake address back to the name and decides the connection as
if the job had asked for that name (``capture``). A TLS ClientHello must name the same
host. Any other destination of the job's namespace has nothing listening: refused by
its kernel.
"""

from __future__ import annotations

import ipaddress
from typing import Final

from .http_proxy import check_sni, relay
from .policy import Refused
from .relay import Conn, JobTraffic

__all__ = ("FAKE_NETWORK", "CAPTURE_PORTS", "FakeAddresses", "serve_capture")

FAKE_NETWORK: Final = ipaddress.IPv4Network("127.1.0.0/16")
#: The ports captured on the fake addresses.
CAPTURE_PORTS: Final = (80, 443)


class FakeAddresses:
    """One fake address per name for one job, stable for its life."""

    def __init__(self) -> None:
        self._by_name: dict[str, str] = {}
        self._by_address: dict[str, str] = {}

    def address_for(self, name: str) -> str | None:
        """The name's fake address (``None``: the range is used up)."""
        hit = self._by_name.get(name)
        if hit is not None:
            return hit
        index = len(self._by_name) + 1
        if index >= FAKE_NETWORK.num_addresses - 1:
            return None
        address = str(FAKE_NETWORK.network_address + index)
        self._by_name[name] = address
        self._by_address[address] = name
        return address

    def name_for(self, address: str) -> str | None:
        return self._by_address.get(address)


async def serve_capture(
    traffic: JobTraffic, conn: Conn, fake: FakeAddresses, local: str, port: int
) -> None:
    """A connection to fake address `local`: decide it for the name the stub gave out."""
    conn.via = "capture"
    name = fake.name_for(local)
    if name is None:
        traffic.refuse(
            conn.via,
            local,
            port,
            f"{local} is no address the DNS stub gave out; blocked by the executor's manifest",
        )
        return
    decision = await traffic.decide(name, port)
    if isinstance(decision, Refused):
        traffic.refuse(conn.via, decision.host, port, decision.reason)
        return
    first = b""
    if port == 443:
        first, why = await check_sni(
            conn, decision, b"", min(5.0, traffic.policy.limits.idle_timeout_s)
        )
        if why is not None:
            traffic.refuse(conn.via, decision.host, port, why)
            return
    await relay(traffic, conn, decision, first)
