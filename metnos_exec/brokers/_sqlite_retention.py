"""The SQLite broker's retention: purging finished jobs in short batches (with the purge
hooks, `metnos_exec.brokers.base.PurgeHook`), and giving the freed space back to the
file system (incremental vacuum in steps; a full `SQLiteRetention.vacuum` for an older
file)."""

from __future__ import annotations

import functools
import sqlite3
import threading
import time

import anyio
import anyio.to_thread

from ..errors import BrokerError, BrokerUnavailable
from ._sqlite_store import SQLiteStore, column_text
from .base import PurgeReport

__all__ = ("SQLiteRetention",)

# Retention: finished jobs whose result is older than the cut. No index on `at` (one more
# write per ack, for an hourly purge): the purge walks `results` in job id order (for ULIDs,
# submission order) a window at a time, as a plain read that takes no lock, and only the
# deletes of what it found take the write lock, a short transaction each. A result whose
# job row is gone (written by hand, or left by a crash of an older version between two
# deletes) is purged with the rest: `orphan` is 1 for it.
#
# A job with a ``result_ttl_s`` (read from its body) goes once that long has passed. The
# text tests spare the JSON parse for the others: a body without the field, or with it
# ``null`` as this package writes it (a ``null`` text inside the arguments can only make a
# job be kept for the whole retention, never go early). CASE keeps the order of the
# tests, so a body that is not JSON is never parsed.
_TTL_PASSED = (
    "CASE WHEN j.id IS NULL OR instr(j.body, '\"result_ttl_s\"') = 0 "
    "OR instr(j.body, '\"result_ttl_s\":null') > 0 OR NOT json_valid(j.body) THEN 0 "
    "WHEN json_type(j.body, '$.result_ttl_s') IN ('integer', 'real') "
    "THEN r.at + json_extract(j.body, '$.result_ttl_s') < :now ELSE 0 END"
)
_PURGEABLE = (
    "(r.at < :cut OR " + _TTL_PASSED + ") AND (j.id IS NULL OR j.state IN ('done', 'dead'))"
)
_SCAN = (
    "SELECT r.job_id, " + _PURGEABLE + ", j.id IS NULL FROM results r "
    "LEFT JOIN jobs j ON j.id = r.job_id WHERE r.job_id > :after ORDER BY r.job_id LIMIT :n"
)
#: Results read per window of the scan (a read: it holds no lock).
_SCAN_WINDOW = 2000
#: Jobs per delete transaction: starts at `_BATCH_START`, halves when a transaction held
#: the lock longer than `_HOLD_S`, doubles when it took under a quarter of that.
_BATCH_START = 500
_BATCH_MIN = 16
_BATCH_MAX = 4000
#: The longest a purge transaction should hold the write lock (seconds).
_HOLD_S = 0.025
#: After each of its transactions the purge leaves the lock free at least this long, and
#: at least as long as it held it: every waiter gets its turn (SQLite's lock is not a
#: queue, and a purge that took it again at once would starve them; see `_yield_lock`).
_MIN_PAUSE_S = 0.005
#: Free pages given back per incremental-vacuum transaction (1 MiB at 4 KiB pages):
#: measured a few ms each, so a large reclaim never holds the write lock for long.
_VACUUM_STEP_PAGES = 256
#: How long the final checkpoint (which shrinks the file) may wait for readers: it
#: blocks writers while it waits, and it can be done by the next purge.
_CHECKPOINT_WAIT_MS = 100


def _yield_lock(held_s: float, since: float, stop: threading.Event | None) -> None:
    """Leave the write lock free until `since` (the last commit, monotonic) plus the
    pause, so that the purge holds the lock at most half the time; wakes early on
    `stop`."""
    left = since + max(_MIN_PAUSE_S, held_s) - time.monotonic()
    if left > 0:
        if stop is None:
            time.sleep(left)
        else:
            stop.wait(left)


class _Batches:
    """The size of the next delete transaction, bounded by the time it holds the lock."""

    def __init__(self) -> None:
        self.size = _BATCH_START

    def held(self, seconds: float, rows: int) -> None:
        if seconds > _HOLD_S:
            self.size = max(_BATCH_MIN, min(self.size, rows) // 2)
        elif seconds < _HOLD_S / 4 and rows >= self.size:
            self.size = min(_BATCH_MAX, self.size * 2)


class SQLiteRetention(SQLiteStore):
    """Purging and vacuuming the SQLite store."""

    def _forget(
        self, db: sqlite3.Connection, _txn_now: float, *, ids: list[str], now: float, cut: float
    ) -> int:
        """Delete the finished jobs among `ids` (candidates the scan found; each is checked
        again here, inside the transaction), with their results, dead letters and undo
        entries; hand the ids of those with a job row to the purge hooks."""
        marks = ",".join("?" * len(ids))
        rows = db.execute(
            f"SELECT r.job_id, j.id IS NULL FROM results r LEFT JOIN jobs j ON j.id = "
            f"r.job_id WHERE r.job_id IN ({marks}) AND "
            + _PURGEABLE.replace(":cut", "?").replace(":now", "?"),
            [*ids, cut, now],
        ).fetchall()
        jobs = [column_text(r[0]) for r in rows if not r[1]]
        if jobs:
            for hook in self.purge_hooks:
                hook.forget_jobs(db, jobs)
        gone = [column_text(r[0]) for r in rows]
        if gone:
            marks = ",".join("?" * len(gone))
            db.execute(f"DELETE FROM jobs WHERE id IN ({marks})", gone)
            db.execute(f"DELETE FROM results WHERE job_id IN ({marks})", gone)
            db.execute(f"DELETE FROM dead_letters WHERE job_id IN ({marks})", gone)
            # A job's undo entries go with its result (retention follows the results'),
            # and the blob rows of those entries with them.
            db.execute(
                "DELETE FROM undo_blobs WHERE entry_id IN (SELECT id FROM undo_entries "
                f"WHERE job_id IN ({marks}))",
                gone,
            )
            db.execute(f"DELETE FROM undo_entries WHERE job_id IN ({marks})", gone)
        return len(gone)

    def _purge_jobs(
        self, db: sqlite3.Connection, now: float, cut: float, stop: threading.Event
    ) -> int:
        """Walk `results` by job id, a window at a time (reads), and forget what is past
        the cut in short transactions sized by `_Batches`, yielding the lock after each."""
        after, purged = "", 0
        found: list[str] = []
        batches, last_commit, held = _Batches(), time.monotonic(), 0.0
        scanned_all = False
        while not stop.is_set():
            if not scanned_all and len(found) < batches.size:
                at = {"cut": cut, "now": now, "after": after, "n": _SCAN_WINDOW}
                window = db.execute(_SCAN, at)
                rows = window.fetchall()
                scanned_all = len(rows) < _SCAN_WINDOW
                if rows:
                    after = column_text(rows[-1][0])
                found += [column_text(r[0]) for r in rows if r[1]]
                continue
            if not found:
                break
            batch, found = found[: batches.size], found[batches.size :]
            _yield_lock(held, last_commit, stop)
            if stop.is_set():
                break
            start = time.monotonic()
            purged += self._txn(functools.partial(self._forget, ids=batch, now=now, cut=cut), db)
            last_commit = time.monotonic()
            held = last_commit - start
            batches.held(held, len(batch))
        return purged

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
        """Give free pages back to the file system: incremental vacuum, in steps that
        yield the lock (`_yield_lock`) like the purge's deletes.

        ``None`` when the file was made without ``auto_vacuum = INCREMENTAL`` (created by
        version 1 of the schema): only a full `vacuum` can shrink it (``metnos-exec
        purge --vacuum``), and a worker must not hold the whole file for that.
        """
        (mode,) = db.execute("PRAGMA auto_vacuum").fetchone()
        if mode != 2:
            return None
        before, page_size = cls._pages(db)
        last_commit, held = time.monotonic(), 0.0
        while stop is None or not stop.is_set():
            (free,) = db.execute("PRAGMA freelist_count").fetchone()
            if not free:
                break
            _yield_lock(held, last_commit, stop)
            start = time.monotonic()
            try:
                # A script, not `execute`: the pragma returns no columns, and the sqlite3
                # module steps such a statement once, which gives back a single page
                # (measured: 7,355 transactions for 30 MB instead of 8).
                db.executescript(
                    f"BEGIN IMMEDIATE; PRAGMA incremental_vacuum({_VACUUM_STEP_PAGES}); COMMIT;"
                )
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
            last_commit = time.monotonic()
            held = last_commit - start
        # The main file only shrinks when the WAL is checkpointed (TRUNCATE also empties
        # the WAL). First PASSIVE, which writers need not wait for, copying most of the
        # WAL; then TRUNCATE for the rest, briefly: writers wait for it meanwhile.
        db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        db.execute(f"PRAGMA busy_timeout = {_CHECKPOINT_WAIT_MS}")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        return max(0, before - cls._pages(db)[0]) * page_size

    def _aux_connection(self) -> sqlite3.Connection:
        """A connection of its own for long work (purge), so this broker's connection
        stays free: a worker purging in the background keeps leasing and acking."""
        db = sqlite3.connect(self.path, timeout=0, isolation_level=None)
        db.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
        return db

    def _purge_now(self, older_than_s: float, stop: threading.Event) -> PurgeReport:
        """The purge itself, in the calling thread, on a connection of its own."""
        db = self._aux_connection()
        try:
            now = self._clock()
            jobs = self._purge_jobs(db, now, now - older_than_s, stop)
            collected = 0
            if not stop.is_set():
                collected = self._txn(
                    lambda d, now: (
                        self._purge_undo(d, now - older_than_s)
                        + sum(
                            int(h.collect(d, before=now - older_than_s)) for h in self.purge_hooks
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

    async def purge(self, *, older_than_s: float) -> PurgeReport:
        if self._closed:
            raise BrokerUnavailable(f"the broker on {self.path} is closed")
        self._check_file()
        stop = threading.Event()

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
                return self._purge_now(older_than_s, stop)
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
