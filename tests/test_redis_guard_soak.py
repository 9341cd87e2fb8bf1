"""A wrong-type write to the inbox while a fleet runs (issue 18, item 1; acceptance 2).

Three real worker processes and a producer on a private redis-server; a hostile producer
``SET``s the inbox key (the write that used to stop every worker and dead-letter queued
jobs ``E_LEASE_EXPIRED``). For ``METNOS_SOAK_S`` seconds (20 by default; the acceptance
run used 60) the producer submits through the scripts and through the inbox: no job
loses an attempt, none is dead-lettered, the key is set aside once with one log record
and its content kept, and every job runs.
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import anyio
import coredis
import pytest
from structlog.testing import capture_logs

from metnos_exec.brokers import open_broker
from metnos_exec.messages import Job, Result, encode
from tests.helpers.redis_server import RedisServer
from tests.test_redis_workers import ECHO, _results, _stats
from tests.test_worker_process import (
    SLEEPY_MAIN,
    SLEEPY_MANIFEST,
    Workers,
    events,
    wait_until,
)

pytestmark = pytest.mark.slow

SOAK_S = float(os.environ.get("METNOS_SOAK_S", "20"))


@pytest.fixture
def fleet(tmp_path: Path, redis_server: RedisServer) -> Iterator[Workers]:
    root = tmp_path / "executors" / "sleepy"
    root.mkdir(parents=True)
    (root / "manifest.toml").write_text(SLEEPY_MANIFEST)
    (root / "main.py").write_text(SLEEPY_MAIN)
    w = Workers(tmp_path, tmp_path / "executors")
    w.url = f"{redis_server.url}?prefix={tmp_path.name}&poll_interval_s=0.02"
    try:
        yield w
    finally:
        w.close()


async def _produce(
    url: str, raw_url: str, prefix: str
) -> tuple[list[str], list[dict[str, object]]]:
    """Spoil the inbox, then submit for SOAK_S seconds (one job in four through the
    inbox, as another language would); the ids and this process's log records."""
    ids: list[str] = []
    with capture_logs() as logs:
        async with open_broker(url) as b:
            raw = coredis.Redis.from_url(raw_url)
            async with raw:
                inbox = "{" + prefix + "}:inbox"
                await raw.delete([inbox])
                await raw.set(inbox, "written by hand")
                deadline = anyio.current_time() + SOAK_S
                n = 0
                while anyio.current_time() < deadline:
                    job = Job(executor="sleepy", args={"s": 0}, max_attempts=1)
                    if n % 4 == 3:
                        await raw.xadd(inbox, {"job": encode(job)})
                    else:
                        await b.submit(job)
                    ids.append(job.id)
                    n += 1
                    await anyio.sleep(0.01)  # the producer's pace, not a synchronisation
    return ids, logs


def test_a_wrong_type_inbox_costs_no_job_an_attempt(
    fleet: Workers, redis_server: RedisServer
) -> None:
    logs = [
        fleet.start(wid, "--concurrency", "4", "--visibility", "5", env=ECHO)
        for wid in ("W1", "W2", "W3")
    ]
    for log in logs:
        wait_until(
            functools.partial(lambda p: bool(events(p, event="worker.started")), log), 20, "up"
        )
    prefix = fleet.tmp.name
    ids, producer_logs = anyio.run(_produce, fleet.url, redis_server.url, prefix)
    assert len(ids) > 10 * SOAK_S  # it really produced all along
    wait_until(lambda: _stats(fleet.url).done >= len(ids), 60, "every job ran")
    results = _results(fleet.url, ids)
    assert all(r is not None for r in results)
    finished: list[Result] = [r for r in results if r is not None]
    assert {r.status for r in finished} == {"succeeded"}
    assert {r.attempt for r in finished} == {1}  # max_attempts=1: a lost attempt is dead
    stats = _stats(fleet.url)
    assert (stats.dead, stats.queued, stats.running) == (0, 0, 0)
    aside = [r for r in producer_logs if r["event"] == "broker.key_set_aside"]
    for log in logs:
        aside += events(log, event="broker.key_set_aside")
    assert len(aside) == 1, aside
    assert aside[0]["key"] == "{" + prefix + "}:inbox"

    async def evidence() -> bytes | None:
        async with coredis.Redis.from_url(redis_server.url) as raw:
            kept: bytes | None = await raw.get(str(aside[0]["kept_as"]))
            return kept

    assert anyio.run(evidence) == b"written by hand"
    for p in fleet.procs:
        p.send_signal(signal.SIGTERM)
    assert [p.wait(20) for p in fleet.procs] == [0, 0, 0]
