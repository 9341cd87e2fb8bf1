"""Issue 9, acceptance 2: a queue that survives bad messages, bad disks and bad days.

Three real worker processes on one SQLite file, real executors (the direct arm: a plain
subprocess per job, so no bubblewrap is needed and it runs unprivileged too). While a few
hundred jobs go through:

- every 1-3 s a random worker is SIGKILLed and a new one started in its place;
- poison messages arrive mid-run the way a producer in another language sends them
  (plain SQL into ``job_inbox``, or straight into ``jobs``): nested 1,000 and 100,000
  levels deep, not JSON, not UTF-8 (in the body or in the id), wrong field types, over
  the size limit;
- storage faults are injected into live workers: one can no longer grow any file (its
  RLIMIT_FSIZE set from outside, as a full disk does: its WAL writes and its log writes
  fail) for about a second; and the test itself holds the write lock past the workers'
  busy timeout.

Then: every valid job has exactly one stored result, and it succeeded; every poison
message is dead-lettered once with E_BAD_MESSAGE (and logged at most once); no worker
ever exited on its own, and each drains with exit 0 at the end; the file passes
``PRAGMA integrity_check``.

The random schedule is seeded (printed on failure) so a failing run can be replayed.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from metnos_exec.brokers.sqlite import SQLiteBroker
from metnos_exec.logs import iter_records
from metnos_exec.messages import MAX_JOB_BYTES, Job, decode_result
from tests.helpers.faults import limit_file_size, restore_file_size
from tests.helpers.worker_cli import worker_argv

pytestmark = pytest.mark.slow

SLEEPY_MANIFEST = """\
name = "sleepy"
version = "1"
runtime = "python"
entry = "main.py"
[args.s]
type = "number"
default = 0
[args.i]
type = "integer"
default = 0
"""
SLEEPY_MAIN = """\
import json, sys, time
a = json.load(sys.stdin)
time.sleep(a["s"])
print(json.dumps({"i": a["i"]}))
"""

VALID_JOBS = 300
WORKERS = 3
#: The whole run (kills included) must end well within this.
DEADLINE_S = 150.0


def _poison() -> list[tuple[str, str, Any]]:
    """(id, how it is inserted, body): what producers that get it wrong send."""

    def deep(n: int) -> str:
        return '{"executor":"sleepy","args":{"a":' + "[" * n + "]" * n + "}}"

    huge = '{"v":1,"id":"P-HUGE","executor":"sleepy","args":{"b":"' + "x" * MAX_JOB_BYTES + '"}}'
    return [
        ("P-DEEP1000", "inbox", deep(1000)),
        ("P-DEEP100K", "inbox", deep(100_000)),
        ("P-NOTJSON", "inbox", "this is not a job"),
        ("P-TYPES", "inbox", '{"v":1,"id":"P-TYPES","executor":7,"max_attempts":"x"}'),
        (
            "P-LATIN1",
            "inbox-bytes",
            b'{"v":1,"id":"P-LATIN1","executor":"sleepy","args":{"t":"\xe9"}}',
        ),
        ("P-BADID\ufffd", "inbox-bad-id", '{"v":1,"id":"x","executor":"sleepy"}'),
        ("P-HUGE", "jobs", huge),
        ("P-MISMATCH", "inbox", '{"v":1,"id":"OTHER","executor":"sleepy"}'),
    ]


def _insert_poison(db: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(db, isolation_level=None, timeout=30)) as conn:
        conn.execute("PRAGMA busy_timeout = 30000")
        for job_id, how, body in _poison():
            if how == "inbox":
                conn.execute("INSERT INTO job_inbox (id, body) VALUES (?, ?)", (job_id, body))
            elif how == "inbox-bytes":
                conn.execute(
                    "INSERT INTO job_inbox (id, body) VALUES (?, CAST(? AS TEXT))", (job_id, body)
                )
            elif how == "inbox-bad-id":
                raw_id = job_id.replace("\ufffd", "").encode() + b"\xff"
                conn.execute(
                    "INSERT INTO job_inbox (id, body) VALUES (CAST(? AS TEXT), ?)", (raw_id, body)
                )
            else:  # past the inbox, which refuses it: as an older version's store
                conn.execute("INSERT INTO jobs (id, body) VALUES (?, ?)", (job_id, body))
    return [job_id for job_id, _, _ in _poison()]


class Fleet:
    """The worker processes: started, killed and restarted; every log kept."""

    def __init__(self, tmp: Path, rng: random.Random) -> None:
        self.tmp = tmp
        self.rng = rng
        self.url = f"sqlite:///{tmp / 'q.db'}?busy_timeout_s=0.5"
        self.live: dict[int, subprocess.Popen[bytes]] = {}
        self.killed: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        self.log_of: dict[int, int] = {}
        self.started = 0

    def start(self, slot: int) -> None:
        self.started += 1
        log = self.tmp / f"w{slot}-{self.started}.jsonl"
        self.log_of[slot] = len(self.logs)
        self.logs.append(log)
        self.live[slot] = subprocess.Popen(
            worker_argv(
                self.url,
                self.tmp / "executors",
                log,
                *("--worker-id", f"w{slot}-{self.started}", "--concurrency", "2"),
                *("--visibility", "2", "--grace", "5"),
                *("--backend", self.rng.choice(["asyncio", "trio"])),
            ),
            env={**os.environ, "HOME": str(self.tmp), "METNOS_SANDBOX": "off"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def check_alive(self) -> None:
        for slot, proc in self.live.items():
            code = proc.poll()
            if code is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise AssertionError(f"worker w{slot} exited on its own ({code}): {err}")

    def wait_serving(self) -> None:
        """Every live worker runs metnos-exec's code (past the interpreter's start-up: a
        signal is then honoured): its log has a record. Not necessarily `worker.started`:
        a disk fault right at its start may have dropped that one (a `log.dropped` record
        says so later)."""
        deadline = time.monotonic() + 30
        for slot in self.live:
            log = self.logs[self.log_of[slot]]
            while not (log.exists() and any(True for _ in iter_records(log))):
                self.check_alive()
                assert time.monotonic() < deadline, f"w{slot} never logged anything"
                time.sleep(0.02)  # polling a log file, with a deadline

    def kill_one(self) -> None:
        slot = self.rng.choice(sorted(self.live))
        proc = self.live.pop(slot)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        self.killed.append(proc)
        self.start(slot)

    def close(self) -> None:
        for proc in [*self.live.values(), *self.killed]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stderr:
                proc.stderr.close()


@contextlib.contextmanager
def _fleet(tmp: Path, rng: random.Random) -> Iterator[Fleet]:
    fleet = Fleet(tmp, rng)
    try:
        yield fleet
    finally:
        fleet.close()


def _stats(db: Path) -> dict[str, int]:
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as conn:
        conn.execute("PRAGMA busy_timeout = 30000")
        return dict(conn.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall())


@pytest.mark.timeout(DEADLINE_S + 60)
def test_workers_killed_fed_poison_and_starved_of_disk_lose_nothing(tmp_path: Path) -> None:
    seed = int(os.environ.get("METNOS_CHAOS_SEED", random.randrange(2**32)))
    print(f"chaos seed: {seed} (METNOS_CHAOS_SEED={seed} replays it)")
    rng = random.Random(seed)
    ex = tmp_path / "executors" / "sleepy"
    ex.mkdir(parents=True)
    (ex / "manifest.toml").write_text(SLEEPY_MANIFEST)
    (ex / "main.py").write_text(SLEEPY_MAIN)
    db = tmp_path / "q.db"
    valid = [
        Job(executor="sleepy", args={"s": round(rng.uniform(0, 0.25), 3), "i": i}, max_attempts=50)
        for i in range(VALID_JOBS)
    ]

    async def submit(jobs: list[Job]) -> None:
        async with SQLiteBroker(db, busy_timeout_s=30) as broker:
            await broker.submit_many(jobs)

    anyio.run(submit, valid[:100])
    kills = lock_holds = disk_faults = 0
    poison: list[str] = []
    with _fleet(tmp_path, rng) as fleet:
        for slot in range(WORKERS):
            fleet.start(slot)
        t0 = time.monotonic()
        next_kill = t0 + rng.uniform(1, 3)
        next_fault = t0 + rng.uniform(0.5, 2)
        fed = 100
        faulted: tuple[int, tuple[int, int], float] | None = None
        while True:
            now = time.monotonic()
            assert now - t0 < DEADLINE_S, f"not done in {DEADLINE_S} s: {_stats(db)}"
            fleet.check_alive()
            if fed < VALID_JOBS and now - t0 > 1.0 * (fed // 100):
                anyio.run(submit, valid[fed : fed + 100])
                fed += 100
            if not poison and now - t0 > 2.0:
                poison = _insert_poison(db)
            if faulted is not None and now >= faulted[2]:
                restore_file_size(faulted[0], faulted[1])
                faulted = None
            if now >= next_fault:
                next_fault = now + rng.uniform(1, 3)
                if rng.random() < 0.5 and faulted is None:
                    pid = fleet.live[rng.choice(sorted(fleet.live))].pid
                    with contextlib.suppress(ProcessLookupError):
                        faulted = (pid, limit_file_size(pid), now + rng.uniform(0.5, 1.5))
                        disk_faults += 1
                else:
                    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
                        conn.execute("PRAGMA busy_timeout = 30000")
                        conn.execute("BEGIN IMMEDIATE")
                        time.sleep(rng.uniform(0.6, 1.2))  # holding the lock *is* the fault
                        conn.execute("ROLLBACK")
                    lock_holds += 1
            if now >= next_kill:
                fleet.kill_one()
                kills += 1
                next_kill = time.monotonic() + rng.uniform(1, 3)
            stats = _stats(db)
            if (
                fed == VALID_JOBS
                and poison
                and faulted is None
                and stats.get("queued", 0) == 0
                and stats.get("running", 0) == 0
            ):
                break
            time.sleep(0.05)  # the chaos loop's own pace
        took = time.monotonic() - t0
        fleet.check_alive()
        # The end of a bad day: every live worker drains and exits 0. (Once it serves: a
        # signal in the first instants of the interpreter, before metnos-exec's code
        # runs, still kills it, as it would any Python program.)
        fleet.wait_serving()
        for proc in fleet.live.values():
            proc.send_signal(signal.SIGTERM)
        for slot, proc in fleet.live.items():
            code = proc.wait(30)
            err = proc.stderr.read().decode() if proc.stderr else ""
            assert code == 0, f"w{slot} exited {code} on SIGTERM: {err}"
        logs = list(fleet.logs)
    print(f"chaos: {took:.1f} s, {kills} kills, {disk_faults} disk faults, {lock_holds} locks")
    assert kills >= 3 and disk_faults + lock_holds >= 2

    with contextlib.closing(sqlite3.connect(db)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        results = {
            job_id: decode_result(body)
            for job_id, body in conn.execute("SELECT job_id, CAST(body AS BLOB) FROM results")
        }
        letters = conn.execute("SELECT job_id, body FROM dead_letters").fetchall()
        states = dict(conn.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall())
    # Every valid job: one result (the table's key makes it one at most), and a success.
    for job in valid:
        result = results.get(job.id)
        assert result is not None, f"no result for {job.id}"
        assert (result.status, result.output) == ("succeeded", {"i": job.args["i"]}), result
    # Every poison message: dead-lettered once, as a bad message.
    assert sorted(j for j, _ in letters) == sorted(poison)
    for job_id in poison:
        assert results[job_id].status == "dead"
        assert results[job_id].error is not None and results[job_id].error.code == "E_BAD_MESSAGE"
    assert states == {"done": VALID_JOBS, "dead": len(poison)}
    # Logged at most once each (a killed worker, or one starved of disk, may lose a record;
    # none is logged twice: records are written after the transaction commits).
    logged = [
        rec["job_id"]
        for log in logs
        if log.exists()
        for rec in iter_records(log, event="job.bad_message")
    ]
    assert len(logged) == len(set(logged)) and set(logged) <= set(poison)
