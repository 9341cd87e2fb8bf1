"""``python -m metnos_exec worker`` for bench/fleet.py, with two clocks on the broker.

Run as ``python bench/_fleet_worker.py worker --broker URL ...`` (the arguments of
``python -m metnos_exec``). Before it hands over to the real command line it wraps:

- every broker's ``lease`` (SQLite and Redis): the wall time of each call as the
  supervisor's lease loop sees it (the round trip, a wait for the SQLite write lock, the
  event loop's turn after it), kept in memory as (monotonic start, seconds, jobs leased)
  and written at exit to ``$BENCH_FLEET_STATS.lease`` (float64 triples);
- the SQLite store's ``_run`` (each call into SQLite: one transaction or one read): the
  calls, the CPU time of the thread that ran them (`time.thread_time`: the event loop's
  thread when inline, the worker thread when it waited for the lock held by another
  process, every try counted) and their wall time, kept up to date in the 24-byte file
  ``$BENCH_FLEET_STATS.sqlite`` (three float64: cpu_s, wall_s, calls), which the bench
  reads at the start and at the end of its window.

Nothing else changes: the worker, its supervisor and its broker are the real ones. The
wrappers cost two clock reads and a 24-byte write per store call (about 2 us, against
the ~100 us of CPU a job costs a worker); ``bench/fleet.py --plain`` runs the workers
without them, to check that.
"""

from __future__ import annotations

import array
import atexit
import mmap
import os
import runpy
import struct
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from metnos_exec.brokers._sqlite_store import SQLiteStore  # noqa: E402
from metnos_exec.brokers.redis import RedisBroker  # noqa: E402
from metnos_exec.brokers.sqlite import SQLiteBroker  # noqa: E402

OUT = os.environ["BENCH_FLEET_STATS"]
_leases = array.array("d")
_sqlite = [0.0, 0.0, 0.0]  # cpu_s, wall_s, calls
_fd = os.open(f"{OUT}.sqlite", os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(_fd, 24)
_shared = mmap.mmap(_fd, 24)


def _wrap_lease(cls: Any) -> None:
    inner = cls.lease

    async def lease(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = time.monotonic()
        out = await inner(self, *args, **kwargs)
        _leases.extend((t, time.monotonic() - t, float(len(out))))
        return out

    cls.lease = lease


def _wrap_store() -> None:
    inner = SQLiteStore._run

    async def _run(self: Any, fn: Any, *args: Any, inline: bool = True) -> Any:
        def timed(*a: Any) -> Any:
            c, w = time.thread_time(), time.perf_counter()
            try:
                return fn(*a)
            finally:
                _sqlite[0] += time.thread_time() - c
                _sqlite[1] += time.perf_counter() - w

        try:
            return await inner(self, timed, *args, inline=inline)
        finally:
            _sqlite[2] += 1
            struct.pack_into("ddd", _shared, 0, *_sqlite)

    SQLiteStore._run = _run  # type: ignore[method-assign]


@atexit.register
def _dump() -> None:
    with open(f"{OUT}.lease", "wb") as f:
        _leases.tofile(f)


_wrap_lease(SQLiteBroker)
_wrap_lease(RedisBroker)
_wrap_store()
sys.argv = ["metnos_exec", *sys.argv[1:]]
runpy.run_module("metnos_exec", run_name="__main__", alter_sys=True)
