"""Failover while workers run (issue 18, item 12), on real worker processes.

Sentinel: a primary, its replica and a sentinel on loopback; workers and a producer on
``redis+sentinel://`` with ``wait_replicas=1``; the primary is killed (SIGKILL, the worst
case: nothing flushed, no goodbye) mid-drain and the sentinel promotes the replica. Every
job whose submit returned a receipt runs and has its result; the workers reconnect to
the new primary by themselves and drain the rest.

Cluster: the same on a three-primary cluster with a replica each, ``CLUSTER FAILOVER``
on the replica of the shard holding the queue.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from metnos_exec.brokers import Broker, BrokerStats
from metnos_exec.errors import BrokerError
from metnos_exec.messages import Job
from tests.conftest import ALLOWED_CHILDREN, need
from tests.helpers.redis_cluster import LocalCluster, SentinelGroup, cli, redis_cli_path
from tests.helpers.redis_server import redis_server_path
from tests.test_worker_process import (
    SLEEPY_MAIN,
    SLEEPY_MANIFEST,
    Workers,
    events,
    has_event,
    wait_until,
    with_broker,
)

pytestmark = pytest.mark.slow

ECHO = {"METNOS_ARM_OVERRIDE": "echo"}


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    need(
        redis_server_path() is not None and redis_cli_path() is not None,
        "redis-server and redis-cli are not installed (apt install redis-server)",
    )
    root = tmp_path / "executors"
    (root / "sleepy").mkdir(parents=True)
    (root / "sleepy" / "manifest.toml").write_text(SLEEPY_MANIFEST)
    (root / "sleepy" / "main.py").write_text(SLEEPY_MAIN)
    w = Workers(tmp_path, root)
    try:
        yield w
    finally:
        w.close()


def _stats(url: str) -> BrokerStats:
    stats: BrokerStats = with_broker(url, lambda b: b.stats())
    return stats


def _submit_all(url: str, jobs: list[Job]) -> None:
    """Submit `jobs` until each has a receipt: a submit whose outcome is unknown (the
    failover cut it off, or no replica confirmed it) is sent again, harmless with its
    idempotency key."""

    def once() -> bool:
        try:
            with_broker(url, lambda b: b.submit_many(jobs))
        except BrokerError:
            return False
        return True

    wait_until(once, 60, "every submit acknowledged")


def _drained(url: str, ids: list[str]) -> None:
    async def missing(b: Broker) -> list[str]:
        return [i for i in ids if await b.get_result(i) is None]

    def done() -> bool:
        try:
            return not with_broker(url, missing)
        except BrokerError:
            return False

    wait_until(done, 120, "every acknowledged job's result")


def _run_through_failover(
    workers: Workers, url: str, fail_over: object, *, outage: bool = True
) -> None:
    workers.url = url
    logs = [
        workers.start(
            wid, "--concurrency", "8", "--visibility", "5", "--backend", backend, env=ECHO
        )
        for wid, backend in (("W1", "asyncio"), ("W2", "trio"))
    ]
    for log in logs:
        wait_until(functools.partial(has_event, log, "worker.started"), 20, "workers up")
    first = [
        Job(executor="sleepy", args={"s": i / 1e6}, idempotency_key=f"a{i}") for i in range(600)
    ]
    _submit_all(url, first)
    wait_until(lambda: _stats(url).done >= 100, 60, "work under way")
    fail_over()  # type: ignore[operator]
    second = [
        Job(executor="sleepy", args={"s": i / 1e5}, idempotency_key=f"b{i}") for i in range(200)
    ]
    _submit_all(url, second)
    ids = [j.id for j in first + second]
    _drained(url, ids)
    assert [p.poll() for p in workers.procs] == [None, None], "no worker exited"
    for log in logs:
        # A killed primary is an outage each worker lives through; a cluster's graceful
        # failover is a MOVED reply the client follows (and a script the promoted
        # replica lacks, sent again with EVAL), no outage at all.
        errors = events(log, event="broker.error")
        assert bool(errors) is outage, errors[:3]
    for p in workers.procs:
        p.send_signal(signal.SIGTERM)
    assert [p.wait(30) for p in workers.procs] == [0, 0]
    stats = _stats(url)
    assert (stats.done, stats.queued, stats.running) == (800, 0, 0), stats


def test_sentinel_promotes_the_replica_while_workers_run(workers: Workers, tmp_path: Path) -> None:
    group = SentinelGroup(tmp_path / "sentinel")
    try:
        group.start()
        ALLOWED_CHILDREN.update(group.pids)
        old = group.primary

        def fail_over() -> None:
            old.stop(signal.SIGKILL)  # nothing flushed: only what reached the replica counts
            wait_until(lambda: group.primary_port() == group.replica.port, 30, "promotion")
            # Until a replica is back, durable writes are not acknowledged (wait_replicas):
            # the old primary comes back and the sentinel makes it the new one's replica.
            ALLOWED_CHILDREN.difference_update(group.pids)
            old.start()
            ALLOWED_CHILDREN.update(group.pids)
            wait_until(
                lambda: "master_link_status:up" in cli(old.port, "info", "replication"),
                30,
                "the old primary back as a replica",
            )

        url = f"{group.url}?prefix=fo&poll_interval_s=0.02&wait_replicas=1&wait_timeout_s=0.5"
        _run_through_failover(workers, url, fail_over)
        # status and doctor through the sentinel: the new primary, its append-only file.
        env = {**os.environ, "HOME": str(tmp_path), "METNOS_REQUIRE_SANDBOX": "never"}
        for command in ("status", "doctor"):
            out = subprocess.run(
                [sys.executable, "-m", "metnos_exec", command, "--json", "--broker", url],
                capture_output=True,
                text=True,
                timeout=60,
                env=env,
                check=False,
            )
            assert out.returncode in (0, 1), out.stderr
            assert "redis+sentinel://" in out.stdout and "Traceback" not in out.stderr
        doc = json.loads(out.stdout)
        broker = next(f for f in doc["findings"] if f["check"] == "broker")
        assert "keeps nothing" not in broker["detail"], broker
    finally:
        ALLOWED_CHILDREN.difference_update(group.pids)
        workers.close()
        group.stop()


def test_a_cluster_shard_fails_over_while_workers_run(workers: Workers, tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "cluster", replicas=1)
    try:
        cluster.start()
        ALLOWED_CHILDREN.update(cluster.pids)
        holder = cluster.node_for_key("{fo}:counts")
        replica = cluster.replica_of(holder)

        def fail_over() -> None:
            cli(replica.port, "cluster", "failover")
            wait_until(lambda: cluster.node_for_key("{fo}:counts") is replica, 30, "promotion")

        url = f"{cluster.url}?prefix=fo&poll_interval_s=0.02&wait_replicas=1&wait_timeout_s=0.5"
        _run_through_failover(workers, url, fail_over, outage=False)
    finally:
        ALLOWED_CHILDREN.difference_update(cluster.pids)
        workers.close()
        cluster.stop()
