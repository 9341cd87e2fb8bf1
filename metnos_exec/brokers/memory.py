"""An in-process broker for tests and embedding: nothing survives the process.

Same semantics as the SQLite broker (the conformance suite runs both). The clock is
injectable so lease expiry, delays and backoff can be tested on a virtual clock. All state
is touched only from the event loop thread, between awaits, so no lock is needed.
"""

from __future__ import annotations

import heapq
import os
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio

from ..devices.catalog import ExecutorInfo
from ..errors import BadMessage
from ..logs import get_logger
from ..messages import (
    E_CANCELLED,
    E_LEASE_EXPIRED,
    MAX_JOB_BYTES,
    SERVER_DEVICE,
    DeadLetter,
    ErrorInfo,
    Job,
    Progress,
    Result,
    UndoEntry,
    check_job_size,
    decode_job,
    encode_job,
    new_job_id,
)
from ._memory_catalog import MemoryCatalog
from .base import (
    MAX_UNSTARTED_LAPSES,
    Broker,
    BrokerStats,
    CancelOutcome,
    HeartbeatReply,
    JobState,
    Lease,
    PurgeReport,
    RetryOutcome,
    SubmitReceipt,
    UndoRecord,
    check_idempotent_reuse,
    queued_cancel_message,
)
from .presence import WorkerInfo

__all__ = ("MemoryBroker",)

_log = get_logger()

_State = Literal["queued", "running", "done", "dead"]


@dataclass(eq=False)
class _Entry:
    seq: int
    job_id: str
    job: Job | None
    raw: bytes | None
    bad: ErrorInfo | None
    device: str
    priority: int
    max_attempts: int
    due_at: float
    state: _State = "queued"
    attempt: int = 0
    token: str | None = None
    lease_until: float | None = None
    worker: str | None = None
    cancel_requested: bool = False
    #: The current delivery was launched (`mark_started`): it counts as an attempt.
    started: bool = False
    #: Leases that lapsed before they started.
    lapses: int = 0
    # Bumped whenever the entry is (re)queued, so stale heap items are recognised.
    version: int = 0
    progress: Progress | None = None  # the latest reported (`brokers.progress`)


@dataclass
class _Heaps:
    # (-priority, seq, version, job_id): higher priority first, then submission order.
    ready: dict[str, list[tuple[int, int, int, str]]] = field(default_factory=dict)
    # (due_at, seq, version, job_id)
    delayed: list[tuple[float, int, int, str]] = field(default_factory=list)


class MemoryBroker(MemoryCatalog, Broker):
    """In-memory `Broker`.

    Args:
        clock: unix-seconds clock used for leases, delays and timestamps.
    """

    scheme = "memory"

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._idem: dict[str, str] = {}
        self._running: dict[str, _Entry] = {}
        self._results: dict[str, Result] = {}
        self._result_at: dict[str, float] = {}
        self._dead: list[DeadLetter] = []
        self._undo: dict[str, UndoRecord] = {}
        self._heaps = _Heaps()
        self._seq = 0
        self._work_event: anyio.Event | None = None
        self._result_events: dict[str, anyio.Event] = {}
        self._closed = False
        self._catalog: dict[str, ExecutorInfo] = {}
        self._workers: dict[str, WorkerInfo] = {}

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MemoryBroker:
        """``memory://`` — a fresh, empty broker each time (``create`` is ignored: there
        is nothing to find)."""
        options.pop("create", None)
        return cls(**options)

    # --- internals --------------------------------------------------------------------

    def _push(self, entry: _Entry) -> None:
        entry.version += 1
        if entry.due_at <= self._clock():
            heap = self._heaps.ready.setdefault(entry.device, [])
            heapq.heappush(heap, (-entry.priority, entry.seq, entry.version, entry.job_id))
        else:
            heapq.heappush(
                self._heaps.delayed, (entry.due_at, entry.seq, entry.version, entry.job_id)
            )

    def _wake_workers(self) -> None:
        if self._work_event is not None:
            self._work_event.set()
            self._work_event = None

    def _store_result(self, result: Result) -> bool:
        if result.job_id in self._results:
            return False
        self._results[result.job_id] = result
        self._result_at[result.job_id] = self._clock()
        event = self._result_events.pop(result.job_id, None)
        if event is not None:
            event.set()
        return True

    def _live(self, lease: Lease) -> _Entry | None:
        entry = self._entries.get(lease.job.id)
        if entry is None or entry.state != "running" or entry.token != lease.token:
            return None
        return entry

    def _finish(self, entry: _Entry, state: _State) -> None:
        entry.state = state
        entry.token = None
        entry.lease_until = None
        self._running.pop(entry.job_id, None)

    def _kill(self, entry: _Entry, error: ErrorInfo, now: float) -> None:
        """Dead-letter `entry` and store its ``dead`` result."""
        worker = entry.worker or ""
        self._finish(entry, "dead")
        raw = entry.raw if entry.job is None else None
        self._dead.append(
            DeadLetter(
                job_id=entry.job_id,
                job=entry.job,
                raw=raw[:MAX_JOB_BYTES] if raw is not None else None,
                raw_truncated=raw is not None and len(raw) > MAX_JOB_BYTES,
                error=error,
                attempts=entry.attempt,
                at=now,
                worker=worker,
            )
        )
        self._store_result(
            Result(
                job_id=entry.job_id,
                status="dead",
                error=error,
                worker=worker,
                device=entry.device,
                attempt=entry.attempt,
                finished_at=now,
            )
        )

    def _sweep(self, now: float) -> None:
        """Promote due delayed jobs; settle or requeue jobs whose lease expired."""
        delayed = self._heaps.delayed
        while delayed and delayed[0][0] <= now:
            _, _, version, job_id = heapq.heappop(delayed)
            entry = self._entries[job_id]
            if entry.state == "queued" and entry.version == version:
                entry.version -= 1  # _push bumps it again
                self._push(entry)
        expired = [e for e in self._running.values() if (e.lease_until or 0.0) <= now]
        for entry in expired:
            if not entry.started:
                # Never launched: the delivery gives its attempt back (base.py, "Attempts").
                entry.attempt = max(entry.attempt - 1, 0)
                entry.lapses += 1
            if entry.cancel_requested:
                self._finish(entry, "done")
                self._store_result(
                    Result(
                        job_id=entry.job_id,
                        status="cancelled",
                        error=ErrorInfo(
                            code=E_CANCELLED,
                            message="cancelled while running; its worker was lost",
                        ),
                        worker=entry.worker or "",
                        device=entry.device,
                        attempt=entry.attempt,
                        finished_at=now,
                    )
                )
            elif (entry.started and entry.attempt >= entry.max_attempts) or (
                not entry.started and entry.lapses >= MAX_UNSTARTED_LAPSES
            ):
                if entry.started:
                    message = (
                        f"the lease expired on delivery {entry.attempt} of "
                        f"{entry.max_attempts}; its worker stopped heart-beating"
                    )
                else:
                    message = (
                        f"the job was leased {entry.lapses} times and never started: each "
                        "time its worker was lost before launching it"
                    )
                error = ErrorInfo(code=E_LEASE_EXPIRED, message=message)
                self._kill(entry, error, now)
                _log.warning(
                    "job.dead_lettered",
                    job_id=entry.job_id,
                    # The job's own executor and worker, not the sweeping worker's context.
                    executor=entry.job.executor if entry.job is not None else None,
                    worker=entry.worker,
                    device=entry.device,
                    code=error.code,
                    message=error.message,
                )
            else:
                self._requeue(entry, now)

    def _requeue(self, entry: _Entry, due_at: float) -> None:
        self._running.pop(entry.job_id, None)
        entry.state = "queued"
        entry.token = None
        entry.lease_until = None
        entry.started = False
        entry.due_at = due_at
        self._push(entry)

    # --- producing --------------------------------------------------------------------

    def _add(
        self, job_id: str, job: Job | None, raw: bytes | None, bad: ErrorInfo | None
    ) -> SubmitReceipt:
        if job is not None:
            key = job.idempotency_key
            if key is not None and key in self._idem:
                original = self._idem[key]
                entry_ = self._entries.get(original)
                if entry_ is not None and entry_.job is not None:
                    check_idempotent_reuse(entry_.job, job)
                return SubmitReceipt(original, duplicate=True)
            if job.id in self._entries:
                known = self._entries[job.id].job
                if known is not None:
                    check_idempotent_reuse(known, job, by_id=True)
                return SubmitReceipt(job.id, duplicate=True)
            if key is not None:
                self._idem[key] = job.id
        self._seq += 1
        entry = _Entry(
            seq=self._seq,
            job_id=job_id,
            job=job,
            raw=raw,
            bad=bad,
            device=(job.device if job and job.device else SERVER_DEVICE),
            priority=job.priority if job else 0,
            max_attempts=job.max_attempts if job else 1,
            due_at=(job.not_before or 0.0) if job else 0.0,
        )
        self._entries[job_id] = entry
        self._push(entry)
        self._wake_workers()
        return SubmitReceipt(job_id)

    async def submit(self, job: Job) -> SubmitReceipt:
        # Encoded although it is kept as an object: the same bounds as every broker (size,
        # depth, encodable at all), and nothing reaches a worker that a store would refuse.
        encode_job(job)
        await anyio.lowlevel.checkpoint()
        return self._add(job.id, job, None, None)

    async def submit_raw(self, data: bytes) -> str:
        await anyio.lowlevel.checkpoint()
        check_job_size(len(data))
        try:
            job = decode_job(data)
        except BadMessage as exc:
            job_id = new_job_id()
            self._add(job_id, None, bytes(data), ErrorInfo(code=exc.code, message=exc.message))
            return job_id
        return self._add(job.id, job, None, None).job_id

    # --- consuming --------------------------------------------------------------------

    async def lease(
        self,
        worker_id: str,
        *,
        visibility_s: float,
        device: str | None = None,
        limit: int = 1,
        started: int | None = None,
        executors: Collection[str] | None = None,
    ) -> list[Lease]:
        if not visibility_s > 0:
            raise ValueError(f"visibility_s must be > 0, got {visibility_s}")
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        await anyio.lowlevel.checkpoint()
        now = self._clock()
        self._sweep(now)
        dev = device or SERVER_DEVICE
        heap = self._heaps.ready.get(dev, [])
        out: list[Lease] = []
        served = None if executors is None else frozenset(executors)
        skipped: list[tuple[int, int, int, str]] = []
        while heap and len(out) < limit:
            item = heapq.heappop(heap)
            _, _, version, job_id = item
            entry = self._entries[job_id]
            if entry.state != "queued" or entry.version != version:
                continue
            if served is not None and entry.job is not None and entry.job.executor not in served:
                skipped.append(item)  # another worker's executor: it stays queued
                continue
            entry.attempt += 1
            entry.worker = worker_id
            if entry.job is None:
                error = entry.bad or ErrorInfo(code=BadMessage.code, message="undecodable")
                self._kill(entry, error, now)
                _log.error(
                    "job.bad_message",
                    job_id=job_id,
                    executor=None,  # undecodable: no executor is known
                    code=error.code,
                    message=error.message,
                )
                continue
            entry.state = "running"
            # The first `started` handed out start at once (base.py, "Attempts").
            entry.started = started is None or len(out) < started
            entry.token = os.urandom(8).hex()
            entry.lease_until = now + visibility_s
            self._running[job_id] = entry
            out.append(
                Lease(
                    job=entry.job,
                    attempt=entry.attempt,
                    token=entry.token,
                    lease_until=entry.lease_until,
                    worker=worker_id,
                    device=dev,
                    visibility_s=visibility_s,
                    started=entry.started,
                )
            )
        for item in skipped:
            heapq.heappush(heap, item)
        return out

    async def wait_for_work(self, timeout: float) -> None:  # noqa: ASYNC109
        if self._work_event is None:
            self._work_event = anyio.Event()
        event = self._work_event
        # Nothing signals when a delay ends or a lease lapses: wake up by then ourselves
        # (with a floor, so a clock that does not move cannot make this a busy loop).
        now = self._clock()
        wake_at = [e.lease_until or now for e in self._running.values()]
        if self._heaps.delayed:
            wake_at.append(self._heaps.delayed[0][0])
        if wake_at:
            timeout = min(timeout, max(0.005, min(wake_at) - now))
        with anyio.move_on_after(timeout):
            await event.wait()

    async def heartbeat(self, lease: Lease, *, visibility_s: float | None = None) -> HeartbeatReply:
        await anyio.lowlevel.checkpoint()
        entry = self._live(lease)
        if entry is None:
            return HeartbeatReply(ok=False)
        window = lease.visibility_s if visibility_s is None else visibility_s
        entry.lease_until = self._clock() + window
        return HeartbeatReply(
            ok=True, cancel_requested=entry.cancel_requested, lease_until=entry.lease_until
        )

    async def mark_started(self, lease: Lease) -> bool:
        await anyio.lowlevel.checkpoint()
        entry = self._live(lease)
        if entry is None:
            return False
        entry.started = True
        return True

    async def ack(self, lease: Lease, result: Result) -> bool:
        await anyio.lowlevel.checkpoint()
        entry = self._live(lease)
        if entry is None or result.job_id != entry.job_id:
            return False
        self._finish(entry, "dead" if result.status == "dead" else "done")
        return self._store_result(result)

    async def retry(self, lease: Lease, *, error: ErrorInfo, delay_s: float) -> RetryOutcome:
        await anyio.lowlevel.checkpoint()
        entry = self._live(lease)
        if entry is None:
            return "lost"
        now = self._clock()
        if entry.attempt >= entry.max_attempts:
            self._kill(entry, error, now)
            return "dead"
        self._requeue(entry, now + max(0.0, delay_s))
        return "scheduled"

    async def dead_letter(self, lease: Lease, *, error: ErrorInfo) -> bool:
        await anyio.lowlevel.checkpoint()
        entry = self._live(lease)
        if entry is None:
            return False
        self._kill(entry, error, self._clock())
        return True

    async def release(self, lease: Lease) -> bool:
        await anyio.lowlevel.checkpoint()
        entry = self._live(lease)
        if entry is None:
            return False
        entry.attempt -= 1
        self._requeue(entry, self._clock())
        self._wake_workers()
        return True

    # --- control and inspection -------------------------------------------------------

    async def cancel(self, job_id: str) -> CancelOutcome:
        await anyio.lowlevel.checkpoint()
        entry = self._entries.get(job_id)
        if entry is None:
            return "unknown"
        if entry.state == "queued":
            self._finish(entry, "done")
            self._store_result(
                Result(
                    job_id=job_id,
                    status="cancelled",
                    error=ErrorInfo(code=E_CANCELLED, message=queued_cancel_message(entry.attempt)),
                    device=entry.device,
                    attempt=entry.attempt,
                    finished_at=self._clock(),
                )
            )
            return "cancelled"
        if entry.state == "running":
            entry.cancel_requested = True
            return "cancelling"
        return "finished"

    async def cancel_requested(self, job_ids: Sequence[str]) -> set[str]:
        await anyio.lowlevel.checkpoint()
        entries = self._entries
        return {
            job_id
            for job_id in job_ids
            if (entry := entries.get(job_id)) is not None
            and entry.state == "running"
            and entry.cancel_requested
        }

    async def get_result(self, job_id: str) -> Result | None:
        await anyio.lowlevel.checkpoint()
        return self._results.get(job_id)

    async def wait_result(
        self,
        job_id: str,
        *,
        timeout: float | None,  # noqa: ASYNC109
    ) -> Result | None:
        result = self._results.get(job_id)
        if result is not None:
            await anyio.lowlevel.checkpoint()
            return result
        event = self._result_events.get(job_id)
        if event is None:
            event = self._result_events[job_id] = anyio.Event()
        with anyio.move_on_after(timeout if timeout is not None else float("inf")):
            await event.wait()
        return self._results.get(job_id)

    async def get_job_state(self, job_id: str) -> JobState | None:
        await anyio.lowlevel.checkpoint()
        entry = self._entries.get(job_id)
        if entry is None:
            return None
        return JobState(
            job_id=job_id,
            state=entry.state,
            attempt=entry.attempt,
            worker=entry.worker,
            lease_until=entry.lease_until,
            cancel_requested=entry.cancel_requested,
        )

    async def dead_letters(self, *, limit: int = 100) -> list[DeadLetter]:
        await anyio.lowlevel.checkpoint()
        return list(reversed(self._dead[-limit:])) if limit > 0 else []

    async def stats(self) -> BrokerStats:
        await anyio.lowlevel.checkpoint()
        now = self._clock()
        counts = {"queued": 0, "running": 0, "done": 0, "dead": 0}
        delayed = 0
        due: list[float] = []  # the due queued jobs' submit times
        for entry in self._entries.values():
            counts[entry.state] += 1
            if entry.state == "queued" and entry.due_at > now:
                delayed += 1
            elif entry.state == "queued" and entry.job is not None:
                due.append(entry.job.submitted_at)
        return BrokerStats(delayed=delayed, oldest_queued_at=min(due, default=None), **counts)

    async def purge(self, *, older_than_s: float) -> PurgeReport:
        """See `Broker.purge`; hooks get this broker as their ``store``."""
        await anyio.lowlevel.checkpoint()
        now = self._clock()
        cut = now - older_than_s

        def expired(job_id: str, at: float) -> bool:
            job = self._entries[job_id].job if job_id in self._entries else None
            ttl = None if job is None else job.result_ttl_s
            return at < cut or (ttl is not None and at + ttl < now)

        old = {job_id for job_id, at in self._result_at.items() if expired(job_id, at)}
        old = {j for j in old if self._entries[j].state in ("done", "dead")}
        if old:
            for hook in self.purge_hooks:
                hook.forget_jobs(self, sorted(old))
        for job_id in old:
            entry = self._entries.pop(job_id)
            if entry.job is not None and entry.job.idempotency_key is not None:
                self._idem.pop(entry.job.idempotency_key, None)
            del self._results[job_id], self._result_at[job_id]
        self._dead = [d for d in self._dead if d.job_id not in old]
        for entry_id, record in list(self._undo.items()):
            result = self._results.get(record.entry.job_id)
            listed = result is not None and entry_id in result.undo_ids
            if record.entry.job_id in old or (not listed and record.recorded_at < cut):
                del self._undo[entry_id]
        collected = sum(int(hook.collect(self, before=cut)) for hook in self.purge_hooks)
        return PurgeReport(jobs=len(old), collected=collected, reclaimed_bytes=None)

    # --- undo entries -----------------------------------------------------------------

    async def record_undo(
        self, lease: Lease, entries: Sequence[UndoEntry], *, undoes: Sequence[str] = ()
    ) -> bool:
        await anyio.lowlevel.checkpoint()
        if self._live(lease) is None:
            return False
        now = self._clock()
        for entry in entries:
            self._undo[entry.id] = UndoRecord(entry=entry, recorded_at=now)
        for entry_id in undoes:
            record = self._undo.get(entry_id)
            if record is not None:
                self._undo[entry_id] = UndoRecord(
                    entry=record.entry, undone_by=lease.job.id, recorded_at=record.recorded_at
                )
        return True

    async def close(self) -> None:
        self._closed = True
        await anyio.lowlevel.checkpoint()
