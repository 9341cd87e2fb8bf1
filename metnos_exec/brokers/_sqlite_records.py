"""The SQLite broker's records beside the queue: the executor catalog server workers
publish (`metnos_exec.devices.catalog`) and the undo entries jobs record (fenced by their
lease, see `metnos_exec.brokers.base`)."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Collection, Sequence
from typing import Any

import anyio.lowlevel

from ..devices.catalog import ExecutorInfo, decode_info, encode_info
from ..errors import BadMessage, BrokerCorrupt, BrokerError
from ..messages import Job, Result, UndoEntry, decode_undo_entry, encode
from ._common import decode_body
from ._sqlite_store import IN_CHUNK, SQLiteStore, column_text
from .base import Lease, UndoRecord
from .presence import (
    JOB_STATES,
    RECENTLY_GONE_S,
    JobListing,
    WorkerInfo,
    decode_worker,
    encode_worker,
    sort_out,
)

__all__ = ("SQLiteRecords",)

# A row an older build stored names its executor only in its body (which may not be JSON).
_OLD_ROUTE = (
    "CASE WHEN j.executor IS NULL AND typeof(j.body) = 'text' AND json_valid(j.body) "
    "THEN json_extract(j.body, '$.executor') END"
)
_LEASE_IS_CURRENT = "SELECT 1 FROM jobs WHERE id = ? AND token = ? AND state = 'running'"


class SQLiteRecords(SQLiteStore):
    """The executor catalog and the undo entries on the SQLite store."""

    # --- the executor catalog (see `metnos_exec.devices.catalog`) -------------------------------

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

    async def executor_names(self) -> set[str]:
        rows = await self._run(self._read_missing_ok, "SELECT name FROM executors")
        return {str(name) for (name,) in rows}

    def _read_missing_ok(self, sql: str, *params: object) -> list[Any]:
        """Rows of a table a file may lack (made before it, opened read-only): none."""
        try:
            return self._db.execute(sql, params).fetchall()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                return []
            raise

    # --- who serves the queue (see `metnos_exec.brokers.presence`) --------------------

    async def register_worker(self, info: WorkerInfo) -> None:
        body = encode_worker(info).decode()

        def work(db: sqlite3.Connection, _now: float) -> None:
            db.execute(
                "INSERT INTO workers (id, body, seen) VALUES (?, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET body = excluded.body, seen = excluded.seen",
                (info.id, body, info.seen_at),
            )

        await self._run(self._txn, work)

    async def workers(self, *, gone_within_s: float = RECENTLY_GONE_S) -> list[WorkerInfo]:
        rows = await self._run(self._read_missing_ok, "SELECT CAST(body AS BLOB) FROM workers")
        found = [info for (body,) in rows if (info := decode_worker(body)) is not None]
        keep, old = sort_out(found, self._clock(), gone_within_s)
        if old:

            def forget(db: sqlite3.Connection, _now: float) -> None:
                db.executemany("DELETE FROM workers WHERE id = ?", [(i,) for i in old])

            with contextlib.suppress(sqlite3.Error, BrokerError):  # a read-only reader
                await self._run(self._txn, forget)
        return keep

    async def list_jobs(
        self,
        *,
        states: Collection[str] = JOB_STATES,
        executor: str | None = None,
        device: str | None = None,
        limit: int = 50,
    ) -> list[JobListing]:
        if not states:
            return []
        where = [f"j.state IN ({', '.join('?' * len(states))})"]
        params: list[object] = list(states)
        if executor is not None:
            where.append(f"coalesce(j.executor, {_OLD_ROUTE}) = ?")
            params.append(executor)
        if device is not None:
            where.append("j.device = ?")
            params.append(device)
        rows = await self._run(
            self._read_missing_ok,
            f"SELECT j.id, j.executor, {_OLD_ROUTE}, "
            "j.device, j.state, j.attempt, j.worker, r.status, r.at "
            "FROM jobs j LEFT JOIN results r ON r.job_id = j.id "
            f"WHERE {' AND '.join(where)} ORDER BY j.seq DESC LIMIT ?",
            *params,
            max(0, limit),
        )
        return [
            JobListing(
                job_id=column_text(job_id),
                executor=str(name or old or ""),
                device=str(dev),
                state=str(state),
                attempt=int(attempt),
                worker=worker,
                status=status,
                finished_at=at,
            )
            for job_id, name, old, dev, state, attempt, worker, status, at in rows
        ]

    async def get_job(self, job_id: str) -> Job | None:
        rows = await self._run(self._read_missing_ok, "SELECT body FROM jobs WHERE id = ?", job_id)
        if not rows:
            return None
        found = decode_body(job_id, rows[0][0])
        return found if isinstance(found, Job) else None

    async def queued_executors(self) -> dict[tuple[str, str], int]:
        rows = await self._run(
            self._read_missing_ok,
            "SELECT device, coalesce(executor, ''), count(*) FROM jobs "
            "WHERE state = 'queued' GROUP BY device, executor",
        )
        return {(str(dev), str(name)): int(n) for dev, name, n in rows}

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

    async def settle_gate(self, job_id: str, result: Result) -> bool:
        if result.job_id != job_id or result.status == "awaiting_approval":
            raise ValueError("settle_gate takes the job's own final result")
        body = encode(result).decode()

        def work(db: sqlite3.Connection, now: float) -> bool:
            cur = db.execute(
                "UPDATE results SET body = ?, status = ?, at = ? "
                "WHERE job_id = ? AND status = 'awaiting_approval'",
                (body, result.status, now, job_id),
            )
            return cur.rowcount == 1

        done: bool = await self._run(self._txn, work)
        if done:
            self._wake_results()
        return done

    async def get_undo(self, entry_ids: Sequence[str]) -> list[UndoRecord]:
        ids = list(entry_ids)

        def work() -> dict[str, UndoRecord]:
            found: dict[str, UndoRecord] = {}
            for i in range(0, len(ids), IN_CHUNK):
                chunk = ids[i : i + IN_CHUNK]
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
