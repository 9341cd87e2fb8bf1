"""Running the Redis broker in earnest (issue 18, item 8), on a real private
redis-server: a restart that loses the data set is said (``broker.data_lost``, kept for
``status`` and ``doctor``)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import coredis
import msgspec
import pytest
from structlog.testing import capture_logs

from metnos_exec.brokers import BrokerStats, Lease
from metnos_exec.brokers._redis_watch import DataWatch
from metnos_exec.brokers.redis import RedisBroker
from metnos_exec.errors import BrokerUnavailable
from metnos_exec.messages import Job, Result
from tests.conftest import need
from tests.helpers.redis_server import RedisServer, redis_server_path

T = TypeVar("T")


def _prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def _ok(lease: Lease) -> Result:
    return Result(job_id=lease.job.id, status="succeeded", worker="w1", attempt=lease.attempt)


@contextlib.asynccontextmanager
async def _raw(url: str) -> AsyncIterator[coredis.Redis[bytes]]:
    async with coredis.Redis.from_url(url, decode_responses=False) as client:
        yield client


async def _answered(call: Callable[[], Awaitable[T]]) -> T:
    """`call` once Redis answers again (after a restart)."""
    with anyio.fail_after(20):
        while True:
            try:
                return await call()
            except BrokerUnavailable:
                await anyio.sleep(0.05)


def _server(tmp_path: Path, **kw: Any) -> RedisServer:
    need(redis_server_path() is not None, "redis-server is not installed")
    server = RedisServer(tmp_path / "redis", **kw)
    server.start()
    return server


# --- item 8: a restart without persistence ------------------------------------------


async def _fill(b: RedisBroker) -> BrokerStats:
    """5 jobs: one done, one running, three queued; the counts as the broker saw them."""
    await b.submit_many([Job(executor="echo") for _ in range(5)])
    [first] = await b.lease("w1", visibility_s=60)
    assert await b.ack(first, _ok(first))
    await b.lease("w1", visibility_s=60)
    stats = await b.stats()
    assert (stats.queued, stats.running, stats.done) == (3, 1, 1)
    return stats


@pytest.mark.anyio
async def test_a_restart_without_persistence_is_said_once_with_what_was_lost(
    tmp_path: Path,
) -> None:
    """Issue 18, item 8: a Redis without its append-only file restarted with nothing, and
    nothing said why the jobs were gone. Now the broker that saw the queue logs
    ``broker.data_lost`` once, with the counts it last saw, and records it in the new
    data set, where a reader started afterwards (``status``, ``doctor``) finds it."""
    server = _server(tmp_path)  # queue/redis.conf with --appendonly no
    prefix = _prefix()
    try:
        async with RedisBroker(server.url, prefix=prefix) as b:
            seen = await _fill(b)
            await anyio.to_thread.run_sync(server.restart)
            with capture_logs() as logs:
                after = await _answered(b.stats)
                await b.lease("w1", visibility_s=60)
                await b.submit(Job(executor="echo"))
                await b.stats()
            assert (after.queued, after.done) == (0, 0)
            lost = [r for r in logs if r["event"] == "broker.data_lost"]
            assert len(lost) == 1, logs  # once, not once per call
            record = lost[0]
            assert record["log_level"] == "error" and record["cause"] == "restart"
            assert record["last_seen"] == msgspec.to_builtins(seen)
            assert record["run_id_before"] != record["run_id_now"]
            assert "3 queued" in record["detail"] and "1 done" in record["detail"]
            assert "no append-only file" in record["detail"]
            [kept] = await b.data_lost()
            assert kept.cause == "restart" and kept.last_seen == seen
        async with RedisBroker(server.url, prefix=prefix, create=False) as reader:
            [found] = await reader.data_lost()
            assert found == kept
    finally:
        server.stop()


@pytest.mark.anyio
async def test_a_restart_that_keeps_the_data_is_no_loss(tmp_path: Path) -> None:
    """With the append-only file the marker comes back with the jobs: a restart, said at
    info level, and nothing recorded as lost."""
    server = _server(tmp_path, appendonly=True)
    try:
        async with RedisBroker(server.url, prefix=_prefix()) as b:
            seen = await _fill(b)
            await anyio.to_thread.run_sync(server.restart)
            with capture_logs() as logs:
                after = await _answered(b.stats)
                await b.stats()
            assert after == seen
            events = [r["event"] for r in logs]
            assert "broker.data_lost" not in events
            [restarted] = [r for r in logs if r["event"] == "broker.restarted"]
            assert restarted["run_id_before"] != restarted["run_id_now"]
            assert await b.data_lost() == []
    finally:
        server.stop()


@pytest.mark.anyio
async def test_keys_flushed_under_a_running_server_are_a_flush(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No connection drops when the keys are deleted (FLUSHDB, a DEL by hand): the broker
    looks again after `DataWatch.every_s` and finds the marker gone, the server the same."""
    monkeypatch.setattr(DataWatch, "every_s", 0.0)
    prefix = _prefix()
    async with RedisBroker(redis_server.url, prefix=prefix) as b, _raw(redis_server.url) as raw:
        await b.submit(Job(executor="echo"))
        await b.stats()
        keys = [k async for k in raw.scan_iter(match="{" + prefix + "}:*")]
        await raw.delete(keys)
        with capture_logs() as logs:
            await b.stats()
            await b.stats()
        [lost] = [r for r in logs if r["event"] == "broker.data_lost"]
        assert lost["cause"] == "flush" and lost["last_seen"]["queued"] == 1


@pytest.mark.anyio
async def test_a_reader_writes_nothing(redis_server: RedisServer) -> None:
    """``status`` and ``doctor`` (readers) leave no marker on a queue nobody wrote yet."""
    prefix = _prefix()
    async with RedisBroker(redis_server.url, prefix=prefix, create=False) as reader:
        assert (await reader.stats()).queued == 0
        assert await reader.data_lost() == []
    async with _raw(redis_server.url) as raw:
        assert [k async for k in raw.scan_iter(match="{" + prefix + "}:*")] == []


# --- what status and doctor say -----------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "METNOS_REQUIRE_SANDBOX": "never"}
    return subprocess.run(
        [sys.executable, "-m", "metnos_exec", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _findings(out: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    return {f["check"]: f for f in json.loads(out.stdout)["findings"]}


def test_status_and_doctor_say_a_data_loss(tmp_path: Path) -> None:
    """After a loss (a Redis without persistence, restarted), a ``status`` and a
    ``doctor`` started afterwards say it: what was lost and when."""
    server = _server(tmp_path)
    url = f"{server.url}?prefix={_prefix()}"

    async def lose() -> None:
        async with RedisBroker(url.split("?")[0], prefix=url.split("=")[1]) as b:
            await _fill(b)
            await anyio.to_thread.run_sync(server.restart)
            await _answered(b.stats)
            assert await b.data_lost()

    try:
        anyio.run(lose)
        status = _cli("status", "--broker", url, "--json")
        assert status.returncode == 0, status.stderr
        broker = json.loads(status.stdout)["broker"]
        [loss] = broker["data_lost"]
        assert loss["cause"] == "restart" and loss["last_seen"]["queued"] == 3
        text = _cli("status", "--broker", url)
        assert "DATA LOST (found " in text.stdout and "3 queued" in text.stdout
        doctor = _cli("doctor", "--broker", url, "--json")
        found = _findings(doctor)
        assert found["broker_data"]["state"] == "weakened"
        assert "lost 1 time(s)" in found["broker_data"]["detail"]
        assert "appendonly yes" in found["broker_data"]["fix"]
    finally:
        server.stop()
