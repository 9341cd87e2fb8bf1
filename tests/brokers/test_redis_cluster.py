"""The Redis broker on a Redis Cluster (issue 18, item 12): the whole broker contract on
a private three-primary cluster, queues spread over its shards, server commands asked of
the node holding the queue, and a failover of that node's shard."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import coredis
import pytest

from metnos_exec.brokers import Broker
from metnos_exec.brokers.redis import RedisBroker
from tests.helpers.redis_cluster import LocalCluster

from . import test_redis


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
