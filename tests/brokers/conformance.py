"""The broker conformance suite: every broker must pass all of it.

A broker's test module subclasses `BrokerConformance` and implements `open_broker(clock)`
as an async context manager yielding a fresh, empty broker that uses `clock` for leases,
delays and timestamps. Time moves only when a test advances the `VirtualClock`, so lease
expiry and backoff are tested without sleeping.

A broker with a store that can fail also implements `storage_fault(broker)`: an async
context manager inside which the broker's writes fail for a real reason (a lock held
elsewhere past its wait, a server that refuses writes, ...). Without it (the memory
broker has no store) the storage-error tests skip.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import pytest
from msgspec.structs import replace as msgspec_replace
from structlog.testing import capture_logs

from metnos_exec.brokers import Broker, Lease, SubmitReceipt
from metnos_exec.brokers.base import MAX_UNSTARTED_LAPSES
from metnos_exec.errors import BadMessage, BrokerError, IdempotencyConflict
from metnos_exec.messages import (
    E_CANCELLED,
    E_LEASE_EXPIRED,
    MAX_ARGS_DEPTH,
    MAX_JOB_BYTES,
    ErrorInfo,
    FileState,
    Job,
    Progress,
    Put,
    Result,
    UndoEntry,
    encode,
)

T0 = 1_900_000_000.0
VIS = 30.0


class VirtualClock:
    """A unix-seconds clock that only moves when told to."""

    def __init__(self, start: float = T0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def ok_result(lease: Lease, output: object = None, *, worker: str = "w1") -> Result:
    return Result(
        job_id=lease.job.id,
        status="succeeded",
        output=output,
        worker=worker,
        attempt=lease.attempt,
        finished_at=T0,
    )


def undo_entry(job_id: str, blob: str) -> UndoEntry:
    """An entry whose undo restores one file from blob `blob`."""
    return UndoEntry(
        job_id=job_id,
        recorded_at=T0,
        roots=("/r",),
        ops=(
            Put(
                path="/r/f",
                before=FileState(sha256="0" * 64, size=1, mode=0o644),
                after=FileState(sha256=blob, size=1, mode=0o644),
            ),
        ),
    )


def job(executor: str = "echo", **kw: object) -> Job:
    return Job(executor=executor, args={"n": 1}, **kw)  # type: ignore[arg-type]


class RecordingHook:
    """A `PurgeHook` that records what it was handed."""

    def __init__(self) -> None:
        self.forgotten: list[str] = []
        self.collected = 0

    def forget_jobs(self, store: Any, job_ids: Sequence[str]) -> None:
        assert store is not None
        self.forgotten.extend(job_ids)

    def collect(self, store: Any, *, before: float) -> int:
        assert store is not None and before < T0 + 1000
        self.collected += 1
        return 3


@pytest.mark.anyio
class BrokerConformance:
    """Behaviour every `Broker` promises (see `metnos_exec.brokers.base`)."""

    @contextlib.asynccontextmanager
    async def open_broker(self, clock: VirtualClock) -> AsyncIterator[Broker]:
        raise NotImplementedError
        yield  # pragma: no cover

    @contextlib.asynccontextmanager
    async def storage_fault(self, broker: Broker) -> AsyncIterator[None]:
        pytest.skip(f"{type(broker).__name__} has no store that can fail")
        yield  # pragma: no cover

    @contextlib.asynccontextmanager
    async def broker(self) -> AsyncIterator[tuple[Broker, VirtualClock]]:
        clock = VirtualClock()
        async with self.open_broker(clock) as b:
            yield b, clock

    # --- submit / lease / ack ---------------------------------------------------------

    async def test_submit_lease_ack_stores_the_result(self) -> None:
        async with self.broker() as (b, _clock):
            j = job()
            receipt = await b.submit(j)
            assert receipt.job_id == j.id and not receipt.duplicate
            assert (await b.get_job_state(j.id)).state == "queued"  # type: ignore[union-attr]
            [lease] = await b.lease("w1", visibility_s=VIS)
            assert lease.job == j
            assert lease.attempt == 1
            assert lease.lease_until == T0 + VIS
            state = await b.get_job_state(j.id)
            assert state is not None and state.state == "running" and state.worker == "w1"
            assert await b.get_result(j.id) is None
            assert await b.ack(lease, ok_result(lease, {"x": 1}))
            result = await b.get_result(j.id)
            assert result is not None and result.output == {"x": 1}
            assert result.status == "succeeded"
            assert (await b.get_job_state(j.id)).state == "done"  # type: ignore[union-attr]
            assert await b.lease("w1", visibility_s=VIS) == []
            stats = await b.stats()
            assert (stats.queued, stats.running, stats.done, stats.dead) == (0, 0, 1, 0)

    async def test_lease_on_empty_queue_returns_nothing(self) -> None:
        async with self.broker() as (b, _clock):
            assert await b.lease("w1", visibility_s=VIS, limit=10) == []
            with pytest.raises(ValueError):
                await b.lease("w1", visibility_s=0)
            with pytest.raises(ValueError):
                await b.lease("w1", visibility_s=VIS, limit=0)
            assert await b.get_job_state("nope") is None
            assert await b.get_result("nope") is None

    async def test_result_is_stored_once(self) -> None:
        async with self.broker() as (b, _clock):
            await b.submit(job())
            [lease] = await b.lease("w1", visibility_s=VIS)
            assert await b.ack(lease, ok_result(lease, "first"))
            assert not await b.ack(lease, ok_result(lease, "second"))
            result = await b.get_result(lease.job.id)
            assert result is not None and result.output == "first"

    async def test_ack_with_another_jobs_result_is_refused(self) -> None:
        async with self.broker() as (b, _clock):
            await b.submit(job())
            [lease] = await b.lease("w1", visibility_s=VIS)
            wrong = Result(job_id="someone-else", status="succeeded")
            assert not await b.ack(lease, wrong)
            assert await b.get_result("someone-else") is None

    async def test_batch_lease_and_ack_many(self) -> None:
        async with self.broker() as (b, _clock):
            jobs = [job() for _ in range(5)]
            receipts = await b.submit_many(jobs)
            assert [r.job_id for r in receipts] == [j.id for j in jobs]
            leases = await b.lease("w1", visibility_s=VIS, limit=3)
            assert [le.job.id for le in leases] == [j.id for j in jobs[:3]]
            leases += await b.lease("w1", visibility_s=VIS, limit=10)
            assert [le.job.id for le in leases] == [j.id for j in jobs]
            oks = await b.ack_many([(le, ok_result(le, i)) for i, le in enumerate(leases)])
            assert oks == [True] * 5
            assert not any(await b.ack_many([(leases[0], ok_result(leases[0]))]))
            for i, j in enumerate(jobs):
                result = await b.get_result(j.id)
                assert result is not None and result.output == i

    # --- idempotency ------------------------------------------------------------------

    async def test_idempotency_key_returns_the_original_id(self) -> None:
        async with self.broker() as (b, _clock):
            first = job(idempotency_key="run-7/step-3")
            second = job(idempotency_key="run-7/step-3")
            assert first.id != second.id
            r1 = await b.submit(first)
            r2 = await b.submit(second)
            assert (r1.job_id, r1.duplicate) == (first.id, False)
            assert (r2.job_id, r2.duplicate) == (first.id, True)
            assert await b.get_job_state(second.id) is None
            leases = await b.lease("w1", visibility_s=VIS, limit=10)
            assert [le.job.id for le in leases] == [first.id]
            # Still deduplicated after the original finished.
            await b.ack(leases[0], ok_result(leases[0]))
            r3 = await b.submit(job(idempotency_key="run-7/step-3"))
            assert (r3.job_id, r3.duplicate) == (first.id, True)
            # A different key is a different job; the same id twice is a duplicate.
            r4 = await b.submit(job(idempotency_key="run-7/step-4"))
            assert not r4.duplicate
            again = await b.submit(first)
            assert (again.job_id, again.duplicate) == (first.id, True)

    async def test_idempotency_key_reused_for_another_job_is_a_conflict(self) -> None:
        async with self.broker() as (b, _clock):
            first = job(idempotency_key="k", priority=1)
            await b.submit(first)
            # Same executor, same arguments (as JSON sees them): a duplicate, even when
            # how-fields (priority, timeout) differ.
            same = Job(executor="echo", args={"n": 1}, idempotency_key="k", timeout_s=5.0)
            assert await b.submit(same) == SubmitReceipt(first.id, duplicate=True)
            for other in (
                Job(executor="echo", args={"n": 2}, idempotency_key="k"),
                Job(executor="echo", args={}, idempotency_key="k"),
                Job(executor="other", args={"n": 1}, idempotency_key="k"),
            ):
                with pytest.raises(IdempotencyConflict) as info:
                    await b.submit(other)
                assert info.value.code == "E_IDEMPOTENCY_CONFLICT"
                assert info.value.original_job_id == first.id
                assert first.id in info.value.message
                assert await b.get_job_state(other.id) is None
            with pytest.raises(IdempotencyConflict):
                await b.submit_raw(encode(Job(executor="echo", args={"n": 3}, idempotency_key="k")))
            # Still a conflict once the original finished; the queue holds one job.
            [lease] = await b.lease("w1", visibility_s=VIS, limit=10)
            await b.ack(lease, ok_result(lease))
            with pytest.raises(IdempotencyConflict):
                await b.submit(Job(executor="echo", args={"n": 2}, idempotency_key="k"))
            assert (await b.stats()).done == 1

    async def test_an_id_reused_for_another_job_is_a_conflict(self) -> None:
        # The same id twice is a duplicate, like a key; another job under a known id was
        # answered with the original's id and silently dropped (`submit(..., id=...)`).
        async with self.broker() as (b, _clock):
            first = Job(id="step-3", executor="echo", args={"n": 1})
            await b.submit(first)
            same = Job(id="step-3", executor="echo", args={"n": 1}, priority=5)
            assert await b.submit(same) == SubmitReceipt(first.id, duplicate=True)
            for other in (
                Job(id="step-3", executor="echo", args={"n": 2}),
                Job(id="step-3", executor="other", args={"n": 1}),
                Job(id="step-3", executor="echo", args={"n": 2}, idempotency_key="fresh"),
            ):
                with pytest.raises(IdempotencyConflict) as info:
                    await b.submit(other)
                assert info.value.original_job_id == first.id
                assert "job id 'step-3'" in info.value.message
                assert "idempotency key" not in info.value.message
            with pytest.raises(IdempotencyConflict):
                await b.submit_raw(encode(Job(id="step-3", executor="echo", args={"n": 3})))
            with pytest.raises(IdempotencyConflict):
                await b.submit_many([Job(id="step-3", executor="echo", args={"n": 4})])
            [lease] = await b.lease("w1", visibility_s=VIS, limit=10)
            assert lease.job == first
            stats = await b.stats()
            assert (stats.queued, stats.running) == (0, 1)

    async def test_submit_raw_accepts_a_valid_json_job(self) -> None:
        async with self.broker() as (b, _clock):
            j = job(idempotency_key="k")
            assert await b.submit_raw(encode(j)) == j.id
            assert await b.submit_raw(encode(job(idempotency_key="k"))) == j.id
            [lease] = await b.lease("w1", visibility_s=VIS, limit=5)
            assert lease.job == j

    # --- ordering ---------------------------------------------------------------------

    async def test_priority_then_fifo(self) -> None:
        async with self.broker() as (b, _clock):
            a, hi1, c, hi2, lo = (
                job(priority=0),
                job(priority=5),
                job(priority=0),
                job(priority=5),
                job(priority=-1),
            )
            for j in (a, hi1, c, hi2, lo):
                await b.submit(j)
            order = []
            while leases := await b.lease("w1", visibility_s=VIS):
                order.append(leases[0].job.id)
            assert order == [hi1.id, hi2.id, a.id, c.id, lo.id]

    async def test_priority_order_within_one_batch(self) -> None:
        async with self.broker() as (b, _clock):
            js = [job(priority=p) for p in (0, 3, 1, 3, 0)]
            for j in js:
                await b.submit(j)
            leases = await b.lease("w1", visibility_s=VIS, limit=10)
            assert [le.job.id for le in leases] == [
                js[1].id,
                js[3].id,
                js[2].id,
                js[0].id,
                js[4].id,
            ]

    async def test_not_before_delays_delivery(self) -> None:
        async with self.broker() as (b, clock):
            later = job(not_before=T0 + 10, priority=9)
            now = job()
            await b.submit(later)
            await b.submit(now)
            stats = await b.stats()
            assert (stats.queued, stats.delayed) == (2, 1)
            leases = await b.lease("w1", visibility_s=VIS, limit=10)
            assert [le.job.id for le in leases] == [now.id]
            clock.advance(9.5)
            assert await b.lease("w1", visibility_s=VIS) == []
            clock.advance(0.5)
            [lease] = await b.lease("w1", visibility_s=VIS)
            assert lease.job.id == later.id and lease.attempt == 1

    # --- leases -----------------------------------------------------------------------

    async def test_expired_lease_is_redelivered_with_next_attempt(self) -> None:
        async with self.broker() as (b, clock):
            j = job()
            await b.submit(j)
            [first] = await b.lease("w1", visibility_s=10)
            assert first.started  # a plain lease counts at once
            clock.advance(9.9)
            assert await b.lease("w2", visibility_s=10) == []
            clock.advance(0.1)
            [second] = await b.lease("w2", visibility_s=10)
            assert second.job.id == j.id
            assert second.attempt == 2
            assert second.token != first.token
            state = await b.get_job_state(j.id)
            assert state is not None and state.attempt == 2 and state.worker == "w2"

    async def test_heartbeat_extends_the_lease_and_reports_a_lost_one(self) -> None:
        async with self.broker() as (b, clock):
            await b.submit(job())
            [lease] = await b.lease("w1", visibility_s=10)
            clock.advance(8)
            beat = await b.heartbeat(lease)
            assert beat.ok and not beat.cancel_requested
            assert beat.lease_until == T0 + 18
            clock.advance(8)  # 16 s after the lease: past the first window only
            assert await b.lease("w2", visibility_s=10) == []
            beat = await b.heartbeat(lease, visibility_s=2)
            assert beat.ok and beat.lease_until == T0 + 18
            clock.advance(2)
            [taken] = await b.lease("w2", visibility_s=10)
            assert taken.attempt == 2
            assert not (await b.heartbeat(lease)).ok
            assert (await b.heartbeat(taken)).ok

    async def test_progress_is_stored_while_the_lease_holds(self) -> None:
        """The latest progress is kept per job, fenced like a heartbeat: a lost lease (or
        a finished job) writes nothing, and the new delivery's write replaces the old."""
        async with self.broker() as (b, clock):
            await b.submit(job())
            [lease] = await b.lease("w1", visibility_s=10)
            assert await b.get_progress(lease.job.id) is None
            first = Progress(fraction=0.25, message="a quarter", at=T0, attempt=1, lines=3)
            assert await b.report_progress(lease, first)
            assert await b.get_progress(lease.job.id) == first
            later = Progress(fraction=None, message="still going", at=T0 + 1, attempt=1)
            assert await b.report_progress(lease, later)
            assert await b.get_progress(lease.job.id) == later
            clock.advance(11)
            [taken] = await b.lease("w2", visibility_s=10)
            stale = Progress(fraction=0.9, message="stale", attempt=1)
            assert not await b.report_progress(lease, stale)  # the lease was lost
            assert await b.get_progress(lease.job.id) == later
            fresh = Progress(fraction=0.5, message="second try", attempt=2)
            assert await b.report_progress(taken, fresh)
            assert await b.get_progress(taken.job.id) == fresh
            assert await b.ack(taken, ok_result(taken, "done"))
            assert not await b.report_progress(taken, Progress(fraction=1.0, attempt=2))
            assert await b.get_progress(taken.job.id) == fresh  # the last, kept with the job
            assert await b.get_progress("nope") is None

    async def test_ack_after_a_lost_lease_is_refused_and_overwrites_nothing(self) -> None:
        async with self.broker() as (b, clock):
            await b.submit(job())
            [slow] = await b.lease("w1", visibility_s=10)
            clock.advance(11)
            [fast] = await b.lease("w2", visibility_s=10)
            # The slow worker finishes first, but its lease is gone: refused.
            assert not await b.ack(slow, ok_result(slow, "slow", worker="w1"))
            assert await b.get_result(slow.job.id) is None
            assert await b.ack(fast, ok_result(fast, "fast", worker="w2"))
            assert not await b.ack(slow, ok_result(slow, "slow", worker="w1"))
            result = await b.get_result(slow.job.id)
            assert result is not None and (result.output, result.worker) == ("fast", "w2")
            assert not (await b.heartbeat(fast)).ok  # settled: no longer a live lease
            assert await b.retry(slow, error=ErrorInfo(code="E_X", message="x"), delay_s=0) == (
                "lost"
            )
            assert not await b.release(slow)
            assert not await b.dead_letter(slow, error=ErrorInfo(code="E_X", message="x"))

    async def test_lease_expiring_on_the_last_attempt_is_dead(self) -> None:
        async with self.broker() as (b, clock):
            j = job(max_attempts=2)
            await b.submit(j)
            for _ in range(2):
                assert len(await b.lease("w1", visibility_s=5)) == 1
                clock.advance(5)
            assert await b.lease("w1", visibility_s=5) == []
            result = await b.get_result(j.id)
            assert result is not None and result.status == "dead"
            assert result.error is not None and result.error.code == E_LEASE_EXPIRED
            [letter] = await b.dead_letters()
            assert letter.job_id == j.id and letter.attempts == 2 and letter.job == j
            assert (await b.get_job_state(j.id)).state == "dead"  # type: ignore[union-attr]

    async def test_a_lease_that_lapses_before_it_started_uses_no_attempt(self) -> None:
        """A job leased ahead whose worker dies before launching it, again and again, is
        delivered with the same attempt number and never dead-lettered for it."""
        async with self.broker() as (b, clock):
            j = job(max_attempts=2)
            await b.submit(j)
            for _ in range(5):
                [lease] = await b.lease("w1", visibility_s=5, started=0)
                assert (lease.attempt, lease.started) == (1, False)
                clock.advance(5)
            [lease] = await b.lease("w2", visibility_s=5, started=0)
            assert lease.attempt == 1
            state = await b.get_job_state(j.id)
            assert state is not None and (state.state, state.attempt) == ("running", 1)
            assert await b.mark_started(lease)
            clock.advance(5)
            # That delivery had started: it counts, and the next one is the last.
            [again] = await b.lease("w3", visibility_s=5)
            assert again.attempt == 2
            assert await b.ack(again, ok_result(again))
            assert await b.dead_letters() == []

    async def test_a_job_that_never_starts_is_dead_after_the_unstarted_lapse_cap(self) -> None:
        async with self.broker() as (b, clock):
            j = job(max_attempts=3)
            await b.submit(j)
            for _ in range(MAX_UNSTARTED_LAPSES):
                [lease] = await b.lease("w1", visibility_s=5, started=0)
                assert lease.attempt == 1
                clock.advance(5)
            assert await b.lease("w1", visibility_s=5) == []
            result = await b.get_result(j.id)
            assert result is not None and result.status == "dead"
            assert result.error is not None and result.error.code == E_LEASE_EXPIRED
            assert "never started" in result.error.message
            [letter] = await b.dead_letters()
            assert (letter.job_id, letter.attempts) == (j.id, 0)

    async def test_mark_started_needs_the_current_lease(self) -> None:
        async with self.broker() as (b, clock):
            await b.submit(job())
            [slow] = await b.lease("w1", visibility_s=10, started=0)
            clock.advance(10)
            [fast] = await b.lease("w2", visibility_s=10, started=0)
            assert fast.attempt == 1  # the slow delivery never started
            assert not await b.mark_started(slow)
            assert await b.mark_started_many([slow, fast]) == [False, True]
            assert await b.mark_started(fast)  # again: still the current lease
            assert await b.ack(fast, ok_result(fast))
            assert not await b.mark_started(fast)
            assert await b.mark_started_many([]) == []

    async def test_a_released_lease_starts_afresh(self) -> None:
        async with self.broker() as (b, clock):
            j = job(max_attempts=1)
            await b.submit(j)
            [lease] = await b.lease("w1", visibility_s=5)
            assert await b.release(lease)
            # Released (drain) after it started: handed back un-attempted, and the next
            # delivery leased ahead is unstarted until marked.
            [again] = await b.lease("w2", visibility_s=5, started=0)
            assert again.attempt == 1
            clock.advance(5)
            [third] = await b.lease("w3", visibility_s=5)
            assert third.attempt == 1

    async def test_only_the_first_started_leases_of_a_batch_count_at_once(self) -> None:
        async with self.broker() as (b, clock):
            jobs = [job() for _ in range(4)]
            await b.submit_many(jobs)
            leases = await b.lease("w1", visibility_s=5, limit=4, started=1)
            assert [le.started for le in leases] == [True, False, False, False]
            assert await b.mark_started(leases[1])
            clock.advance(5)
            again = await b.lease("w2", visibility_s=5, limit=4)
            assert [le.attempt for le in again] == [2, 2, 1, 1]
            assert all(le.started for le in again)

    # --- retries and dead letters -----------------------------------------------------

    async def test_retry_redelivers_after_the_delay_then_dead_letters_the_last_error(
        self,
    ) -> None:
        async with self.broker() as (b, clock):
            j = job(max_attempts=3)
            await b.submit(j)
            seen = []
            for attempt, delay in ((1, 1.0), (2, 2.0)):
                [lease] = await b.lease("w1", visibility_s=VIS)
                assert lease.attempt == attempt
                seen.append(attempt)
                err = ErrorInfo(code="E_TRANSIENT", message=f"try {attempt}")
                assert await b.retry(lease, error=err, delay_s=delay) == "scheduled"
                state = await b.get_job_state(j.id)
                assert state is not None and state.state == "queued"
                clock.advance(delay - 0.01)
                assert await b.lease("w1", visibility_s=VIS) == []
                clock.advance(0.01)
            [lease] = await b.lease("w1", visibility_s=VIS)
            assert lease.attempt == 3
            last = ErrorInfo(code="E_TRANSIENT", message="try 3")
            assert await b.retry(lease, error=last, delay_s=4.0) == "dead"
            clock.advance(10)
            assert await b.lease("w1", visibility_s=VIS) == []
            result = await b.get_result(j.id)
            assert result is not None and result.status == "dead" and result.error == last
            assert result.attempt == 3
            [letter] = await b.dead_letters()
            assert (letter.job_id, letter.error, letter.attempts) == (j.id, last, 3)
            assert (await b.stats()).dead == 1

    async def test_dead_letter_now(self) -> None:
        async with self.broker() as (b, _clock):
            j = job(max_attempts=5)
            await b.submit(j)
            [lease] = await b.lease("w1", visibility_s=VIS)
            err = ErrorInfo(code="E_UNKNOWN_EXECUTOR", message="no such executor")
            assert await b.dead_letter(lease, error=err)
            result = await b.get_result(j.id)
            assert result is not None and result.status == "dead" and result.error == err
            assert [d.job_id for d in await b.dead_letters()] == [j.id]
            assert not await b.ack(lease, ok_result(lease))

    async def test_release_does_not_count_an_attempt(self) -> None:
        async with self.broker() as (b, _clock):
            j = job(max_attempts=1)
            await b.submit(j)
            [lease] = await b.lease("w1", visibility_s=VIS)
            assert await b.release(lease)
            [again] = await b.lease("w2", visibility_s=VIS)
            assert again.attempt == 1 and again.job.id == j.id
            assert not await b.ack(lease, ok_result(lease))
            assert await b.ack(again, ok_result(again))

    # --- cancel -----------------------------------------------------------------------

    async def test_cancel_queued_running_finished_unknown(self) -> None:
        async with self.broker() as (b, _clock):
            queued, running = job(), job()
            await b.submit(running)
            [lease] = await b.lease("w1", visibility_s=VIS)
            await b.submit(queued)

            assert await b.cancel(queued.id) == "cancelled"
            result = await b.get_result(queued.id)
            assert result is not None and result.status == "cancelled"
            assert result.error is not None and result.error.code == E_CANCELLED
            assert await b.lease("w2", visibility_s=VIS) == []

            assert await b.cancel(running.id) == "cancelling"
            beat = await b.heartbeat(lease)
            assert beat.ok and beat.cancel_requested
            state = await b.get_job_state(running.id)
            assert state is not None and state.cancel_requested
            cancelled = Result(job_id=running.id, status="cancelled", attempt=1, worker="w1")
            assert await b.ack(lease, cancelled)

            assert await b.cancel(running.id) == "finished"
            assert await b.cancel(queued.id) == "finished"
            assert await b.cancel("no-such-job") == "unknown"

    async def test_cancel_during_a_retry_delay_says_the_job_ran(self) -> None:
        # It said "cancelled before it started" of a job that had run (and failed) once.
        async with self.broker() as (b, _clock):
            j = job(max_attempts=3)
            await b.submit(j)
            [lease] = await b.lease("w1", visibility_s=VIS)
            assert await b.mark_started(lease)
            err = ErrorInfo(code="E_TRANSIENT", message="try 1")
            assert await b.retry(lease, error=err, delay_s=60.0) == "scheduled"
            assert await b.cancel(j.id) == "cancelled"
            result = await b.get_result(j.id)
            assert result is not None and result.status == "cancelled"
            assert result.error is not None and result.error.code == E_CANCELLED
            assert result.attempt == 1
            assert "before it started" not in result.error.message
            assert "retried" in result.error.message and "1 attempt" in result.error.message
            fresh = job()
            await b.submit(fresh)
            assert await b.cancel(fresh.id) == "cancelled"
            first = await b.get_result(fresh.id)
            assert first is not None and first.error is not None
            assert first.error.message == "cancelled before it started"

    async def test_cancel_requested_names_running_jobs_with_a_pending_cancel(self) -> None:
        async with self.broker() as (b, _clock):
            a, c, queued = job(), job(), job()
            await b.submit_many([a, c])
            leases = await b.lease("w1", visibility_s=VIS, limit=2)
            assert len(leases) == 2
            await b.submit(queued)
            assert await b.cancel_requested([]) == set()
            assert await b.cancel_requested([a.id, c.id, queued.id, "no-such-job"]) == set()
            assert await b.cancel(a.id) == "cancelling"
            assert await b.cancel(queued.id) == "cancelled"
            # One call for the lot; a queued job cancelled outright is not "running".
            assert await b.cancel_requested([a.id, c.id, queued.id, "nope"]) == {a.id}
            lease_a = next(lease for lease in leases if lease.job.id == a.id)
            done = Result(job_id=a.id, status="cancelled", attempt=1, worker="w1")
            assert await b.ack(lease_a, done)
            assert await b.cancel_requested([a.id, c.id]) == set()

    async def test_cancel_requested_job_whose_worker_died_ends_cancelled(self) -> None:
        async with self.broker() as (b, clock):
            j = job()
            await b.submit(j)
            await b.lease("w1", visibility_s=5)
            assert await b.cancel(j.id) == "cancelling"
            clock.advance(5)
            assert await b.lease("w2", visibility_s=5) == []
            result = await b.get_result(j.id)
            assert result is not None and result.status == "cancelled"

    # --- malformed messages -----------------------------------------------------------

    async def test_malformed_messages_are_dead_lettered_and_leasing_continues(self) -> None:
        async with self.broker() as (b, _clock):
            bad_ids = [
                await b.submit_raw(b"this is not json"),
                await b.submit_raw(b'{"executor": 5}'),
                await b.submit_raw(b'{"v": 99, "executor": "echo"}'),
                await b.submit_raw(b"\xff\xfe\x00 binary"),
                await b.submit_raw(b'{"executor": "echo", "device": 7, "priority": "high"}'),
            ]
            assert len(set(bad_ids)) == 5
            good = job()
            await b.submit(good)
            [lease] = await b.lease("w1", visibility_s=VIS)
            assert lease.job.id == good.id
            letters = {d.job_id: d for d in await b.dead_letters()}
            assert set(letters) == set(bad_ids)
            for job_id in bad_ids:
                assert letters[job_id].error.code == "E_BAD_MESSAGE"
                assert letters[job_id].job is None
                result = await b.get_result(job_id)
                assert result is not None and result.status == "dead"
                assert result.error is not None and result.error.code == "E_BAD_MESSAGE"
            assert letters[bad_ids[0]].raw == b"this is not json"
            assert letters[bad_ids[3]].raw == b"\xff\xfe\x00 binary"
            assert "max_attempts" not in letters[bad_ids[1]].error.message
            assert "$.executor" in letters[bad_ids[1]].error.message

    async def test_any_undecodable_message_is_dead_lettered_once_and_the_batch_flows(
        self,
    ) -> None:
        """Whatever a decoder raises (RecursionError from nesting, bad UTF-8, a number
        out of range, a depth over the limit), the message is dead-lettered once with
        E_BAD_MESSAGE, logged once, and the valid jobs around it in the same batch are
        leased in the same call."""

        def nested(depth: int) -> bytes:
            return b'{"executor":"echo","args":{"a":' + b"[" * depth + b"]" * depth + b"}}"

        async with self.broker() as (b, _clock):
            first = job()
            await b.submit(first)
            bad_ids = [
                await b.submit_raw(nested(1000)),  # RecursionError inside the decoder
                await b.submit_raw(nested(200_000)),  # far deeper, still under 1 MiB
                await b.submit_raw(nested(MAX_ARGS_DEPTH)),  # decodes; over the limit
                await b.submit_raw(b'{"executor":"echo","args":{"t":"\xff\xfe"}}'),
                await b.submit_raw(b'{"executor":"echo","args":{"n":1' + b"0" * 5000 + b"}}"),
                await b.submit_raw(b'{"executor":"echo","max_attempts":1e999}'),
                await b.submit_raw(b"[" * 50_000),
            ]
            last = job()
            await b.submit(last)
            with capture_logs() as logs:
                leases = await b.lease("w1", visibility_s=VIS, limit=20)
            assert [le.job.id for le in leases] == [first.id, last.id]
            letters = {d.job_id: d for d in await b.dead_letters()}
            assert set(letters) == set(bad_ids)
            for job_id in bad_ids:
                assert letters[job_id].error.code == "E_BAD_MESSAGE", letters[job_id]
                result = await b.get_result(job_id)
                assert result is not None and result.status == "dead"
            assert "nests too deeply" in letters[bad_ids[0]].error.message
            assert str(MAX_ARGS_DEPTH) in letters[bad_ids[2]].error.message
            logged = sorted(e["job_id"] for e in logs if e["event"] == "job.bad_message")
            assert logged == sorted(bad_ids)
            # Once: nothing is left to dead-letter or to log on the next lease.
            with capture_logs() as again:
                assert await b.lease("w2", visibility_s=VIS, limit=20) == []
            assert [e for e in again if e["event"] == "job.bad_message"] == []
            assert len(await b.dead_letters()) == len(bad_ids)
            # A bad body just under the nesting limit is a valid job.
            ok_id = await b.submit_raw(nested(MAX_ARGS_DEPTH - 3))
            [lease] = await b.lease("w3", visibility_s=VIS)
            assert lease.job.id == ok_id

    async def test_submit_refuses_a_job_over_the_size_limit(self) -> None:
        async with self.broker() as (b, _clock):
            big = Job(executor="echo", args={"blob": "x" * MAX_JOB_BYTES})
            for submit in (b.submit(big), b.submit_many([job(), big])):
                with pytest.raises(BadMessage) as info:
                    await submit
                assert info.value.code == "E_BAD_MESSAGE"
                assert f"{MAX_JOB_BYTES:,}" in info.value.message, info.value.message
            with pytest.raises(BadMessage, match="MAX_JOB_BYTES"):
                await b.submit_raw(b"x" * (MAX_JOB_BYTES + 1))
            deep: Any = []
            for _ in range(MAX_ARGS_DEPTH + 5):
                deep = [deep]
            with pytest.raises(BadMessage, match="MAX_ARGS_DEPTH"):
                await b.submit(Job(executor="echo", args={"d": deep}))
            # Nothing of it was stored.
            stats = await b.stats()
            assert (stats.queued, stats.dead) == (0, 0)
            assert await b.get_job_state(big.id) is None

    # --- devices ----------------------------------------------------------------------

    async def test_device_routing(self) -> None:
        async with self.broker() as (b, _clock):
            untargeted, on_server, on_phone = job(), job(device="server"), job(device="phone")
            for j in (untargeted, on_server, on_phone):
                await b.submit(j)
            assert await b.lease("laptop", visibility_s=VIS, device="laptop") == []
            phone = await b.lease("p1", visibility_s=VIS, device="phone", limit=10)
            assert [le.job.id for le in phone] == [on_phone.id]
            assert phone[0].device == "phone"
            server = await b.lease("s1", visibility_s=VIS, limit=10)
            assert [le.job.id for le in server] == [untargeted.id, on_server.id]
            assert {le.device for le in server} == {"server"}

    # --- executor routing (issue 18, item 3) ------------------------------------------

    async def test_a_worker_leases_only_the_executors_it_serves(self) -> None:
        """Heterogeneous workers on one queue: each takes only jobs it can run, the others
        stay queued with no attempt spent, and the order (priority, then age) holds
        across the executors one worker serves."""
        async with self.broker() as (b, _clock):
            a1, b1, c1, a2, b2 = (
                job(executor="alpha"),
                job(executor="beta"),
                job(executor="gamma", priority=2),
                job(executor="alpha"),
                job(executor="beta"),
            )
            for j in (a1, b1, c1, a2, b2):
                await b.submit(j)
            assert await b.lease("w0", visibility_s=VIS, limit=10, executors=()) == []
            assert await b.lease("w0", visibility_s=VIS, limit=10, executors=["delta"]) == []
            alpha = await b.lease("wa", visibility_s=VIS, limit=10, executors=["alpha"])
            assert [le.job.id for le in alpha] == [a1.id, a2.id]
            for j in (b1, c1, b2):
                state = await b.get_job_state(j.id)
                assert state is not None and (state.state, state.attempt) == ("queued", 0)
            # One at a time: the oldest of the executors served, the higher priority first.
            order = []
            while le := await b.lease("wbg", visibility_s=VIS, executors=["beta", "gamma"]):
                order.append(le[0].job.id)
            assert order == [c1.id, b1.id, b2.id]

    async def test_routing_holds_for_a_large_set_of_executors(self) -> None:
        async with self.broker() as (b, _clock):
            served = [f"tool{i:03d}" for i in range(100)]
            js = [job(executor=served[i * 7 % 100], priority=i % 2) for i in range(12)]
            other = job(executor="elsewhere")
            await b.submit(other)
            for j in js:
                await b.submit(j)
            leases = await b.lease("w", visibility_s=VIS, limit=50, executors=served)
            want = [j.id for j in js if j.priority == 1] + [j.id for j in js if j.priority == 0]
            assert [le.job.id for le in leases] == want
            state = await b.get_job_state(other.id)
            assert state is not None and state.state == "queued"

    async def test_a_job_back_in_the_queue_keeps_its_route(self) -> None:
        """Released, retried, lapsed or delayed: a job goes back to its executor's
        workers only."""
        async with self.broker() as (b, clock):
            rel, ret, lap = job(executor="alpha"), job(executor="alpha"), job(executor="alpha")
            later = job(executor="alpha", not_before=T0 + 5)
            for j in (rel, ret, lap, later):
                await b.submit(j)
            leases = {
                le.job.id: le
                for le in await b.lease("wa", visibility_s=10, limit=3, executors=["alpha"])
            }
            assert set(leases) == {rel.id, ret.id, lap.id}
            assert await b.release(leases[rel.id])
            err = ErrorInfo(code="E_X", message="x")
            assert await b.retry(leases[ret.id], error=err, delay_s=0) == "scheduled"
            clock.advance(10)  # lap's lease lapses; later falls due
            assert await b.lease("wb", visibility_s=10, limit=10, executors=["beta"]) == []
            again = await b.lease("wa2", visibility_s=10, limit=10, executors=["alpha"])
            assert {le.job.id for le in again} == {rel.id, ret.id, lap.id, later.id}
            attempts = {le.job.id: le.attempt for le in again}
            assert attempts == {rel.id: 1, ret.id: 2, lap.id: 2, later.id: 1}

    async def test_an_undecodable_message_is_dead_lettered_by_a_routing_worker(self) -> None:
        """A message with no readable executor has no route: any server worker takes it
        and dead-letters it (it never waits for a worker that cannot exist)."""
        async with self.broker() as (b, _clock):
            bad = await b.submit_raw(b'{"v": 1, "executor": 7}')
            good = await b.submit_raw(encode(job(executor="alpha")))
            leases = await b.lease("w", visibility_s=VIS, limit=10, executors=["alpha"])
            assert [le.job.id for le in leases] == [good]
            result = await b.get_result(bad)
            assert result is not None and result.status == "dead"

    async def test_queued_jobs_are_counted_by_device_and_executor(self) -> None:
        async with self.broker() as (b, _clock):
            for j in (job(executor="alpha"), job(executor="alpha", priority=3)):
                await b.submit(j)
            await b.submit(job(executor="beta", device="phone"))
            leased = job(executor="gamma")
            await b.submit(leased)
            [lease] = await b.lease("w", visibility_s=VIS, executors=["gamma"])
            assert lease.job.id == leased.id
            counts = {k: n for k, n in (await b.queued_executors()).items() if n}
            assert counts == {("server", "alpha"): 2, ("phone", "beta"): 1}

    async def test_list_jobs_by_state_executor_and_device(self) -> None:
        async with self.broker() as (b, _clock):
            js = [job(executor="alpha"), job(executor="beta"), job(executor="alpha")]
            phone = job(executor="beta", device="phone")
            later = job(executor="alpha", not_before=T0 + 60)
            for j in (*js, phone, later):
                await b.submit(j)
            [run] = await b.lease("w", visibility_s=VIS, executors=["alpha"])
            assert run.job.id == js[0].id
            [fin] = await b.lease("w", visibility_s=VIS, executors=["beta"])
            assert await b.ack(fin, ok_result(fin))
            listed = await b.list_jobs()
            assert [x.job_id for x in listed] == [later.id, phone.id, js[2].id, js[1].id, js[0].id]
            by_id = {x.job_id: x for x in listed}
            assert (by_id[js[0].id].state, by_id[js[0].id].worker) == ("running", "w")
            assert (by_id[js[1].id].state, by_id[js[1].id].status) == ("done", "succeeded")
            assert by_id[js[1].id].finished_at is not None
            assert (by_id[phone.id].device, by_id[later.id].state) == ("phone", "queued")
            queued = await b.list_jobs(states=["queued"], executor="alpha")
            assert [x.job_id for x in queued] == [later.id, js[2].id]
            assert [x.job_id for x in await b.list_jobs(device="phone")] == [phone.id]
            assert len(await b.list_jobs(limit=2)) == 2
            assert await b.list_jobs(states=["dead"]) == []

    async def test_get_job_returns_the_stored_message(self) -> None:
        """The live view's job detail reads a job's arguments back, in every state."""
        async with self.broker() as (b, _clock):
            j = Job(executor="alpha", args={"path": "<b>x</b>", "n": [1, 2]})
            await b.submit(j)
            assert await b.get_job(j.id) == j
            [lease] = await b.lease("w", visibility_s=VIS)
            assert await b.ack(lease, ok_result(lease))
            got = await b.get_job(j.id)
            assert got is not None and got.args == {"path": "<b>x</b>", "n": [1, 2]}
            assert await b.get_job("01NOSUCHJOB") is None

    async def test_worker_presence_records(self) -> None:
        """Registered, renewed, stopped; a record gone longer than asked is forgotten."""
        from metnos_exec.brokers.presence import WORKER_TTL_S, WorkerInfo, is_live

        async with self.broker() as (b, clock):

            def info(wid: str, **kw: Any) -> WorkerInfo:
                fields: dict[str, Any] = {
                    "id": wid,
                    "host": "h",
                    "pid": 1,
                    "device": "server",
                    "executors": ("alpha",),
                    "slots": 4,
                    "started_at": T0,
                    "seen_at": clock.now,
                }
                return WorkerInfo(**{**fields, **kw})

            assert await b.workers() == []
            await b.register_worker(info("w1"))
            await b.register_worker(info("w2"))
            clock.advance(5)
            await b.register_worker(info("w1", running=("j1",)))
            await b.register_worker(info("w2", stopped_at=clock.now))
            found = {w.id: w for w in await b.workers()}
            assert found["w1"].running == ("j1",) and is_live(found["w1"], clock.now)
            assert not is_live(found["w2"], clock.now)
            clock.advance(WORKER_TTL_S)  # w1 stopped renewing: gone without a word
            found = {w.id: w for w in await b.workers()}
            assert set(found) == {"w1", "w2"} and not is_live(found["w1"], clock.now)
            clock.advance(100)
            assert [w.id for w in await b.workers(gone_within_s=50)] == []
            assert await b.workers() == []  # forgotten, not only hidden

    # --- housekeeping -----------------------------------------------------------------

    async def test_purge_forgets_old_finished_jobs_only(self) -> None:
        async with self.broker() as (b, clock):
            old, dead, fresh, queued = (
                job(idempotency_key="old"),
                job(max_attempts=1),
                job(),
                job(priority=-5),
            )
            for j in (old, dead, fresh, queued):
                await b.submit(j)
            l_old, l_dead = await b.lease("w", visibility_s=VIS, limit=2)
            await b.ack(l_old, ok_result(l_old))
            err = ErrorInfo(code="E_X", message="x")
            assert await b.dead_letter(l_dead, error=err)
            clock.advance(100)
            [l_fresh] = await b.lease("w", visibility_s=VIS)
            await b.ack(l_fresh, ok_result(l_fresh))
            hook = RecordingHook()
            b.add_purge_hook(hook)
            report = await b.purge(older_than_s=50)
            assert report.jobs == 2
            assert sorted(hook.forgotten) == sorted([old.id, dead.id])
            assert hook.collected == 1 and report.collected == 3
            for gone in (old, dead):
                assert await b.get_result(gone.id) is None
                assert await b.get_job_state(gone.id) is None
            assert await b.dead_letters() == []
            assert await b.get_result(fresh.id) is not None
            assert (await b.get_job_state(queued.id)).state == "queued"  # type: ignore[union-attr]
            # The idempotency key is forgotten with its job.
            assert not (await b.submit(job(idempotency_key="old"))).duplicate
            # Nothing older left: nothing forgotten, the hooks still collect.
            assert (await b.purge(older_than_s=50)).jobs == 0
            assert hook.collected == 2

    async def test_a_result_ttl_shortens_the_retention_of_its_job(self) -> None:
        """``Job.result_ttl_s`` (issue 18, item 7): the first purge once that long has
        passed since the job finished forgets it; other jobs wait for the retention, and
        a queued job is never purged, whatever its ttl."""
        async with self.broker() as (b, clock):
            short = job(result_ttl_s=60, idempotency_key="short")
            dead = job(result_ttl_s=60, max_attempts=1)
            plain, queued = job(), job(result_ttl_s=1, priority=-5)
            for j in (short, dead, plain, queued):
                await b.submit(j)
            l_short, l_dead, l_plain = await b.lease("w", visibility_s=VIS, limit=3)
            await b.ack(l_short, ok_result(l_short))
            assert await b.dead_letter(l_dead, error=ErrorInfo(code="E_X", message="x"))
            await b.ack(l_plain, ok_result(l_plain))
            clock.advance(30)
            assert (await b.purge(older_than_s=86400)).jobs == 0
            clock.advance(31)
            report = await b.purge(older_than_s=86400)
            assert report.jobs == 2
            for gone in (short, dead):
                assert await b.get_result(gone.id) is None
                assert await b.get_job_state(gone.id) is None
            assert await b.dead_letters() == []
            assert await b.get_result(plain.id) is not None
            assert (await b.get_job_state(queued.id)).state == "queued"  # type: ignore[union-attr]
            assert not (await b.submit(job(idempotency_key="short"))).duplicate
            assert (await b.purge(older_than_s=86400)).jobs == 0

    # --- store failures ---------------------------------------------------------------

    async def test_a_store_failure_is_a_broker_error_and_changes_nothing(self) -> None:
        async with self.broker() as (b, _clock):
            j = job()
            await b.submit(j)
            [lease] = await b.lease("w1", visibility_s=VIS)
            assert await b.mark_started(lease)
            async with self.storage_fault(b):
                for call in (
                    b.ack(lease, ok_result(lease, "kept")),
                    b.submit(job()),
                    b.retry(lease, error=ErrorInfo(code="E_X", message="x"), delay_s=0),
                ):
                    with pytest.raises(BrokerError) as info:
                        await call
                    assert info.value.retry and not info.value.fatal
                    assert info.value.code.startswith("E_BROKER_")
            # Nothing half-done: the lease is still this worker's, and the result kept in
            # memory is stored now, once.
            assert await b.get_result(j.id) is None
            assert (await b.heartbeat(lease)).ok
            assert await b.ack(lease, ok_result(lease, "kept"))
            result = await b.get_result(j.id)
            assert result is not None and result.output == "kept"
            assert (await b.stats()).queued == 0

    # --- approval gates ---------------------------------------------------------------

    async def test_an_awaiting_approval_result_is_settled_once(self) -> None:
        async with self.broker() as (b, clock):
            await b.submit(job())
            [lease] = await b.lease("w", visibility_s=VIS)
            waiting = msgspec_replace(ok_result(lease), status="awaiting_approval")
            assert await b.ack(lease, waiting)
            got = await b.get_result(lease.job.id)
            assert got is not None and got.status == "awaiting_approval"
            # The job is finished for the queue while it waits.
            state = await b.get_job_state(lease.job.id)
            assert state is not None and state.state != "running"
            clock.advance(5)
            final = msgspec_replace(waiting, status="succeeded", undo_ids=("u1",))
            assert await b.settle_gate(lease.job.id, final)
            assert await b.get_result(lease.job.id) == final
            assert await b.wait_result(lease.job.id, timeout=0) == final
            # The first answer wins: a second one (a rejection racing) changes nothing.
            rejected = msgspec_replace(waiting, status="rejected")
            assert not await b.settle_gate(lease.job.id, rejected)
            assert await b.get_result(lease.job.id) == final
            # Only an awaiting_approval result may be written again.
            await b.submit(job())
            [other] = await b.lease("w", visibility_s=VIS)
            assert await b.ack(other, ok_result(other))
            assert not await b.settle_gate(
                other.job.id, msgspec_replace(ok_result(other), status="rejected")
            )
            assert not await b.settle_gate("unknown", msgspec_replace(final, job_id="unknown"))
            with pytest.raises(ValueError):
                await b.settle_gate(lease.job.id, waiting)
            with pytest.raises(ValueError):
                await b.settle_gate(other.job.id, final)

    # --- undo entries -----------------------------------------------------------------

    async def test_undo_entries_are_stored_fenced_and_read_back(self) -> None:
        async with self.broker() as (b, clock):
            await b.submit(job())
            [lease] = await b.lease("w", visibility_s=VIS)
            e1, e2 = undo_entry(lease.job.id, "a" * 64), undo_entry(lease.job.id, "b" * 64)
            assert await b.record_undo(lease, [e1, e2])
            assert await b.ack(lease, msgspec_replace(ok_result(lease), undo_ids=(e1.id, e2.id)))
            records = await b.get_undo([e2.id, "unknown", e1.id])
            assert [r.entry for r in records] == [e2, e1]
            assert all(r.undone_by is None and r.recorded_at == T0 for r in records)
            assert await b.undo_blobs() == {"a" * 64, "b" * 64}
            assert await b.get_undo([]) == []
            # A lease no longer current records nothing.
            await b.submit(job())
            [other] = await b.lease("w", visibility_s=VIS)
            clock.advance(VIS + 1)
            [again] = await b.lease("w2", visibility_s=VIS)
            assert again.job.id == other.job.id
            late = undo_entry(other.job.id, "c" * 64)
            assert not await b.record_undo(other, [late])
            assert await b.get_undo([late.id]) == []
            assert not await b.record_undo(lease, [late])  # settled: no more entries

    async def test_an_undo_job_marks_the_entries_it_undid(self) -> None:
        async with self.broker() as (b, _clock):
            await b.submit(job())
            [lease] = await b.lease("w", visibility_s=VIS)
            entry = undo_entry(lease.job.id, "a" * 64)
            assert await b.record_undo(lease, [entry])
            await b.ack(lease, msgspec_replace(ok_result(lease), undo_ids=(entry.id,)))
            undo = job("metnos:undo")
            await b.submit(undo)
            [ulease] = await b.lease("w", visibility_s=VIS)
            redo = undo_entry(undo.id, "d" * 64)
            assert await b.record_undo(ulease, [redo], undoes=[entry.id])
            [record] = await b.get_undo([entry.id])
            assert record.undone_by == undo.id
            [redone] = await b.get_undo([redo.id])
            assert redone.entry == redo and redone.undone_by is None

    async def test_purge_forgets_entries_with_their_results(self) -> None:
        async with self.broker() as (b, clock):
            kept, gone, orphaned = job(), job(), job()
            for j in (gone, orphaned):
                await b.submit(j)
            l_gone, l_orphan = await b.lease("w", visibility_s=VIS, limit=2)
            e_gone = undo_entry(gone.id, "a" * 64)
            e_orphan = undo_entry(orphaned.id, "b" * 64)  # its result never lists it
            assert await b.record_undo(l_gone, [e_gone])
            assert await b.record_undo(l_orphan, [e_orphan])
            await b.ack(l_gone, msgspec_replace(ok_result(l_gone), undo_ids=(e_gone.id,)))
            await b.ack(l_orphan, ok_result(l_orphan))
            clock.advance(100)
            await b.submit(kept)
            [l_kept] = await b.lease("w", visibility_s=VIS)
            e_kept = undo_entry(kept.id, "c" * 64)
            assert await b.record_undo(l_kept, [e_kept])
            await b.ack(l_kept, msgspec_replace(ok_result(l_kept), undo_ids=(e_kept.id,)))
            assert (await b.purge(older_than_s=50)).jobs == 2
            assert [r.entry.id for r in await b.get_undo([e_gone.id, e_orphan.id, e_kept.id])] == [
                e_kept.id
            ]
            # Retention follows: only the kept entry's blob is still needed.
            assert await b.undo_blobs() == {"c" * 64}

    # --- waiting ----------------------------------------------------------------------

    async def test_wait_result_wakes_on_ack_and_times_out(self) -> None:
        async with self.broker() as (b, _clock):
            j = job()
            await b.submit(j)
            assert await b.wait_result(j.id, timeout=0.01) is None
            got: list[Result | None] = []

            async def waiter() -> None:
                got.append(await b.wait_result(j.id, timeout=None))

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(waiter)
                    [lease] = await b.lease("w1", visibility_s=VIS)
                    await b.ack(lease, ok_result(lease, "done"))
            assert got and got[0] is not None and got[0].output == "done"
            # Already there: returns at once.
            with anyio.fail_after(10):
                again = await b.wait_result(j.id, timeout=None)
            assert again is not None and again.output == "done"

    async def test_wait_for_work_wakes_on_submit(self) -> None:
        async with self.broker() as (b, _clock):
            woke = anyio.Event()

            async def waiter() -> None:
                await b.wait_for_work(timeout=60)
                woke.set()

            # The broker under test polls rarely (see open_broker), so only the in-process
            # wake-up can end the wait in time. Submitting until it wakes avoids guessing
            # when the waiter has parked.
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(waiter)
                    while not woke.is_set():
                        await b.submit(job())
                        with anyio.move_on_after(0.05):
                            await woke.wait()
            assert len(await b.lease("w1", visibility_s=VIS, limit=100)) >= 1
