"""The SQLite broker's connection: opening the file, running each call on it, and the
two records every settling path writes.

`SQLiteStore` opens the file (its pragmas, the schema, the check that it takes writes),
runs each call against its one connection (inline on the event loop while the database is
unlocked, else in a worker thread that may wait for the lock: `SQLiteStore._run`), wraps a
transaction body in ``BEGIN IMMEDIATE`` (`SQLiteStore._txn`), notices a file deleted or
replaced under it, and maps SQLite's result codes to `BrokerError` subclasses
(`_store_error`). The operations (`metnos_exec.brokers._sqlite_queue` and its siblings)
are written on top of it; `metnos_exec.brokers.sqlite` says how the whole works.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.lowlevel
import anyio.to_thread

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
from ..messages import ErrorInfo, Job, Result, encode
from ..private import create_private_file, tighten
from ._common import PolledWaits, dead_records
from ._sqlite_schema import check_writable, init_schema

__all__ = ("IN_CHUNK", "SQLiteStore", "store_dead", "store_result", "column_text")

_MIN_SQLITE = (3, 35, 0)

_INSERT_RESULT = "INSERT OR IGNORE INTO results (job_id, body, status, at) VALUES (?, ?, ?, ?)"
_INSERT_DEAD = "INSERT OR IGNORE INTO dead_letters (job_id, body, at) VALUES (?, ?, ?)"
#: Ids per ``IN (...)`` list: well under SQLite's host-parameter cap (999 before 3.32).
IN_CHUNK = 500
#: SQLITE_IOERR_SHMSIZE (extended result code; not in every Python's sqlite3 module).
_SQLITE_IOERR_SHMSIZE: Final = 4874
#: The extended I/O errors a write that cannot grow a file gives (EFBIG under a file size
#: limit, which SQLite does not call SQLITE_FULL; EIO on a failing disk gives them too):
#: SQLITE_IOERR_WRITE, _TRUNCATE, _SHMOPEN (the -shm's first write, at open).
_SQLITE_IOERR_GROW: Final = frozenset({778, 1546, 4618})
#: One try of a call waiting for a lock held elsewhere (`SQLiteStore._patient`), in ms:
#: SQLite's busy handler tries again at 1 and 3 ms within it.
_BUSY_SLICE_MS: Final = 5
#: How often (seconds) a call checks that the path still names the file it opened.
_FILE_CHECK_S = 1.0


def column_text(value: bytes | str) -> str:
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
    if code in _SQLITE_IOERR_GROW:
        return BrokerFull(
            f"{text} (its writes fail: the file system is full or a file size limit is "
            "reached, or the disk is failing)"
        )
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


def store_result(db: sqlite3.Connection, result: Result, now: float) -> bool:
    """Store `result` once (``INSERT OR IGNORE``): ``False`` when the job had one."""
    try:
        body = encode(result)
    except Exception as exc:  # output msgspec cannot encode (too deep, ...)
        raise BadMessage(
            f"the result of job {result.job_id} cannot be encoded: {type(exc).__name__}: {exc}"
        ) from None
    cur = db.execute(_INSERT_RESULT, (result.job_id, body, result.status, now))
    return cur.rowcount == 1


def store_dead(
    db: sqlite3.Connection,
    *,
    job_id: str,
    job: Job | None,
    error: ErrorInfo,
    attempt: int,
    worker: str,
    device: str,
    now: float,
    raw: bytes | None = None,
) -> None:
    """Store a dead letter (`raw` cut to ``MAX_JOB_BYTES``) and the job's ``dead`` result."""
    result, letter = dead_records(
        job_id=job_id,
        job=job,
        raw=raw,
        error=error,
        attempt=attempt,
        worker=worker,
        device=device,
        now=now,
    )
    db.execute(_INSERT_DEAD, (job_id, encode(letter), now))
    store_result(db, result, now)


class SQLiteStore(PolledWaits):
    """The connection to one queue file and the running of calls on it (see the module
    docstring); `SQLiteBroker` documents the arguments."""

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
                # Made 0600 when missing; an existing file is tightened only once it is
                # known to be a queue (below): a file that is not one is left as found.
                create_private_file(self.path, tighten_existing=False)
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
            st = self._set_up(synchronous, create=create)
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
        if create:
            # A queue now: its file, and the -wal and -shm SQLite made with its old mode.
            for name in (str(self.path), f"{self.path}-wal", f"{self.path}-shm"):
                with contextlib.suppress(OSError):
                    tighten(name)
        self._identity = (st.st_dev, st.st_ino)
        self._next_file_check = time.monotonic() + _FILE_CHECK_S
        self._gone: BrokerGone | None = None
        self._limiter: anyio.CapacityLimiter | None = None
        #: The second connection inspections read on (`_read`), opened at the first need.
        self._reader: sqlite3.Connection | None = None
        self._reader_limiter: anyio.CapacityLimiter | None = None
        self._wake_key = str(self.path.resolve())
        # Every commit in WAL mode writes the -wal file: another process's submit or ack
        # wakes our idle waits at once (`_file_wake`), the poll stays for what it misses.
        resolved = Path(self._wake_key)
        self._watch_files = (resolved.with_name(resolved.name + "-wal"),)
        self._closed = False

    @property
    def queue_id(self) -> str:
        return f"sqlite:{self._wake_key}"

    def _set_up(self, synchronous: str, *, create: bool) -> os.stat_result:
        """Set the new connection's pragmas, bring the schema up to date and (with
        `create`) check that the file takes writes; return the file's status, by which
        `_check_file` knows it later."""
        self._busy_ms = int(self._busy_s * 1000)
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
        init_schema(self._db, self.path)
        if create:
            check_writable(self._db)
        self._db.execute("PRAGMA busy_timeout = 0")
        # The file this broker serves, to notice when the path names another one.
        return os.stat(self.path)

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

    async def _read(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        """Run the read-only `fn(reader)` in a worker thread, on a second connection of
        this broker's (opened at the first need), in one read transaction.

        For the inspections that walk the stored jobs (the counts by state: `status`, a
        ``/metrics`` scrape inside a worker, the live view): on 100,000 stored jobs the
        count is about 80 ms of SQLite's work, which inline would hold the worker's event
        loop, and on the broker's own connection its leases and acks. A WAL reader does
        not block the writers, nor they it; SQLite runs without the GIL meanwhile.

        Raises:
            BrokerError: the store failed, or the file is gone.
        """
        if self._closed:
            raise BrokerUnavailable(f"the broker on {self.path} is closed")
        self._check_file()
        if self._reader_limiter is None:
            self._reader_limiter = anyio.CapacityLimiter(1)

        def work() -> Any:
            db = self._reader
            if db is None:
                db = sqlite3.connect(
                    self.path, timeout=self._busy_s, isolation_level=None, check_same_thread=False
                )
                db.execute("PRAGMA query_only = 1")
                self._reader = db
            db.execute("BEGIN")
            try:
                return fn(db)
            finally:
                db.execute("COMMIT")

        try:
            return await anyio.to_thread.run_sync(work, limiter=self._reader_limiter)
        except sqlite3.Error as exc:
            raise self._error(exc) from None

    def _patient(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """Run `fn(*args)`, waiting up to the busy timeout for a lock held elsewhere.

        In short tries (`_BUSY_SLICE_MS` each), redone until the timeout: SQLite's own
        busy handler sleeps up to 100 ms between its tries, so a writer that frees the
        lock for a few ms at a time (a purge between its batches) would take it again
        before this call ever woke up to see it free (measured: submits waited 8 s
        behind a purge that freed the lock after each 20 ms batch). Redoing is safe:
        a call failed at its first statement, or its transaction was rolled back."""
        deadline = time.monotonic() + self._busy_s
        self._db.execute(f"PRAGMA busy_timeout = {min(_BUSY_SLICE_MS, self._busy_ms)}")
        try:
            while True:
                try:
                    return fn(*args)
                except sqlite3.Error as exc:
                    code = getattr(exc, "sqlite_errorcode", None)
                    busy = isinstance(code, int) and code & 0xFF == sqlite3.SQLITE_BUSY
                    if not busy or time.monotonic() >= deadline:
                        raise
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

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_watches()
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(1)
        # Through the limiter: a call still running in a worker thread finishes first.
        await anyio.to_thread.run_sync(self._db.close, limiter=self._limiter)
        if self._reader_limiter is not None:
            # After a read still running in its thread: the same limiter.
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._close_reader, limiter=self._reader_limiter)

    def _close_reader(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()
