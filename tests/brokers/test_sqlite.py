"""The SQLite broker: the conformance suite, the schema contract, and real processes."""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from metnos_exec.brokers import Broker, SubmitReceipt, open_broker
from metnos_exec.brokers.sqlite import SCHEMA_SQL, SCHEMA_VERSION, BrokerUnavailable, SQLiteBroker
from metnos_exec.errors import BrokerCorrupt
from metnos_exec.messages import Job, Result, decode_result

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
        _spawn("drain", str(db), str(records[0]), "w1", "asyncio", str(go)),
        _spawn("drain", str(db), str(records[1]), "w2", "trio", str(go)),
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
    assert all(done), "both workers should have taken part"
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
    import metnos_exec.brokers.sqlite as sqlite_mod

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


def test_an_unopenable_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(BrokerUnavailable, match="cannot open the queue database") as info:
        SQLiteBroker(tmp_path / "missing-dir" / "queue.db")
    assert info.value.code == "E_BROKER_UNAVAILABLE"
    (tmp_path / "garbage.db").write_bytes(b"this is not a database" * 100)
    with pytest.raises(BrokerCorrupt, match="cannot use the queue database") as bad:
        SQLiteBroker(tmp_path / "garbage.db")
    assert bad.value.code == "E_BROKER_CORRUPT" and bad.value.fatal
