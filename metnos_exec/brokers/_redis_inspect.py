"""The Redis broker's control and inspection: cancelling, and reading a job's result,
state, the dead letters, the counts by state, whether Redis keeps what it
acknowledged across a restart, and the data losses found."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import anyio.lowlevel

from ..errors import BadMessage, BrokerCorrupt
from ..messages import (
    MAX_JOB_BYTES,
    DeadLetter,
    ErrorInfo,
    Progress,
    Result,
    decode_dead_letter,
    decode_progress,
    encode,
)
from ._redis_client import BATCH, RedisStore, as_str, closing_buffers, stored_result
from ._redis_watch import decode_losses
from .base import BrokerStats, CancelOutcome, DataLoss, JobState, Lease

__all__ = ("RedisInspection",)


class RedisInspection(RedisStore):
    """Cancelling and reading jobs on Redis."""

    async def cancel(self, job_id: str) -> CancelOutcome:
        outcome = as_str(await self._script("cancel", job_id))
        self._wake_results()
        assert outcome in ("cancelled", "cancelling", "finished", "unknown"), outcome
        return outcome  # type: ignore[return-value]

    async def cancel_requested(self, job_ids: Sequence[str]) -> set[str]:
        ids = list(job_ids)
        if not ids:
            await anyio.lowlevel.checkpoint()
            return set()
        found: set[str] = set()
        for start in range(0, len(ids), BATCH):
            chunk = ids[start : start + BATCH]
            found.update(as_str(x) for x in await self._script("cancel_requested", *chunk))
        return found

    async def get_result(self, job_id: str) -> Result | None:
        body = await self._guard(self._redis.hget(self.keys.job(job_id), "result"))
        return None if body is None else stored_result(job_id, body, self.where)

    async def report_progress(self, lease: Lease, progress: Progress) -> bool:
        done = await self._script("progress", lease.job.id, lease.token, encode(progress))
        return bool(done)

    async def get_progress(self, job_id: str) -> Progress | None:
        body = await self._guard(self._redis.hget(self.keys.job(job_id), "progress"))
        return None if body is None else decode_progress(body)

    async def get_job_state(self, job_id: str) -> JobState | None:
        state, attempt, worker, until, cancel = await self._guard(
            self._redis.hmget(
                self.keys.job(job_id), ["state", "attempt", "worker", "lease_until", "cancel"]
            )
        )
        if state is None:
            return None
        return JobState(
            job_id=job_id,
            state=as_str(state),  # type: ignore[arg-type]
            attempt=int(attempt or 0),
            worker=as_str(worker) if worker is not None else None,
            lease_until=float(until) if until is not None else None,
            cancel_requested=cancel is not None and as_str(cancel) == "1",
        )

    async def dead_letters(self, *, limit: int = 100) -> list[DeadLetter]:
        if limit < 1:
            return []
        out: list[DeadLetter] = []
        for body in await self._script("dead_letters", str(limit)):
            try:
                out.append(decode_dead_letter(body))
            except BadMessage as exc:
                # One damaged record must not hide the others; say what it is.
                raw = bytes(body)
                out.append(
                    DeadLetter(
                        job_id="",
                        raw=raw[:MAX_JOB_BYTES],
                        raw_truncated=len(raw) > MAX_JOB_BYTES,
                        error=ErrorInfo(
                            code=BrokerCorrupt.code,
                            message=f"this dead letter's stored record is unreadable: "
                            f"{exc.message}",
                        ),
                        at=0.0,
                    )
                )
        return out

    async def durability(self) -> str | None:
        """See `Broker.durability`: Redis keeps writes across a restart only with its
        append-only file (``appendonly yes``; ``queue/redis.conf``). ``None`` when CONFIG
        is not allowed to this client (a managed Redis): it cannot be told. On a cluster,
        the node holding the queue's slot (through Sentinel: the primary)."""
        try:
            async with self.target.queue_node(
                self._redis, self.keys.counts, connect_timeout=self._connect_timeout
            ) as node:
                conf = await node.config_get(["appendonly", "save"])
        except Exception:
            return None
        values = {as_str(k): as_str(v) for k, v in conf.items()}
        if values.get("appendonly", "yes") == "yes":
            return None
        save = values.get("save", "").strip()
        if not save:
            return (
                "Redis keeps nothing on disk (appendonly no, no save points): every queued "
                "job and every result is lost when it restarts"
            )
        return (
            f"Redis keeps only snapshots (appendonly no, save {save}): jobs and results "
            "acknowledged since the last one are lost when it restarts"
        )

    async def stats(self) -> BrokerStats:
        *counts, oldest = await self._script("stats", "1")
        queued, delayed, running, done, dead = (int(x) for x in counts)
        stats = BrokerStats(
            queued=queued,
            delayed=delayed,
            running=running,
            done=done,
            dead=dead,
            oldest_queued_at=float(oldest) if oldest else None,
        )
        self._watch.saw(stats, self._wall())
        return stats

    async def data_lost(self) -> list[DataLoss]:
        """See `Broker.data_lost`: the losses the brokers of this queue found (a marker
        gone, `metnos_exec.brokers._redis_watch`) and recorded in the data set that
        replaced the lost one, kept a week; newest first."""
        if self._watch.due(self._usable()):
            await self._watch.look(self._wall())  # a loss this very call can find
        found = await self._guard(self._redis.hgetall(self.keys.lost))
        return decode_losses(list(found.values()))

    async def open_access(self) -> str | None:
        """See `Broker.open_access`: a connection without user or password (whatever the
        URL gives) that may read the queue's keys (``EXISTS`` of its counts) means anyone
        who reaches the port may read, submit and settle its jobs."""
        anon, parts = self.target.client(
            connect_timeout=self._connect_timeout,
            stream_timeout=self._connect_timeout,
            connected=lambda cls: closing_buffers(cls, lambda: None),
            anonymous=True,
        )
        try:
            async with contextlib.AsyncExitStack() as stack:
                for part in parts:
                    await stack.enter_async_context(part)
                await anon.exists([self.keys.counts])
        except Exception:  # refused (NOAUTH, NOPERM), or not reached: not open to all
            return None
        return (
            f"Redis at {self.where} lets a client that gives no password read and write "
            f"this queue's keys ({self.keys.base}*)"
        )
