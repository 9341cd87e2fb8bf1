"""The SQLite broker's retention: purging finished jobs in short batches (with the purge
hooks, `metnos_exec.brokers.base.PurgeHook`), and giving the freed space back to the
file system (incremental vacuum in steps; a full `SQLiteRetention.vacuum` for an older
file)."""

from __future__ import annotations

import sqlite3
import threading

import anyio
import anyio.to_thread

from ..errors import BrokerError, BrokerUnavailable
from ._sqlite_store import SQLiteStore, column_text
from .base import PurgeReport

__all__ = ("SQLiteRetention",)

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


class SQLiteRetention(SQLiteStore):
    """Purging and vacuuming the SQLite store."""

    def _purge_batch(self, db: sqlite3.Connection, now: float, older_than_s: float) -> int:
        cut = now - older_than_s
        ids = [column_text(r[0]) for r in db.execute(_PURGE_PICK, (cut, _PURGE_BATCH)).fetchall()]
        orphans = [
            column_text(r[0]) for r in db.execute(_PURGE_ORPHANS, (cut, _PURGE_BATCH)).fetchall()
        ]
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
