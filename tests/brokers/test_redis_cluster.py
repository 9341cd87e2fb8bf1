"""The Redis broker on a Redis Cluster (issue 18, item 12): the whole broker contract on
a private three-primary cluster, queues spread over its shards, server commands asked of
the node holding the queue, and a failover of that node's shard."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import coredis
import pytest

from metnos_exec.brokers import BadBrokerURL, Broker, open_broker, redact_url
from metnos_exec.brokers.redis import RedisBroker
from metnos_exec.errors import BrokerUnavailable, SubmitOutcomeUnknown
from metnos_exec.messages import Job
from tests.helpers.redis_cluster import LocalCluster
from tests.helpers.redis_server import RedisServer

from . import test_redis
from .conformance import ok_result


class TestRedisClusterBroker(test_redis.TestRedisBroker):
    """The whole contract through ``redis+cluster://``: every script routed by its
    ``KEYS[1]`` to the shard holding the queue's hash tag."""

    @pytest.fixture(autouse=True)
    def _server(self, redis_cluster: LocalCluster) -> None:
        self.cluster = redis_cluster

    def broker_url(self) -> str:
        return self.cluster.url

    @contextlib.asynccontextmanager
    async def storage_fault(self, broker: Broker) -> AsyncIterator[None]:
        # The shard's primary refuses writes until a replica acknowledges them
        # (``min-replicas-to-write``; it has none), as a primary cut off from its
        # replicas does: every write is NOREPLICAS, the data stay.
        assert isinstance(broker, RedisBroker)
        node = self.cluster.node_for_key(broker.keys.counts)
        async with coredis.Redis("127.0.0.1", node.port, decode_responses=True) as raw:
            await raw.config_set({"min-replicas-to-write": 1})
            try:
                yield
            finally:
                await raw.config_set({"min-replicas-to-write": 0})


def _prefix_on(cluster: LocalCluster, port: int, taken: set[str]) -> str:
    """A fresh prefix whose hash tag lands on the primary at `port`."""
    for i in range(10_000):
        prefix = f"spread-{uuid.uuid4().hex[:8]}-{i}"
        if prefix not in taken and cluster.node_for_key("{" + prefix + "}:counts").port == port:
            return prefix
    raise AssertionError(f"no prefix found for {port}")


@pytest.mark.anyio
async def test_queues_spread_over_the_shards_and_each_stays_in_one(
    redis_cluster: LocalCluster,
) -> None:
    """One queue per primary: each works end to end, and all of its keys are on its
    shard (one slot): that shard is as far as one queue scales."""
    primaries = list(redis_cluster.nodes)
    prefixes: set[str] = set()
    for node in primaries:
        prefix = _prefix_on(redis_cluster, node.port, prefixes)
        prefixes.add(prefix)
        async with RedisBroker(redis_cluster.url, prefix=prefix) as b:
            job = Job(executor="echo", args={"on": node.port})
            await b.submit(job)
            [lease] = await b.lease("w1", visibility_s=30)
            assert lease.job.id == job.id
            assert await b.ack(lease, ok_result(lease, {"port": node.port}))
            result = await b.get_result(job.id)
            assert result is not None and result.output == {"port": node.port}
        async with coredis.Redis("127.0.0.1", node.port, decode_responses=True) as raw:
            keys = {k async for k in raw.scan_iter(match="{" + prefix + "}:*")}
            assert "{" + prefix + "}:counts" in keys and len(keys) > 3, keys
            slots = {await raw.cluster_keyslot(k) for k in keys}
            assert len(slots) == 1
    assert len(prefixes) == 3


@pytest.mark.anyio
async def test_durability_and_the_run_id_are_the_queue_nodes(
    redis_cluster: LocalCluster,
) -> None:
    """``doctor``'s persistence check asks the node holding the queue: one primary
    without its append-only file is said for its queues only."""
    holder, other = redis_cluster.nodes[0], redis_cluster.nodes[1]
    weak = _prefix_on(redis_cluster, holder.port, set())
    sound = _prefix_on(redis_cluster, other.port, set())
    async with coredis.Redis("127.0.0.1", holder.port, decode_responses=True) as raw:
        run_id = (await raw.info("server"))["run_id"]
        await raw.config_set({"appendonly": "no"})
        try:
            async with RedisBroker(redis_cluster.url, prefix=weak) as b:
                said = await b.durability()
                assert said is not None and "appendonly no" in said
                assert (await b._server_info())["run_id"] == run_id
            async with RedisBroker(redis_cluster.url, prefix=sound) as b:
                assert await b.durability() is None
                assert (await b._server_info())["run_id"] != run_id
        finally:
            await raw.config_set({"appendonly": "yes"})


def test_a_password_in_a_cluster_or_sentinel_url_is_never_shown() -> None:
    for url in (
        "redis+cluster://metnos:hunter2@127.0.0.1:7000,127.0.0.1:7001",
        "redis+sentinel://:hunter2@127.0.0.1:26379,127.0.0.1:26380/svc/2",
    ):
        broker = open_broker(url)
        assert isinstance(broker, RedisBroker)
        assert "hunter2" not in broker.where and "hunter2" not in broker.queue_id
        assert "hunter2" not in redact_url(url) and "***" in redact_url(url)
        with pytest.raises(BadBrokerURL) as caught:
            open_broker(url + "?wait_replicas=many")
        assert "hunter2" not in str(caught.value) and "wait_replicas" in str(caught.value)
    with pytest.raises(BadBrokerURL) as caught:
        open_broker("redis+sentinel://u:hunter2@127.0.0.1:26379")
    assert "hunter2" not in str(caught.value) and "names its service" in str(caught.value)


@pytest.mark.anyio
async def test_wait_replicas_without_a_replica_is_an_unknown_outcome(
    redis_server: RedisServer,
) -> None:
    """A write the primary did but no replica confirmed is not acknowledged: the caller
    hears the outcome is unknown (the job is there; a retry with its key is harmless)."""
    url = f"{redis_server.url}?wait_replicas=1&wait_timeout_s=0.05"
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    async with open_broker(url, prefix=prefix) as b:
        job = Job(executor="echo", idempotency_key="once")
        with pytest.raises(SubmitOutcomeUnknown, match="0 of 1 replicas"):
            await b.submit(job)
        assert (await b.stats()).queued == 1  # done on the primary all the same
        [lease] = await b.lease("w1", visibility_s=30)  # a lease waits for no replica
        with pytest.raises(BrokerUnavailable):
            await b.ack(lease, ok_result(lease, "x"))
        # A replica is back (as if): the worker's retry, replay flag set, hears the
        # first try's outcome rather than "lease lost"; the job is done once.
        assert isinstance(b, RedisBroker)
        b._wait = (0, b._wait[1])
        assert await b.ack(lease, ok_result(lease, "x"))
        assert (await b.submit(job)).duplicate
        assert (await b.stats()).done == 1


def test_status_and_doctor_read_a_cluster_queue(
    redis_cluster: LocalCluster, tmp_path: Path
) -> None:
    url = f"{redis_cluster.url}?prefix=cli-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "HOME": str(tmp_path), "METNOS_REQUIRE_SANDBOX": "never"}
    run = functools.partial(
        subprocess.run, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path
    )
    submit = run([sys.executable, "-m", "metnos_exec", "submit", "echo", "--broker", url])
    assert submit.returncode in (0, 2, 3), submit.stderr  # refused without a catalog is fine
    status = run([sys.executable, "-m", "metnos_exec", "status", "--json", "--broker", url])
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)["broker"]
    assert "redis+cluster://" in json.dumps(doc)
    doctor = run([sys.executable, "-m", "metnos_exec", "doctor", "--json", "--broker", url])
    assert doctor.returncode in (0, 1), doctor.stderr
    report = json.loads(doctor.stdout)
    broker = next(f for f in report["findings"] if f["check"] == "broker")
    # appendonly yes on every node; no password: said as open to anyone.
    assert "keeps nothing" not in broker["detail"], broker


@pytest.mark.anyio
async def test_a_cluster_with_no_node_reachable_is_unavailable_not_a_crash() -> None:
    from tests.helpers.redis_server import _free_port

    url = f"redis+cluster://127.0.0.1:{_free_port()}?connect_timeout_s=0.5"
    broker = open_broker(url)
    with pytest.raises(BrokerUnavailable, match="cannot reach Redis at redis\\+cluster://"):
        async with broker:
            pass  # pragma: no cover


@pytest.mark.anyio
async def test_a_write_waiting_for_replicas_holds_up_no_lease_or_heartbeat(
    redis_server: RedisServer,
) -> None:
    """``WAIT`` blocks the connection it is sent on: durable writes have a client of
    their own, so while one waits (here its whole timeout: no replica) the worker's
    heartbeats and leases go on the shared connection without queueing behind it."""
    url = f"{redis_server.url}?wait_replicas=1&wait_timeout_s=2&settle_patience_s=0.1"
    async with (
        open_broker(url, prefix=f"t-{uuid.uuid4().hex[:12]}") as b,
        coredis.Redis("127.0.0.1", redis_server.port, decode_responses=True) as raw,
    ):
        with contextlib.suppress(SubmitOutcomeUnknown):
            await b.submit_many([Job(executor="echo"), Job(executor="echo")])
        lease, other = await b.lease("w1", visibility_s=30, limit=2)
        took: list[float] = []

        async def ack() -> None:
            with pytest.raises(BrokerUnavailable, match="0 of 1 replicas"):
                await b.ack(lease, ok_result(lease, "x"))

        async def blocked_in_wait() -> bool:
            return any(c.get("cmd") == "wait" for c in await raw.client_list())

        async with anyio.create_task_group() as tg:
            tg.start_soon(ack)
            with anyio.fail_after(5):
                while not await blocked_in_wait():  # noqa: ASYNC110 - polled, deadline
                    await anyio.sleep(0.01)
            start = anyio.current_time()
            for _ in range(5):
                assert (await b.heartbeat(other)).ok  # the ack's job is settled already
                assert await b.lease("w2", visibility_s=30) == []
            took.append(anyio.current_time() - start)
            assert await blocked_in_wait(), "the ack still waits for a replica"
        assert took[0] < 1.0, took  # ten calls beside a write waiting 2 s
