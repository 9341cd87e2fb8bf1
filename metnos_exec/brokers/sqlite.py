"""The embedded default broker: one SQLite file, WAL, several worker processes.

Across processes, SQLite's own locking does the work. Every read-modify-write runs in
``BEGIN IMMEDIATE``: the write lock is taken *before* reading, so two workers can never
pick the same row, and a lease is a pick-then-take inside that one transaction. Settling
a job is guarded by the lease token (the row changes only while the caller's token is
current) and the result row is ``INSERT OR IGNORE`` on its primary key, so a result is
written once.

Within a process, each broker object owns one connection, used by one call at a time (a
`CapacityLimiter(1)`). A call first runs *inline* on the event loop with
``busy_timeout = 0``: an uncontended transaction takes tens of microseconds, less than the
hop to a worker thread (~120 us here), and that hop alone would cap one worker below 4,000
acks/s. When another process holds the lock (``SQLITE_BUSY``) the call is redone in a
worker thread (`anyio.to_thread.run_sync`) with the full busy timeout, so the event loop
never waits on another process. Large batches (more than 8 submits or acks, leases of more
than 64 jobs) go straight to the thread so they never stall the loop for milliseconds.

Idle waiting (`wait_for_work`, `wait_result`) polls every ``poll_interval_s`` (50 ms by
default): other processes cannot signal us, and the idle check is a plain read that takes
no lock. A submit or ack through any broker object on the same file in the same event loop
wakes waiters at once.

Needs SQLite >= 3.35 (``RETURNING``), checked at open.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.lowlevel
import anyio.to_thread
import structlog
from anyio.lowlevel import RunVar

from ..catalog import ExecutorInfo, decode_info, encode_info
from ..errors import BadMessage, MetnosError
from ..messages import (
    E_CANCELLED,
    E_LEASE_EXPIRED,
    SERVER_DEVICE,
    DeadLetter,
    ErrorInfo,
    Job,
    Result,
    UndoEntry,
    decode_dead_letter,
    decode_job,
    decode_result,
    decode_undo_entry,
    encode,
    new_job_id,
)
from .base import (
    Broker,
    BrokerStats,
    CancelOutcome,
    HeartbeatReply,
    JobState,
    Lease,
    RetryOutcome,
    SubmitReceipt,
    UndoRecord,
    check_idempotent_reuse,
)

__all__ = ("SCHEMA_SQL", "SCHEMA_VERSION", "BrokerUnavailable", "SQLiteBroker")

_log = structlog.get_logger("metnos_exec")

SCHEMA_VERSION: Final = 2

#: The schema; identical to ``queue/sqlite_schema.sql`` (a test keeps them in step). Kept
#: in the code rather than read from the package so a wheel needs no data files.
SCHEMA_SQL: Final = """-- metnos-exec SQLite queue, schema version 2 (PRAGMA user_version = 2).
-- The broker (metnos_exec/brokers/sqlite.py) embeds this exact text; a test keeps the two
-- identical. Producers in other languages: see queue/README.md.
--
-- journal_mode=WAL is persistent in the file; synchronous=NORMAL and busy_timeout are per
-- connection: the broker sets them, and another-language producer should set busy_timeout.

-- One row per job. `body` is the job exactly as submitted (JSON text, see
-- queue/schemas/job.json); the routing columns copy fields of it. Producers in other
-- languages insert into the `job_inbox` view below, which fills them from the body.
CREATE TABLE IF NOT EXISTS jobs (
    seq              INTEGER PRIMARY KEY,         -- submission order (FIFO tie-break)
    id               TEXT NOT NULL UNIQUE,        -- the job id (equal to body's "id")
    body             TEXT NOT NULL,
    device           TEXT NOT NULL DEFAULT 'server',
    priority         INTEGER NOT NULL DEFAULT 0,
    max_attempts     INTEGER NOT NULL DEFAULT 3,
    idempotency_key  TEXT,
    not_before       REAL,
    -- Mutable delivery state, owned by the broker.
    state            TEXT NOT NULL DEFAULT 'queued'
                     CHECK (state IN ('queued', 'running', 'done', 'dead')),
    due_at           REAL,                        -- NULL: use not_before (NULL: now)
    attempt          INTEGER NOT NULL DEFAULT 0,  -- deliveries so far
    token            TEXT,                        -- fencing token of the current lease
    lease_until      REAL,
    worker           TEXT,
    cancel_requested INTEGER NOT NULL DEFAULT 0
);

-- The producer edge: INSERT INTO job_inbox (id, body) VALUES (?, ?).
-- The trigger derives the routing columns from the body. A field of the wrong JSON type
-- (or a body that is not JSON at all) yields the column's default, so the row is still
-- leased by a server worker and dead-lettered with E_BAD_MESSAGE rather than stranded.
-- OR IGNORE: a duplicate id or idempotency key inserts nothing (the first job stands).
-- (Generated columns would say the same more briefly, but SQLite recomputes stored
-- generated columns on every UPDATE of the row, which tripled the cost of a lease.)
CREATE VIEW IF NOT EXISTS job_inbox AS SELECT id, body FROM jobs;
CREATE TRIGGER IF NOT EXISTS job_inbox_insert INSTEAD OF INSERT ON job_inbox
BEGIN
    INSERT OR IGNORE INTO jobs (id, body, device, priority, max_attempts, idempotency_key,
                                not_before)
    SELECT NEW.id, NEW.body,
        coalesce(CASE WHEN ok THEN CASE json_type(NEW.body, '$.device')
            WHEN 'text' THEN json_extract(NEW.body, '$.device') END END, 'server'),
        coalesce(CASE WHEN ok THEN CASE json_type(NEW.body, '$.priority')
            WHEN 'integer' THEN json_extract(NEW.body, '$.priority') END END, 0),
        coalesce(CASE WHEN ok THEN CASE json_type(NEW.body, '$.max_attempts')
            WHEN 'integer' THEN json_extract(NEW.body, '$.max_attempts') END END, 3),
        CASE WHEN ok THEN CASE json_type(NEW.body, '$.idempotency_key')
            WHEN 'text' THEN json_extract(NEW.body, '$.idempotency_key') END END,
        CASE WHEN ok THEN CASE json_type(NEW.body, '$.not_before')
            WHEN 'real' THEN json_extract(NEW.body, '$.not_before')
            WHEN 'integer' THEN json_extract(NEW.body, '$.not_before') END END
    FROM (SELECT json_valid(NEW.body) AS ok);
END;

-- Leasing: the best queued job for one device.
CREATE INDEX IF NOT EXISTS jobs_ready
    ON jobs (device, priority DESC, seq) WHERE state = 'queued';
-- Expired leases (workers that died).
CREATE INDEX IF NOT EXISTS jobs_running
    ON jobs (lease_until) WHERE state = 'running';
-- Idempotency: a second job with the same key is not inserted.
CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency
    ON jobs (idempotency_key) WHERE idempotency_key IS NOT NULL;

-- One result per job, written once (see queue/schemas/result.json).
CREATE TABLE IF NOT EXISTS results (
    job_id  TEXT PRIMARY KEY,
    body    TEXT NOT NULL,
    status  TEXT NOT NULL,
    at      REAL NOT NULL
) WITHOUT ROWID;

-- Jobs that will not run again, with the last error (see queue/schemas/dead_letter.json).
CREATE TABLE IF NOT EXISTS dead_letters (
    seq     INTEGER PRIMARY KEY,
    job_id  TEXT NOT NULL UNIQUE,
    body    TEXT NOT NULL,
    at      REAL NOT NULL
);

-- Undo entries (see queue/schemas/undo_entry.json), stored with the results. An entry
-- counts only once its job's result lists its id in undo_ids; undone_by names the undo
-- job that applied it (it stands only if that job's result is 'succeeded').
-- Version 2 added these two tables; opening a version 1 file creates them.
CREATE TABLE IF NOT EXISTS undo_entries (
    id         TEXT PRIMARY KEY,
    job_id     TEXT NOT NULL,
    body       TEXT NOT NULL,
    at         REAL NOT NULL,
    undone_by  TEXT
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS undo_entries_job ON undo_entries (job_id);

-- The blobs each entry needs (blob retention: never delete one a stored entry lists).
CREATE TABLE IF NOT EXISTS undo_blobs (
    entry_id  TEXT NOT NULL,
    sha256    TEXT NOT NULL,
    PRIMARY KEY (entry_id, sha256)
) WITHOUT ROWID;

-- The executor catalog: each server worker publishes the manifests of the executors it
-- runs, so a submit can refuse a device job whose executor must stay on the server
-- (metnos_exec/catalog.py). `body` is an ExecutorInfo as JSON. A cache, not queue state:
-- it needs no schema version (a file made before it gains it when a broker opens it).
CREATE TABLE IF NOT EXISTS executors (
    name    TEXT PRIMARY KEY,
    body    TEXT NOT NULL,
    worker  TEXT NOT NULL,
    at      REAL NOT NULL
) WITHOUT ROWID;

PRAGMA user_version = 2;
"""

#: The catalog's table alone (see SCHEMA_SQL), for files made before it existed.
_CATALOG_SQL: Final = SCHEMA_SQL[
    SCHEMA_SQL.index("CREATE TABLE IF NOT EXISTS executors") : SCHEMA_SQL.rindex(
        "PRAGMA user_version"
    )
]

_MIN_SQLITE = (3, 35, 0)


class BrokerUnavailable(MetnosError):
    """The broker's store cannot be used (SQLite too old, newer schema, unreadable file)."""

    code = "E_BROKER_UNAVAILABLE"


# --- SQL ------------------------------------------------------------------------------

_INSERT = (
    "INSERT INTO jobs (id, body, device, priority, max_attempts, idempotency_key, not_before) "
    "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
)
# The other-language producers' door; its trigger derives the columns from the body.
_INSERT_INBOX = "INSERT INTO job_inbox (id, body) VALUES (?, ?)"
_FIND_BY_KEY = "SELECT id, body FROM jobs WHERE idempotency_key = ?"
_DUE = "coalesce(due_at, not_before, 0) <= :now"
_ANY_DUE = (
    "SELECT 1 FROM jobs WHERE state = 'queued' AND device = :dev AND "
    + _DUE
    + " UNION ALL SELECT 1 FROM jobs WHERE state = 'running' AND lease_until <= :now LIMIT 1"
)
_ANY_EXPIRED = "SELECT 1 FROM jobs WHERE state = 'running' AND lease_until <= ? LIMIT 1"
# Expired leases with attempts left go back to the queue (the next lease redelivers them
# with attempt + 1); the rest are settled by _SETTLE_EXPIRED.
_REQUEUE_EXPIRED = (
    "UPDATE jobs SET state = 'queued', token = NULL, lease_until = NULL, due_at = :now "
    "WHERE state = 'running' AND lease_until <= :now AND attempt < max_attempts "
    "AND cancel_requested = 0"
)
_SETTLE_EXPIRED = (
    "UPDATE jobs SET state = CASE WHEN cancel_requested THEN 'done' ELSE 'dead' END, "
    "token = NULL, lease_until = NULL "
    "WHERE state = 'running' AND lease_until <= :now "
    "RETURNING id, body, attempt, worker, device, cancel_requested"
)
# Pick, then take. Both run inside one BEGIN IMMEDIATE, which holds the write lock from the
# start, so no other process can take the same rows in between. (A single
# "UPDATE ... WHERE seq IN (SELECT ...) RETURNING" measured 3-4x slower per row here.)
_PICK = (
    "SELECT seq, id, body, attempt + 1, device FROM jobs "
    "WHERE state = 'queued' AND device = :dev AND " + _DUE + " "
    "ORDER BY priority DESC, seq LIMIT :limit"
)
_TAKE = (
    "UPDATE jobs SET state = 'running', attempt = attempt + 1, token = ?, lease_until = ?, "
    "worker = ? WHERE seq = ?"
)
_SETTLE = (
    "UPDATE jobs SET state = ?, token = NULL, lease_until = NULL "
    "WHERE id = ? AND token = ? AND state = 'running'"
)
_INSERT_RESULT = "INSERT OR IGNORE INTO results (job_id, body, status, at) VALUES (?, ?, ?, ?)"
_INSERT_DEAD = "INSERT OR IGNORE INTO dead_letters (job_id, body, at) VALUES (?, ?, ?)"
_HEARTBEAT = (
    "UPDATE jobs SET lease_until = ? WHERE id = ? AND token = ? AND state = 'running' "
    "RETURNING cancel_requested"
)
_RETRY_LOOKUP = (
    "SELECT attempt, max_attempts, worker, device, body FROM jobs "
    "WHERE id = ? AND token = ? AND state = 'running'"
)
_REQUEUE = (
    "UPDATE jobs SET state = 'queued', token = NULL, lease_until = NULL, due_at = ?, "
    "attempt = attempt - ? WHERE id = ? AND token = ? AND state = 'running'"
)
_GET_RESULT = "SELECT body FROM results WHERE job_id = ?"
_LEASE_IS_CURRENT = "SELECT 1 FROM jobs WHERE id = ? AND token = ? AND state = 'running'"
#: Ids per ``IN (...)`` list: well under SQLite's host-parameter cap (999 before 3.32).
_IN_CHUNK = 500
_GET_STATE = "SELECT state, attempt, worker, lease_until, cancel_requested FROM jobs WHERE id = ?"


# In-process wake-ups, per event loop (a RunVar) and per database file: a submit or ack
# through any broker object on the same file in the same event loop (say, a client and a
# worker embedded in one program) wakes the waiters at once. Other loops and other
# processes fall back to polling; events are never touched across threads.
_WAKE: RunVar[dict[tuple[str, str], anyio.Event]] = RunVar("metnos_exec.brokers.sqlite.wake")


def _check_lease_args(visibility_s: float, limit: int) -> None:
    if not visibility_s > 0:
        raise ValueError(f"visibility_s must be > 0, got {visibility_s}")
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")


def _wake_event(key: str, kind: str) -> anyio.Event:
    try:
        table = _WAKE.get()
    except LookupError:
        table = {}
        _WAKE.set(table)
    event = table.get((key, kind))
    if event is None:
        event = table[(key, kind)] = anyio.Event()
    return event


def _notify(key: str, kind: str) -> None:
    try:
        table = _WAKE.get()
    except LookupError:
        return
    event = table.pop((key, kind), None)
    if event is not None:
        event.set()


class SQLiteBroker(Broker):
    """`Broker` on one SQLite file.

    Args:
        path: the database file (created with its schema when missing).
        clock: unix-seconds clock for leases, delays and timestamps (tests inject one).
        poll_interval_s: how often idle waits look at the file again.
        busy_timeout_s: how long a statement waits for another process's write lock.
        synchronous: ``NORMAL`` (default: durable across process crashes, may lose the
            last transactions on power loss) or ``FULL``.
        create: create the file (and its schema) when it is missing. ``False`` for
            readers (``status``, ``result``, ``cancel``): a mistyped path must not
            create an empty queue that then answers "no such job".

    Raises:
        BrokerUnavailable: SQLite older than 3.35, the file has a newer schema, or
            (with ``create=False``) there is no file at `path`.
    """

    scheme = "sqlite"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock: Callable[[], float] = time.time,
        poll_interval_s: float = 0.05,
        busy_timeout_s: float = 10.0,
        synchronous: str = "NORMAL",
        create: bool = True,
    ) -> None:
        if sqlite3.sqlite_version_info < _MIN_SQLITE:
            raise BrokerUnavailable(
                f"SQLite {sqlite3.sqlite_version} is too old; the queue needs 3.35 or newer "
                "(UPDATE ... RETURNING)"
            )
        if synchronous.upper() not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be NORMAL or FULL, got {synchronous!r}")
        self.path = Path(path)
        if not create and not self.path.is_file():
            raise BrokerUnavailable(
                f"no queue file at {self.path.absolute()} (sqlite:///x.db is relative to the "
                "current folder; an absolute path takes four slashes: sqlite:////abs/x.db)"
            )
        self._clock = clock
        self._poll = poll_interval_s
        # isolation_level=None: we issue BEGIN IMMEDIATE ourselves; Python's implicit
        # (deferred) transactions would let two processes read the same due row.
        try:
            self._db = sqlite3.connect(
                self.path,
                timeout=0,
                isolation_level=None,
                check_same_thread=False,
                cached_statements=64,
            )
        except sqlite3.Error as exc:
            raise BrokerUnavailable(f"cannot open the queue database {self.path}: {exc}") from None
        try:
            self._busy_ms = int(busy_timeout_s * 1000)
            self._db.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
            (mode,) = self._db.execute("PRAGMA journal_mode = WAL").fetchone()
            if mode != "wal":
                # Without WAL, readers block writers and the lock fallback turns into a
                # stall; refuse rather than run slowly and surprise (e.g. on NFS).
                raise BrokerUnavailable(
                    f"{self.path} cannot use write-ahead logging (journal_mode={mode}); "
                    "put the queue on a local file system"
                )
            self._db.execute(f"PRAGMA synchronous = {synchronous.upper()}")
            self._init_schema()
            self._db.execute("PRAGMA busy_timeout = 0")
        except sqlite3.Error as exc:
            self._db.close()
            raise BrokerUnavailable(f"cannot use the queue database {self.path}: {exc}") from None
        except BaseException:
            self._db.close()
            raise
        self._limiter: anyio.CapacityLimiter | None = None
        self._wake_key = str(self.path.resolve())
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **options: Any) -> SQLiteBroker:
        """``sqlite:///relative.db`` or ``sqlite:////absolute.db``; query options
        ``poll_interval_s``, ``busy_timeout_s``, ``synchronous``, ``create``."""
        rest = url.split("://", 1)[1].split("?", 1)[0]
        if not rest.startswith("/") or rest == "/":
            raise ValueError(f"expected sqlite:///path/to/file.db, got {url!r}")
        path = rest[1:]
        kwargs: dict[str, Any] = {}
        for key in ("poll_interval_s", "busy_timeout_s"):
            if key in options:
                kwargs[key] = float(options.pop(key))
        if "synchronous" in options:
            kwargs["synchronous"] = str(options.pop("synchronous"))
        if "create" in options:
            create = options.pop("create")
            if isinstance(create, str):
                create = create.strip().lower() not in ("0", "false", "no", "off")
            kwargs["create"] = bool(create)
        if "clock" in options:
            kwargs["clock"] = options.pop("clock")
        if options:
            raise ValueError(f"unknown sqlite broker options: {sorted(options)}")
        return cls(path, **kwargs)

    def _init_schema(self) -> None:
        (version,) = self._db.execute("PRAGMA user_version").fetchone()
        if version == SCHEMA_VERSION:
            self._ensure_catalog()
            return
        if version > SCHEMA_VERSION:
            raise BrokerUnavailable(
                f"{self.path} has queue schema version {version}; this metnos-exec "
                f"understands {SCHEMA_VERSION}. Upgrade metnos-exec."
            )
        # BEGIN IMMEDIATE around the script: two processes opening a fresh file at once
        # must not interleave their CREATEs (IF NOT EXISTS makes the second a no-op).
        self._db.executescript("BEGIN IMMEDIATE;\n" + SCHEMA_SQL + "\nCOMMIT;")

    def _ensure_catalog(self) -> None:
        """Create the executor catalog in a file made before it (best effort: a file this
        process may not write keeps working without it, see `executor_info`)."""
        found = self._db.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'executors'"
        ).fetchone()
        if found is None:
            with contextlib.suppress(sqlite3.Error):
                self._db.executescript("BEGIN IMMEDIATE;\n" + _CATALOG_SQL + "\nCOMMIT;")

    # --- plumbing ---------------------------------------------------------------------

    async def _run(self, fn: Callable[..., Any], *args: Any, inline: bool = True) -> Any:
        """Run `fn(*args)` against the connection: inline when the connection is free and
        the database unlocked, else in a worker thread that may wait for the lock."""
        if self._closed:
            raise BrokerUnavailable(f"the broker on {self.path} is closed")
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(1)
        limiter = self._limiter
        if inline:
            try:
                limiter.acquire_nowait()
            except anyio.WouldBlock:
                pass
            else:
                try:
                    out = fn(*args)
                except BaseException as exc:
                    limiter.release()
                    # Only a lock held elsewhere is redone (in a thread that may wait); a
                    # transaction body either failed at BEGIN or was rolled back, so
                    # redoing it is safe.
                    if not (
                        isinstance(exc, sqlite3.OperationalError)
                        and exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY
                    ):
                        raise
                else:
                    # Released *before* the checkpoint: held across it, the connection
                    # looked busy to every task that ran meanwhile, which then took the
                    # thread path (a thread hop per call, and the next call found that
                    # one busy in turn: measured, every lease of a bwrap run went there).
                    limiter.release()
                    # Inline work never yielded: give other tasks a turn, as any async
                    # call should. Shielded: the work is done (a lease taken, an ack
                    # committed), and a cancel here would throw its result away; the
                    # caller sees the cancellation at its next checkpoint.
                    await anyio.lowlevel.cancel_shielded_checkpoint()
                    return out
        return await anyio.to_thread.run_sync(self._patient, fn, args, limiter=limiter)

    def _patient(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        self._db.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
        try:
            return fn(*args)
        finally:
            self._db.execute("PRAGMA busy_timeout = 0")

    def _txn(self, body: Callable[[sqlite3.Connection], Any]) -> Any:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            out = body(db)
        except BaseException:
            if db.in_transaction:  # SQLite may have rolled back already
                db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return out

    def _wake_workers(self) -> None:
        _notify(self._wake_key, "work")

    def _wake_results(self) -> None:
        _notify(self._wake_key, "result")

    @staticmethod
    def _store_result(db: sqlite3.Connection, result: Result, now: float) -> bool:
        cur = db.execute(_INSERT_RESULT, (result.job_id, encode(result), result.status, now))
        return cur.rowcount == 1

    @staticmethod
    def _store_dead(
        db: sqlite3.Connection,
        *,
        job_id: str,
        job: Job | None,
        raw: bytes | None,
        error: ErrorInfo,
        attempt: int,
        worker: str,
        device: str,
        now: float,
    ) -> None:
        letter = DeadLetter(
            job_id=job_id, job=job, raw=raw, error=error, attempts=attempt, at=now, worker=worker
        )
        db.execute(_INSERT_DEAD, (job_id, encode(letter), now))
        SQLiteBroker._store_result(
            db,
            Result(
                job_id=job_id,
                status="dead",
                error=error,
                worker=worker,
                device=device,
                attempt=attempt,
                finished_at=now,
            ),
            now,
        )

    @staticmethod
    def _decode_body(job_id: str, body: str | bytes) -> Job | ErrorInfo:
        try:
            job = decode_job(body)
        except BadMessage as exc:
            return ErrorInfo(code=exc.code, message=exc.message)
        if job.id != job_id:
            return ErrorInfo(
                code=BadMessage.code,
                message=f"job message rejected: body id {job.id!r} differs from row id",
            )
        return job

    # --- producing --------------------------------------------------------------------

    @staticmethod
    def _insert(db: sqlite3.Connection, job: Job) -> SubmitReceipt:
        cur = db.execute(
            _INSERT,
            (
                job.id,
                encode(job).decode(),
                job.device or SERVER_DEVICE,
                job.priority,
                job.max_attempts,
                job.idempotency_key,
                job.not_before,
            ),
        )
        if cur.rowcount == 1:
            return SubmitReceipt(job.id)
        key = job.idempotency_key
        if key is not None:
            row = db.execute(_FIND_BY_KEY, (key,)).fetchone()
            if row is not None:
                original = SQLiteBroker._decode_body(row[0], row[1])
                # A stored body that no longer decodes cannot be compared; it is
                # dead-lettered when leased, and the key still names it.
                if isinstance(original, Job):
                    check_idempotent_reuse(original, job)
                return SubmitReceipt(row[0], duplicate=True)
        return SubmitReceipt(job.id, duplicate=True)

    async def submit(self, job: Job) -> SubmitReceipt:
        receipt: SubmitReceipt = await self._run(self._insert, self._db, job)
        self._wake_workers()
        return receipt

    async def submit_many(self, jobs: Sequence[Job]) -> list[SubmitReceipt]:
        def work(db: sqlite3.Connection) -> list[SubmitReceipt]:
            return [self._insert(db, job) for job in jobs]

        receipts: list[SubmitReceipt] = await self._run(self._txn, work, inline=len(jobs) <= 8)
        self._wake_workers()
        return receipts

    async def submit_raw(self, data: bytes) -> str:
        try:
            job = decode_job(data)
        except BadMessage:
            job_id = new_job_id()
            body: str | bytes
            try:
                body = bytes(data).decode("utf-8")
            except UnicodeDecodeError:
                body = bytes(data)  # stored as a BLOB; leasing dead-letters it
            # Through the producers' door, so the inbox trigger is what routes it.
            await self._run(self._db.execute, _INSERT_INBOX, (job_id, body))
            self._wake_workers()
            return job_id
        return (await self.submit(job)).job_id

    # --- consuming --------------------------------------------------------------------

    def _settle_expired(self, db: sqlite3.Connection, now: float) -> None:
        db.execute(_REQUEUE_EXPIRED, {"now": now})
        for job_id, body, attempt, worker, device, cancel in db.execute(
            _SETTLE_EXPIRED, {"now": now}
        ).fetchall():
            if cancel:
                self._store_result(
                    db,
                    Result(
                        job_id=job_id,
                        status="cancelled",
                        error=ErrorInfo(
                            code=E_CANCELLED,
                            message="cancelled while running; its worker was lost",
                        ),
                        worker=worker or "",
                        device=device,
                        attempt=attempt,
                        finished_at=now,
                    ),
                    now,
                )
                continue
            decoded = self._decode_body(job_id, body)
            error = ErrorInfo(
                code=E_LEASE_EXPIRED,
                message=(
                    f"the lease expired on delivery {attempt}, the last allowed; "
                    "its worker stopped heart-beating"
                ),
            )
            self._store_dead(
                db,
                job_id=job_id,
                job=decoded if isinstance(decoded, Job) else None,
                raw=None,
                error=error,
                attempt=attempt,
                worker=worker or "",
                device=device,
                now=now,
            )
            _log.warning(
                "job.dead_lettered",
                job_id=job_id,
                # The job's own executor and worker, not the sweeping worker's context.
                executor=decoded.executor if isinstance(decoded, Job) else None,
                worker=worker,
                device=device,
                code=error.code,
                message=error.message,
            )

    def _lease_sync(self, worker_id: str, visibility_s: float, dev: str, limit: int) -> list[Lease]:
        db = self._db
        now = self._clock()
        # A plain read first: an idle worker polling an empty queue never takes the write
        # lock, so it does not slow down the processes that have work.
        if db.execute(_ANY_DUE, {"now": now, "dev": dev}).fetchone() is None:
            return []
        out: list[Lease] = []
        db.execute("BEGIN IMMEDIATE")
        try:
            if db.execute(_ANY_EXPIRED, (now,)).fetchone() is not None:
                self._settle_expired(db, now)
            until = now + visibility_s
            base = os.urandom(8).hex()
            while len(out) < limit:
                rows = db.execute(
                    _PICK, {"dev": dev, "now": now, "limit": limit - len(out)}
                ).fetchall()
                if not rows:
                    break
                tokens = {seq: f"{base}.{seq}" for seq, *_ in rows}
                db.executemany(_TAKE, [(tokens[seq], until, worker_id, seq) for seq, *_ in rows])
                for seq, job_id, body, attempt, device in rows:
                    token = tokens[seq]
                    decoded = self._decode_body(job_id, body)
                    if isinstance(decoded, ErrorInfo):
                        db.execute(_SETTLE, ("dead", job_id, token))
                        self._store_dead(
                            db,
                            job_id=job_id,
                            job=None,
                            raw=body.encode() if isinstance(body, str) else bytes(body),
                            error=decoded,
                            attempt=attempt,
                            worker=worker_id,
                            device=device,
                            now=now,
                        )
                        _log.error(
                            "job.bad_message",
                            job_id=job_id,
                            executor=None,  # undecodable: no executor is known
                            code=decoded.code,
                            message=decoded.message,
                        )
                        continue
                    out.append(
                        Lease(
                            job=decoded,
                            attempt=attempt,
                            token=token,
                            lease_until=until,
                            worker=worker_id,
                            device=device,
                            visibility_s=visibility_s,
                        )
                    )
        except BaseException:
            if db.in_transaction:  # SQLite may have rolled back already
                db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return out

    async def lease(
        self,
        worker_id: str,
        *,
        visibility_s: float,
        device: str | None = None,
        limit: int = 1,
    ) -> list[Lease]:
        _check_lease_args(visibility_s, limit)
        leases: list[Lease] = await self._run(
            self._lease_sync,
            worker_id,
            visibility_s,
            device or SERVER_DEVICE,
            limit,
            inline=limit <= 64,
        )
        return leases

    async def wait_for_work(self, timeout: float) -> None:  # noqa: ASYNC109
        event = _wake_event(self._wake_key, "work")
        with anyio.move_on_after(min(timeout, self._poll)):
            await event.wait()

    async def heartbeat(self, lease: Lease, *, visibility_s: float | None = None) -> HeartbeatReply:
        window = lease.visibility_s if visibility_s is None else visibility_s
        until = self._clock() + window

        def work() -> Any:
            return self._db.execute(_HEARTBEAT, (until, lease.job.id, lease.token)).fetchone()

        row = await self._run(work)
        if row is None:
            return HeartbeatReply(ok=False)
        return HeartbeatReply(ok=True, cancel_requested=bool(row[0]), lease_until=until)

    def _ack_one(self, db: sqlite3.Connection, lease: Lease, result: Result, now: float) -> bool:
        if result.job_id != lease.job.id:
            return False
        state = "dead" if result.status == "dead" else "done"
        if db.execute(_SETTLE, (state, lease.job.id, lease.token)).rowcount != 1:
            return False
        return self._store_result(db, result, now)

    async def ack(self, lease: Lease, result: Result) -> bool:
        now = self._clock()
        ok: bool = await self._run(self._txn, lambda db: self._ack_one(db, lease, result, now))
        self._wake_results()
        return ok

    async def ack_many(self, items: Sequence[tuple[Lease, Result]]) -> list[bool]:
        now = self._clock()

        def work(db: sqlite3.Connection) -> list[bool]:
            return [self._ack_one(db, lease, result, now) for lease, result in items]

        oks: list[bool] = await self._run(self._txn, work, inline=len(items) <= 8)
        self._wake_results()
        return oks

    async def retry(self, lease: Lease, *, error: ErrorInfo, delay_s: float) -> RetryOutcome:
        now = self._clock()

        def work(db: sqlite3.Connection) -> RetryOutcome:
            row = db.execute(_RETRY_LOOKUP, (lease.job.id, lease.token)).fetchone()
            if row is None:
                return "lost"
            attempt, max_attempts, _worker, _device, _body = row
            if attempt >= max_attempts:
                self._settle_dead(db, lease, row, error, now)
                return "dead"
            db.execute(_REQUEUE, (now + max(0.0, delay_s), 0, lease.job.id, lease.token))
            return "scheduled"

        outcome: RetryOutcome = await self._run(self._txn, work)
        if outcome == "dead":
            self._wake_results()
        return outcome

    def _settle_dead(
        self,
        db: sqlite3.Connection,
        lease: Lease,
        row: tuple[Any, ...],
        error: ErrorInfo,
        now: float,
    ) -> None:
        """Mark the leased job dead and store its dead letter (a `_RETRY_LOOKUP` row)."""
        attempt, _max, worker, device, _body = row
        db.execute(_SETTLE, ("dead", lease.job.id, lease.token))
        self._store_dead(
            db,
            job_id=lease.job.id,
            job=lease.job,
            raw=None,
            error=error,
            attempt=attempt,
            worker=worker or "",
            device=device,
            now=now,
        )

    async def dead_letter(self, lease: Lease, *, error: ErrorInfo) -> bool:
        now = self._clock()

        def work(db: sqlite3.Connection) -> bool:
            row = db.execute(_RETRY_LOOKUP, (lease.job.id, lease.token)).fetchone()
            if row is None:
                return False
            self._settle_dead(db, lease, row, error, now)
            return True

        ok: bool = await self._run(self._txn, work)
        self._wake_results()
        return ok

    async def release(self, lease: Lease) -> bool:
        now = self._clock()

        def work() -> bool:
            cur = self._db.execute(_REQUEUE, (now, 1, lease.job.id, lease.token))
            return cur.rowcount == 1

        ok: bool = await self._run(work)
        self._wake_workers()
        return ok

    # --- control and inspection -------------------------------------------------------

    async def cancel(self, job_id: str) -> CancelOutcome:
        now = self._clock()

        def work(db: sqlite3.Connection) -> CancelOutcome:
            row = db.execute(
                "SELECT state, attempt, device FROM jobs WHERE id = ?", (job_id,)
            ).fetchone()
            if row is None:
                return "unknown"
            state, attempt, device = row
            if state == "queued":
                db.execute("UPDATE jobs SET state = 'done' WHERE id = ?", (job_id,))
                self._store_result(
                    db,
                    Result(
                        job_id=job_id,
                        status="cancelled",
                        error=ErrorInfo(code=E_CANCELLED, message="cancelled before it started"),
                        device=device,
                        attempt=attempt,
                        finished_at=now,
                    ),
                    now,
                )
                return "cancelled"
            if state == "running":
                db.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ?", (job_id,))
                return "cancelling"
            return "finished"

        outcome: CancelOutcome = await self._run(self._txn, work)
        self._wake_results()
        return outcome

    async def cancel_requested(self, job_ids: Sequence[str]) -> set[str]:
        ids = list(job_ids)
        if not ids:
            await anyio.lowlevel.checkpoint()
            return set()

        def work() -> set[str]:
            found: set[str] = set()
            # Chunked: SQLite caps the number of host parameters in one statement.
            for i in range(0, len(ids), _IN_CHUNK):
                chunk = ids[i : i + _IN_CHUNK]
                marks = ",".join("?" * len(chunk))
                found.update(
                    job_id
                    for (job_id,) in self._db.execute(
                        f"SELECT id FROM jobs WHERE id IN ({marks}) "
                        "AND state = 'running' AND cancel_requested",
                        chunk,
                    )
                )
            return found

        found: set[str] = await self._run(work)
        return found

    async def get_result(self, job_id: str) -> Result | None:
        row = await self._run(lambda: self._db.execute(_GET_RESULT, (job_id,)).fetchone())
        return None if row is None else decode_result(row[0])

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
        row = await self._run(lambda: self._db.execute(_GET_STATE, (job_id,)).fetchone())
        if row is None:
            return None
        state, attempt, worker, lease_until, cancel = row
        return JobState(
            job_id=job_id,
            state=state,
            attempt=attempt,
            worker=worker,
            lease_until=lease_until,
            cancel_requested=bool(cancel),
        )

    async def dead_letters(self, *, limit: int = 100) -> list[DeadLetter]:
        rows = await self._run(
            lambda: self._db.execute(
                "SELECT body FROM dead_letters ORDER BY seq DESC LIMIT ?", (limit,)
            ).fetchall()
        )
        return [decode_dead_letter(body) for (body,) in rows]

    async def stats(self) -> BrokerStats:
        now = self._clock()

        def work() -> BrokerStats:
            counts = {"queued": 0, "running": 0, "done": 0, "dead": 0}
            for state, n in self._db.execute("SELECT state, count(*) FROM jobs GROUP BY state"):
                counts[state] = n
            (delayed,) = self._db.execute(
                "SELECT count(*) FROM jobs WHERE state = 'queued' AND NOT (" + _DUE + ")",
                {"now": now},
            ).fetchone()
            return BrokerStats(delayed=delayed, **counts)

        stats: BrokerStats = await self._run(work)
        return stats

    async def publish_executors(self, infos: Sequence[ExecutorInfo]) -> None:
        rows = [(i.name, encode_info(i).decode(), i.worker, i.at) for i in infos]

        def work(db: sqlite3.Connection) -> None:
            db.executemany(
                "INSERT INTO executors (name, body, worker, at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (name) DO UPDATE SET body = excluded.body, "
                "worker = excluded.worker, at = excluded.at",
                rows,
            )

        await self._run(self._txn, work)

    async def executor_info(self, name: str) -> ExecutorInfo | None:
        def work() -> Any:
            try:
                return self._db.execute(
                    "SELECT body FROM executors WHERE name = ?", (name,)
                ).fetchone()
            except sqlite3.OperationalError as exc:
                if "no such table" in str(exc):
                    return None  # a file without the catalog (read-only, made before it)
                raise

        row = await self._run(work)
        return None if row is None else decode_info(row[0])

    async def purge(self, *, older_than_s: float) -> int:
        cut = self._clock() - older_than_s

        def work(db: sqlite3.Connection) -> int:
            gone = db.execute(
                "DELETE FROM jobs WHERE state IN ('done', 'dead') AND id IN "
                "(SELECT job_id FROM results WHERE at < ?)",
                (cut,),
            ).rowcount
            db.execute(
                "DELETE FROM dead_letters WHERE job_id NOT IN (SELECT id FROM jobs) AND at < ?",
                (cut,),
            )
            db.execute(
                "DELETE FROM results WHERE at < ? AND job_id NOT IN (SELECT id FROM jobs)",
                (cut,),
            )
            # Entries of forgotten jobs, and old entries no result ever confirmed.
            db.execute(
                "DELETE FROM undo_entries WHERE job_id NOT IN (SELECT job_id FROM results) "
                "AND (at < ? OR job_id NOT IN (SELECT id FROM jobs))",
                (cut,),
            )
            db.execute(
                "DELETE FROM undo_entries WHERE at < ? AND id NOT IN (SELECT value FROM "
                "results, json_each(results.body, '$.undo_ids') WHERE results.job_id = "
                "undo_entries.job_id)",
                (cut,),
            )
            db.execute("DELETE FROM undo_blobs WHERE entry_id NOT IN (SELECT id FROM undo_entries)")
            return int(gone)

        # A purge may touch many rows: always in the thread.
        removed: int = await self._run(self._txn, work, inline=False)
        return removed

    # --- undo entries -----------------------------------------------------------------

    async def record_undo(
        self, lease: Lease, entries: Sequence[UndoEntry], *, undoes: Sequence[str] = ()
    ) -> bool:
        now = self._clock()
        rows = [(e.id, e.job_id, encode(e).decode(), now) for e in entries]
        blobs = [(e.id, digest) for e in entries for digest in sorted(e.blobs())]

        def work(db: sqlite3.Connection) -> bool:
            # Fenced like an ack: only the current lease may record.
            if db.execute(_LEASE_IS_CURRENT, (lease.job.id, lease.token)).fetchone() is None:
                return False
            db.executemany(
                "INSERT OR REPLACE INTO undo_entries (id, job_id, body, at) VALUES (?, ?, ?, ?)",
                rows,
            )
            db.executemany(
                "INSERT OR IGNORE INTO undo_blobs (entry_id, sha256) VALUES (?, ?)", blobs
            )
            db.executemany(
                "UPDATE undo_entries SET undone_by = ? WHERE id = ?",
                [(lease.job.id, entry_id) for entry_id in undoes],
            )
            return True

        ok: bool = await self._run(self._txn, work, inline=len(rows) <= 8)
        return ok

    async def get_undo(self, entry_ids: Sequence[str]) -> list[UndoRecord]:
        ids = list(entry_ids)

        def work() -> dict[str, UndoRecord]:
            found: dict[str, UndoRecord] = {}
            for i in range(0, len(ids), _IN_CHUNK):
                chunk = ids[i : i + _IN_CHUNK]
                marks = ",".join("?" * len(chunk))
                for entry_id, body, at, undone_by in self._db.execute(
                    f"SELECT id, body, at, undone_by FROM undo_entries WHERE id IN ({marks})",
                    chunk,
                ):
                    found[entry_id] = UndoRecord(
                        entry=decode_undo_entry(body), undone_by=undone_by, recorded_at=at
                    )
            return found

        if not ids:
            await anyio.lowlevel.checkpoint()
            return []
        found: dict[str, UndoRecord] = await self._run(work)
        return [found[i] for i in ids if i in found]

    async def undo_blobs(self) -> set[str]:
        rows = await self._run(
            lambda: self._db.execute("SELECT DISTINCT sha256 FROM undo_blobs").fetchall(),
            inline=False,
        )
        return {digest for (digest,) in rows}

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(1)
        # Through the limiter: a call still running in a worker thread finishes first.
        await anyio.to_thread.run_sync(self._db.close, limiter=self._limiter)
