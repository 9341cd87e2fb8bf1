"""The SQLite broker: the conformance suite, the schema contract, and real processes."""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from metnos_exec.brokers import Broker, SubmitReceipt, open_broker
from metnos_exec.brokers.sqlite import SCHEMA_SQL, SCHEMA_VERSION, BrokerUnavailable, SQLiteBroker
from metnos_exec.errors import (
    BrokerBusy,
    BrokerCorrupt,
    BrokerFull,
    BrokerGone,
    BrokerReadOnly,
    MetnosError,
)
from metnos_exec.messages import MAX_JOB_BYTES, Job, Result, decode_result, encode
from tests.helpers.faults import read_only

from .conformance import BrokerConformance, VirtualClock

ROOT = Path(__file__).resolve().parents[2]


class TestSQLiteBroker(BrokerConformance):
    @pytest.fixture(autouse=True)
    def _db_path(self, tmp_path: Path) -> None:
        self.db_path = tmp_path / "queue.db"

    @contextlib.asynccontextmanager
    async def open_broker(self, clock: VirtualClock) -> AsyncIterator[Broker]:
        # A long poll interval: the suite's wait tests must be woken by the in-process
        # signal, not by a poll that happens to come round. A short busy timeout, for
        # `storage_fault` (no other test contends for the lock).
        async with SQLiteBroker(
            self.db_path, clock=clock, poll_interval_s=30.0, busy_timeout_s=0.2
        ) as broker:
            yield broker

    @contextlib.asynccontextmanager
    async def storage_fault(self, broker: Broker) -> AsyncIterator[None]:
        # Another process's write lock, held past the broker's busy timeout.
        with contextlib.closing(sqlite3.connect(self.db_path, isolation_level=None)) as other:
            other.execute("BEGIN IMMEDIATE")
            try:
                yield
            finally:
                other.execute("ROLLBACK")


def test_schema_file_matches_the_embedded_schema() -> None:
    assert (ROOT / "queue" / "sqlite_schema.sql").read_text() == SCHEMA_SQL


def test_open_broker_sqlite_url(tmp_path: Path) -> None:
    async def main() -> None:
        broker = open_broker(f"sqlite:///{tmp_path}/q.db?poll_interval_s=0.2")
        assert isinstance(broker, SQLiteBroker)
        assert broker.path == tmp_path / "q.db"
        await broker.close()

    anyio.run(main)


def test_open_without_create_refuses_a_missing_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "nope.db"
    for url, create in ((f"sqlite:///{missing}", False), (f"sqlite:///{missing}?create=0", True)):
        with pytest.raises(BrokerUnavailable) as info:
            open_broker(url, create=create)
        assert "no queue file at" in info.value.message and str(missing) in info.value.message
        assert not missing.exists()
    # Three slashes are relative to the current folder, and the message shows where.
    with pytest.raises(BrokerUnavailable) as info:
        open_broker("sqlite:///work/x.db", create=False)
    assert str(tmp_path / "work" / "x.db") in info.value.message
    assert "four slashes" in info.value.message

    async def main() -> None:
        async with open_broker(f"sqlite:///{missing}") as created:  # the default creates
            assert (await created.stats()).queued == 0
        async with open_broker(f"sqlite:///{missing}", create=False) as existing:
            assert isinstance(existing, SQLiteBroker)

    anyio.run(main)


# --- real processes on one file -------------------------------------------------------

CONSUMER = Path(__file__).with_name("_consumer.py")


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(CONSUMER), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )


def _reap(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _all_results(db: Path) -> list[tuple[str, str]]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return conn.execute("SELECT job_id, body FROM results").fetchall()


@pytest.mark.slow
def test_two_worker_processes_drain_1000_jobs_exactly_once(tmp_path: Path) -> None:
    db = tmp_path / "queue.db"
    jobs = [Job(executor="echo", args={"i": i}) for i in range(1000)]

    async def fill() -> None:
        async with SQLiteBroker(db) as broker:
            await broker.submit_many(jobs)

    anyio.run(fill)
    records = [tmp_path / "w1.ids", tmp_path / "w2.ids"]
    go = tmp_path / "go"
    procs = [
        _spawn("drain", str(db), str(records[0]), "w1", "asyncio", str(go), str(records[1])),
        _spawn("drain", str(db), str(records[1]), "w2", "trio", str(go), str(records[0])),
    ]
    try:
        deadline = time.monotonic() + 30
        while not all(Path(f"{r}.ready").exists() for r in records):
            assert all(p.poll() is None for p in procs), "a consumer died at start"
            assert time.monotonic() < deadline, "consumers never got ready"
            time.sleep(0.01)  # polling files with a deadline
        go.touch()
        for proc in procs:
            _out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err.decode()
    finally:
        _reap(procs)
    done = [r.read_text().split() for r in records]
    # Both took part by construction (each holds its first batch until the other has
    # leased too, see _consumer.py), not by the luck of scheduling on a busy machine.
    assert all(done)
    # No job ran twice, none was lost.
    assert len(done[0]) == len(set(done[0])) and len(done[1]) == len(set(done[1]))
    assert not set(done[0]) & set(done[1])
    assert set(done[0]) | set(done[1]) == {j.id for j in jobs}
    # Every job has exactly one result, from the worker that ran it.
    results = _all_results(db)
    assert len(results) == 1000
    by_worker = {job_id: decode_result(body).output["by"] for job_id, body in results}
    assert {k for k, v in by_worker.items() if v == "w1"} == set(done[0])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sigkilled_consumer_loses_its_lease_and_the_job_is_redelivered(
    tmp_path: Path, backend: str
) -> None:
    db = tmp_path / "queue.db"
    ready = tmp_path / "ready"
    job = Job(executor="echo", args={"n": 1})

    async def fill() -> None:
        async with SQLiteBroker(db) as broker:
            await broker.submit(job)

    anyio.run(fill, backend=backend)
    proc = _spawn("hold", str(db), str(ready), "1.0", backend)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[1].decode()
            assert time.monotonic() < deadline, "the consumer never leased the job"
            time.sleep(0.01)  # polling a file with a deadline
        assert ready.read_text().split() == [job.id, "1"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        _reap([proc])

    async def take_over() -> None:
        async with SQLiteBroker(db, poll_interval_s=0.05) as broker:
            state = await broker.get_job_state(job.id)
            assert state is not None and state.state == "running" and state.worker == "doomed"
            with anyio.fail_after(30):
                while not (leases := await broker.lease("rescuer", visibility_s=30)):
                    await broker.wait_for_work(0.05)
            [lease] = leases
            assert (lease.job.id, lease.attempt) == (job.id, 2)
            done = Result(job_id=job.id, status="succeeded", worker="rescuer", attempt=2)
            assert await broker.ack(lease, done)
            assert await broker.lease("rescuer", visibility_s=30) == []

    anyio.run(take_over, backend=backend)
    results = _all_results(db)
    assert len(results) == 1
    result = decode_result(results[0][1])
    assert (result.worker, result.attempt) == ("rescuer", 2)


# --- the producer edge and the lock fallback ------------------------------------------


@pytest.mark.anyio
async def test_a_foreign_producer_inserting_into_job_inbox_is_served(tmp_path: Path) -> None:
    db = tmp_path / "queue.db"
    async with SQLiteBroker(db) as broker:
        # What a producer in another language does (queue/README.md): plain SQL.
        with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
            conn.execute("PRAGMA busy_timeout = 5000")
            body = {
                "v": 1,
                "id": "01JDX9FOREIGN0000000000000",
                "executor": "echo",
                "args": {"x": 1},
                "priority": 7,
                "device": "phone",
                "idempotency_key": "k1",
                "not_before": 0,
            }
            conn.execute(
                "INSERT INTO job_inbox (id, body) VALUES (?, ?)", (body["id"], json.dumps(body))
            )
            dup = dict(body, id="01JDX9FOREIGN0000000000001")
            conn.execute(
                "INSERT INTO job_inbox (id, body) VALUES (?, ?)", (dup["id"], json.dumps(dup))
            )
            assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (1,)
        assert await broker.lease("s", visibility_s=5) == []  # targeted at the phone
        [lease] = await broker.lease("p", visibility_s=5, device="phone")
        assert lease.job.id == body["id"] and lease.job.priority == 7
        assert lease.job.args == {"x": 1}


@pytest.mark.anyio
async def test_a_write_lock_held_elsewhere_waits_in_a_thread_not_on_the_loop(
    tmp_path: Path,
) -> None:
    db = tmp_path / "queue.db"
    async with SQLiteBroker(db, busy_timeout_s=20) as broker:
        with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as other:
            other.execute("BEGIN IMMEDIATE")
            receipts: list[SubmitReceipt] = []
            ticks = 0

            async def submit() -> None:
                receipts.append(await broker.submit(Job(executor="echo")))

            async with anyio.create_task_group() as tg:
                tg.start_soon(submit)
                # The loop keeps running while the submit waits for the lock...
                with anyio.move_on_after(0.3):
                    while True:
                        ticks += 1
                        await anyio.sleep(0.01)
                assert not receipts and ticks > 5
                other.execute("COMMIT")
                # ...and the submit completes once the lock is free.
            assert len(receipts) == 1
        [lease] = await broker.lease("w", visibility_s=5)
        assert lease.job.id == receipts[0].job_id


@pytest.mark.anyio
async def test_calls_made_while_another_yields_still_run_inline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An uncontended call runs on the loop; it frees the connection *before* it yields,
    so calls that other tasks make meanwhile run inline too (no thread hop each)."""
    import metnos_exec.brokers._sqlite_store as sqlite_mod

    hops: list[object] = []
    real = sqlite_mod.anyio.to_thread.run_sync

    async def counting(fn: object, *args: object, **kw: object) -> object:
        if getattr(fn, "__name__", "") == "_patient":  # the broker's waiting path
            hops.append(fn)
        return await real(fn, *args, **kw)  # type: ignore[arg-type]

    async with SQLiteBroker(tmp_path / "queue.db") as broker:
        await broker.submit_many([Job(executor="echo") for _ in range(40)])
        monkeypatch.setattr(sqlite_mod.anyio.to_thread, "run_sync", counting)
        leased: list[int] = []

        async def consumer() -> None:
            for _ in range(10):
                leases = await broker.lease("w", visibility_s=5)
                leased.append(len(leases))
                await broker.ack(leases[0], Result(job_id=leases[0].job.id, status="succeeded"))

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(consumer)
    assert leased == [1] * 40
    assert hops == []


@pytest.mark.anyio
async def test_jobs_survive_reopening_the_file(tmp_path: Path) -> None:
    db = tmp_path / "queue.db"
    job = Job(executor="echo")
    async with SQLiteBroker(db) as broker:
        await broker.submit(job)
    async with SQLiteBroker(db) as broker:
        [lease] = await broker.lease("w", visibility_s=5)
        assert lease.job == job


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "queue.db"
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(BrokerUnavailable, match=f"schema version {SCHEMA_VERSION + 1}"):
        SQLiteBroker(db)


@pytest.mark.anyio
async def test_a_second_broker_object_on_the_same_file_is_woken_in_process(
    tmp_path: Path,
) -> None:
    db = tmp_path / "queue.db"
    # Polling is made too slow to matter: only the in-process wake-up can pass this test.
    async with (
        SQLiteBroker(db, poll_interval_s=60) as client,
        SQLiteBroker(db, poll_interval_s=60) as worker,
    ):
        got: list[Result | None] = []
        job = Job(executor="echo")

        async def wait() -> None:
            got.append(await client.wait_result(job.id, timeout=None))

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait)
                await client.submit(job)
                while not (leases := await worker.lease("w", visibility_s=5)):
                    await worker.wait_for_work(60)
                await worker.ack(leases[0], Result(job_id=job.id, status="succeeded"))
        assert got and got[0] is not None and got[0].status == "succeeded"


async def _answered_by_another_process(
    db: Path, backend: str, *, poll_s: float, jobs: int = 3
) -> list[Result | None]:
    """Submit `jobs` jobs one after another and wait for each result, answered by a
    consumer process polling every `poll_s`, this side polling every `poll_s` too."""
    ready = db.with_name("ready")
    proc = _spawn("answer", str(db), str(ready), str(jobs), backend, str(poll_s))
    got: list[Result | None] = []
    try:
        async with SQLiteBroker(db, poll_interval_s=poll_s) as client:
            with anyio.fail_after(30):
                while not ready.exists():  # noqa: ASYNC110 (another process's signal)
                    await anyio.sleep(0.01)
                for _ in range(jobs):
                    job = Job(executor="echo")
                    await client.submit(job)
                    got.append(await client.wait_result(job.id, timeout=None))
        # The consumer leaves after its last ack: it must end by itself.
        await anyio.to_thread.run_sync(proc.wait, 30)
    finally:
        _reap([proc])
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    return got


async def test_another_process_s_submit_and_ack_wake_the_waits_without_the_poll(
    tmp_path: Path, anyio_backend: str
) -> None:
    """Issue 22: an idle worker and a waiting client in other processes noticed a new row
    only at their next poll (50 ms: an echo job took 51 ms through a worker). With both
    polls at an hour, only the inotify watch on the -wal file can pass this: the consumer
    is woken by our submits, we by its acks."""
    got = await _answered_by_another_process(tmp_path / "q.db", anyio_backend, poll_s=3600)
    assert [r.output if r else None for r in got] == [{"by": "answer"}] * 3


async def test_where_no_watch_can_be_made_the_waits_still_poll(
    tmp_path: Path, anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kernel refuses inotify (no support, the instance limit reached): the poll is
    # what finds the rows, in both processes (the consumer's watch is refused by the same
    # limit: here, its poll is short too).
    from metnos_exec.brokers import _file_wake

    monkeypatch.setattr(_file_wake.FileWatch, "open", classmethod(lambda cls, files: None))
    got = await _answered_by_another_process(tmp_path / "q.db", anyio_backend, poll_s=0.02)
    assert [r.status if r else None for r in got] == ["succeeded"] * 3


async def test_a_watch_wakes_for_its_files_only(tmp_path: Path, anyio_backend: str) -> None:
    from metnos_exec.brokers._file_wake import FileWatch

    wal = tmp_path / "q.db-wal"
    watch = FileWatch.open((wal,))
    assert watch is not None
    try:
        (tmp_path / "worker.jsonl").write_text("a log line beside the queue\n")
        with anyio.move_on_after(0.3) as scope:
            await watch.changed()
        assert scope.cancelled_caught, "a write to another file of the folder woke it"
        wal.write_bytes(b"x")  # made: IN_CREATE
        with anyio.fail_after(10):
            await watch.changed()
        with wal.open("ab") as f:  # written: IN_MODIFY, seen although nobody waited yet
            f.write(b"y")
        with anyio.fail_after(10):
            await watch.changed()
    finally:
        watch.close()
        watch.close()  # idempotent


def test_an_unopenable_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(BrokerUnavailable, match="cannot open the queue database") as info:
        SQLiteBroker(tmp_path / "missing-dir" / "queue.db")
    assert info.value.code == "E_BROKER_UNAVAILABLE"
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database" * 100)
    garbage.chmod(0o644)
    with pytest.raises(BrokerCorrupt, match="cannot use the queue database") as bad:
        SQLiteBroker(garbage)
    assert bad.value.code == "E_BROKER_CORRUPT" and bad.value.fatal
    # Refused untouched (issue 18: its mode was tightened 0644 -> 0640 first).
    assert garbage.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["garbage.db"]


# --- issue 9: a queue that survives bad messages, bad disks and bad days --------------


def _foreign(db: Path) -> contextlib.closing[sqlite3.Connection]:
    """A producer in another language: plain SQL on the queue file."""
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 5000")
    return contextlib.closing(conn)


def _body(job_id: str, args: str = "{}") -> str:
    return f'{{"v":1,"id":"{job_id}","executor":"echo","args":{args}}}'


@pytest.mark.anyio
async def test_poison_rows_from_a_foreign_producer_never_wedge_the_queue(tmp_path: Path) -> None:
    """Finding 1 at the SQLite edge: rows a producer wrote with plain SQL that make a
    decoder raise anything (RecursionError, text that is not UTF-8 in the body or the id,
    a body over the size limit written straight into `jobs`) are dead-lettered once, and
    the valid jobs of the same batch are leased in the same call."""
    db = tmp_path / "queue.db"
    async with SQLiteBroker(db) as broker:
        good = [Job(executor="echo", args={"i": i}) for i in range(2)]
        await broker.submit(good[0])
        with _foreign(db) as conn:
            for job_id, depth in (("DEEP1000", 1000), ("DEEP5000", 5000)):
                args = '{"a":' + "[" * depth + "]" * depth + "}"
                conn.execute(
                    "INSERT INTO job_inbox (id, body) VALUES (?, ?)", (job_id, _body(job_id, args))
                )
            latin = _body("LATIN1", '{"t":"caf\xe9"}').encode("latin-1")
            conn.execute(
                "INSERT INTO job_inbox (id, body) VALUES ('LATIN1', CAST(? AS TEXT))", (latin,)
            )
            conn.execute(
                "INSERT INTO job_inbox (id, body) VALUES (CAST(? AS TEXT), ?)",
                (b"BAD\xffID", _body("x")),
            )
            huge = _body("HUGE", '{"blob":"' + "x" * (MAX_JOB_BYTES + 10) + '"}')
            # Past the inbox (which refuses it): as a store written by an older version.
            conn.execute("INSERT INTO jobs (id, body) VALUES ('HUGE', ?)", (huge,))
        await broker.submit(good[1])
        with capture_logs() as logs:
            leases = await broker.lease("w", visibility_s=30, limit=20)
        assert [le.job.id for le in leases] == [j.id for j in good]
        letters = {d.job_id: d for d in await broker.dead_letters()}
        assert set(letters) == {"DEEP1000", "DEEP5000", "LATIN1", "BAD\ufffdID", "HUGE"}
        assert all(d.error.code == "E_BAD_MESSAGE" for d in letters.values())
        assert letters["HUGE"].raw_truncated and len(letters["HUGE"].raw or b"") == MAX_JOB_BYTES
        assert "MAX_JOB_BYTES" in letters["HUGE"].error.message
        assert letters["LATIN1"].raw == latin
        assert len([e for e in logs if e["event"] == "job.bad_message"]) == 5
        with capture_logs() as again:
            assert await broker.lease("w", visibility_s=30, limit=20) == []
        assert [e for e in again if e["event"] == "job.bad_message"] == []
        assert (await broker.stats()).dead == 5


def test_the_inbox_refuses_a_body_over_the_size_limit(tmp_path: Path) -> None:
    db = tmp_path / "queue.db"
    anyio.run(_open_and_close, db)
    with _foreign(db) as conn:
        big = _body("BIG", '{"blob":"' + "x" * MAX_JOB_BYTES + '"}')
        with pytest.raises(sqlite3.IntegrityError, match=r"E_BAD_MESSAGE.*MAX_JOB_BYTES"):
            conn.execute("INSERT INTO job_inbox (id, body) VALUES ('BIG', ?)", (big,))
        assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (0,)
        conn.execute("INSERT INTO job_inbox (id, body) VALUES ('OK', ?)", (_body("OK"),))
        assert conn.execute("SELECT count(*) FROM jobs").fetchone() == (1,)


async def _open_and_close(db: Path) -> None:
    async with SQLiteBroker(db):
        pass


class _WatchedClock:
    """A virtual clock that counts its reads, so a test knows when a call has read it
    (from any thread)."""

    def __init__(self) -> None:
        self.now = 1_900_000_000.0
        self.reads = 0
        self._cond = threading.Condition()

    def __call__(self) -> float:
        with self._cond:
            self.reads += 1
            self._cond.notify_all()
        return self.now

    def wait_reads(self, n: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.reads >= n, timeout)


@pytest.mark.anyio
@pytest.mark.parametrize("op", ["lease", "heartbeat"])
async def test_a_lease_is_timed_from_after_the_wait_for_the_lock(tmp_path: Path, op: str) -> None:
    """Finding 3: the write lock held elsewhere for a while (here: 100 s of virtual time)
    must not shorten a lease granted or renewed after the wait."""
    db = tmp_path / "queue.db"
    clock = _WatchedClock()
    async with SQLiteBroker(db, clock=clock, busy_timeout_s=60) as broker:
        await broker.submit(Job(executor="echo"))
        [first] = await broker.lease("w", visibility_s=30) if op == "heartbeat" else [None]
        with _foreign(db) as other:
            other.execute("BEGIN IMMEDIATE")
            got: list[Any] = []

            async def call() -> None:
                if op == "lease":
                    got.extend(await broker.lease("w", visibility_s=30))
                else:
                    got.append(await broker.heartbeat(first, visibility_s=30))

            async with anyio.create_task_group() as tg:
                before = clock.reads
                tg.start_soon(call)
                # The call met the lock inline and now waits for it in a thread (holding
                # the connection); a lease has read the clock on both paths by then.
                await anyio.wait_all_tasks_blocked()
                assert broker._limiter is not None and broker._limiter.borrowed_tokens == 1
                if op == "lease":
                    assert await anyio.to_thread.run_sync(clock.wait_reads, before + 2, 10)
                clock.now += 100  # the lock is held a long time
                other.execute("COMMIT")
        [reply] = got
        assert reply.lease_until == 1_900_000_000.0 + 100 + 30


@pytest.mark.anyio
async def test_a_lock_held_past_the_busy_timeout_is_broker_busy_and_costs_no_attempt(
    tmp_path: Path,
) -> None:
    db = tmp_path / "queue.db"
    async with SQLiteBroker(db, busy_timeout_s=0.1) as broker:
        job = Job(executor="echo")
        await broker.submit(job)
        with _foreign(db) as other:
            other.execute("BEGIN IMMEDIATE")
            for call in (
                broker.lease("w", visibility_s=30),
                broker.submit(Job(executor="echo")),
                broker.cancel(job.id),
            ):
                with pytest.raises(BrokerBusy) as info:
                    await call
                assert info.value.code == "E_BROKER_BUSY" and info.value.retry
                assert "busy_timeout_s" in info.value.message
            other.execute("ROLLBACK")
        [lease] = await broker.lease("w", visibility_s=30)
        assert lease.attempt == 1


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["deleted", "replaced"])
async def test_a_queue_file_deleted_or_replaced_under_the_broker_is_broker_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Finding 5: a worker must not go on serving a file nobody else sees."""
    import metnos_exec.brokers._sqlite_store as sqlite_mod

    monkeypatch.setattr(sqlite_mod, "_FILE_CHECK_S", 0.0)
    db = tmp_path / "queue.db"
    async with SQLiteBroker(db) as broker:
        await broker.submit(Job(executor="echo"))
        for suffix in ("", "-wal", "-shm"):
            Path(f"{db}{suffix}").unlink(missing_ok=True)  # noqa: ASYNC240
        if how == "replaced":
            async with SQLiteBroker(db) as fresh:  # e.g. a demo starting afresh
                await fresh.submit(Job(executor="echo"))
        for call in (
            broker.lease("w", visibility_s=30),
            broker.stats(),
            broker.purge(older_than_s=1),
        ):
            with pytest.raises(BrokerGone) as info:
                await call
            assert info.value.code == "E_BROKER_GONE" and info.value.fatal
            assert str(db) in info.value.message and how in info.value.message


def test_a_read_only_queue_is_refused_by_writers_at_open(tmp_path: Path) -> None:
    """Finding 5: a worker (or producer) on a read-only database refuses to start instead
    of starting and failing every lease; a reader still reads."""
    db = tmp_path / "queue.db"
    anyio.run(_open_and_close, db)
    with read_only(db):
        with pytest.raises(BrokerReadOnly) as info:
            SQLiteBroker(db)
        assert info.value.code == "E_BROKER_READONLY" and str(db) in info.value.message

        async def read() -> None:
            async with SQLiteBroker(db, create=False) as reader:
                assert (await reader.stats()).queued == 0

        anyio.run(read)


@pytest.mark.anyio
async def test_store_failures_are_broker_errors_never_sqlite_errors(tmp_path: Path) -> None:
    """Finding 9 (the Python API): a full file, a read-only connection and a held lock
    each raise their own MetnosError with its code."""
    db = tmp_path / "queue.db"
    async with SQLiteBroker(db, busy_timeout_s=0.1) as broker:
        await broker.submit(Job(executor="echo"))
        (pages,) = broker._db.execute("PRAGMA page_count").fetchone()
        broker._db.execute(f"PRAGMA max_page_count = {pages}")  # SQLite's own SQLITE_FULL
        big = [Job(executor="echo", args={"x": "y" * 100_000}) for _ in range(3)]
        with pytest.raises(BrokerFull) as full:
            await broker.submit_many(big)
        assert full.value.code == "E_BROKER_FULL" and isinstance(full.value, MetnosError)
        broker._db.execute("PRAGMA max_page_count = 1073741823")
        broker._db.execute("PRAGMA query_only = 1")
        with pytest.raises(BrokerReadOnly):
            await broker.submit(Job(executor="echo"))
        broker._db.execute("PRAGMA query_only = 0")
        assert len(await broker.lease("w", visibility_s=30, limit=10)) == 1


@pytest.mark.anyio
async def test_purge_gives_the_space_back(tmp_path: Path) -> None:
    """Finding 6: forgetting finished jobs shrinks the file (incremental vacuum)."""
    db = tmp_path / "queue.db"
    clock = _WatchedClock()
    async with SQLiteBroker(db, clock=clock) as broker:
        await broker.submit_many([Job(executor="echo", args={"i": i}) for i in range(2000)])
        while leases := await broker.lease("w", visibility_s=30, limit=500):
            await broker.ack_many(
                [
                    (le, Result(job_id=le.job.id, status="succeeded", output="o" * 4000))
                    for le in leases
                ]
            )
        await broker.submit(Job(executor="echo", args={"kept": True}))
        broker._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        full = db.stat().st_size
        assert full > 8_000_000
        clock.now += 8 * 86400
        report = await broker.purge(older_than_s=7 * 86400)
        assert report.jobs == 2000
        assert report.reclaimed_bytes is not None and report.reclaimed_bytes > 0.8 * full
        assert db.stat().st_size < full / 5
        assert (await broker.stats()).queued == 1  # a queued job is never purged
        with contextlib.closing(sqlite3.connect(db)) as check:
            assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_a_file_of_this_version_made_without_the_new_columns_is_brought_up_to_date(
    tmp_path: Path,
) -> None:
    """Another branch's build may have made a version-2 file before these columns existed:
    the migration goes by what the file lacks, not by its number."""
    db = tmp_path / "queue.db"
    v1 = (Path(__file__).with_name("sqlite_schema_v1.sql")).read_text()
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.executescript(
            v1.replace("PRAGMA user_version = 1;", f"PRAGMA user_version = {SCHEMA_VERSION};")
        )
    anyio.run(_open_and_close, db)
    with contextlib.closing(sqlite3.connect(db)) as conn:
        cols = {row[1] for row in conn.execute("PRAGMA table_info(jobs)")}
        assert {"started", "lapses"} <= cols


@pytest.mark.anyio
async def test_a_version_1_file_is_migrated_and_can_be_vacuumed(tmp_path: Path) -> None:
    db = tmp_path / "queue.db"
    v1 = (Path(__file__).with_name("sqlite_schema_v1.sql")).read_text()
    job = Job(executor="echo", args={"old": True})
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.executescript(v1)
        conn.execute("INSERT INTO job_inbox (id, body) VALUES (?, ?)", (job.id, encode(job)))
        # A v1 row left running with no lease at all (finding 8): swept after migration.
        lost = Job(executor="echo", args={"lost": True})
        conn.execute("INSERT INTO job_inbox (id, body) VALUES (?, ?)", (lost.id, encode(lost)))
        conn.execute("UPDATE jobs SET state = 'running', attempt = 1 WHERE id = ?", (lost.id,))
    async with SQLiteBroker(db) as broker:
        leases = await broker.lease("w", visibility_s=30, limit=5)
        assert sorted(le.job.id for le in leases) == sorted([job.id, lost.id])
        assert {le.job.id: le.attempt for le in leases}[lost.id] == 1  # never started
        for le in leases:
            await broker.ack(le, Result(job_id=le.job.id, status="succeeded"))
        report = await broker.purge(older_than_s=-1)
        assert report.jobs == 2 and report.reclaimed_bytes is None  # no incremental vacuum yet
        await broker.vacuum()
    with contextlib.closing(sqlite3.connect(db)) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
        assert conn.execute("PRAGMA auto_vacuum").fetchone() == (2,)


@pytest.mark.anyio
async def test_an_idle_poll_costs_the_same_with_20000_delayed_jobs(tmp_path: Path) -> None:
    """Finding 7: the idle check is an index probe, not a scan of the delayed jobs.
    Measured in SQLite VM instructions (a progress handler every 100), not in time."""
    later = time.time() + 3600

    async def idle_cost(broker: SQLiteBroker) -> int:
        ticks = 0

        def tick() -> int:
            nonlocal ticks
            ticks += 1
            return 0

        broker._db.set_progress_handler(tick, 100)
        try:
            assert await broker.lease("w", visibility_s=30, limit=8) == []
        finally:
            broker._db.set_progress_handler(None, 100)
        return ticks

    async with SQLiteBroker(tmp_path / "empty.db") as empty:
        baseline = await idle_cost(empty)
    async with SQLiteBroker(tmp_path / "delayed.db") as broker:
        for start in range(0, 20_000, 1000):
            await broker.submit_many(
                [Job(executor="echo", not_before=later + i) for i in range(start, start + 1000)]
            )
        assert (await broker.stats()).delayed == 20_000
        assert await idle_cost(broker) <= baseline + 2


@pytest.mark.anyio
async def test_the_counts_by_state_are_read_off_the_event_loop(tmp_path: Path) -> None:
    """`stats` (what `status`, a /metrics scrape inside a worker and the live view read)
    walks every stored job: on 100,000 of them about 80 ms, which on the worker's event
    loop stalled every job at each scrape. It runs in a thread, on a connection of its own
    (not the one the leases and acks wait for): checked on the statements it really runs
    (captured as SQLite runs them), and that the broker's own connection runs none."""
    loop_thread = threading.get_ident()
    async with SQLiteBroker(tmp_path / "q.db") as broker:
        await broker.submit_many([Job(executor="echo") for _ in range(50)])
        [lease] = await broker.lease("w", visibility_s=30)
        await broker.ack(lease, Result(job_id=lease.job.id, status="succeeded"))
        await broker.stats()  # opens the reader
        on_loop: list[str] = []
        broker._db.set_trace_callback(on_loop.append)
        reader = broker._reader
        assert reader is not None and reader is not broker._db
        seen: list[tuple[int, str]] = []
        reader.set_trace_callback(lambda sql: seen.append((threading.get_ident(), sql)))
        try:
            stats = await broker.stats()
        finally:
            broker._db.set_trace_callback(None)
            reader.set_trace_callback(None)
        assert (stats.queued, stats.done, stats.running) == (49, 1, 0)
        assert any("GROUP BY state" in sql for _, sql in seen), seen
        assert all(thread != loop_thread for thread, _ in seen)
        assert on_loop == []
        # A write after the read is seen by the next read (no snapshot kept open).
        [lease] = await broker.lease("w", visibility_s=30)
        assert (await broker.stats()).running == 1
    assert broker._reader is None  # closed with the broker


@pytest.mark.anyio
async def test_a_running_row_without_a_lease_is_swept(tmp_path: Path) -> None:
    """Finding 8: a row left 'running' with no lease time (a bug, a hand edit) is treated
    as a lost lease, never left running forever."""
    db = tmp_path / "queue.db"
    async with SQLiteBroker(db) as broker:
        job = Job(executor="echo")
        await broker.submit(job)
        [lease] = await broker.lease("w", visibility_s=3600)
        assert await broker.mark_started(lease)
        with _foreign(db) as conn:
            conn.execute("UPDATE jobs SET lease_until = NULL WHERE id = ?", (job.id,))
        [again] = await broker.lease("w2", visibility_s=30)
        assert (again.job.id, again.attempt) == (job.id, 2)
        assert not await broker.ack(lease, Result(job_id=job.id, status="succeeded"))


@pytest.mark.anyio
async def test_a_backlog_for_another_executor_costs_an_idle_worker_nothing(tmp_path: Path) -> None:
    """Executor routing: 20,000 jobs queued for an executor whose worker is away cost the
    poll (and the lease) of a worker serving other executors one index probe each, not a
    walk of the backlog. Measured in SQLite VM instructions, not in time."""

    async def cost(broker: SQLiteBroker, served: list[str]) -> tuple[int, int]:
        ticks = 0

        def tick() -> int:
            nonlocal ticks
            ticks += 1
            return 0

        broker._db.set_progress_handler(tick, 100)
        try:
            got = await broker.lease("w", visibility_s=30, limit=8, executors=served)
        finally:
            broker._db.set_progress_handler(None, 100)
        return ticks, len(got)

    async with SQLiteBroker(tmp_path / "empty.db") as empty:
        baseline, _ = await cost(empty, ["alpha"])
    async with SQLiteBroker(tmp_path / "backlog.db") as broker:
        for _ in range(20):
            await broker.submit_many([Job(executor="beta") for _ in range(1000)])
        idle, got = await cost(broker, ["alpha"])
        assert got == 0 and idle <= baseline + 2
        await broker.submit(Job(executor="alpha"))
        busy, got = await cost(broker, ["alpha", "gamma"])
        assert got == 1 and busy < 200  # a full walk of the backlog is thousands


@pytest.mark.anyio
async def test_a_file_without_the_routing_column_gains_it_and_routes_its_queue(
    tmp_path: Path,
) -> None:
    """A queue file of the previous build (version 2, no `executor` column): opening it
    adds the column, gives the queued jobs their routes from their bodies, and a routing
    worker then takes only its own."""
    db = tmp_path / "queue.db"
    alpha, beta = Job(executor="alpha"), Job(executor="beta")
    async with SQLiteBroker(db) as broker:
        await broker.submit_many([alpha, beta])
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
        conn.execute("DROP INDEX jobs_route")
        conn.execute("ALTER TABLE jobs DROP COLUMN executor")
        conn.execute("DROP TRIGGER job_inbox_insert")
    async with SQLiteBroker(db) as broker:
        leases = await broker.lease("w", visibility_s=30, limit=5, executors=["beta"])
        assert [le.job.id for le in leases] == [beta.id]
        raw = Job(executor="alpha")
        with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
            # Another language's producer, through the inbox view's new trigger.
            conn.execute("INSERT INTO job_inbox (id, body) VALUES (?, ?)", (raw.id, encode(raw)))
        leases = await broker.lease("w", visibility_s=30, limit=5, executors=["alpha"])
        assert sorted(le.job.id for le in leases) == sorted([alpha.id, raw.id])
