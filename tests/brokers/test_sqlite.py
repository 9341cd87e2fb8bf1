"""The SQLite broker: the conformance suite, the schema contract, and real processes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from metnos_exec.brokers import Broker, open_broker
from metnos_exec.brokers.sqlite import SCHEMA_SQL, SQLiteBroker

from .conformance import BrokerConformance, VirtualClock

ROOT = Path(__file__).resolve().parents[2]


class TestSQLiteBroker(BrokerConformance):
    @pytest.fixture(autouse=True)
    def _db_path(self, tmp_path: Path) -> None:
        self.db_path = tmp_path / "queue.db"

    @contextlib.asynccontextmanager
    async def open_broker(self, clock: VirtualClock) -> AsyncIterator[Broker]:
        # A long poll interval: the suite's wait tests must be woken by the in-process
        # signal, not by a poll that happens to come round.
        async with SQLiteBroker(self.db_path, clock=clock, poll_interval_s=30.0) as broker:
            yield broker


def test_schema_file_matches_the_embedded_schema() -> None:
    assert (ROOT / "queue" / "sqlite_schema.sql").read_text() == SCHEMA_SQL


def test_open_broker_sqlite_url(tmp_path: Path) -> None:
    import anyio

    async def main() -> None:
        broker = open_broker(f"sqlite:///{tmp_path}/q.db?poll_interval_s=0.2")
        assert isinstance(broker, SQLiteBroker)
        assert broker.path == tmp_path / "q.db"
        await broker.close()

    anyio.run(main)
