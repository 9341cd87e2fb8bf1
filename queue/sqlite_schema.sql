-- metnos-exec SQLite queue, schema version 2 (PRAGMA user_version = 2).
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
