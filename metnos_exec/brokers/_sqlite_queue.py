"""The SQLite broker's queue: submitting, leasing, heart-beating and settling a job.

Every write is one transaction on the store's connection (`SQLiteStore._txn`, or
`_lease_sync`'s own ``BEGIN IMMEDIATE``), guarded by the lease token where a lease is
involved; the statements are here, by what they do. A lease first settles the leases
that lapsed (`_settle_expired`), then picks due rows and takes them in the same
transaction. What to log is gathered in `_Notes` and logged once the transaction
committed.
"""

from __future__ import annotations

import functools
import json
import os
import sqlite3
from collections.abc import Collection, Sequence
from typing import Any

from ..errors import BadMessage
from ..logs import get_logger
from ..messages import (
    E_CANCELLED,
    SERVER_DEVICE,
    ErrorInfo,
    Job,
    Result,
    check_job_size,
    decode_job,
    encode_job,
    new_job_id,
)
from ._common import check_lease_args, decode_body, lapsed_error
from ._sqlite_store import SQLiteStore, column_text, store_dead, store_result
from .base import (
    MAX_UNSTARTED_LAPSES,
    HeartbeatReply,
    Lease,
    RetryOutcome,
    SubmitReceipt,
    check_idempotent_reuse,
)

__all__ = ("DUE", "SQLiteQueue")

_log = get_logger()


# --- SQL ------------------------------------------------------------------------------

_INSERT = (
    "INSERT INTO jobs (id, body, device, priority, max_attempts, idempotency_key, not_before, "
    "executor) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
)
# The other-language producers' door; its trigger derives the columns from the body.
_INSERT_INBOX = "INSERT INTO job_inbox (id, body) VALUES (?, ?)"
_FIND_BY_KEY = "SELECT id, CAST(body AS BLOB) FROM jobs WHERE idempotency_key = ?"
_FIND_BY_ID = "SELECT CAST(body AS BLOB) FROM jobs WHERE id = ?"
DUE = "coalesce(due_at, not_before, 0) <= :now"
# A lease is lost once its time is up, or when it has no time at all (a row left
# 'running' with no lease_until can only have been written by hand or by a bug: it would
# otherwise stay running forever). Both parts are index searches on jobs_running.
_EXPIRED = "state = 'running' AND (lease_until <= :now OR lease_until IS NULL)"
_ANY_DUE = (
    "SELECT 1 FROM jobs WHERE state = 'queued' AND device = :dev AND "
    + DUE
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
    "WHERE state = 'queued' AND device = :dev AND " + DUE + " "
    "ORDER BY priority DESC, seq LIMIT :limit"
)
# A worker serving some executors: one walk of jobs_route per executor (and one for the
# rows of older builds, which name none), each stopping after `limit` due rows, merged.
# (``executor IN (...)`` made the planner sort every due row of the served executors.)
_ROUTE_WALK = (
    "SELECT * FROM (SELECT seq, id, body, attempt, device, priority "
    "FROM jobs INDEXED BY jobs_route "
    "WHERE state = 'queued' AND device = :dev AND executor {} AND " + DUE + " "
    "ORDER BY priority DESC, seq LIMIT :limit)"
)
#: Above this many executors one walk each costs more than it saves (and SQLite allows
#: 500 terms in a compound SELECT): the rows are filtered on the way instead.
_MAX_WALKS = 64
_PICK_FILTERED = (
    "SELECT seq, CAST(id AS BLOB), CAST(body AS BLOB), attempt + 1, device "
    "FROM jobs INDEXED BY jobs_ready "
    "WHERE state = 'queued' AND device = :dev AND " + DUE + " AND (executor IS NULL OR "
    "executor IN (SELECT value FROM json_each(:served))) "
    "ORDER BY priority DESC, seq LIMIT :limit"
)


@functools.lru_cache(maxsize=32)
def pick_sql(walks: int | None) -> str:
    """The pick for a worker serving every executor (``None``) or `walks` of them (bound
    as ``:e0``, ``:e1``, ...; more than `_MAX_WALKS`: ``:served``, a JSON list)."""
    if walks is None:
        return _PICK
    if walks > _MAX_WALKS:
        return _PICK_FILTERED
    parts = [_ROUTE_WALK.format("IS NULL")] + [_ROUTE_WALK.format(f"= :e{i}") for i in range(walks)]
    return (
        "SELECT seq, CAST(id AS BLOB), CAST(body AS BLOB), attempt + 1, device FROM ("
        + " UNION ALL ".join(parts)
        + ") ORDER BY priority DESC, seq LIMIT :limit"
    )


def pick_params(served: tuple[str, ...] | None) -> dict[str, object]:
    """The executors' parameters of `pick_sql` (for ``len(served)`` of them)."""
    if served is None:
        return {}
    if len(served) > _MAX_WALKS:
        return {"served": json.dumps(served)}
    return {f"e{i}": name for i, name in enumerate(served)}


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


class SQLiteQueue(SQLiteStore):
    """Producing and consuming on the SQLite store (see the module docstring)."""

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
                job.executor,
            ),
        )
        if cur.rowcount == 1:
            return SubmitReceipt(job.id)
        key = job.idempotency_key
        if key is not None:
            row = db.execute(_FIND_BY_KEY, (key,)).fetchone()
            if row is not None:
                original_id = column_text(row[0])
                original = decode_body(original_id, row[1])
                # A stored body that no longer decodes cannot be compared; it is
                # dead-lettered when leased, and the key still names it.
                if isinstance(original, Job):
                    check_idempotent_reuse(original, job)
                return SubmitReceipt(original_id, duplicate=True)
        # The id is known: the same job again is a duplicate, another one a conflict.
        row = db.execute(_FIND_BY_ID, (job.id,)).fetchone()
        if row is not None:
            known = decode_body(job.id, row[0])
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
            job_id = column_text(raw_id)
            if cancel:
                store_result(
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
            decoded = decode_body(job_id, body)
            error = lapsed_error(started=bool(started), attempt=attempt, lapses=lapses)
            store_dead(
                db,
                job_id=job_id,
                job=decoded if isinstance(decoded, Job) else None,
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
        self,
        worker_id: str,
        visibility_s: float,
        dev: str,
        limit: int,
        started: int,
        served: tuple[str, ...] | None,
    ) -> tuple[list[Lease], _Notes]:
        db = self._db
        notes = _Notes()
        pick = pick_sql(None if served is None else len(served))
        params = pick_params(served)
        # A plain read first: an idle worker polling an empty queue never takes the write
        # lock, so it does not slow down the processes that have work (nor do the jobs
        # of executors it does not serve).
        if not self._any_due(dev, pick, params):
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
                    pick, {"dev": dev, "now": now, "limit": limit - len(out), **params}
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
                    job_id = column_text(raw_id)
                    decoded = decode_body(job_id, body)
                    if isinstance(decoded, ErrorInfo):
                        where = (seq, token, attempt, worker_id, device, now)
                        self._dead_on_lease(db, notes, job_id, body, decoded, where)
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

    @staticmethod
    def _dead_on_lease(
        db: sqlite3.Connection,
        notes: _Notes,
        job_id: str,
        body: bytes,
        error: ErrorInfo,
        where: tuple[int, str, int, str, str, float],
    ) -> None:
        """Dead-letter an undecodable row just taken (`where`: its seq, token, attempt,
        the worker, the device and the time)."""
        seq, token, attempt, worker_id, device, now = where
        db.execute(_SETTLE_SEQ, ("dead", seq, token))
        store_dead(
            db,
            job_id=job_id,
            job=None,
            raw=bytes(body),
            error=error,
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
            code=error.code,
            message=error.message,
        )

    async def lease(
        self,
        worker_id: str,
        *,
        visibility_s: float,
        device: str | None = None,
        limit: int = 1,
        started: int | None = None,
        executors: Collection[str] | None = None,
    ) -> list[Lease]:
        check_lease_args(visibility_s, limit)
        leases, notes = await self._run(
            self._lease_sync,
            worker_id,
            visibility_s,
            device or SERVER_DEVICE,
            limit,
            limit if started is None else started,
            None if executors is None else tuple(sorted(set(executors))),
            inline=limit <= 64,
        )
        notes.emit()
        if notes.items:
            self._wake_results()
        out: list[Lease] = leases
        return out

    def _any_due(self, dev: str, pick: str, params: dict[str, object]) -> bool:
        now = self._clock()
        if pick is _PICK:
            return self._db.execute(_ANY_DUE, {"now": now, "dev": dev}).fetchone() is not None
        if self._db.execute(_ANY_EXPIRED, {"now": now}).fetchone() is not None:
            return True
        found = self._db.execute(pick, {"dev": dev, "now": now, "limit": 1, **params})
        return found.fetchone() is not None

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
        return store_result(db, result, now)

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
        store_dead(
            db,
            job_id=lease.job.id,
            job=lease.job,
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
