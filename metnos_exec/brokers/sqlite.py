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

Idle waiting (`wait_for_work`, `wait_result`) is woken by any commit to the file, from any
process: every commit in WAL mode writes the ``-wal`` file, and an inotify watch on it
(`_file_wake`) ends the wait at once (an echo job through an idle worker went from one
50 ms poll period to a few ms). The poll stays, every ``poll_interval_s`` (50 ms by
default), for what no write announces (a delayed job falling due, a lapsed lease) and
for where no watch can be made; the idle check is a plain read through one index probe
(``jobs_due``) that takes no lock, however many delayed jobs wait.

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

Where the code is: `SQLiteBroker` (here) joins one class per concept, each on top of the
connection (`_sqlite_store`: opening, running a call, errors): the queue (`_sqlite_queue`:
submit, lease, heartbeat, settle), control and inspection (`_sqlite_inspect`), the
catalog and undo entries (`_sqlite_records`) and retention (`_sqlite_retention`: purge,
vacuum); the schema and its migrations are `_sqlite_schema`.
"""

from __future__ import annotations

from typing import Any

from ..errors import BrokerUnavailable
from ._sqlite_inspect import SQLiteInspection
from ._sqlite_queue import SQLiteQueue
from ._sqlite_records import SQLiteRecords
from ._sqlite_retention import SQLiteRetention
from ._sqlite_schema import SCHEMA_SQL, SCHEMA_VERSION
from ._url import take_options

__all__ = ("SCHEMA_SQL", "SCHEMA_VERSION", "BrokerUnavailable", "SQLiteBroker")


class SQLiteBroker(SQLiteQueue, SQLiteInspection, SQLiteRecords, SQLiteRetention):
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
