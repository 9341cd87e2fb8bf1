"""The SQLite queue's schema, and bringing a file of an older version up to it.

`SCHEMA_SQL` is the whole schema (every statement ``IF NOT EXISTS``), run on every open
in one ``BEGIN IMMEDIATE`` transaction; `init_schema` adds before it what a file of an
older version lacks (columns, the inbox trigger's replacement, the catalog table), by what
the file lacks rather than by its version number. `check_writable` is the open's test
that the file takes writes.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import Final

from ..errors import BrokerUnavailable

__all__ = ("SCHEMA_SQL", "SCHEMA_VERSION", "check_writable", "init_schema")

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
    lapses           INTEGER NOT NULL DEFAULT 0,  -- leases that lapsed before launch
    -- Routing: workers lease only the executors they serve. NULL (a row an older build
    -- wrote): any server worker leases it.
    executor         TEXT,
    -- The latest progress its executor reported (queue/schemas/progress.json), written
    -- by the worker holding the lease at most once a second; NULL: none reported.
    progress         TEXT
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
                                not_before, executor)
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
            WHEN 'integer' THEN json_extract(NEW.body, '$.not_before') END END,
        CASE WHEN ok THEN CASE json_type(NEW.body, '$.executor')
            WHEN 'text' THEN json_extract(NEW.body, '$.executor') END END
    FROM (SELECT json_valid(NEW.body) AS ok);
END;

-- Leasing: the best queued job for one device (a worker that serves every executor)...
CREATE INDEX IF NOT EXISTS jobs_ready
    ON jobs (device, priority DESC, seq) WHERE state = 'queued';
-- ... and for one device and executor (a worker that serves some: one walk each).
CREATE INDEX IF NOT EXISTS jobs_route
    ON jobs (device, executor, priority DESC, seq) WHERE state = 'queued';
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

-- Who serves the queue: one presence record per worker, renewed every few seconds
-- (metnos_exec/brokers/presence.py; `body` is a WorkerInfo as JSON). Advice for `status`,
-- not queue state: like the catalog, it needs no schema version.
CREATE TABLE IF NOT EXISTS workers (
    id      TEXT PRIMARY KEY,
    body    TEXT NOT NULL,
    seen    REAL NOT NULL
) WITHOUT ROWID;

PRAGMA user_version = 2;
"""

#: Migrating from version 1 (before retention, unstarted leases and the size bound): the
#: missing columns are added (see `_init_schema`), then the inbox trigger is replaced;
#: `SCHEMA_SQL` (all IF NOT EXISTS) adds the rest.
_MIGRATE_TRIGGER: Final = "DROP TRIGGER IF EXISTS job_inbox_insert;\n"

#: The columns a file made by an older build may lack, with their definitions.
_COLUMNS: Final = {
    "started": "INTEGER NOT NULL DEFAULT 0",
    "lapses": "INTEGER NOT NULL DEFAULT 0",
    "executor": "TEXT",
    "progress": "TEXT",
}

#: A file gaining the routing column: its unfinished jobs get their routes from their
#: bodies (a body that is not JSON, or names no executor, keeps NULL: any worker).
_BACKFILL_ROUTES: Final = (
    "UPDATE jobs SET executor = json_extract(body, '$.executor') "
    "WHERE state IN ('queued', 'running') AND typeof(body) = 'text' AND json_valid(body) "
    "AND json_type(body, '$.executor') = 'text';\n"
)

#: The catalog's and the presence records' tables (see SCHEMA_SQL), for files made
#: before they existed.
_CATALOG_SQL: Final = SCHEMA_SQL[
    SCHEMA_SQL.index("CREATE TABLE IF NOT EXISTS executors") : SCHEMA_SQL.rindex(
        "PRAGMA user_version"
    )
]


def init_schema(db: sqlite3.Connection, path: Path, *, _retried: bool = False) -> None:
    """Create the schema in a new file, or bring the file at `path` up to this version.

    Raises:
        BrokerUnavailable: the file has a newer schema than this version understands.
    """
    (version,) = db.execute("PRAGMA user_version").fetchone()
    if version > SCHEMA_VERSION:
        raise BrokerUnavailable(
            f"{path} has queue schema version {version}; this metnos-exec "
            f"understands {SCHEMA_VERSION}. Upgrade metnos-exec."
        )
    missing = _missing_columns(db)
    if version == SCHEMA_VERSION and not missing:
        _ensure_catalog(db)
        return
    migrate = ""
    if missing:
        # From version 1 (or a file of this version made without them): by what the
        # file lacks rather than by its number, so a file is brought up to date
        # whatever build made it. (The routing and progress columns need no new
        # version: a build before them ignores them, and the rows that build writes go
        # to any worker, with no progress.)
        migrate = (
            "".join(f"ALTER TABLE jobs ADD COLUMN {n} {_COLUMNS[n]};\n" for n in sorted(missing))
            + _MIGRATE_TRIGGER
        )
        if "executor" in missing:
            migrate += _BACKFILL_ROUTES
        if missing - {"executor", "progress"}:
            # Recorded now, applied by the first full `vacuum` (``purge --vacuum``).
            db.execute("PRAGMA auto_vacuum = INCREMENTAL")
    # BEGIN IMMEDIATE around the script: two processes opening a fresh file at once
    # must not interleave their CREATEs (IF NOT EXISTS makes the second a no-op).
    try:
        db.executescript("BEGIN IMMEDIATE;\n" + migrate + SCHEMA_SQL + "\nCOMMIT;")
    except sqlite3.OperationalError as exc:
        if db.in_transaction:
            db.execute("ROLLBACK")
        if not (migrate and "duplicate column" in str(exc)) or _retried:
            raise
        # Another process brought the file up to date between our look and our lock
        # (two workers of a new build starting at once on an old file): look again.
        init_schema(db, path, _retried=True)


def _missing_columns(db: sqlite3.Connection) -> set[str]:
    """Columns of version 2's `jobs` an existing file lacks (none for a new file)."""
    have = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
    return set() if not have else set(_COLUMNS) - have


def check_writable(db: sqlite3.Connection) -> None:
    """Refuse a store this process cannot write, at open, not at the first lease.

    SQLite opens a read-only file happily and even grants ``BEGIN IMMEDIATE``; only a
    write fails. So write (the header's user_version, to the value it has) and roll
    back: nothing changes on disk either way.
    """
    db.execute("BEGIN IMMEDIATE")
    try:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    finally:
        if db.in_transaction:
            db.execute("ROLLBACK")


def _ensure_catalog(db: sqlite3.Connection) -> None:
    """Create the executor catalog in a file made before it (best effort: a file this
    process may not write keeps working without it, see `executor_info`)."""
    (found,) = db.execute(
        "SELECT count(*) FROM sqlite_master WHERE type = 'table' "
        "AND name IN ('executors', 'workers')"
    ).fetchone()
    if found < 2:
        with contextlib.suppress(sqlite3.Error):
            db.executescript("BEGIN IMMEDIATE;\n" + _CATALOG_SQL + "\nCOMMIT;")
