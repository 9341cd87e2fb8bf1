"""The network wall's tests never let a packet leave loopback, even if the wall breaks.

Some tests resolve names to link-local or private addresses (through a resolver they
control) to show the wall refuses them before any connect. If the wall were broken it
would connect, and a real packet would go to somebody's address. This guard sits in
front of the worker's only way to open an upstream connection, `JobTraffic.connect`, in
this process. It refuses any address outside loopback without sending anything, and
fails the test that tried.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator

import pytest

from metnos_exec.sandbox.egress import Authorized
from metnos_exec.sandbox.egress.relay import JobTraffic


@pytest.fixture(autouse=True)
def _no_packet_leaves_loopback(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    tried: list[str] = []
    real = JobTraffic.connect

    async def guarded(self: JobTraffic, ok: Authorized) -> tuple[socket.socket, str]:
        outside = [a for a in ok.addresses if not ipaddress.ip_address(a).is_loopback]
        if outside:
            tried.extend(f"{a}:{ok.port} ({ok.host})" for a in outside)
            raise OSError(f"test guard: no connection outside loopback ({outside})")
        return await real(self, ok)

    monkeypatch.setattr(JobTraffic, "connect", guarded)
    yield
    assert not tried, f"the wall let a connection go to a non-loopback address: {tried}"
