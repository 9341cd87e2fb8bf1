"""The Redis broker: the conformance suite on a private redis-server, and what a fleet needs."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest

from metnos_exec.brokers import Broker
from metnos_exec.brokers.redis import RedisBroker
from tests.helpers.redis_server import RedisServer

from .conformance import BrokerConformance, VirtualClock


def _prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


class TestRedisBroker(BrokerConformance):
    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> None:
        self.server = redis_server

    @contextlib.asynccontextmanager
    async def open_broker(self, clock: VirtualClock) -> AsyncIterator[Broker]:
        # A long poll interval: the suite's wait tests must be woken in process.
        async with RedisBroker(
            self.server.url, prefix=_prefix(), clock=clock, poll_interval_s=30.0
        ) as broker:
            yield broker
