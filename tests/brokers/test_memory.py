"""The in-memory broker against the conformance suite."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import anyio
import pytest

from metnos_exec.brokers import BadBrokerURL, Broker, open_broker
from metnos_exec.brokers.memory import MemoryBroker
from metnos_exec.messages import Job

from .conformance import BrokerConformance, VirtualClock


class TestMemoryBroker(BrokerConformance):
    @contextlib.asynccontextmanager
    async def open_broker(self, clock: VirtualClock) -> AsyncIterator[Broker]:
        async with MemoryBroker(clock=clock) as broker:
            yield broker


def test_open_broker_memory_url() -> None:
    assert isinstance(open_broker("memory://"), MemoryBroker)


def test_open_broker_unknown_scheme_names_the_known_ones() -> None:
    with pytest.raises(BadBrokerURL, match=r"memory://.*sqlite://") as info:
        open_broker("ftp://example.com")
    assert info.value.code == "E_BAD_BROKER_URL"


@pytest.mark.anyio
async def test_wait_for_work_returns_when_a_delayed_job_falls_due() -> None:
    async with MemoryBroker() as broker:
        await broker.submit(Job(executor="echo", not_before=time.time() + 0.05))
        assert await broker.lease("w", visibility_s=5) == []
        with anyio.fail_after(10):  # without the due-time wake-up each wait lasts 60 s
            while not await broker.lease("w", visibility_s=5):
                await broker.wait_for_work(60)
