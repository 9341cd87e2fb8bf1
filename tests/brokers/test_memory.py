"""The in-memory broker against the conformance suite."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from metnos_exec.brokers import Broker, open_broker
from metnos_exec.brokers.memory import MemoryBroker

from .conformance import BrokerConformance, VirtualClock


class TestMemoryBroker(BrokerConformance):
    @contextlib.asynccontextmanager
    async def open_broker(self, clock: VirtualClock) -> AsyncIterator[Broker]:
        async with MemoryBroker(clock=clock) as broker:
            yield broker


def test_open_broker_memory_url() -> None:
    assert isinstance(open_broker("memory://"), MemoryBroker)


def test_open_broker_unknown_scheme_names_the_known_ones() -> None:
    from metnos_exec.brokers import BadBrokerURL

    with pytest.raises(BadBrokerURL, match=r"memory://.*sqlite://") as info:
        open_broker("ftp://example.com")
    assert info.value.code == "E_BAD_BROKER_URL"
