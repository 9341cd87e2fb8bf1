-- metnos-exec SQLite queue, schema version 1 (PRAGMA user_version = 1).
-- The broker (metnos_exec/brokers/sqlite.py) embeds this exact text; a test keeps the two
-- identical. Producers in other languages: see queue/README.md.
--
-- journal_mode=WAL is persistent in the file; synchronous=NORMAL and busy_timeout are per
-- connection: the broker sets them, and another-language producer should set busy_timeout.

-- One row per job. `body` is the job exactly as submitted (JSON text, see
-- queue/schemas/job.json). The routing columns are derived from it by SQLite itself, so a
-- producer only inserts (id, body) and they can never disagree with the body. For a body
-- that is not valid JSON they are NULL / defaults, and the first server worker to lease
-- the row dead-letters it with E_BAD_MESSAGE.
CREATE TABLE IF NOT EXISTS jobs (
    seq              INTEGER PRIMARY KEY,         -- submission order (FIFO tie-break)
    id               TEXT NOT NULL UNIQUE,        -- the job id (equal to body's "id")
    body             TEXT NOT NULL,
    -- A field of the wrong JSON type yields the default here (json_type check), so the row
    -- is still leased by a server worker and dead-lettered rather than stranded.
    device           TEXT GENERATED ALWAYS AS (coalesce(
        CASE WHEN json_valid(body) THEN CASE json_type(body, '$.device')
            WHEN 'text' THEN json_extract(body, '$.device') END END, 'server')) STORED,
    priority         INTEGER GENERATED ALWAYS AS (coalesce(
        CASE WHEN json_valid(body) THEN CASE json_type(body, '$.priority')
            WHEN 'integer' THEN json_extract(body, '$.priority') END END, 0)) STORED,
    max_attempts     INTEGER GENERATED ALWAYS AS (coalesce(
        CASE WHEN json_valid(body) THEN CASE json_type(body, '$.max_attempts')
            WHEN 'integer' THEN json_extract(body, '$.max_attempts') END END, 3)) STORED,
    idempotency_key  TEXT GENERATED ALWAYS AS (
        CASE WHEN json_valid(body) THEN CASE json_type(body, '$.idempotency_key')
            WHEN 'text' THEN json_extract(body, '$.idempotency_key') END END) STORED,
    not_before       REAL GENERATED ALWAYS AS (
        CASE WHEN json_valid(body) THEN CASE json_type(body, '$.not_before')
            WHEN 'real' THEN json_extract(body, '$.not_before')
            WHEN 'integer' THEN json_extract(body, '$.not_before') END END) STORED,
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

PRAGMA user_version = 1;
