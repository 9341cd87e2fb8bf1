"""The memory broker's records beside the queue: the executor catalog, the workers'
presence records, the queued jobs by executor (see `metnos_exec.brokers.presence`),
reading undo entries, and the running jobs' progress (`metnos_exec.brokers.progress`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import anyio.lowlevel

from ..devices.catalog import ExecutorInfo
from ..messages import Job, Progress, Result
from .base import Lease, UndoRecord
from .presence import JOB_STATES, RECENTLY_GONE_S, JobListing, WorkerInfo, sort_out

__all__ = ("MemoryCatalog",)


class MemoryCatalog:
    """The catalog and presence part of `MemoryBroker` (its state is set up there)."""

    _clock: Callable[[], float]
    _catalog: dict[str, ExecutorInfo]
    _workers: dict[str, WorkerInfo]
    _entries: dict[str, Any]  # job id -> the memory broker's entry
    _undo: dict[str, UndoRecord]
    _results: dict[str, Result]
    _live: Callable[[Lease], Any]  # the entry `lease` holds, else None

    async def settle_gate(self, job_id: str, result: Result) -> bool:
        await anyio.lowlevel.checkpoint()
        if result.job_id != job_id or result.status == "awaiting_approval":
            raise ValueError("settle_gate takes the job's own final result")
        stored = self._results.get(job_id)
        if stored is None or stored.status != "awaiting_approval":
            return False
        self._results[job_id] = result
        return True

    async def report_progress(self, lease: Lease, progress: Progress) -> bool:
        await anyio.lowlevel.checkpoint()
        entry = self._live(lease)
        if entry is None:
            return False
        entry.progress = progress
        return True

    async def get_progress(self, job_id: str) -> Progress | None:
        await anyio.lowlevel.checkpoint()
        entry = self._entries.get(job_id)
        return None if entry is None else entry.progress

    async def publish_executors(self, infos: Sequence[ExecutorInfo]) -> None:
        for info in infos:
            self._catalog[info.name] = info

    async def executor_info(self, name: str) -> ExecutorInfo | None:
        return self._catalog.get(name)

    async def executor_names(self) -> set[str]:
        await anyio.lowlevel.checkpoint()
        return set(self._catalog)

    async def register_worker(self, info: WorkerInfo) -> None:
        await anyio.lowlevel.checkpoint()
        self._workers[info.id] = info

    async def workers(self, *, gone_within_s: float = RECENTLY_GONE_S) -> list[WorkerInfo]:
        await anyio.lowlevel.checkpoint()
        keep, forget = sort_out(self._workers.values(), self._clock(), gone_within_s)
        for wid in forget:
            del self._workers[wid]
        return keep

    async def queued_executors(self) -> dict[tuple[str, str], int]:
        await anyio.lowlevel.checkpoint()
        counts: dict[tuple[str, str], int] = {}
        for entry in self._entries.values():
            if entry.state == "queued":
                key = (entry.device, entry.job.executor if entry.job is not None else "")
                counts[key] = counts.get(key, 0) + 1
        return counts

    async def get_undo(self, entry_ids: Sequence[str]) -> list[UndoRecord]:
        await anyio.lowlevel.checkpoint()
        return [self._undo[i] for i in entry_ids if i in self._undo]

    async def undo_blobs(self) -> set[str]:
        await anyio.lowlevel.checkpoint()
        return {digest for record in self._undo.values() for digest in record.entry.blobs()}

    async def list_jobs(
        self,
        *,
        states: Collection[str] = JOB_STATES,
        executor: str | None = None,
        device: str | None = None,
        limit: int = 50,
    ) -> list[JobListing]:
        await anyio.lowlevel.checkpoint()
        out: list[JobListing] = []
        for entry in sorted(self._entries.values(), key=lambda e: -e.seq):
            name = entry.job.executor if entry.job is not None else ""
            if entry.state not in states or (executor is not None and name != executor):
                continue
            if device is not None and entry.device != device:
                continue
            if len(out) >= limit:
                break
            result = self._results.get(entry.job_id)
            out.append(
                JobListing(
                    job_id=entry.job_id,
                    executor=name,
                    device=entry.device,
                    state=entry.state,
                    attempt=entry.attempt,
                    worker=entry.worker,
                    status=result.status if result else None,
                    finished_at=result.finished_at if result else None,
                )
            )
        return out

    async def get_job(self, job_id: str) -> Job | None:
        await anyio.lowlevel.checkpoint()
        entry = self._entries.get(job_id)
        return entry.job if entry is not None else None
