"""The SQLite purge yields the write lock (issue 18, item 7): a producer's submit gets in
while a long purge runs, instead of waiting for its end (or failing ``E_BROKER_BUSY``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from metnos_exec.brokers import _sqlite_retention as retention
from metnos_exec.brokers.sqlite import SQLiteBroker
from metnos_exec.messages import Job, Result

from .conformance import VirtualClock


class _Batches:
    """A purge hook that counts the purge's transactions (it is called inside each), and
    how many of them came after the test's submit had completed. It takes `work_s` in
    each (a hook with rows of its own to delete), so each transaction holds the lock
    that long."""

    work_s = 0.015

    def __init__(self) -> None:
        self.count = 0
        self.after_submit = 0
        self.started = threading.Event()
        self.submitted = threading.Event()

    def forget_jobs(self, store: Any, job_ids: Sequence[str]) -> None:
        self.count += 1
        if self.submitted.is_set():
            self.after_submit += 1
        self.started.set()
        time.sleep(self.work_s)

    def collect(self, store: Any, *, before: float) -> int:
        return 0


async def _finished(broker: SQLiteBroker, n: int) -> None:
    await broker.submit_many([Job(executor="echo", args={"i": i}) for i in range(n)])
    while leases := await broker.lease("w", visibility_s=60, limit=500):
        await broker.ack_many([(le, Result(job_id=le.job.id, status="succeeded")) for le in leases])


@pytest.mark.anyio
async def test_a_submit_gets_in_while_a_long_purge_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding: a purge of 100,000 jobs made a submit wait 9.76 s (and one fail), the
    purge taking the lock again as soon as it freed it. Here the purge is made long
    (50 transactions of at most 20 jobs, each holding the lock 15 ms) and a submit from
    another connection starts once the purge's first transaction ran: it must complete
    while the purge still goes on, not after (it did, before the fix)."""
    monkeypatch.setattr(retention, "_BATCH_START", 20)
    monkeypatch.setattr(retention, "_BATCH_MAX", 20)
    db = tmp_path / "queue.db"
    clock = VirtualClock()
    async with SQLiteBroker(db, clock=clock) as purger, SQLiteBroker(db) as producer:
        await _finished(purger, 1000)
        clock.advance(2 * 86400)
        batches = _Batches()
        purger.add_purge_hook(batches)
        reports = []

        async def purge() -> None:
            reports.append(await purger.purge(older_than_s=86400))

        async with anyio.create_task_group() as tg:
            tg.start_soon(purge)
            assert await anyio.to_thread.run_sync(batches.started.wait, 60)
            await producer.submit(Job(executor="echo", args={"during": True}))
            batches.submitted.set()
        [report] = reports
        assert report.jobs == 1000
        assert batches.count >= 50  # a transaction per batch of 20 (or fewer: a slow one)
        # The purge went on after the submit: the submit did not wait for its end.
        assert batches.after_submit > 0, batches.count
        assert (await producer.stats()).queued == 1


def test_the_batch_size_follows_the_time_the_lock_was_held() -> None:
    batches = retention._Batches()
    start = batches.size
    batches.held(retention._HOLD_S * 3, batches.size)
    assert batches.size == start // 2
    for _ in range(20):
        batches.held(retention._HOLD_S * 3, batches.size)
    assert batches.size == retention._BATCH_MIN
    for _ in range(20):
        batches.held(retention._HOLD_S / 10, batches.size)
    assert batches.size == retention._BATCH_MAX
    # A short batch (the scan's last) says nothing about a full one: no growth.
    batches = retention._Batches()
    batches.held(retention._HOLD_S / 10, 3)
    assert batches.size == retention._BATCH_START
