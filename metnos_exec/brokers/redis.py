"""The distributed broker: Redis Streams with consumer groups, for workers on many machines.

Selected by ``redis://[:password@]host:port/db`` (``rediss://`` for TLS), a Redis Cluster
by ``redis+cluster://host:port[,host:port...]`` and a primary found through Sentinel by
``redis+sentinel://host:port[,...]/service[/db]`` (`_redis_target`). Query options:
``prefix`` (the key namespace, default ``metnos``; one prefix is one queue),
``poll_interval_s``, ``connect_timeout_s``, ``stream_timeout_s``, ``settle_patience_s``,
``wait_replicas`` and ``wait_timeout_s`` (below), ``sentinel_auth``.
The client is coredis, which runs on anyio: the same code serves asyncio and trio, and
never blocks the event loop.

Layout (every key name is in one place, `KEY_NAMES`: `Keys` builds them for the code, and
they are substituted into ``redis.lua`` for the scripts; the table in ``queue/README.md``
is kept to them by a test). All keys share the prefix's hash
tag (``{metnos}:...``), so on a Redis Cluster a queue lives in one slot (one shard) and
every script may touch all its keys: each script call passes the queue's ``counts`` key
as ``KEYS[1]``, by which the cluster client routes it; every other command names one key.
Several queues (prefixes) spread over the shards; one queue scales as far as one shard.

- ``job:<id>`` (hash): the job's body and its delivery state (the "row" of the SQLite
  broker): ``state``, ``attempt``, ``token``, ``lease_until``, ``worker``, ``entry`` (its
  stream entry id), ``cancel``, ``result``, ``letter``.
- ``q:<device>:<priority>`` (stream, consumer group ``workers``): jobs ready to run for
  one device at one priority; ``prios:<device>`` (sorted set) lists the priorities in use.
  `lease` reads with ``XREADGROUP`` from the highest priority down, so an entry is
  delivered to one consumer and sits in the group's pending-entries list while it runs.
  Settling a job ``XACK`` s and ``XDEL`` s its entry: streams hold only queued and running
  jobs, and an empty stream is deleted with its group.
- ``leases:<device>`` (sorted set, score = lease deadline): the running jobs' leases.
- ``delayed`` (sorted set, score = due time): ``not_before`` and retry backoff; due jobs
  join their stream inside `lease`.
- ``epoch`` (string): the data set's marker, ``lost`` (hash): the data losses found
  (`_redis_watch`).
- ``idem:<key>``: idempotency key → job id. ``finished`` / ``dead`` (sorted sets, score =
  when): for `purge` and `dead_letters`. ``counts`` (hash): jobs per state, for `stats`.
- ``undo:<entry id>`` (hash: the entry, its job, when, ``undone_by``, its blobs),
  ``undos:<job id>`` (set), ``undo-at`` (sorted set), ``undo-blobs`` (hash: digest →
  how many stored entries need it): undo entries stored with the results, fenced by the
  lease like an ack, forgotten with their job by `purge`.
- ``executors`` (hash): name → the executor as a server worker published it (the
  catalog `submit` checks device jobs against, `metnos_exec.devices.catalog`).
- ``wake`` (stream, capped) and ``done:<id>`` (stream, expiring): the wake-ups idle
  workers and waiting clients block on (``XREAD BLOCK``, `_redis_wait`), so neither polls.
- ``inbox`` (stream): the door for producers in other languages (``XADD`` a ``job`` field;
  see ``queue/README.md``). Server workers take entries off it, validate them with the
  same decoder as `submit`, and queue or dead-letter them (``E_BAD_MESSAGE``), once each.

Leases and fencing. Every lease carries a random token stored in the job's hash; every
settle (ack, retry, dead-letter, release) and every heartbeat is a script that first
checks that token, so a worker that lost its lease (taken over, or settled) changes
nothing, exactly as with SQLite. A lapsed lease is taken over inside `lease` with
``XCLAIM`` (the pending entry moves to the new consumer and its delivery count grows),
and the job's ``attempt`` counts deliveries across retries too, so a poison job whose
workers keep dying is dead-lettered with ``E_LEASE_EXPIRED`` after ``max_attempts``.
Heartbeats renew the deadline and reset the pending entry's idle time (``XCLAIM ...
JUSTID`` to the same consumer), so a long job whose worker lives is never taken over.

Why deadlines in a sorted set rather than ``XAUTOCLAIM``'s idle time: a lease has its own
window (``visibility_s`` per lease, and per heartbeat), which one ``min-idle-time`` per
sweep cannot express; and lease decisions use one clock, by default the Redis server's
own ``TIME`` (read inside the scripts), so clock skew between worker machines can never
cut a lease short. Tests inject a virtual clock instead. The takeover itself is what
``XAUTOCLAIM`` does (``XCLAIM`` of each lapsed entry), in the same script as the checks.
No recovery step takes a lock: each is one atomic script, so a worker killed at any
moment leaves nothing that blocks the others.

Redis restarting or failing over. A call that cannot reach Redis raises
`BrokerUnavailable` (``E_BROKER_UNAVAILABLE``) and logs ``broker.error``; the supervisor
then keeps its running jobs and stops leasing until Redis answers. Settling calls (ack,
retry, dead-letter, release) retry with backoff for up to ``settle_patience_s`` first, so
a finished job's result is kept in memory and stored once Redis is back; a retried call
whose first try did reach Redis reports the outcome that try had (the scripts remember
the last settle per token, and the broker remembers which tokens' settles failed with
their outcome unknown), never a false "lease lost". With the append-only file on
(``queue/redis.conf``) nothing acknowledged is lost across a restart. Across a failover
(Sentinel, a cluster shard), replication is asynchronous: with ``wait_replicas=N`` every
durable write (`_redis_client._DURABLE`) is followed by ``WAIT N`` on its connection, and
fewer replicas than that within ``wait_timeout_s`` is an unknown outcome for the caller
(`SubmitOutcomeUnknown`; a settle retries with its replay flag), never a false "done". Without it, a
restart loses everything: a broker that saw the queue before finds its marker gone and
logs ``broker.data_lost`` once, with what it last saw, and records it for ``status`` and
``doctor`` (`_redis_watch`).

Credentials. ``redis://:PASSWORD@host`` (``requirepass``) and ``redis://USER:PASSWORD@host``
(an ACL user; the least one the queue works with is in the README) are passed to Redis at
connect; a refusal (``WRONGPASS``, ``NOAUTH``, ``NOPERM``) is `BrokerAuth`
(``E_BROKER_AUTH``). Messages and logs name the server as ``where``: never the password.

Where the code is: `RedisBroker` (here) joins one class per concept, each on top of the
client (`_redis_client`: the pool, scripts and commands, errors, settling with retries):
the queue (`_redis_queue`: submit, the inbox, lease, heartbeat, settle), the idle waits
(`_redis_wait`: blocking reads on the wake-up streams), control and
inspection (`_redis_inspect`) and the records beside the jobs (`_redis_records`: undo
entries, the catalog, purge); the key names and the scripts are `_redis_keys`; the watch
on the data set is `_redis_watch`.
"""

from __future__ import annotations

from typing import Any

from ._redis_inspect import RedisInspection
from ._redis_keys import GROUP, KEY_NAMES, SCRIPTS, Keys
from ._redis_queue import RedisQueue
from ._redis_records import RedisRecords
from ._url import take_options

__all__ = ("GROUP", "KEY_NAMES", "SCRIPTS", "Keys", "RedisBroker")


class RedisBroker(RedisQueue, RedisInspection, RedisRecords):
    """`Broker` on Redis Streams. Use it as an async context manager (``async with``):
    the connection pool lives in the task that enters it.

    Args:
        url: ``redis://host:port/db`` or ``rediss://...`` (options in the query are
            taken by `from_url`, not here).
        prefix: the queue's key namespace.
        clock: unix-seconds clock for leases and delays (tests inject one); ``None``
            (default) uses the Redis server's ``TIME``, one clock for every worker.
        poll_interval_s: how often an idle wait asks Redis again where it has nothing
            to block on (before a worker's first lease, a result wait for a job Redis
            does not know yet); otherwise idle waits block in Redis (`_redis_wait`).
        connect_timeout_s: how long opening a connection may take.
        stream_timeout_s: how long one reply may take before the call fails (a Redis
            that hangs must not hang the worker).
        settle_patience_s: how long ack / retry / dead-letter / release keep retrying
            while Redis cannot be reached, before they give up with the `BrokerError`. A
            worker keeps the result and tries again itself (with its own backoff, and the
            replay flags still apply), so this only smooths over a blip: a long wait here
            would keep a drained worker from stopping.
        create: ``False`` for readers (``status``, ``doctor``): Redis needs no store to
            be created, and a reader writes nothing, not even the queue's marker
            (``epoch``, `_redis_watch`).
        wait_replicas: replicas a durable write must reach before it is acknowledged
            (``WAIT``; 0, the default: the primary's word is enough).
        wait_timeout_s: how long a durable write waits for them.
        sentinel_auth: give the sentinels the URL's credentials too.
    """

    scheme = "redis"

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisBroker:
        """``redis://host:port/db?prefix=metnos&poll_interval_s=0.05`` (see the class)."""
        kwargs = take_options(
            "redis",
            options,
            floats=(
                "poll_interval_s",
                "connect_timeout_s",
                "stream_timeout_s",
                "settle_patience_s",
                "wait_timeout_s",
            ),
            strings=("prefix",),
            flags=("create", "sentinel_auth"),
            objects=("clock",),
            counts=("wait_replicas",),
        )
        return cls(url, **kwargs)
