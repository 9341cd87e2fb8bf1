"""The Redis broker's idle waits block in Redis instead of polling (issue 22): an idle
worker notices a new job, a due delayed job and a lapsed lease, and a waiting client its
result, with every poll set to an hour, so only the blocked reads can pass."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import anyio
import anyio.to_thread
import pytest

from metnos_exec.brokers._redis_wait import WorkCursor
from metnos_exec.brokers.redis import RedisBroker
from metnos_exec.messages import Job, Result
from tests.helpers.redis_cluster import LocalCluster
from tests.helpers.redis_server import RedisServer

HOUR = 3600.0


def _prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def _consume(url: str, prefix: str, jobs: int, backend: str, errors: list[BaseException]) -> None:
    """A worker in its own event loop (no in-process wake-up reaches it), polling hourly."""

    async def main() -> None:
        async with RedisBroker(url, prefix=prefix, poll_interval_s=HOUR) as w:
            done = 0
            with anyio.fail_after(30):
                while done < jobs:
                    leases = await w.lease("w", visibility_s=30)
                    if not leases:
                        await w.wait_for_work(HOUR)
                        continue
                    for lease in leases:
                        result = Result(job_id=lease.job.id, status="succeeded", output={"by": "w"})
                        assert await w.ack(lease, result)
                        done += 1

    try:
        anyio.run(main, backend=backend)
    except BaseException as exc:  # reported by the test
        errors.append(exc)


@pytest.mark.anyio
async def test_another_loop_s_submit_and_ack_wake_the_waits_without_the_poll(
    redis_server: RedisServer, anyio_backend: str
) -> None:
    await _answered_across_loops(redis_server.url, anyio_backend)


@pytest.mark.anyio
async def test_the_blocked_reads_work_on_a_cluster(
    redis_cluster: LocalCluster, anyio_backend: str
) -> None:
    # The blocked reads go to the node owning the queue's slot (routed by their key).
    await _answered_across_loops(redis_cluster.url, anyio_backend)


async def _answered_across_loops(url: str, anyio_backend: str) -> None:
    prefix, errors = _prefix(), []
    thread = threading.Thread(target=_consume, args=(url, prefix, 3, anyio_backend, errors))
    thread.start()
    got: list[Any] = []
    try:
        async with RedisBroker(url, prefix=prefix, poll_interval_s=HOUR) as c:
            with anyio.fail_after(20):
                for _ in range(3):
                    job = Job(executor="echo")
                    await c.submit(job)
                    result = await c.wait_result(job.id, timeout=None)
                    got.append(result.output if result else None)
    finally:
        await anyio.to_thread.run_sync(thread.join, 30)
    assert not errors, errors
    assert got == [{"by": "w"}] * 3


@pytest.mark.anyio
async def test_an_idle_worker_wakes_for_a_delayed_job_and_a_lapsed_lease(
    redis_server: RedisServer,
) -> None:
    prefix = _prefix()
    async with (
        RedisBroker(redis_server.url, prefix=prefix, poll_interval_s=HOUR) as w1,
        RedisBroker(redis_server.url, prefix=prefix, poll_interval_s=HOUR) as w2,
    ):
        with anyio.fail_after(20):
            now = await w1._guard(w1._redis.time())
            await w1.submit(Job(executor="echo", not_before=now.timestamp() + 0.3))
            # Nothing wakes the stream when it falls due: the lease said when it would.
            while not (leases := await w1.lease("w1", visibility_s=0.3)):
                await w1.wait_for_work(HOUR)
            # w1 dies holding it: w2's wait ends when the lease may lapse, and takes it.
            while not (taken := await w2.lease("w2", visibility_s=30)):
                await w2.wait_for_work(HOUR)
        assert taken[0].job.id == leases[0].job.id and taken[0].attempt == 2


@pytest.mark.anyio
async def test_wake_ups_for_other_work_do_not_end_a_wait(redis_server: RedisServer) -> None:
    prefix = _prefix()
    async with (
        RedisBroker(redis_server.url, prefix=prefix, poll_interval_s=HOUR) as w,
        RedisBroker(redis_server.url, prefix=prefix, poll_interval_s=HOUR) as c,
    ):
        assert await w.lease("w", visibility_s=30, executors=["mine"]) == []
        woke = anyio.Event()

        async def wait() -> None:
            await w.wait_for_work(HOUR)
            woke.set()

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                cursor = w._work_cursor
                assert isinstance(cursor, WorkCursor)
                before = cursor.wake
                tg.start_soon(wait)
                # Another executor's job and a device's: seen, skipped (the cursor moves).
                await c.submit(Job(executor="theirs"))
                await c.submit(Job(executor="mine", device="phone"))
                while cursor.wake == before:  # noqa: ASYNC110 (the other read's progress)
                    await anyio.sleep(0.01)
                assert not woke.is_set()
                await c.submit(Job(executor="mine"))
                await woke.wait()
        [lease] = await w.lease("w", visibility_s=30, executors=["mine"])
        assert lease.job.executor == "mine"


def test_a_wake_up_is_wanted_by_its_device_and_executors() -> None:
    every = WorkCursor("server", None, "0-0", None, None, 0.0)
    some = WorkCursor("server", frozenset({"a"}), "0-0", None, None, 0.0)
    assert every.wants({b"d": b"server", b"e": b"x"})
    assert not every.wants({b"d": b"phone", b"e": b"x"})
    assert some.wants({b"d": b"server", b"e": b"a"})
    assert not some.wants({b"d": b"server", b"e": b"b"})
    assert some.wants({b"d": b"server", b"e": b""})  # an older build's route: everyone's
