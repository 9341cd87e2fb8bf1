"""The Redis broker's client: the connection pool, running a script (`RedisStore._script`,
`RedisStore._evalsha`) or a command (`RedisStore._guard`) with Redis's failures said as
`BrokerError` subclasses, and settling with retries while Redis cannot be reached
(`RedisStore._settle`). The operations (`metnos_exec.brokers._redis_queue` and its
siblings) are written on top of it; `metnos_exec.brokers.redis` says how the whole works.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, Self

import anyio
import coredis
import coredis.exceptions
import coredis.retry

from ..errors import (
    BadMessage,
    BrokerAuth,
    BrokerBusy,
    BrokerCorrupt,
    BrokerError,
    BrokerFull,
    BrokerReadOnly,
    BrokerUnavailable,
)
from ..logs import get_logger
from ..messages import SERVER_DEVICE, ErrorInfo, Result, decode_result, encode
from ._common import PolledWaits, dead_records
from ._redis_keys import SCRIPTS, Keys
from ._redis_target import parse_target
from ._redis_watch import DataWatch
from .base import Lease

__all__ = (
    "BATCH",
    "RedisStore",
    "as_str",
    "closing_buffers",
    "error_fields",
    "inbox_text",
    "stored_result",
)

_log = get_logger()

#: Jobs per script call for batches (submit_many, ack_many, cancel polls, inbox).
BATCH: Final = 200

#: Errors that mean "Redis cannot be reached right now" (down, restarting, loading its
#: data, a dropped or timed-out connection), as opposed to a bug or a refused command.
_UNREACHABLE: Final = (coredis.exceptions.ConnectionError, TimeoutError, OSError)

#: Replies by which a reachable Redis refuses writes for a while, by their first word:
#: ``OOM`` (maxmemory reached under ``noeviction``: a queue must not evict), ``READONLY``
#: (a replica, e.g. just after a failover), ``NOREPLICAS`` (``min-replicas-to-write`` not
#: met), ``MASTERDOWN``, ``CLUSTERDOWN`` (a cluster without a primary for a slot),
#: ``BUSY`` (a script running too long elsewhere), ``LOADING``, ``TRYAGAIN``; and the
#: `BrokerError` each one is (the rest: `BrokerUnavailable`).
#: Replies by which Redis refuses this client (``WRONGPASS``, ``NOAUTH``, ``NOPERM``).
_REFUSED_CLIENT: Final = (
    coredis.exceptions.AuthenticationError,
    coredis.exceptions.AuthorizationError,
)

#: What Redis says of a command in a script that the user's ACL forbids (no NOPERM code).
_SCRIPT_DENIED: Final = "The user executing the script can't"

_REFUSING: Final = (
    "OOM",
    "READONLY",
    "NOREPLICAS",
    "MASTERDOWN",
    "BUSY",
    "LOADING",
    "TRYAGAIN",
    "CLUSTERDOWN",
)
_REFUSAL_ERRORS: Final[dict[str, type[BrokerError]]] = {
    "OOM": BrokerFull,
    "READONLY": BrokerReadOnly,
    # ``min-replicas-to-write`` not met (a primary cut off from its replicas).
    "NOREPLICAS": BrokerReadOnly,
    "BUSY": BrokerBusy,
}


#: The scripts whose writes a caller is told are done (a receipt, a settle, a cancel, an
#: undo entry): with ``wait_replicas`` they wait for replicas (`RedisStore._evalsha`).
#: A lease or a heartbeat does not: a lease lost in a failover is leased again.
_DURABLE: Final = frozenset(
    (
        "submit",
        "admit_inbox",
        "ack",
        "retry",
        "dead_letter",
        "release",
        "cancel",
        "record_undo",
        "settle_gate",
    )
)


#: The longest one blocked read lasts (`_redis_wait`).
_BLOCK_CAP_S: Final = 1.0


def stored_result(job_id: str, body: bytes, where: str) -> Result:
    """A result as Redis stores it, decoded (`BrokerCorrupt` when it cannot be)."""
    try:
        return decode_result(body)
    except BadMessage as exc:
        raise BrokerCorrupt(
            f"the stored result of job {job_id} in {where} cannot be read: {exc.message}"
        ) from None


#: How many keys one call may find to set aside before it gives up (each is set aside,
#: logged and the call made again; more than this many at once is no producer's slip).
_MAX_SET_ASIDE: Final = 16


class _BadKey(Exception):
    """A script's guard found a key of the wrong kind before it changed anything
    (``METNOS_BADKEY|<problem>|<key>|``, redis.lua's prelude)."""

    def __init__(self, text: str) -> None:
        _tag, problem, key, *_rest = text.split("|")
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


def _before_sending(exc: BaseException) -> bool:
    """The failure happened before a request could reach Redis (no connection was made)."""
    if isinstance(exc, ConnectionRefusedError):
        return True
    text = str(exc).lower()
    return any(
        words in text for words in ("connecting", "connection refused", "unable to establish")
    )


def closing_buffers(cls: type[Any], connected: Callable[[], None]) -> type[Any]:
    """`cls` (a coredis connection class) whose failed connect closes its buffers, and
    whose connect made calls `connected` (the watch on the data set looks again).

    coredis 6.9 creates six in-memory streams per connection and closes them only once
    connected: each failed attempt (Redis down) leaves them to the garbage collector,
    which warns (``ResourceWarning: Unclosed <MemoryObjectSendStream>``) for every retry
    of a worker waiting for Redis to come back.
    """

    class Connection(cls):  # type: ignore[misc]
        async def _connect(self) -> Any:
            try:
                out = await super()._connect()
            except BaseException:
                for stream in (
                    self._write_buffer_in,
                    self._write_buffer_out,
                    self._push_message_buffer_in,
                    self._push_message_buffer_out,
                    self._streamed_message_buffer_in,
                    self._streamed_message_buffer_out,
                ):
                    stream.close()
                raise
            connected()
            return out

    Connection.__name__ = Connection.__qualname__ = f"Closing{cls.__name__}"
    return Connection


def as_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def inbox_text(value: bytes | str) -> str:
    """What a producer wrote (an inbox entry's field name or id), as text: bytes that are
    not UTF-8 are replaced, as the SQLite inbox reads a bad id, never an exception."""
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


def error_fields(error: ErrorInfo) -> dict[str, str]:
    return {"code": error.code, "message": error.message}


class RedisStore(PolledWaits):
    """The client of one queue on one Redis server (see the module docstring);
    `RedisBroker` documents the arguments."""

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "metnos",
        clock: Callable[[], float] | None = None,
        poll_interval_s: float = 0.05,
        connect_timeout_s: float = 5.0,
        stream_timeout_s: float = 10.0,
        settle_patience_s: float = 5.0,
        create: bool = True,
        wait_replicas: int = 0,
        wait_timeout_s: float = 1.0,
        sentinel_auth: bool = False,
    ) -> None:
        target = parse_target(url, sentinel_auth=sentinel_auth)
        self.target = target
        self.keys = Keys(prefix)
        self._clock = clock
        self._poll = poll_interval_s
        self._patience = settle_patience_s
        # For messages and logs: never the password.
        self._user = target.username or ""
        self.where = target.where
        self._queue_id = target.queue_id(prefix)
        self._connect_timeout = connect_timeout_s
        self._cluster = target.kind == "cluster"
        self._sentinel = target.kind == "sentinel"
        #: Replicas a durable write waits for (`WAIT`), and for how long (ms).
        self._wait = (wait_replicas, max(1, round(wait_timeout_s * 1000)))
        self._redis, self._enter = target.client(
            connect_timeout=connect_timeout_s,
            stream_timeout=stream_timeout_s,
            connected=lambda cls: closing_buffers(cls, lambda: self._watch.connected()),
        )
        self._watch = DataWatch(
            self._redis,
            marker=self.keys.epoch,
            lost=self.keys.lost,
            where=self.where,
            prefix=prefix,
            create=create,
            stats=lambda: self._evalsha("stats", self.keys.base, self._now_arg()),
            info=self._server_info,
        )
        self._scripts = {name: self._redis.register_script(src) for name, src in SCRIPTS.items()}
        self._shas = {name: script.sha for name, script in self._scripts.items()}
        self._conn: Any = None
        #: Durable writes with ``wait_replicas`` on one server or through Sentinel go
        #: through a client of their own: ``WAIT`` holds the connection it is sent on
        #: (up to ``wait_timeout_s`` while no replica answers), and leases, heartbeats
        #: and reads multiplexed on the shared one must not queue behind it. A cluster
        #: client holds a connection per waiting command by itself.
        self._writer: Any = self._redis
        self._wconn: Any = None
        if wait_replicas and not self._cluster:
            self._writer = self._client_of_its_own(connect_timeout_s, stream_timeout_s)
        #: Blocked reads (`_redis_wait`) hold their connection until Redis answers, so
        #: on one server or through Sentinel they get a client of their own (a cluster
        #: client holds a connection per blocking command by itself), whose reply timeout
        #: covers the longest block.
        self._blocker: Any = (
            self._redis
            if self._cluster
            else self._client_of_its_own(
                connect_timeout_s, stream_timeout_s + _BLOCK_CAP_S, watched=False
            )
        )
        #: Where the next idle wait starts (set by each lease, `_redis_wait.WorkCursor`).
        self._work_cursor: Any = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._open = False
        self._closed = False
        self._failing_since: float | None = None
        #: Lease tokens whose last settle failed with its outcome unknown (see `_settle`).
        self._unsure: set[str] = set()
        self._wake_key = f"{self._queue_id}/{self.keys.base}"

    def _client_of_its_own(self, connect_s: float, reply_s: float, *, watched: bool = True) -> Any:
        """Another client of the same deployment, entered with the broker (`watched`: its
        new connections make the data watch look again)."""
        hook = self._watch.connected if watched else (lambda: None)
        client, parts = self.target.client(
            connect_timeout=connect_s,
            stream_timeout=reply_s,
            connected=lambda cls: closing_buffers(cls, hook),
        )
        self._enter = [*self._enter, *parts]
        return client

    @property
    def queue_id(self) -> str:
        return self._queue_id

    async def __aenter__(self) -> Self:
        if self._closed:
            raise BrokerUnavailable(f"the broker on {self.where} is closed")
        if not self._open:
            stack = contextlib.AsyncExitStack()
            # Connections are made on first use, so a worker starts (and says so in its
            # logs) while Redis is still down.
            try:
                for part in self._enter:
                    await stack.enter_async_context(part)
            except (coredis.exceptions.RedisError, *_UNREACHABLE) as exc:
                # A cluster client learns the layout when it opens: no node reachable
                # now is "Redis unavailable", not a crash (one server or Sentinel connect
                # on first use and never fail here).
                await stack.aclose()
                raise BrokerUnavailable(
                    f"cannot reach Redis at {self.where}: {type(exc).__name__}: {exc}"
                ) from None
            self._stack = stack
            self._open = True
        return self

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._stack is not None:
            stack, self._stack = self._stack, None
            # Not under a shield scope of ours: the client's task group was entered
            # before it, and scopes must be left in the order they were entered.
            await stack.aclose()

    # --- plumbing ---------------------------------------------------------------------

    def _usable(self) -> bool:
        """Whether the next call has a connection (a cluster client's are its own: the
        watch learns of new ones from the connect hook alone)."""
        conn = self._conn
        return self._cluster or (conn is not None and conn.usable)

    async def _server_info(self) -> dict[str, Any]:
        """``INFO server`` of the server holding the queue (a cluster's node for its
        slot: any other node's run id says nothing of the queue's data)."""
        async with self.target.queue_node(
            self._redis, self.keys.counts, connect_timeout=self._connect_timeout
        ) as node:
            info: dict[str, Any] = await node.info("server")
            return info

    def _now_arg(self) -> str:
        return "" if self._clock is None else repr(float(self._clock()))

    def _wall(self) -> float:
        """Time for records (results, dead letters); leases use the scripts' clock."""
        return self._clock() if self._clock is not None else time.time()

    def _check_open(self) -> None:
        if self._closed:
            raise BrokerUnavailable(f"the broker on {self.where} is closed")
        if not self._open:
            raise BrokerUnavailable(
                f"the Redis broker on {self.where} is not open: use `async with broker:`"
            )

    async def _guard(self, call: Any) -> Any:
        """Await a client call, turning "cannot reach Redis" into `BrokerUnavailable`."""
        self._check_open()
        try:
            out = await call
        except _UNREACHABLE as exc:
            self._failed(exc)
            error = BrokerUnavailable(
                f"cannot reach Redis at {self.where}: {type(exc).__name__}: {exc}"
            )
            # Whether the call may have been carried out: anything but a refused or
            # failed connect (a timeout waiting for the reply, a connection dropped
            # mid-call) may have reached Redis (`submit` says so: `SubmitOutcomeUnknown`).
            error.maybe_done = not _before_sending(exc)  # type: ignore[attr-defined]
            raise error from None
        except _REFUSED_CLIENT as exc:
            self._failed(exc)
            raise self._auth_error(exc) from None
        except coredis.exceptions.ResponseError as exc:
            text = str(exc)
            if text.startswith("METNOS_BADKEY|"):
                raise _BadKey(text) from None
            if _SCRIPT_DENIED in text:  # a command of a script the ACL forbids
                self._failed(exc)
                raise self._auth_error(exc) from None
            if not text.startswith(_REFUSING):
                # A refused command, or a failed script: a bug of ours or a damaged key,
                # said as a store error rather than the client library's exception.
                raise BrokerUnavailable(f"Redis at {self.where} refused a call: {text}") from None
            self._failed(exc)
            if self._sentinel and text.startswith("READONLY"):
                # A connection to a primary demoted by a failover: the next one is made
                # to the primary the sentinels name now.
                self._redis.connection_pool.disconnect()
                self._writer.connection_pool.disconnect()
                self._conn = self._wconn = None
            kind = _REFUSAL_ERRORS.get(text.split(" ", 1)[0], BrokerUnavailable)
            raise kind(f"Redis at {self.where} refuses writes: {text}") from None
        if self._failing_since is not None:
            _log.debug(
                "broker.recovered",
                broker=self.where,
                down_s=round(time.monotonic() - self._failing_since, 3),
            )
            self._failing_since = None
        return out

    def _auth_error(self, exc: BaseException) -> BrokerAuth:
        """`BrokerAuth` for a refused client, naming the user (never the password)."""
        who = f"user {self._user!r}" if self._user else "the default user"
        text = str(exc).rstrip(".")
        if isinstance(exc, coredis.exceptions.AuthorizationError) or _SCRIPT_DENIED in text:
            return BrokerAuth(
                f"Redis at {self.where} does not allow {who} a command or key the queue "
                f"needs: {text}; the ACL it needs is in the README (Redis)"
            )
        if isinstance(exc, coredis.exceptions.AuthenticationRequiredError):
            return BrokerAuth(
                f"Redis at {self.where} needs a password and the broker URL gives none: "
                "redis://:PASSWORD@host:port/db, or redis://USER:PASSWORD@host:port/db"
            )
        return BrokerAuth(
            f"Redis at {self.where} refused the credentials of {who} ({text}): check the "
            "user and password in the broker URL (redis://USER:PASSWORD@host:port/db)"
        )

    def _failed(self, exc: BaseException) -> None:
        # At debug level: the call's caller gets the error, and a worker says it once
        # per outage with reminders (`supervisor.outage`); an error record here too made
        # every failure two records.
        if self._failing_since is None:
            self._failing_since = time.monotonic()
        _log.debug("broker.error", broker=self.where, error=f"{type(exc).__name__}: {exc}")

    async def _script(self, name: str, *args: str | bytes) -> Any:
        """Run the script `name`; a key its guard finds of the wrong kind (a producer
        wrote it by hand) is set aside (`_set_aside`) and the script run again: the guard
        stops a script before it changes anything, so nothing is done twice and no job
        loses an attempt to it."""
        self._check_open()
        if self._watch.due(self._usable()):
            # Before the call: a loss is said before anything is done on the new data set.
            await self._watch.look(self._wall())
        for _ in range(_MAX_SET_ASIDE):
            self._check_open()  # before the coroutine exists: a closed broker makes none
            try:
                return await self._guard(
                    self._evalsha(name, self.keys.base, self._now_arg(), *args)
                )
            except _BadKey as bad:
                await self._set_aside(bad)
        raise BrokerUnavailable(
            f"Redis at {self.where}: more than {_MAX_SET_ASIDE} keys of the queue had to be "
            "set aside for one call; the queue's keys were written by something else"
        )

    async def _set_aside(self, bad: _BadKey) -> None:
        """Set `bad`'s key aside (redis.lua's ``set_aside``: a key of another type renamed
        to ``aside:<name>:<time>``, a counter or priority that is not a number copied
        there and repaired) and say so, once per key set aside."""
        kept = as_str(
            await self._guard(
                self._evalsha("set_aside", self.keys.base, self._now_arg(), bad.key, bad.problem)
            )
        )
        if kept:
            _log.warning(
                "broker.key_set_aside",
                broker=self.where,
                key=bad.key,
                problem=bad.problem,
                kept_as=kept,
                reason="a key of the queue held what the queue does not write (a producer "
                "writing Redis by hand?); set aside with its content, the queue goes on",
            )

    async def _evalsha(self, name: str, *args: str | bytes) -> Any:
        """Run the script `name` (``KEYS[1]`` = the counts hash: a cluster client routes
        the call by it, to the shard holding the queue's slot).

        On one server or through Sentinel, below coredis's command layer: the request
        goes straight onto a connection the pool made (and still owns, so it is shared as
        the client shares it: requests multiplex on it), with no command object, retry
        policy, telemetry span or response callback on the way. Measured on the 2-core
        VM: 145 -> 70 µs of client CPU per call. The connection is the one coredis would
        have picked (the pool hands out and takes back one connection per call; none of
        ours block), and a dead one is replaced by the pool's own connect, errors and
        timeouts as before. A script Redis no longer has (a restart, a promoted replica)
        is sent again with its source (`_via_client`). A durable write
        (`_DURABLE`) with ``wait_replicas`` waits for them (`_replicated`).
        """
        wait = self._wait[0] > 0 and name in _DURABLE
        if self._cluster:
            return await self._via_client(name, args, wait)
        client = self._writer if wait else self._redis
        conn = self._wconn if wait else self._conn
        if conn is None or not conn.usable:
            async with client.connection_pool.acquire() as conn:
                pass
            if wait:
                self._wconn = conn
            else:
                self._conn = conn
        try:
            request = conn.create_request(
                b"EVALSHA", self._shas[name], 1, self.keys.counts, *args, decode=False
            )
            # Sent right after the script on the same connection: one round trip more
            # only in replication time, and it waits for exactly this write.
            waited = conn.create_request(b"WAIT", *self._wait, decode=False) if wait else None
            out = await request
        except coredis.exceptions.NoScriptError:
            return await self._via_client(name, args, wait)
        if waited is not None:
            self._replicated(name, int(await waited))
        return out

    async def _via_client(self, name: str, args: tuple[str | bytes, ...], wait: bool) -> Any:
        """`_evalsha` through coredis's command layer: on a cluster (routed by the key),
        and for a script the server does not have (a restart, a promoted replica). Then,
        on one server or through Sentinel, ``SCRIPT LOAD`` (outside the wait: a ``WAIT``
        failing after the load must not leave the script unrun) and ``EVALSHA`` again;
        on a cluster, ``EVAL`` with the source, routed by the key like ``EVALSHA`` (a
        cluster client's ``SCRIPT LOAD`` goes to the nodes it believes primaries, which
        just after a failover is not the one the ``MOVED`` names), which caches the
        script there for the next ``EVALSHA``."""
        keys = [self.keys.counts]
        client = self._writer if wait else self._redis

        async def run(source: str | None) -> Any:
            with client.ensure_replication(*self._wait) if wait else contextlib.nullcontext():
                try:
                    if source is None:
                        return await client.evalsha(self._shas[name], keys=keys, args=args)
                    return await client.eval(source, keys=keys, args=args)
                except coredis.exceptions.ReplicationError:
                    self._replicated(name, 0)

        try:
            return await run(None)
        except coredis.exceptions.NoScriptError:
            if self._cluster:
                return await run(SCRIPTS[name])
            await client.script_load(SCRIPTS[name])
            return await run(None)

    def _replicated(self, name: str, replicas: int) -> None:
        """A durable write reached fewer replicas than ``wait_replicas`` in time: it is
        done on the primary, but a failover now could lose it, so the caller hears that
        its outcome is unknown (`submit`: `SubmitOutcomeUnknown`; a settle retries, its
        replay flag making the retry harmless)."""
        if replicas >= self._wait[0]:
            return
        error = BrokerUnavailable(
            f"Redis at {self.where}: the {name} was written on the primary but reached "
            f"{replicas} of {self._wait[0]} replicas within {self._wait[1]} ms "
            "(wait_replicas): a failover could still lose it"
        )
        error.maybe_done = True  # type: ignore[attr-defined]
        raise error

    async def _settle(self, name: str, tokens: Sequence[str], *args: str | bytes) -> Any:
        """Run a settle script for the leases `tokens`, retrying with backoff while Redis
        cannot be reached (up to ``settle_patience_s``).

        A call that failed may still have been carried out (its reply lost with the
        connection): its tokens are remembered, and every later settle of them (this
        loop's resends, or the caller's own retry) carries the replay flag, so the script
        answers with the outcome the first try had rather than "lease lost".
        """
        delay = 0.05
        deadline: float | None = None
        while True:
            flags = "".join("1" if t in self._unsure else "0" for t in tokens)
            try:
                out = await self._script(name, flags, *args)
            except BrokerError as exc:
                if not exc.retry:
                    raise
                self._unsure.update(tokens)
                if self._closed:
                    raise
                now = anyio.current_time()
                if deadline is None:
                    deadline = now + self._patience
                if now >= deadline:
                    raise
                await anyio.sleep(min(delay, deadline - now))
                delay = min(delay * 2, 2.0)
            else:
                self._unsure.difference_update(tokens)
                return out

    def _dead_records(
        self, lease: Lease | None, job_id: str, error: ErrorInfo, **fields: Any
    ) -> tuple[bytes, bytes]:
        """The ``dead`` result and the dead letter of a job, encoded."""
        result, letter = dead_records(
            job_id=job_id,
            attempt=fields.pop("attempt", lease.attempt if lease else 0),
            worker=fields.pop("worker", lease.worker if lease else ""),
            device=fields.pop("device", lease.device if lease else SERVER_DEVICE),
            raw=fields.pop("raw", None),
            job=fields.pop("job", lease.job if lease else None),
            error=error,
            now=self._wall(),
        )
        return encode(result), encode(letter)

    # --- producing --------------------------------------------------------------------
