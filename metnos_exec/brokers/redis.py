"""The distributed broker: Redis Streams with consumer groups, for workers on many machines.

Selected by ``redis://[:password@]host:port/db`` (``rediss://`` for TLS). Query options:
``prefix`` (the key namespace, default ``metnos``; one prefix is one queue),
``poll_interval_s``, ``connect_timeout_s``, ``stream_timeout_s``, ``settle_patience_s``.
The client is coredis, which runs on anyio: the same code serves asyncio and trio, and
never blocks the event loop.

Layout (every key name is in one place, `KEY_NAMES`: `Keys` builds them for the code, and
they are substituted into ``redis.lua`` for the scripts; the table in ``queue/README.md``
is kept to them by a test). All keys share the prefix's hash
tag (``{metnos}:...``), so on a Redis Cluster a queue would live in one slot and every
script may touch all its keys; connecting to a Cluster or through Sentinel (coredis has
both clients) is not wired to a URL yet: a ``redis://`` URL names one server.

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
- ``idem:<key>``: idempotency key → job id. ``finished`` / ``dead`` (sorted sets, score =
  when): for `purge` and `dead_letters`. ``counts`` (hash): jobs per state, for `stats`.
- ``undo:<entry id>`` (hash: the entry, its job, when, ``undone_by``, its blobs),
  ``undos:<job id>`` (set), ``undo-at`` (sorted set), ``undo-blobs`` (hash: digest →
  how many stored entries need it): undo entries stored with the results, fenced by the
  lease like an ack, forgotten with their job by `purge`.
- ``executors`` (hash): name → the executor as a server worker published it (the
  catalog `submit` checks device jobs against, `metnos_exec.devices.catalog`).
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
(``queue/redis.conf``) nothing acknowledged is lost across a restart.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

import anyio
import anyio.lowlevel
import coredis
import coredis.exceptions
import coredis.retry
import structlog

from ..devices.catalog import ExecutorInfo, decode_info, encode_info
from ..errors import (
    BadMessage,
    BrokerBusy,
    BrokerCorrupt,
    BrokerError,
    BrokerFull,
    BrokerReadOnly,
    BrokerUnavailable,
    IdempotencyConflict,
)
from ..messages import (
    E_CANCELLED,
    E_LEASE_EXPIRED,
    MAX_JOB_BYTES,
    SERVER_DEVICE,
    DeadLetter,
    ErrorInfo,
    Job,
    Result,
    UndoEntry,
    check_job_size,
    decode_dead_letter,
    decode_job,
    decode_result,
    decode_undo_entry,
    encode,
    encode_job,
    new_job_id,
)

# Shared with the SQLite broker: the body and argument checks, and the in-process
# wake-ups (per event loop, keyed by store).
from ._common import check_lease_args as _check_lease_args
from ._common import decode_body
from ._common import notify as _notify
from ._common import wake_event as _wake_event
from ._url import take_options
from .base import (
    MAX_UNSTARTED_LAPSES,
    Broker,
    BrokerStats,
    CancelOutcome,
    HeartbeatReply,
    JobState,
    Lease,
    PurgeReport,
    RetryOutcome,
    SubmitReceipt,
    UndoRecord,
    check_idempotent_reuse,
)

__all__ = ("GROUP", "KEY_NAMES", "SCRIPTS", "Keys", "RedisBroker")

_log = structlog.get_logger("metnos_exec")

#: The consumer group every job stream has; workers are its consumers (by worker id).
GROUP: Final = "workers"

#: Jobs per script call for batches (submit_many, ack_many, cancel polls, inbox).
_BATCH: Final = 200

#: Errors that mean "Redis cannot be reached right now" (down, restarting, loading its
#: data, a dropped or timed-out connection), as opposed to a bug or a refused command.
_UNREACHABLE: Final = (coredis.exceptions.ConnectionError, TimeoutError, OSError)

#: Replies by which a reachable Redis refuses writes for a while, by their first word:
#: ``OOM`` (maxmemory reached under ``noeviction``: a queue must not evict), ``READONLY``
#: (a replica, e.g. just after a failover), ``MASTERDOWN``, ``BUSY`` (a script running too
#: long elsewhere), ``LOADING``, ``TRYAGAIN``; and the `BrokerError` each one is (the
#: rest: `BrokerUnavailable`).
_REFUSING: Final = ("OOM", "READONLY", "MASTERDOWN", "BUSY", "LOADING", "TRYAGAIN")
_REFUSAL_ERRORS: Final[dict[str, type[BrokerError]]] = {
    "OOM": BrokerFull,
    "READONLY": BrokerReadOnly,
    "BUSY": BrokerBusy,
}


#: Every Redis key name, in one place: what follows the queue's prefix (``{metnos}:``).
#: Names ending in ``:`` take a part (a job id, a device, ...). `Keys` builds them for the
#: code; `SCRIPTS` gets them substituted into ``redis.lua`` (``$job``, ``$stream``, ...).
KEY_NAMES: Final = {
    "job": "job:",  # job:<id> hash
    "stream": "q:",  # q:<device>:<priority> stream
    "priorities": "prios:",  # prios:<device> sorted set
    "leases": "leases:",  # leases:<device> sorted set
    "idempotency": "idem:",  # idem:<key> string
    "delayed": "delayed",
    "finished": "finished",
    "dead": "dead",
    "counts": "counts",
    "inbox": "inbox",
    "executors": "executors",
    "undo": "undo:",  # undo:<entry id> hash
    "job_undos": "undos:",  # undos:<job id> set
    "undo_at": "undo-at",
    "blobs": "undo-blobs",
    "group": GROUP,  # not a key: the consumer group of every stream
}


def _load_scripts() -> dict[str, str]:
    text = resources.files(__package__).joinpath("redis.lua").read_text(encoding="utf-8")
    text = re.sub(r"\$(\w+)", lambda m: KEY_NAMES[m.group(1)], text)
    parts = re.split(r"^-- == (\w+) ==\n", text, flags=re.MULTILINE)
    sections = dict(zip(parts[1::2], parts[2::2], strict=True))
    prelude = sections.pop("prelude")
    return {name: prelude + body for name, body in sections.items()}


#: Script name → source (the prelude and the section), from ``redis.lua``.
SCRIPTS: Final = _load_scripts()


class Keys:
    """Every key of one queue (`KEY_NAMES` after the prefix).

    Args:
        prefix: the namespace; wrapped in a hash tag, so ``metnos`` gives ``{metnos}:``.
    """

    def __init__(self, prefix: str) -> None:
        if not prefix or any(c in prefix for c in "{}"):
            raise ValueError(f"a key prefix is a non-empty name without braces, got {prefix!r}")
        #: What every key starts with (the scripts' ``P``).
        self.base = "{" + prefix + "}:"
        self.counts = self.base + KEY_NAMES["counts"]
        self.delayed = self.base + KEY_NAMES["delayed"]
        self.finished = self.base + KEY_NAMES["finished"]
        self.dead = self.base + KEY_NAMES["dead"]
        self.inbox = self.base + KEY_NAMES["inbox"]
        self.executors = self.base + KEY_NAMES["executors"]
        self.blobs = self.base + KEY_NAMES["blobs"]

    def job(self, job_id: str) -> str:
        return self.base + KEY_NAMES["job"] + job_id

    def stream(self, device: str, priority: int) -> str:
        return f"{self.base}{KEY_NAMES['stream']}{device}:{priority}"

    def priorities(self, device: str) -> str:
        return self.base + KEY_NAMES["priorities"] + device

    def leases(self, device: str) -> str:
        return self.base + KEY_NAMES["leases"] + device

    def idempotency(self, key: str) -> str:
        return self.base + KEY_NAMES["idempotency"] + key


def _closing_buffers(cls: type[Any]) -> type[Any]:
    """`cls` (a coredis connection class) whose failed connect closes its buffers.

    coredis 6.9 creates six in-memory streams per connection and closes them only once
    connected: each failed attempt (Redis down) leaves them to the garbage collector,
    which warns (``ResourceWarning: Unclosed <MemoryObjectSendStream>``) for every retry
    of a worker waiting for Redis to come back.
    """

    class Connection(cls):  # type: ignore[misc]
        async def _connect(self) -> Any:
            try:
                return await super()._connect()
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

    Connection.__name__ = Connection.__qualname__ = f"Closing{cls.__name__}"
    return Connection


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _text(value: bytes | str) -> str:
    """What a producer wrote (an inbox entry's field name or id), as text: bytes that are
    not UTF-8 are replaced, as the SQLite inbox reads a bad id, never an exception."""
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


class RedisBroker(Broker):
    """`Broker` on Redis Streams. Use it as an async context manager (``async with``):
    the connection pool lives in the task that enters it.

    Args:
        url: ``redis://host:port/db`` or ``rediss://...`` (options in the query are
            taken by `from_url`, not here).
        prefix: the queue's key namespace.
        clock: unix-seconds clock for leases and delays (tests inject one); ``None``
            (default) uses the Redis server's ``TIME``, one clock for every worker.
        poll_interval_s: how often idle waits ask Redis again (other processes cannot
            wake us; a submit through this object in this event loop does at once).
        connect_timeout_s: how long opening a connection may take.
        stream_timeout_s: how long one reply may take before the call fails (a Redis
            that hangs must not hang the worker).
        settle_patience_s: how long ack / retry / dead-letter / release keep retrying
            while Redis cannot be reached, before they give up with the `BrokerError`. A
            worker keeps the result and tries again itself (with its own backoff, and the
            replay flags still apply), so this only smooths over a blip: a long wait here
            would keep a drained worker from stopping.
        create: accepted for the URL contract (readers pass ``False``); Redis needs no
            store to be created, so it changes nothing.
    """

    scheme = "redis"

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
    ) -> None:
        del create
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError(f"expected redis://host:port/db or rediss://..., got {url!r}")
        self.keys = Keys(prefix)
        self._clock = clock
        self._poll = poll_interval_s
        self._patience = settle_patience_s
        # For messages and logs: never the password.
        self.where = f"{parts.scheme}://{parts.hostname or 'localhost'}:{parts.port or 6379}"
        db = parts.path.strip("/") or "0"
        self._queue_id = f"redis://{(parts.hostname or 'localhost').lower()}:{parts.port or 6379}"
        self._queue_id += f"/{db}?prefix={prefix}"
        self._redis: coredis.Redis[bytes] = coredis.Redis.from_url(
            urlunsplit(parts._replace(query="")),
            decode_responses=False,
            connect_timeout=connect_timeout_s,
            stream_timeout=stream_timeout_s,
            # Our own retries (below) know which calls may be resent and how; the
            # client's would resend a lease whose reply was lost, for instance.
            retry_policy=coredis.retry.NoRetryPolicy(),
        )
        pool = self._redis.connection_pool
        pool.connection_class = _closing_buffers(pool.connection_class)
        self._scripts = {name: self._redis.register_script(src) for name, src in SCRIPTS.items()}
        self._shas = {name: script.sha for name, script in self._scripts.items()}
        self._conn: Any = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._open = False
        self._closed = False
        self._failing_since: float | None = None
        #: Lease tokens whose last settle failed with its outcome unknown (see `_settle`).
        self._unsure: set[str] = set()
        self._wake_key = f"{self.where}/{parts.path}/{self.keys.base}"

    @property
    def queue_id(self) -> str:
        return self._queue_id

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
            ),
            strings=("prefix",),
            flags=("create",),
            objects=("clock",),
        )
        return cls(url, **kwargs)

    async def __aenter__(self) -> RedisBroker:
        if self._closed:
            raise BrokerUnavailable(f"the broker on {self.where} is closed")
        if not self._open:
            stack = contextlib.AsyncExitStack()
            # Connections are made on first use, so a worker starts (and says so in its
            # logs) while Redis is still down.
            await stack.enter_async_context(self._redis)
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
            raise BrokerUnavailable(
                f"cannot reach Redis at {self.where}: {type(exc).__name__}: {exc}"
            ) from None
        except coredis.exceptions.ResponseError as exc:
            text = str(exc)
            if not text.startswith(_REFUSING):
                # A refused command, or a failed script: a bug of ours or a damaged key,
                # said as a store error rather than the client library's exception.
                raise BrokerUnavailable(f"Redis at {self.where} refused a call: {text}") from None
            self._failed(exc)
            kind = _REFUSAL_ERRORS.get(text.split(" ", 1)[0], BrokerUnavailable)
            raise kind(f"Redis at {self.where} refuses writes: {text}") from None
        if self._failing_since is not None:
            _log.info(
                "broker.recovered",
                broker=self.where,
                down_s=round(time.monotonic() - self._failing_since, 3),
            )
            self._failing_since = None
        return out

    def _failed(self, exc: BaseException) -> None:
        if self._failing_since is None:
            self._failing_since = time.monotonic()
        _log.error("broker.error", broker=self.where, error=f"{type(exc).__name__}: {exc}")

    async def _script(self, name: str, *args: str | bytes) -> Any:
        self._check_open()  # before the coroutine exists: a closed broker never makes one
        return await self._guard(self._evalsha(name, self.keys.base, self._now_arg(), *args))

    async def _evalsha(self, name: str, *args: str | bytes) -> Any:
        """Run the script `name` (``KEYS[1]`` = the counts hash) on a connection of the pool.

        Below coredis's command layer: the request goes straight onto a connection the
        pool made (and still owns, so it is shared as the client shares it: requests
        multiplex on it), with no command object, retry policy, telemetry span or
        response callback on the way. Measured on the 2-core VM: 145 -> 70 µs of client
        CPU per call. The connection is the one coredis would have picked (the pool
        hands out and takes back one connection per call; none of ours block), and a
        dead one is replaced by the pool's own connect, errors and timeouts as before.
        A script Redis no longer has (a restart) goes through the registered `Script`,
        which loads it and runs it again.
        """
        conn = self._conn
        if conn is None or not conn.usable:
            async with self._redis.connection_pool.acquire() as conn:
                pass
            self._conn = conn
        try:
            return await conn.create_request(
                b"EVALSHA", self._shas[name], 1, self.keys.counts, *args, decode=False
            )
        except coredis.exceptions.NoScriptError:
            return await self._scripts[name](keys=[self.keys.counts], args=args)

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

    def _wake_workers(self) -> None:
        _notify(self._wake_key, "work")

    def _wake_results(self) -> None:
        _notify(self._wake_key, "result")

    def _dead_records(
        self, lease: Lease | None, job_id: str, error: ErrorInfo, **fields: Any
    ) -> tuple[bytes, bytes]:
        """The ``dead`` result and the dead letter of a job, encoded."""
        now = self._wall()
        attempt = fields.pop("attempt", lease.attempt if lease else 0)
        worker = fields.pop("worker", lease.worker if lease else "")
        device = fields.pop("device", lease.device if lease else SERVER_DEVICE)
        result = Result(
            job_id=job_id,
            status="dead",
            error=error,
            worker=worker,
            device=device,
            attempt=attempt,
            finished_at=now,
        )
        raw = fields.pop("raw", None)
        letter = DeadLetter(
            job_id=job_id,
            job=fields.pop("job", lease.job if lease else None),
            raw=raw[:MAX_JOB_BYTES] if raw is not None else None,
            raw_truncated=raw is not None and len(raw) > MAX_JOB_BYTES,
            error=error,
            attempts=attempt,
            at=now,
            worker=worker,
        )
        return encode(result), encode(letter)

    # --- producing --------------------------------------------------------------------

    @staticmethod
    def _submit_args(job: Job) -> list[str | bytes]:
        return [
            job.id,
            encode_job(job),  # held to the size and depth bounds (BadMessage)
            job.device or SERVER_DEVICE,
            str(job.priority),
            str(job.max_attempts),
            job.idempotency_key or "",
            "" if job.not_before is None else repr(float(job.not_before)),
        ]

    @staticmethod
    def _receipt(job: Job, reply: Sequence[bytes]) -> SubmitReceipt:
        status, job_id, original = _s(reply[0]), _s(reply[1]), reply[2]
        if status == "new":
            return SubmitReceipt(job_id)
        if original:
            decoded = decode_body(job_id, original)
            # A stored body that no longer decodes cannot be compared (as with SQLite).
            # The key matched, or else the id did (`admit` checks the id first).
            if isinstance(decoded, Job):
                check_idempotent_reuse(decoded, job, by_id=job_id == job.id)
        return SubmitReceipt(job_id, duplicate=True)

    async def submit(self, job: Job) -> SubmitReceipt:
        [reply] = await self._script("submit", *self._submit_args(job))
        self._wake_workers()
        return self._receipt(job, reply)

    async def submit_many(self, jobs: Sequence[Job]) -> list[SubmitReceipt]:
        """Queue several jobs, `_BATCH` per script call. Not one transaction as with
        SQLite: an `IdempotencyConflict` is raised after the whole batch was handled (the
        conflicting job alone is not queued)."""
        receipts: list[SubmitReceipt] = []
        conflict: IdempotencyConflict | None = None
        # Every job's bounds checked before any is queued (base.py: all or none).
        encoded = [self._submit_args(job) for job in jobs]
        for start in range(0, len(jobs), _BATCH):
            chunk = jobs[start : start + _BATCH]
            args = [a for one in encoded[start : start + _BATCH] for a in one]
            replies = await self._script("submit", *args)
            for job, reply in zip(chunk, replies, strict=True):
                try:
                    receipts.append(self._receipt(job, reply))
                except IdempotencyConflict as exc:
                    conflict = conflict or exc
        self._wake_workers()
        if conflict is not None:
            raise conflict
        return receipts

    async def submit_raw(self, data: bytes) -> str:
        check_job_size(len(data))
        try:
            job = decode_job(data)
        except BadMessage:
            # Through the producers' door, like any other-language message: the first
            # server worker to look dead-letters it.
            job_id = new_job_id()
            await self._guard(
                self._redis.xadd(self.keys.inbox, {b"id": job_id, b"job": bytes(data)})
            )
            self._wake_workers()
            return job_id
        return (await self.submit(job)).job_id

    # --- consuming --------------------------------------------------------------------

    async def lease(
        self,
        worker_id: str,
        *,
        visibility_s: float,
        device: str | None = None,
        limit: int = 1,
        started: int | None = None,
    ) -> list[Lease]:
        _check_lease_args(visibility_s, limit)
        dev = device or SERVER_DEVICE
        start_n = limit if started is None else started
        leases, inbox = await self._lease_once(worker_id, visibility_s, dev, limit, start_n)
        # Only server workers open the inbox: a bad message is dead-lettered by the
        # server, and a device never routes jobs for others.
        if inbox and dev == SERVER_DEVICE:
            try:
                await self._admit_inbox(worker_id)
                if len(leases) < limit:
                    more, _ = await self._lease_once(
                        worker_id,
                        visibility_s,
                        dev,
                        limit - len(leases),
                        max(0, start_n - len(leases)),
                    )
                    leases += more
            except Exception as exc:
                if not leases:
                    raise
                # The leases taken are this worker's already (the first ones count as
                # started): raising would strand them until they lapse, an attempt used
                # for nothing. The inbox is tried again at the next lease.
                _log.error(
                    "broker.error",
                    broker=self.where,
                    op="admit_inbox",
                    error=f"{type(exc).__name__}: {exc}",
                )
        return leases

    async def _lease_once(
        self, worker_id: str, visibility_s: float, dev: str, limit: int, start_n: int
    ) -> tuple[list[Lease], int]:
        _now, inbox, taken, finals, until_s = await self._script(
            "lease",
            worker_id,
            repr(float(visibility_s)),
            dev,
            str(limit),
            os.urandom(8).hex(),
            str(start_n),
            str(MAX_UNSTARTED_LAPSES),
        )
        until = float(until_s)
        out: list[Lease] = []
        for i, (id_b, body, attempt_b, token_b) in enumerate(taken):
            job_id = _s(id_b)
            decoded = decode_body(job_id, body)
            if isinstance(decoded, ErrorInfo):
                await self._bad_leased(
                    job_id, body, decoded, _s(token_b), int(attempt_b), worker_id, dev
                )
                continue
            out.append(
                Lease(
                    job=decoded,
                    attempt=int(attempt_b),
                    token=_s(token_b),
                    lease_until=until,
                    worker=worker_id,
                    device=dev,
                    visibility_s=visibility_s,
                    # The script started the first `start_n` it handed out (in order).
                    started=i < start_n,
                )
            )
        for final in finals:
            await self._settle_lapsed(final, dev)
        return out, int(inbox)

    async def _bad_leased(
        self,
        job_id: str,
        body: bytes,
        error: ErrorInfo,
        token: str,
        attempt: int,
        worker: str,
        dev: str,
    ) -> None:
        result, letter = self._dead_records(
            None, job_id, error, raw=bytes(body), attempt=attempt, worker=worker, device=dev
        )
        await self._settle("dead_letter", [token], job_id, token, result, letter)
        _log.error("job.bad_message", job_id=job_id, executor=None, **_fields(error))

    async def _settle_lapsed(self, final: Sequence[bytes], dev: str) -> None:
        """Settle a lapsed lease with no delivery left (dead) or a cancel pending."""
        job_id, body, attempt, token = _s(final[0]), final[1], int(final[2]), _s(final[3])
        worker, cancel = _s(final[4]), _s(final[5]) == "1"
        started, lapses = _s(final[6]) == "1", int(final[7])
        if cancel:
            result = Result(
                job_id=job_id,
                status="cancelled",
                error=ErrorInfo(
                    code=E_CANCELLED, message="cancelled while running; its worker was lost"
                ),
                worker=worker,
                device=dev,
                attempt=attempt,
                finished_at=self._wall(),
            )
            await self._settle("ack", [token], job_id, token, encode(result), "cancelled")
            self._wake_results()
            return
        decoded = decode_body(job_id, body)
        job = decoded if isinstance(decoded, Job) else None
        if started:
            message = (
                f"the lease expired on delivery {attempt}, the last allowed; "
                "its worker stopped heart-beating"
            )
        else:
            message = (
                f"the job was leased {lapses} times and never started: each time its "
                "worker was lost before launching it"
            )
        error = ErrorInfo(code=E_LEASE_EXPIRED, message=message)
        result_b, letter_b = self._dead_records(
            None, job_id, error, job=job, attempt=attempt, worker=worker, device=dev
        )
        if await self._settle("dead_letter", [token], job_id, token, result_b, letter_b):
            _log.warning(
                "job.dead_lettered",
                job_id=job_id,
                # The job's own executor and worker, not the sweeping worker's context.
                executor=job.executor if job else None,
                worker=worker,
                device=dev,
                **_fields(error),
            )
        self._wake_results()

    async def _admit_inbox(self, worker_id: str) -> None:
        """Queue (or dead-letter) what other-language producers put in the inbox."""
        entries = await self._guard(self._redis.xrange(self.keys.inbox, count=_BATCH))
        if not entries:
            return
        args: list[str | bytes] = []
        bad: list[tuple[str, ErrorInfo]] = []
        for entry in entries:
            eid = _s(entry.identifier)
            fields = {_text(k): v for k, v in entry.field_values.items()}
            raw = fields.get("job")
            given = _text(fields["id"]) if "id" in fields else None
            error: ErrorInfo | None = None
            if raw is None:
                error = ErrorInfo(code=BadMessage.code, message="inbox entry has no `job` field")
            else:
                try:
                    job = decode_job(raw)
                except BadMessage as exc:
                    error = ErrorInfo(code=exc.code, message=exc.message)
                else:
                    if given is not None and given != job.id:
                        error = ErrorInfo(
                            code=BadMessage.code,
                            message=f"job message rejected: body id {job.id!r} differs "
                            f"from the entry's id {given!r}",
                        )
            if error is None:
                # Re-encoded: a body without an id got one here, and it must stay put.
                args += [eid, "job", *self._submit_args(job)]
                continue
            job_id = given or new_job_id()
            result, letter = self._dead_records(
                None, job_id, error, raw=bytes(raw or b""), worker=worker_id
            )
            args += [eid, "bad", job_id, bytes(raw or b""), result, letter, "", "", ""]
            bad.append((job_id, error))
        await self._script("admit_inbox", *args)
        for job_id, error in bad:
            _log.error("job.bad_message", job_id=job_id, executor=None, **_fields(error))
        if bad:
            self._wake_results()

    async def wait_for_work(self, timeout: float) -> None:  # noqa: ASYNC109
        event = _wake_event(self._wake_key, "work")
        with anyio.move_on_after(min(timeout, self._poll)):
            await event.wait()

    async def heartbeat(self, lease: Lease, *, visibility_s: float | None = None) -> HeartbeatReply:
        window = lease.visibility_s if visibility_s is None else visibility_s
        reply = await self._script("heartbeat", lease.job.id, lease.token, repr(float(window)))
        if reply is None:
            return HeartbeatReply(ok=False)
        until, cancel = reply
        return HeartbeatReply(ok=True, cancel_requested=_s(cancel) == "1", lease_until=float(until))

    async def mark_started(self, lease: Lease) -> bool:
        return (await self.mark_started_many([lease]))[0]

    async def mark_started_many(self, leases: Sequence[Lease]) -> list[bool]:
        if not leases:
            await anyio.lowlevel.checkpoint()
            return []
        oks: list[bool] = []
        for start in range(0, len(leases), _BATCH):
            args = [a for le in leases[start : start + _BATCH] for a in (le.job.id, le.token)]
            oks += [bool(x) for x in await self._script("mark_started", *args)]
        return oks

    async def ack(self, lease: Lease, result: Result) -> bool:
        return (await self.ack_many([(lease, result)]))[0]

    async def ack_many(self, items: Sequence[tuple[Lease, Result]]) -> list[bool]:
        oks: list[bool] = [False] * len(items)
        called = False
        for start in range(0, len(items), _BATCH):
            args: list[str | bytes] = []
            tokens: list[str] = []
            where: list[int] = []
            for i, (lease, result) in enumerate(items[start : start + _BATCH], start):
                if result.job_id != lease.job.id:
                    continue
                args += [lease.job.id, lease.token, encode(result), result.status]
                tokens.append(lease.token)
                where.append(i)
            if not where:
                continue
            replies = await self._settle("ack", tokens, *args)
            called = True
            for i, ok in zip(where, replies, strict=True):
                oks[i] = bool(ok)
        if any(oks):
            self._wake_results()
        if not called:
            await anyio.lowlevel.checkpoint()  # every async call yields once
        return oks

    async def retry(self, lease: Lease, *, error: ErrorInfo, delay_s: float) -> RetryOutcome:
        result, letter = self._dead_records(lease, lease.job.id, error)
        outcome = _s(
            await self._settle(
                "retry",
                [lease.token],
                lease.job.id,
                lease.token,
                repr(max(0.0, float(delay_s))),
                result,
                letter,
            )
        )
        if outcome == "dead":
            self._wake_results()
        elif outcome == "scheduled" and delay_s <= 0:
            self._wake_workers()
        assert outcome in ("scheduled", "dead", "lost"), outcome
        return outcome  # type: ignore[return-value]

    async def dead_letter(self, lease: Lease, *, error: ErrorInfo) -> bool:
        result, letter = self._dead_records(lease, lease.job.id, error)
        ok = bool(
            await self._settle(
                "dead_letter", [lease.token], lease.job.id, lease.token, result, letter
            )
        )
        self._wake_results()
        return ok

    async def release(self, lease: Lease) -> bool:
        ok = bool(await self._settle("release", [lease.token], lease.job.id, lease.token))
        self._wake_workers()
        return ok

    # --- control and inspection -------------------------------------------------------

    async def cancel(self, job_id: str) -> CancelOutcome:
        outcome = _s(await self._script("cancel", job_id))
        self._wake_results()
        assert outcome in ("cancelled", "cancelling", "finished", "unknown"), outcome
        return outcome  # type: ignore[return-value]

    async def cancel_requested(self, job_ids: Sequence[str]) -> set[str]:
        ids = list(job_ids)
        if not ids:
            await anyio.lowlevel.checkpoint()
            return set()
        found: set[str] = set()
        for start in range(0, len(ids), _BATCH):
            chunk = ids[start : start + _BATCH]
            found.update(_s(x) for x in await self._script("cancel_requested", *chunk))
        return found

    async def get_result(self, job_id: str) -> Result | None:
        body = await self._guard(self._redis.hget(self.keys.job(job_id), "result"))
        if body is None:
            return None
        try:
            return decode_result(body)
        except BadMessage as exc:
            raise BrokerCorrupt(
                f"the stored result of job {job_id} in {self.where} cannot be read: {exc.message}"
            ) from None

    async def wait_result(
        self,
        job_id: str,
        *,
        timeout: float | None,  # noqa: ASYNC109
    ) -> Result | None:
        with anyio.move_on_after(timeout if timeout is not None else float("inf")):
            while True:
                # Registered before the look, so an ack landing in between still wakes us.
                event = _wake_event(self._wake_key, "result")
                result = await self.get_result(job_id)
                if result is not None:
                    return result
                with anyio.move_on_after(self._poll):
                    await event.wait()
        return await self.get_result(job_id)

    async def get_job_state(self, job_id: str) -> JobState | None:
        state, attempt, worker, until, cancel = await self._guard(
            self._redis.hmget(
                self.keys.job(job_id), ["state", "attempt", "worker", "lease_until", "cancel"]
            )
        )
        if state is None:
            return None
        return JobState(
            job_id=job_id,
            state=_s(state),  # type: ignore[arg-type]
            attempt=int(attempt or 0),
            worker=_s(worker) if worker is not None else None,
            lease_until=float(until) if until is not None else None,
            cancel_requested=cancel is not None and _s(cancel) == "1",
        )

    async def dead_letters(self, *, limit: int = 100) -> list[DeadLetter]:
        if limit < 1:
            return []
        out: list[DeadLetter] = []
        for body in await self._script("dead_letters", str(limit)):
            try:
                out.append(decode_dead_letter(body))
            except BadMessage as exc:
                # One damaged record must not hide the others; say what it is.
                raw = bytes(body)
                out.append(
                    DeadLetter(
                        job_id="",
                        raw=raw[:MAX_JOB_BYTES],
                        raw_truncated=len(raw) > MAX_JOB_BYTES,
                        error=ErrorInfo(
                            code=BrokerCorrupt.code,
                            message=f"this dead letter's stored record is unreadable: "
                            f"{exc.message}",
                        ),
                        at=0.0,
                    )
                )
        return out

    async def durability(self) -> str | None:
        """See `Broker.durability`: Redis keeps writes across a restart only with its
        append-only file (``appendonly yes``; ``queue/redis.conf``). ``None`` when CONFIG
        is not allowed to this client (a managed Redis): it cannot be told."""
        try:
            conf = await self._redis.config_get(["appendonly", "save"])
        except Exception:
            return None
        values = {_s(k): _s(v) for k, v in conf.items()}
        if values.get("appendonly", "yes") == "yes":
            return None
        save = values.get("save", "").strip()
        if not save:
            return (
                "Redis keeps nothing on disk (appendonly no, no save points): every queued "
                "job and every result is lost when it restarts"
            )
        return (
            f"Redis keeps only snapshots (appendonly no, save {save}): jobs and results "
            "acknowledged since the last one are lost when it restarts"
        )

    async def stats(self) -> BrokerStats:
        queued, delayed, running, done, dead = (int(x) for x in await self._script("stats"))
        return BrokerStats(queued=queued, delayed=delayed, running=running, done=done, dead=dead)

    # --- undo entries (see `metnos_exec.brokers.base`) ----------------------------------

    async def record_undo(
        self, lease: Lease, entries: Sequence[UndoEntry], *, undoes: Sequence[str] = ()
    ) -> bool:
        args: list[str | bytes] = [lease.job.id, lease.token, str(len(entries))]
        for entry in entries:
            args += [entry.id, encode(entry), " ".join(sorted(entry.blobs()))]
        return bool(await self._script("record_undo", *args, *undoes))

    async def get_undo(self, entry_ids: Sequence[str]) -> list[UndoRecord]:
        ids = list(entry_ids)
        if not ids:
            await anyio.lowlevel.checkpoint()
            return []
        found: dict[str, UndoRecord] = {}
        for start in range(0, len(ids), _BATCH):
            for entry_id, body, undone_by, at in await self._script(
                "get_undo", *ids[start : start + _BATCH]
            ):
                try:
                    entry = decode_undo_entry(body)
                except BadMessage as exc:
                    raise BrokerCorrupt(
                        f"the stored undo entry {_s(entry_id)} in {self.where} cannot be "
                        f"read: {exc.message}"
                    ) from None
                found[_s(entry_id)] = UndoRecord(
                    entry=entry, undone_by=_s(undone_by) or None, recorded_at=float(at)
                )
        return [found[i] for i in ids if i in found]

    async def undo_blobs(self) -> set[str]:
        return {_s(d) for d in await self._guard(self._redis.hkeys(self.keys.blobs))}

    # --- the executor catalog (see `metnos_exec.devices.catalog`) -------------------------------

    async def publish_executors(self, infos: Sequence[ExecutorInfo]) -> None:
        if not infos:
            await anyio.lowlevel.checkpoint()
            return
        # One HSET: every entry replaces its name's at once.
        await self._guard(
            self._redis.hset(self.keys.executors, {i.name: encode_info(i) for i in infos})
        )

    async def executor_info(self, name: str) -> ExecutorInfo | None:
        body = await self._guard(self._redis.hget(self.keys.executors, name))
        return None if body is None else decode_info(body)

    async def purge(self, *, older_than_s: float) -> PurgeReport:
        """See `Broker.purge`. Redis has no transaction to share with a hook: each batch
        is one script, and the hooks get this broker as their ``store`` and the ids after
        it. Space is Redis's memory, freed as keys go (``reclaimed_bytes`` is ``None``)."""
        removed = collected = 0
        while True:
            ids_b, dropped = await self._script("purge", repr(float(older_than_s)), "500")
            ids = [_s(x) for x in ids_b]
            if ids:
                for hook in self.purge_hooks:
                    hook.forget_jobs(self, ids)
            removed += len(ids)
            collected += int(dropped)
            if len(ids) < 500:
                break
        cut = self._wall() - older_than_s
        collected += sum(int(hook.collect(self, before=cut)) for hook in self.purge_hooks)
        return PurgeReport(jobs=removed, collected=collected, reclaimed_bytes=None)


def _fields(error: ErrorInfo) -> dict[str, str]:
    return {"code": error.code, "message": error.message}
