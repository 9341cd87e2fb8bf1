"""The embedded default broker: one SQLite file, WAL, several worker processes.

Across processes, SQLite's own locking does the work. Every read-modify-write runs in
``BEGIN IMMEDIATE``: the write lock is taken *before* reading, so two workers can never
pick the same row, and a lease is a pick-then-take inside that one transaction. Settling
a job is guarded by the lease token (the row changes only while the caller's token is
current) and the result row is ``INSERT OR IGNORE`` on its primary key, so a result is
written once. The clock is read inside each transaction, after the lock is held: a lease
granted after waiting seconds for another process's lock still runs its full window.

Within a process, each broker object owns one connection, used by one call at a time (a
`CapacityLimiter(1)`). A call first runs *inline* on the event loop with
``busy_timeout = 0``: an uncontended transaction takes tens of microseconds, less than the
hop to a worker thread (~120 us here), and that hop alone would cap one worker below 4,000
acks/s. When another process holds the lock (``SQLITE_BUSY``) the call is redone in a
worker thread (`anyio.to_thread.run_sync`) with the full busy timeout, so the event loop
never waits on another process. Large batches (more than 8 submits, leases of more than 64
jobs, acks or start marks of more than 128) go straight to the thread so they never stall the
loop for long; a worker's own batches (at most about its concurrency) stay inline. A call that
finds the connection busy with another call of ours waits for it, then runs inline too.

Idle waiting (`wait_for_work`, `wait_result`) polls every ``poll_interval_s`` (50 ms by
default): other processes cannot signal us, and the idle check is a plain read through
one index probe (``jobs_due``) that takes no lock, however many delayed jobs wait. A
submit or ack through any broker object on the same file in the same event loop wakes
waiters at once.

Failures are `BrokerError` subclasses (see `metnos_exec.brokers.base`), mapped from
SQLite's result codes by `_store_error`: a lock held past the busy timeout is
`BrokerBusy`, a full disk `BrokerFull`, a read-only file `BrokerReadOnly`, a damaged file
`BrokerCorrupt`, anything else `BrokerUnavailable`. At most once a second a call checks
that the path still names the file it opened: a queue file deleted or replaced under a
running worker is `BrokerGone` (a worker serving it would be alone with a file nobody else
sees). Opened to write (``create=True``: workers, producers), the broker refuses a
read-only file at once rather than fail every lease later.

Text read from rows a producer wrote (``jobs.id``, ``jobs.body``) is fetched as bytes
(``CAST(... AS BLOB)``) and decoded by us: left to the sqlite3 module, one body that is
not UTF-8 would make the whole pick fail, for every worker, at every poll.

Needs SQLite >= 3.35 (``RETURNING``), checked at open.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.lowlevel
import anyio.to_thread
import structlog
from anyio.lowlevel import RunVar

from ..devices.catalog import ExecutorInfo, decode_info, encode_info
from ..errors import (
    BadMessage,
    BrokerBusy,
    BrokerCorrupt,
    BrokerError,
    BrokerFull,
    BrokerGone,
    BrokerReadOnly,
    BrokerUnavailable,
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
from ..private import create_private_file, tighten
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
    queued_cancel_message,
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
-- The broker creates a new file with PRAGMA auto_vacuum = INCREMENTAL (before this
-- script: it only takes effect on an empty file), so purging old jobs gives space back.

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
    attempt          INTEGER NOT NULL DEFAULT 0,  -- attempts so far (the current included)
    token            TEXT,                        -- fencing token of the current lease
    lease_until      REAL,                        -- NULL while running: a lost lease
    worker           TEXT,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    started          INTEGER NOT NULL DEFAULT 0,  -- the current delivery was launched
    lapses           INTEGER NOT NULL DEFAULT 0   -- leases that lapsed before launch
);

-- The producer edge: INSERT INTO job_inbox (id, body) VALUES (?, ?).
-- The trigger derives the routing columns from the body. A field of the wrong JSON type
-- (or a body that is not JSON at all) yields the column's default, so the row is still
-- leased by a server worker and dead-lettered with E_BAD_MESSAGE rather than stranded.
-- A body over 1 MiB (MAX_JOB_BYTES) is refused with an error naming the limit.
-- OR IGNORE: a duplicate id or idempotency key inserts nothing (the first job stands).
-- (Generated columns would say the same more briefly, but SQLite recomputes stored
-- generated columns on every UPDATE of the row, which tripled the cost of a lease.)
CREATE VIEW IF NOT EXISTS job_inbox AS SELECT id, body FROM jobs;
CREATE TRIGGER IF NOT EXISTS job_inbox_insert INSTEAD OF INSERT ON job_inbox
BEGIN
    SELECT RAISE(ABORT, 'E_BAD_MESSAGE: job body over 1048576 bytes (MAX_JOB_BYTES)')
    WHERE length(CAST(NEW.body AS BLOB)) > 1048576;
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
-- "Is anything due?", asked by every idle worker at every poll: one index probe, however
-- many delayed jobs wait (the expression is the one the broker's queries use).
CREATE INDEX IF NOT EXISTS jobs_due
    ON jobs (device, coalesce(due_at, not_before, 0)) WHERE state = 'queued';
-- Expired leases (workers that died), and running rows without a lease at all (NULL).
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
-- (metnos_exec/devices/catalog.py). `body` is an ExecutorInfo as JSON. A cache, not queue state:
-- it needs no schema version (a file made before it gains it when a broker opens it).
CREATE TABLE IF NOT EXISTS executors (
    name    TEXT PRIMARY KEY,
    body    TEXT NOT NULL,
    worker  TEXT NOT NULL,
    at      REAL NOT NULL
) WITHOUT ROWID;

PRAGMA user_version = 2;
"""

#: Migrating from version 1 (before retention, unstarted leases and the size bound): the
#: missing columns are added (see `_init_schema`), then the inbox trigger is replaced;
#: `SCHEMA_SQL` (all IF NOT EXISTS) adds the rest.
_MIGRATE_TRIGGER: Final = "DROP TRIGGER IF EXISTS job_inbox_insert;\n"

#: The catalog's table alone (see SCHEMA_SQL), for files made before it existed.
_CATALOG_SQL: Final = SCHEMA_SQL[
    SCHEMA_SQL.index("CREATE TABLE IF NOT EXISTS executors") : SCHEMA_SQL.rindex(
        "PRAGMA user_version"
    )
]

_MIN_SQLITE = (3, 35, 0)


# --- SQL ------------------------------------------------------------------------------

_INSERT = (
    "INSERT INTO jobs (id, body, device, priority, max_attempts, idempotency_key, not_before) "
    "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
)
# The other-language producers' door; its trigger derives the columns from the body.
_INSERT_INBOX = "INSERT INTO job_inbox (id, body) VALUES (?, ?)"
_FIND_BY_KEY = "SELECT id, CAST(body AS BLOB) FROM jobs WHERE idempotency_key = ?"
_FIND_BY_ID = "SELECT CAST(body AS BLOB) FROM jobs WHERE id = ?"
_DUE = "coalesce(due_at, not_before, 0) <= :now"
# A lease is lost once its time is up, or when it has no time at all (a row left
# 'running' with no lease_until can only have been written by hand or by a bug: it would
# otherwise stay running forever). Both parts are index searches on jobs_running.
_EXPIRED = "state = 'running' AND (lease_until <= :now OR lease_until IS NULL)"
_ANY_DUE = (
    "SELECT 1 FROM jobs WHERE state = 'queued' AND device = :dev AND "
    + _DUE
    + " UNION ALL SELECT 1 FROM jobs WHERE state = 'running' AND lease_until <= :now"
    " UNION ALL SELECT 1 FROM jobs WHERE state = 'running' AND lease_until IS NULL LIMIT 1"
)
_ANY_EXPIRED = (
    "SELECT 1 FROM jobs WHERE state = 'running' AND lease_until <= :now"
    " UNION ALL SELECT 1 FROM jobs WHERE state = 'running' AND lease_until IS NULL LIMIT 1"
)
# An unstarted delivery gives its attempt back when it lapses (base.py, "Attempts").
_GIVE_BACK = (
    "attempt = CASE WHEN started THEN attempt ELSE max(attempt - 1, 0) END, "
    "lapses = lapses + CASE WHEN started THEN 0 ELSE 1 END"
)
# Expired leases with attempts (or unstarted lapses) left go back to the queue; the rest
# are settled by _SETTLE_EXPIRED.
_REQUEUE_EXPIRED = (
    "UPDATE jobs SET state = 'queued', token = NULL, lease_until = NULL, due_at = :now, "
    + _GIVE_BACK
    + ", started = 0 WHERE "
    + _EXPIRED
    + " AND cancel_requested = 0 AND CASE WHEN started THEN attempt < max_attempts "
    "ELSE lapses + 1 < :max_lapses END"
)
_SETTLE_EXPIRED = (
    "UPDATE jobs SET state = CASE WHEN cancel_requested THEN 'done' ELSE 'dead' END, "
    "token = NULL, lease_until = NULL, "
    + _GIVE_BACK
    + " WHERE "
    + _EXPIRED
    + " RETURNING CAST(id AS BLOB), CAST(body AS BLOB), attempt, worker, device, "
    "cancel_requested, started, lapses"
)
# Pick, then take. Both run inside one BEGIN IMMEDIATE, which holds the write lock from the
# start, so no other process can take the same rows in between. (A single
# "UPDATE ... WHERE seq IN (SELECT ...) RETURNING" measured 3-4x slower per row here.)
# INDEXED BY: walking jobs_ready in priority order stops after `limit` due rows; the
# planner would otherwise take jobs_due and sort every due row of a backlog per lease.
_PICK = (
    "SELECT seq, CAST(id AS BLOB), CAST(body AS BLOB), attempt + 1, device "
    "FROM jobs INDEXED BY jobs_ready "
    "WHERE state = 'queued' AND device = :dev AND " + _DUE + " "
    "ORDER BY priority DESC, seq LIMIT :limit"
)
_TAKE = (
    "UPDATE jobs SET state = 'running', attempt = attempt + 1, token = ?, lease_until = ?, "
    "worker = ?, started = ? WHERE seq = ?"
)
_SETTLE = (
    "UPDATE jobs SET state = ?, token = NULL, lease_until = NULL "
    "WHERE id = ? AND token = ? AND state = 'running'"
)
_SETTLE_SEQ = (
    "UPDATE jobs SET state = ?, token = NULL, lease_until = NULL "
    "WHERE seq = ? AND token = ? AND state = 'running'"
)
_MARK_STARTED = "UPDATE jobs SET started = 1 WHERE id = ? AND token = ? AND state = 'running'"
_INSERT_RESULT = "INSERT OR IGNORE INTO results (job_id, body, status, at) VALUES (?, ?, ?, ?)"
_INSERT_DEAD = "INSERT OR IGNORE INTO dead_letters (job_id, body, at) VALUES (?, ?, ?)"
_HEARTBEAT = (
    "UPDATE jobs SET lease_until = ? WHERE id = ? AND token = ? AND state = 'running' "
    "RETURNING cancel_requested"
)
_RETRY_LOOKUP = (
    "SELECT attempt, max_attempts, worker, device FROM jobs "
    "WHERE id = ? AND token = ? AND state = 'running'"
)
_REQUEUE = (
    "UPDATE jobs SET state = 'queued', token = NULL, lease_until = NULL, started = 0, "
    "due_at = ?, attempt = attempt - ? WHERE id = ? AND token = ? AND state = 'running'"
)
_GET_RESULT = "SELECT CAST(body AS BLOB) FROM results WHERE job_id = ?"
_LEASE_IS_CURRENT = "SELECT 1 FROM jobs WHERE id = ? AND token = ? AND state = 'running'"
#: Ids per ``IN (...)`` list: well under SQLite's host-parameter cap (999 before 3.32).
_IN_CHUNK = 500
_GET_STATE = "SELECT state, attempt, worker, lease_until, cancel_requested FROM jobs WHERE id = ?"
# Retention: finished jobs whose result is older than the cut, a batch at a time. No index
# on `at` (one more write per ack, for an hourly purge): the scan goes in job id order,
# which for ULIDs is submission order, so the old rows come first.
_PURGE_PICK = (
    "SELECT r.job_id FROM results r JOIN jobs j ON j.id = r.job_id "
    "WHERE r.at < ? AND j.state IN ('done', 'dead') LIMIT ?"
)
# Results and dead letters whose job row is gone (written by hand, or left by a crash of
# an older version between two deletes).
_PURGE_ORPHANS = (
    "SELECT job_id FROM results WHERE at < ? AND NOT EXISTS "
    "(SELECT 1 FROM jobs WHERE id = results.job_id) LIMIT ?"
)
_PURGE_BATCH = 500
#: Free pages given back per incremental-vacuum transaction (4 MiB at 4 KiB pages), so a
#: large reclaim never holds the write lock for long.
_VACUUM_STEP_PAGES = 1024
#: SQLITE_IOERR_SHMSIZE (extended result code; not in every Python's sqlite3 module).
_SQLITE_IOERR_SHMSIZE: Final = 4874
#: How often (seconds) a call checks that the path still names the file it opened.
_FILE_CHECK_S = 1.0


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


def _text(value: bytes | str) -> str:
    """A column fetched as bytes (``CAST(... AS BLOB)``), as text; bad bytes replaced."""
    return value if isinstance(value, str) else bytes(value).decode("utf-8", errors="replace")


def _store_error(exc: sqlite3.Error, where: str, *, busy_s: float) -> BrokerError:
    """The `BrokerError` an sqlite3 exception means (see the module docstring)."""
    code = getattr(exc, "sqlite_errorcode", None)
    primary = code & 0xFF if isinstance(code, int) else None
    text = f"{where}: {exc}"
    if primary in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return BrokerBusy(
            f"{where}: the file is locked by another process (waited {busy_s:g} s; the "
            "busy_timeout_s option sets how long): try again"
        )
    if primary == sqlite3.SQLITE_FULL:
        return BrokerFull(f"{text} (the disk or the file system holding it is full)")
    if code == _SQLITE_IOERR_SHMSIZE:
        # The -shm file could not grow: what a full file system does to a WAL queue that
        # no process has open yet (SQLite says "disk I/O error").
        return BrokerFull(f"{text} (its -shm file cannot grow: the file system is full)")
    if primary == sqlite3.SQLITE_READONLY:
        return BrokerReadOnly(
            f"{text} (the file, its folder or the file system is read-only to this user)"
        )
    if primary in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
        return BrokerCorrupt(f"{text} (the file is damaged or is not a queue database)")
    if primary == sqlite3.SQLITE_CANTOPEN:
        return BrokerUnavailable(
            f"{text} (the folder may be missing or read-only: a WAL queue needs to create "
            "its -wal and -shm files beside it)"
        )
    return BrokerUnavailable(text)


def _read_only_files(path: Path) -> str:
    """Which of the queue's files (and its folder) this user cannot write, said plainly.

    SQLite gives a -wal file the mode of the database file when it creates it: a file
    made read-only for a while can leave a read-only -wal behind it after it is fixed.
    """
    names = [path, Path(f"{path}-wal"), Path(f"{path}-shm"), path.parent]
    stuck = [str(n) for n in names if n.exists() and not os.access(n, os.W_OK)]
    return f"; not writable here: {', '.join(stuck)}" if stuck else ""


class _Notes:
    """Records to log once a transaction committed (never from inside it: a rolled-back
    transaction, or a worker killed before its commit, would leave a record of something
    that did not happen, and the next worker would log it again)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str, dict[str, Any]]] = []

    def add(self, level: str, event: str, **fields: Any) -> None:
        self.items.append((level, event, fields))

    def emit(self) -> None:
        for level, event, fields in self.items:
            getattr(_log, level)(event, **fields)


class SQLiteBroker(Broker):
    """`Broker` on one SQLite file.

    Args:
        path: the database file (created with its schema when missing).
        clock: unix-seconds clock for leases, delays and timestamps (tests inject one).
        poll_interval_s: how often idle waits look at the file again.
        busy_timeout_s: how long a statement waits for another process's write lock
            before `BrokerBusy`.
        synchronous: ``NORMAL`` (default: durable across process crashes, may lose the
            last transactions on power loss) or ``FULL``.
        create: create the file (and its schema) when it is missing, and refuse a file
            that cannot be written (``BrokerReadOnly``). ``False`` for readers
            (``status``, ``result``, ``cancel``): a mistyped path must not create an
            empty queue that then answers "no such job".

    Raises:
        BrokerUnavailable: SQLite older than 3.35, the file has a newer schema, or
            (with ``create=False``) there is no file at `path`.
        BrokerReadOnly: (with ``create=True``) the file cannot be written.
        BrokerError: another failure opening the file (see `_store_error`).
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
        self._busy_s = busy_timeout_s
        where = f"the queue database {self.path.absolute()}"
        if create:
            # Every job's arguments and results: 0600 whatever the umask (SQLite makes the
            # -wal and -shm with the database's own mode), tightened if it is open to
            # other users (`metnos_exec.private`).
            with contextlib.suppress(OSError):  # SQLite says why, in its own terms, below
                create_private_file(self.path)
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
            raise _store_error(exc, f"cannot open {where}", busy_s=busy_timeout_s) from None
        try:
            self._busy_ms = int(busy_timeout_s * 1000)
            self._db.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
            if self._db.execute("PRAGMA page_count").fetchone() == (0,):
                # A new file: only now, before anything is written (the switch to WAL
                # writes the header), can it get incremental vacuum, so that purges give
                # space back (`_reclaim`). A file made by version 1 gets it at its first
                # full `vacuum`.
                self._db.execute("PRAGMA auto_vacuum = INCREMENTAL")
            (mode,) = self._db.execute("PRAGMA journal_mode = WAL").fetchone()
            if mode != "wal":
                # Without WAL, readers block writers and the lock fallback turns into a
                # stall; refuse rather than run slowly and surprise (e.g. on NFS).
                raise BrokerUnavailable(
                    f"{self.path} cannot use write-ahead logging (journal_mode={mode}); "
                    "put the queue on a local file system"
                )
            self._db.execute(f"PRAGMA synchronous = {synchronous.upper()}")
            if create:
                for suffix in ("-wal", "-shm"):
                    tighten(f"{self.path}{suffix}")
            self._init_schema()
            if create:
                self._check_writable()
            self._db.execute("PRAGMA busy_timeout = 0")
            # The file this broker serves, to notice when the path names another one.
            st = os.stat(self.path)
        except sqlite3.Error as exc:
            self._db.close()
            error = _store_error(exc, f"cannot use {where}", busy_s=busy_timeout_s)
            if isinstance(error, BrokerReadOnly):
                error = BrokerReadOnly(error.message + _read_only_files(self.path))
            raise error from None
        except OSError as exc:
            self._db.close()
            raise BrokerUnavailable(f"cannot use {where}: {exc}") from None
        except BaseException:
            self._db.close()
            raise
        self._identity = (st.st_dev, st.st_ino)
        self._next_file_check = time.monotonic() + _FILE_CHECK_S
        self._gone: BrokerGone | None = None
        self._limiter: anyio.CapacityLimiter | None = None
        self._wake_key = str(self.path.resolve())
        self._closed = False

    @property
    def queue_id(self) -> str:
        return f"sqlite:{self._wake_key}"

    @classmethod
    def from_url(cls, url: str, **options: Any) -> SQLiteBroker:
        """``sqlite:///relative.db`` or ``sqlite:////absolute.db``; query options
        ``poll_interval_s``, ``busy_timeout_s``, ``synchronous``, ``create``."""
        rest = url.split("://", 1)[1].split("?", 1)[0]
        if not rest.startswith("/") or rest == "/":
            raise ValueError(f"expected sqlite:///path/to/file.db, got {url!r}")
        path = rest[1:]
        kwargs = take_options(
            "sqlite",
            options,
            floats=("poll_interval_s", "busy_timeout_s"),
            strings=("synchronous",),
            flags=("create",),
            objects=("clock",),
        )
        return cls(path, **kwargs)

    def _init_schema(self) -> None:
        (version,) = self._db.execute("PRAGMA user_version").fetchone()
        if version > SCHEMA_VERSION:
            raise BrokerUnavailable(
                f"{self.path} has queue schema version {version}; this metnos-exec "
                f"understands {SCHEMA_VERSION}. Upgrade metnos-exec."
            )
        missing = self._missing_columns()
        if version == SCHEMA_VERSION and not missing:
            self._ensure_catalog()
            return
        migrate = ""
        if missing:
            # From version 1 (or a file of this version made without them): by what the
            # file lacks rather than by its number, so a file is brought up to date
            # whatever build made it.
            migrate = (
                "".join(
                    f"ALTER TABLE jobs ADD COLUMN {name} INTEGER NOT NULL DEFAULT 0;\n"
                    for name in sorted(missing)
                )
                + _MIGRATE_TRIGGER
            )
            # Recorded now, applied by the first full `vacuum` (``purge --vacuum``).
            self._db.execute("PRAGMA auto_vacuum = INCREMENTAL")
        # BEGIN IMMEDIATE around the script: two processes opening a fresh file at once
        # must not interleave their CREATEs (IF NOT EXISTS makes the second a no-op).
        self._db.executescript("BEGIN IMMEDIATE;\n" + migrate + SCHEMA_SQL + "\nCOMMIT;")

    def _missing_columns(self) -> set[str]:
        """Columns of version 2's `jobs` an existing file lacks (none for a new file)."""
        have = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
        return set() if not have else {"started", "lapses"} - have

    def _check_writable(self) -> None:
        """Refuse a store this process cannot write, at open, not at the first lease.

        SQLite opens a read-only file happily and even grants ``BEGIN IMMEDIATE``; only a
        write fails. So write (the header's user_version, to the value it has) and roll
        back: nothing changes on disk either way.
        """
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        finally:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")

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

    def _check_file(self) -> None:
        """Raise `BrokerGone` once the path no longer names the file this broker opened.

        A worker whose queue file was deleted (or replaced, e.g. by a demo starting
        afresh) would otherwise serve a file no producer sees: nothing new would ever run
        and nothing would say why. Checked at most once per `_FILE_CHECK_S`.
        """
        if self._gone is not None:
            raise self._gone
        now = time.monotonic()
        if now < self._next_file_check:
            return
        self._next_file_check = now + _FILE_CHECK_S
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            what = "was deleted"
        except OSError as exc:
            raise BrokerUnavailable(f"cannot check the queue file {self.path}: {exc}") from None
        else:
            if (st.st_dev, st.st_ino) == self._identity:
                return
            what = "was replaced by another file"
        self._gone = BrokerGone(
            f"the queue file {self.path.absolute()} {what} while this process had it open; "
            "this process can no longer reach the queue its producers use. Start it again "
            "on the queue file you mean"
        )
        raise self._gone

    def _error(self, exc: sqlite3.Error) -> BrokerError:
        return _store_error(exc, f"the queue database {self.path.absolute()}", busy_s=self._busy_s)

    async def _run(self, fn: Callable[..., Any], *args: Any, inline: bool = True) -> Any:
        """Run `fn(*args)` against the connection: inline when the connection is free and
        the database unlocked, else in a worker thread that may wait for the lock.

        Raises:
            BrokerError: the store failed (`_store_error`), or the file is gone.
        """
        if self._closed:
            raise BrokerUnavailable(f"the broker on {self.path} is closed")
        self._check_file()
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(1)
        limiter = self._limiter
        if inline:
            try:
                limiter.acquire_nowait()
            except anyio.WouldBlock:
                # Another call of ours holds the connection: wait for it, then run inline
                # all the same. Sent to a thread instead, this call held the connection
                # across its hop, so the next call found it busy and hopped in turn:
                # measured, one call sent to a thread (a batch, a lock held by another
                # process) made nearly every later call of the run take a thread (three
                # hops per ~64 echo jobs).
                await limiter.acquire()
                if self._closed:
                    limiter.release()
                    raise BrokerUnavailable(f"the broker on {self.path} is closed") from None
            try:
                out = fn(*args)
            except sqlite3.Error as exc:
                limiter.release()
                # Only a lock held elsewhere is redone (in a thread that may wait); a
                # transaction body either failed at BEGIN or was rolled back, so
                # redoing it is safe.
                code = getattr(exc, "sqlite_errorcode", None)
                if not isinstance(code, int) or code & 0xFF != sqlite3.SQLITE_BUSY:
                    raise self._error(exc) from None
            except BaseException:
                limiter.release()
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
        try:
            return await anyio.to_thread.run_sync(self._patient, fn, args, limiter=limiter)
        except sqlite3.Error as exc:
            raise self._error(exc) from None

    def _patient(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        self._db.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
        try:
            return fn(*args)
        finally:
            self._db.execute("PRAGMA busy_timeout = 0")

    def _txn(
        self,
        body: Callable[[sqlite3.Connection, float], Any],
        db: sqlite3.Connection | None = None,
    ) -> Any:
        """Run ``body(db, now)`` in one ``BEGIN IMMEDIATE`` transaction (on this broker's
        connection unless `db` is given); ``now`` is read once the write lock is held, so
        no wait for it ages a deadline written here."""
        db = self._db if db is None else db
        db.execute("BEGIN IMMEDIATE")
        try:
            out = body(db, self._clock())
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
        try:
            body = encode(result)
        except Exception as exc:  # output msgspec cannot encode (too deep, ...)
            raise BadMessage(
                f"the result of job {result.job_id} cannot be encoded: {type(exc).__name__}: {exc}"
            ) from None
        cur = db.execute(_INSERT_RESULT, (result.job_id, body, result.status, now))
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
        cut = raw is not None and len(raw) > MAX_JOB_BYTES
        letter = DeadLetter(
            job_id=job_id,
            job=job,
            raw=raw[:MAX_JOB_BYTES] if raw is not None else None,
            raw_truncated=cut,
            error=error,
            attempts=attempt,
            at=now,
            worker=worker,
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
    def _decode_body(job_id: str, body: bytes | str) -> Job | ErrorInfo:
        try:
            job = decode_job(body)
        except BadMessage as exc:
            return ErrorInfo(code=exc.code, message=exc.message)
        except Exception as exc:  # decode_job promises BadMessage; belt and braces
            return ErrorInfo(
                code=BadMessage.code,
                message=f"job message rejected: {type(exc).__name__}: {exc}",
            )
        if job.id != job_id:
            return ErrorInfo(
                code=BadMessage.code,
                message=f"job message rejected: body id {job.id!r} differs from row id",
            )
        return job

    # --- producing --------------------------------------------------------------------

    @staticmethod
    def _insert(db: sqlite3.Connection, job: Job, body: str) -> SubmitReceipt:
        cur = db.execute(
            _INSERT,
            (
                job.id,
                body,
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
                original_id = _text(row[0])
                original = SQLiteBroker._decode_body(original_id, row[1])
                # A stored body that no longer decodes cannot be compared; it is
                # dead-lettered when leased, and the key still names it.
                if isinstance(original, Job):
                    check_idempotent_reuse(original, job)
                return SubmitReceipt(original_id, duplicate=True)
        # The id is known: the same job again is a duplicate, another one a conflict.
        row = db.execute(_FIND_BY_ID, (job.id,)).fetchone()
        if row is not None:
            known = SQLiteBroker._decode_body(job.id, row[0])
            if isinstance(known, Job):
                check_idempotent_reuse(known, job, by_id=True)
        return SubmitReceipt(job.id, duplicate=True)

    async def submit(self, job: Job) -> SubmitReceipt:
        body = encode_job(job).decode()
        receipt: SubmitReceipt = await self._run(self._insert, self._db, job, body)
        self._wake_workers()
        return receipt

    async def submit_many(self, jobs: Sequence[Job]) -> list[SubmitReceipt]:
        bodies = [encode_job(job).decode() for job in jobs]

        def work(db: sqlite3.Connection, _now: float) -> list[SubmitReceipt]:
            return [self._insert(db, job, body) for job, body in zip(jobs, bodies, strict=True)]

        receipts: list[SubmitReceipt] = await self._run(self._txn, work, inline=len(jobs) <= 8)
        self._wake_workers()
        return receipts

    async def submit_raw(self, data: bytes) -> str:
        data = bytes(data)
        check_job_size(len(data))
        try:
            job = decode_job(data)
        except BadMessage:
            job_id = new_job_id()
            body: str | bytes
            try:
                body = data.decode("utf-8")
            except UnicodeDecodeError:
                body = data  # stored as a BLOB; leasing dead-letters it
            # Through the producers' door, so the inbox trigger is what routes it.
            await self._run(self._db.execute, _INSERT_INBOX, (job_id, body))
            self._wake_workers()
            return job_id
        return (await self.submit(job)).job_id

    # --- consuming --------------------------------------------------------------------

    def _settle_expired(self, db: sqlite3.Connection, now: float, notes: _Notes) -> None:
        db.execute(_REQUEUE_EXPIRED, {"now": now, "max_lapses": MAX_UNSTARTED_LAPSES})
        rows = db.execute(_SETTLE_EXPIRED, {"now": now}).fetchall()
        for raw_id, body, attempt, worker, device, cancel, started, lapses in rows:
            job_id = _text(raw_id)
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
            notes.add(
                "warning",
                "job.dead_lettered",
                job_id=job_id,
                # The job's own executor and worker, not the sweeping worker's context.
                executor=decoded.executor if isinstance(decoded, Job) else None,
                worker=worker,
                device=device,
                code=error.code,
                message=error.message,
            )

    def _lease_sync(
        self, worker_id: str, visibility_s: float, dev: str, limit: int, started: int
    ) -> tuple[list[Lease], _Notes]:
        db = self._db
        notes = _Notes()
        # A plain read first: an idle worker polling an empty queue never takes the write
        # lock, so it does not slow down the processes that have work.
        if db.execute(_ANY_DUE, {"now": self._clock(), "dev": dev}).fetchone() is None:
            return [], notes
        out: list[Lease] = []
        db.execute("BEGIN IMMEDIATE")
        try:
            # After BEGIN IMMEDIATE returned: any wait for the lock is behind us.
            now = self._clock()
            if db.execute(_ANY_EXPIRED, {"now": now}).fetchone() is not None:
                self._settle_expired(db, now, notes)
            until = now + visibility_s
            base = os.urandom(8).hex()
            while len(out) < limit:
                rows = db.execute(
                    _PICK, {"dev": dev, "now": now, "limit": limit - len(out)}
                ).fetchall()
                if not rows:
                    break
                tokens = {seq: f"{base}.{seq}" for seq, *_ in rows}
                # The first `started` jobs handed out start at once (base.py, "Attempts").
                # A row dead-lettered below takes one of those places: the count stays a
                # bound, never more than the caller can launch now.
                now_ok = max(0, started - len(out))
                db.executemany(
                    _TAKE,
                    [
                        (tokens[seq], until, worker_id, int(i < now_ok), seq)
                        for i, (seq, *_) in enumerate(rows)
                    ],
                )
                for i, (seq, raw_id, body, attempt, device) in enumerate(rows):
                    token = tokens[seq]
                    job_id = _text(raw_id)
                    decoded = self._decode_body(job_id, body)
                    if isinstance(decoded, ErrorInfo):
                        db.execute(_SETTLE_SEQ, ("dead", seq, token))
                        self._store_dead(
                            db,
                            job_id=job_id,
                            job=None,
                            raw=bytes(body),
                            error=decoded,
                            attempt=attempt,
                            worker=worker_id,
                            device=device,
                            now=now,
                        )
                        notes.add(
                            "error",
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
                            started=i < now_ok,
                        )
                    )
        except BaseException:
            if db.in_transaction:  # SQLite may have rolled back already
                db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return out, notes

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
        leases, notes = await self._run(
            self._lease_sync,
            worker_id,
            visibility_s,
            device or SERVER_DEVICE,
            limit,
            limit if started is None else started,
            inline=limit <= 64,
        )
        notes.emit()
        if notes.items:
            self._wake_results()
        out: list[Lease] = leases
        return out

    async def wait_for_work(self, timeout: float) -> None:  # noqa: ASYNC109
        event = _wake_event(self._wake_key, "work")
        with anyio.move_on_after(min(timeout, self._poll)):
            await event.wait()

    async def heartbeat(self, lease: Lease, *, visibility_s: float | None = None) -> HeartbeatReply:
        window = lease.visibility_s if visibility_s is None else visibility_s

        def work(db: sqlite3.Connection, now: float) -> HeartbeatReply:
            until = now + window
            row = db.execute(_HEARTBEAT, (until, lease.job.id, lease.token)).fetchone()
            if row is None:
                return HeartbeatReply(ok=False)
            return HeartbeatReply(ok=True, cancel_requested=bool(row[0]), lease_until=until)

        reply: HeartbeatReply = await self._run(self._txn, work)
        return reply

    async def mark_started(self, lease: Lease) -> bool:
        def work() -> bool:
            cur = self._db.execute(_MARK_STARTED, (lease.job.id, lease.token))
            return cur.rowcount == 1

        ok: bool = await self._run(work)
        return ok

    async def mark_started_many(self, leases: Sequence[Lease]) -> list[bool]:
        def work(db: sqlite3.Connection, _now: float) -> list[bool]:
            return [
                db.execute(_MARK_STARTED, (lease.job.id, lease.token)).rowcount == 1
                for lease in leases
            ]

        oks: list[bool] = await self._run(self._txn, work, inline=len(leases) <= 128)
        return oks

    def _ack_one(self, db: sqlite3.Connection, lease: Lease, result: Result, now: float) -> bool:
        if result.job_id != lease.job.id:
            return False
        state = "dead" if result.status == "dead" else "done"
        if db.execute(_SETTLE, (state, lease.job.id, lease.token)).rowcount != 1:
            return False
        return self._store_result(db, result, now)

    async def ack(self, lease: Lease, result: Result) -> bool:
        ok: bool = await self._run(self._txn, lambda db, now: self._ack_one(db, lease, result, now))
        self._wake_results()
        return ok

    async def ack_many(self, items: Sequence[tuple[Lease, Result]]) -> list[bool]:
        def work(db: sqlite3.Connection, now: float) -> list[bool]:
            return [self._ack_one(db, lease, result, now) for lease, result in items]

        oks: list[bool] = await self._run(self._txn, work, inline=len(items) <= 128)
        self._wake_results()
        return oks

    async def retry(self, lease: Lease, *, error: ErrorInfo, delay_s: float) -> RetryOutcome:
        def work(db: sqlite3.Connection, now: float) -> RetryOutcome:
            row = db.execute(_RETRY_LOOKUP, (lease.job.id, lease.token)).fetchone()
            if row is None:
                return "lost"
            attempt, max_attempts, _worker, _device = row
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
        attempt, _max, worker, device = row
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
        def work(db: sqlite3.Connection, now: float) -> bool:
            row = db.execute(_RETRY_LOOKUP, (lease.job.id, lease.token)).fetchone()
            if row is None:
                return False
            self._settle_dead(db, lease, row, error, now)
            return True

        ok: bool = await self._run(self._txn, work)
        self._wake_results()
        return ok

    async def release(self, lease: Lease) -> bool:
        def work(db: sqlite3.Connection, now: float) -> bool:
            cur = db.execute(_REQUEUE, (now, 1, lease.job.id, lease.token))
            return cur.rowcount == 1

        ok: bool = await self._run(self._txn, work)
        self._wake_workers()
        return ok

    # --- control and inspection -------------------------------------------------------

    async def cancel(self, job_id: str) -> CancelOutcome:
        def work(db: sqlite3.Connection, now: float) -> CancelOutcome:
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
                        error=ErrorInfo(code=E_CANCELLED, message=queued_cancel_message(attempt)),
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
        if row is None:
            return None
        try:
            return decode_result(row[0])
        except BadMessage as exc:
            raise BrokerCorrupt(
                f"the stored result of job {job_id} in {self.path} cannot be read: {exc.message}"
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
                "SELECT CAST(job_id AS BLOB), CAST(body AS BLOB), at FROM dead_letters "
                "ORDER BY seq DESC LIMIT ?",
                (limit,),
            ).fetchall()
        )
        out = []
        for raw_id, body, at in rows:
            try:
                out.append(decode_dead_letter(body))
            except BadMessage as exc:
                # One damaged record must not hide the others; say what it is.
                out.append(
                    DeadLetter(
                        job_id=_text(raw_id),
                        raw=bytes(body)[:MAX_JOB_BYTES],
                        raw_truncated=len(body) > MAX_JOB_BYTES,
                        error=ErrorInfo(
                            code=BrokerCorrupt.code,
                            message=f"this dead letter's stored record is unreadable: "
                            f"{exc.message}",
                        ),
                        at=at if isinstance(at, int | float) else 0.0,
                    )
                )
        return out

    async def stats(self) -> BrokerStats:
        def work() -> BrokerStats:
            now = self._clock()
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

        def work(db: sqlite3.Connection, _now: float) -> None:
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
                    "SELECT CAST(body AS BLOB) FROM executors WHERE name = ?", (name,)
                ).fetchone()
            except sqlite3.OperationalError as exc:
                if "no such table" in str(exc):
                    return None  # a file without the catalog (read-only, made before it)
                raise

        row = await self._run(work)
        return None if row is None else decode_info(row[0])

    # --- retention --------------------------------------------------------------------

    def _purge_batch(self, db: sqlite3.Connection, now: float, older_than_s: float) -> int:
        cut = now - older_than_s
        ids = [_text(r[0]) for r in db.execute(_PURGE_PICK, (cut, _PURGE_BATCH)).fetchall()]
        orphans = [_text(r[0]) for r in db.execute(_PURGE_ORPHANS, (cut, _PURGE_BATCH)).fetchall()]
        if not ids and not orphans:
            return 0
        if ids:
            for hook in self.purge_hooks:
                hook.forget_jobs(db, ids)
        for group in (ids, orphans):
            if not group:
                continue
            marks = ",".join("?" * len(group))
            db.execute(f"DELETE FROM jobs WHERE id IN ({marks})", group)
            db.execute(f"DELETE FROM results WHERE job_id IN ({marks})", group)
            db.execute(f"DELETE FROM dead_letters WHERE job_id IN ({marks})", group)
            # A job's undo entries go with its result (retention follows the results').
            db.execute(f"DELETE FROM undo_entries WHERE job_id IN ({marks})", group)
        return len(ids) + len(orphans)

    @staticmethod
    def _purge_undo(db: sqlite3.Connection, cut: float) -> int:
        """Undo entries no stored result confirms that are older than `cut` (their job
        never got its result, or is gone), and the blob rows of entries no longer stored:
        after this, `undo_blobs` is what the blob store must keep."""
        gone = db.execute(
            "DELETE FROM undo_entries WHERE job_id NOT IN (SELECT job_id FROM results) "
            "AND (at < ? OR job_id NOT IN (SELECT id FROM jobs))",
            (cut,),
        ).rowcount
        gone += db.execute(
            "DELETE FROM undo_entries WHERE at < ? AND id NOT IN (SELECT value FROM "
            "results, json_each(results.body, '$.undo_ids') WHERE results.job_id = "
            "undo_entries.job_id)",
            (cut,),
        ).rowcount
        db.execute("DELETE FROM undo_blobs WHERE entry_id NOT IN (SELECT id FROM undo_entries)")
        return int(gone)

    @staticmethod
    def _pages(db: sqlite3.Connection) -> tuple[int, int]:
        (pages,) = db.execute("PRAGMA page_count").fetchone()
        (page_size,) = db.execute("PRAGMA page_size").fetchone()
        return int(pages), int(page_size)

    @classmethod
    def _reclaim(cls, db: sqlite3.Connection, stop: threading.Event | None = None) -> int | None:
        """Give free pages back to the file system: incremental vacuum, in steps.

        ``None`` when the file was made without ``auto_vacuum = INCREMENTAL`` (created by
        version 1 of the schema): only a full `vacuum` can shrink it (``metnos-exec
        purge --vacuum``), and a worker must not hold the whole file for that.
        """
        (mode,) = db.execute("PRAGMA auto_vacuum").fetchone()
        if mode != 2:
            return None
        before, page_size = cls._pages(db)
        while stop is None or not stop.is_set():
            (free,) = db.execute("PRAGMA freelist_count").fetchone()
            if not free:
                break
            db.execute("BEGIN IMMEDIATE")
            try:
                # One page per row: the pragma only does its work as its rows are read.
                db.execute(f"PRAGMA incremental_vacuum({_VACUUM_STEP_PAGES})").fetchall()
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        # The main file only shrinks when the WAL is checkpointed (TRUNCATE also empties
        # the WAL). Briefly: it waits for readers through the busy handler.
        db.execute("PRAGMA busy_timeout = 1000")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        return max(0, before - cls._pages(db)[0]) * page_size

    def _aux_connection(self) -> sqlite3.Connection:
        """A connection of its own for long work (purge), so this broker's connection
        stays free: a worker purging in the background keeps leasing and acking."""
        db = sqlite3.connect(self.path, timeout=0, isolation_level=None)
        db.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
        return db

    async def purge(self, *, older_than_s: float) -> PurgeReport:
        if self._closed:
            raise BrokerUnavailable(f"the broker on {self.path} is closed")
        self._check_file()
        stop = threading.Event()

        def work() -> PurgeReport:
            db = self._aux_connection()
            try:
                jobs = 0
                # Many short transactions, each waiting its turn for the lock: producers
                # and workers go on between them.
                while not stop.is_set() and (
                    n := self._txn(lambda d, now: self._purge_batch(d, now, older_than_s), db)
                ):
                    jobs += n
                collected = 0
                if not stop.is_set():
                    collected = self._txn(
                        lambda d, now: (
                            self._purge_undo(d, now - older_than_s)
                            + sum(
                                int(h.collect(d, before=now - older_than_s))
                                for h in self.purge_hooks
                            )
                        ),
                        db,
                    )
                reclaimed: int | None = 0
                if stop.is_set():
                    reclaimed = None
                elif jobs or collected or db.execute("PRAGMA freelist_count").fetchone()[0]:
                    # Only when there is something to give back: the checkpoint at the end
                    # waits for readers, which a worker starting up need not do each time.
                    reclaimed = self._reclaim(db, stop)
                elif db.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:
                    reclaimed = None  # an older file: only `vacuum` can shrink it
                return PurgeReport(jobs=jobs, collected=collected, reclaimed_bytes=reclaimed)
            finally:
                db.close()

        async def watch() -> None:
            # A cancel of the caller (a worker stopping) reaches the thread through
            # `stop`: it ends at its next batch (each one transaction, so what it leaves
            # is consistent), and the caller waits only for that, never for a long purge,
            # and leaves no thread (nor its connection) behind.
            try:
                await anyio.sleep_forever()
            finally:
                stop.set()

        def guarded() -> PurgeReport | BrokerError:
            # The error returned, not raised: raised inside the task group below it would
            # come out wrapped in an exception group.
            try:
                return work()
            except sqlite3.Error as exc:
                return self._error(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            outcome = await anyio.to_thread.run_sync(guarded)
            tg.cancel_scope.cancel()
        if isinstance(outcome, BrokerError):
            raise outcome
        return outcome

    async def vacuum(self) -> int:
        """Rewrite the whole file (``VACUUM``) and switch it to incremental vacuum, so
        later purges give space back by themselves. Returns the bytes given back.

        For a file made by an older version; it holds the write lock for the whole
        rewrite (seconds on a large queue), so it is an operator's command
        (``metnos-exec purge --vacuum``), never something a worker does on its own.
        """

        def work() -> int:
            db = self._db
            before, page_size = self._pages(db)
            db.execute("PRAGMA auto_vacuum = INCREMENTAL")
            db.execute("VACUUM")
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            return max(0, before - self._pages(db)[0]) * page_size

        reclaimed: int = await self._run(work, inline=False)
        return reclaimed

    # --- undo entries -----------------------------------------------------------------

    async def record_undo(
        self, lease: Lease, entries: Sequence[UndoEntry], *, undoes: Sequence[str] = ()
    ) -> bool:
        bodies = [(e.id, e.job_id, encode(e).decode()) for e in entries]
        blobs = [(e.id, digest) for e in entries for digest in sorted(e.blobs())]

        def work(db: sqlite3.Connection, now: float) -> bool:
            # Fenced like an ack: only the current lease may record.
            if db.execute(_LEASE_IS_CURRENT, (lease.job.id, lease.token)).fetchone() is None:
                return False
            db.executemany(
                "INSERT OR REPLACE INTO undo_entries (id, job_id, body, at) VALUES (?, ?, ?, ?)",
                [(*row, now) for row in bodies],
            )
            db.executemany(
                "INSERT OR IGNORE INTO undo_blobs (entry_id, sha256) VALUES (?, ?)", blobs
            )
            db.executemany(
                "UPDATE undo_entries SET undone_by = ? WHERE id = ?",
                [(lease.job.id, entry_id) for entry_id in undoes],
            )
            return True

        ok: bool = await self._run(self._txn, work, inline=len(bodies) <= 8)
        return ok

    async def get_undo(self, entry_ids: Sequence[str]) -> list[UndoRecord]:
        ids = list(entry_ids)

        def work() -> dict[str, UndoRecord]:
            found: dict[str, UndoRecord] = {}
            for i in range(0, len(ids), _IN_CHUNK):
                chunk = ids[i : i + _IN_CHUNK]
                marks = ",".join("?" * len(chunk))
                for entry_id, body, at, undone_by in self._db.execute(
                    "SELECT id, CAST(body AS BLOB), at, undone_by FROM undo_entries "
                    f"WHERE id IN ({marks})",
                    chunk,
                ):
                    try:
                        entry = decode_undo_entry(body)
                    except BadMessage as exc:
                        raise BrokerCorrupt(
                            f"the stored undo entry {entry_id} in {self.path} cannot be read: "
                            f"{exc.message}"
                        ) from None
                    found[entry_id] = UndoRecord(entry=entry, undone_by=undone_by, recorded_at=at)
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
