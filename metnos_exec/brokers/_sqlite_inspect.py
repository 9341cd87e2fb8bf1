"""The SQLite broker's control and inspection: cancelling, and reading a job's result,
state, the dead letters and the counts by state."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

import anyio.lowlevel

from ..errors import BadMessage, BrokerCorrupt
from ..messages import (
    E_CANCELLED,
    MAX_JOB_BYTES,
    DeadLetter,
    ErrorInfo,
    Progress,
    Result,
    decode_dead_letter,
    decode_progress,
    decode_result,
    encode,
)
from ._sqlite_queue import DUE
from ._sqlite_store import IN_CHUNK, SQLiteStore, column_text, store_result
from .base import BrokerStats, CancelOutcome, JobState, Lease, queued_cancel_message

__all__ = ("SQLiteInspection",)

_GET_RESULT = "SELECT CAST(body AS BLOB) FROM results WHERE job_id = ?"
_SET_PROGRESS = "UPDATE jobs SET progress = ? WHERE id = ? AND token = ? AND state = 'running'"
_GET_PROGRESS = "SELECT progress FROM jobs WHERE id = ?"
_GET_STATE = "SELECT state, attempt, worker, lease_until, cancel_requested FROM jobs WHERE id = ?"


class SQLiteInspection(SQLiteStore):
    """Cancelling and reading jobs on the SQLite store."""

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
                store_result(
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
            for i in range(0, len(ids), IN_CHUNK):
                chunk = ids[i : i + IN_CHUNK]
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

    async def report_progress(self, lease: Lease, progress: Progress) -> bool:
        body = encode(progress).decode()

        def work() -> bool:
            return self._db.execute(_SET_PROGRESS, (body, lease.job.id, lease.token)).rowcount == 1

        ok: bool = await self._run(work)
        return ok

    async def get_progress(self, job_id: str) -> Progress | None:
        row = await self._run(lambda: self._db.execute(_GET_PROGRESS, (job_id,)).fetchone())
        return None if row is None or row[0] is None else decode_progress(row[0])

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
                        job_id=column_text(raw_id),
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
        # On the reader connection, in a thread (`_read`): the count by state walks every
        # stored job, however long the retention.
        def work(db: sqlite3.Connection) -> BrokerStats:
            now = self._clock()
            counts = {"queued": 0, "running": 0, "done": 0, "dead": 0}
            for state, n in db.execute("SELECT state, count(*) FROM jobs GROUP BY state"):
                counts[state] = n
            (delayed,) = db.execute(
                "SELECT count(*) FROM jobs WHERE state = 'queued' AND NOT (" + DUE + ")",
                {"now": now},
            ).fetchone()
            # The first due job by submission order: a walk of the queued rows' partial
            # index, then one row; never the finished jobs.
            oldest = db.execute(
                "SELECT json_extract(body, '$.submitted_at') FROM jobs WHERE seq = "
                "(SELECT min(seq) FROM jobs WHERE state = 'queued' AND " + DUE + ")",
                {"now": now},
            ).fetchone()
            at = None if oldest is None or oldest[0] is None else float(oldest[0])
            return BrokerStats(delayed=delayed, oldest_queued_at=at, **counts)

        stats: BrokerStats = await self._read(work)
        return stats
