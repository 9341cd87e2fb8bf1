"""The Redis broker's records beside the queue: the undo entries jobs record (fenced by
their lease, see `metnos_exec.brokers.base`), the executor catalog server workers publish
(`metnos_exec.devices.catalog`), and the purge that forgets finished jobs with them."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import anyio.lowlevel

from ..devices.catalog import ExecutorInfo, decode_info, encode_info
from ..errors import BadMessage, BrokerCorrupt
from ..messages import Job, Result, UndoEntry, decode_undo_entry, encode
from ._common import decode_body
from ._redis_client import BATCH, RedisStore, as_str
from .base import Lease, PurgeReport, UndoRecord
from .presence import (
    JOB_STATES,
    RECENTLY_GONE_S,
    JobListing,
    WorkerInfo,
    decode_worker,
    encode_worker,
    sort_out,
)

__all__ = ("RedisRecords",)


class RedisRecords(RedisStore):
    """Undo entries, the executor catalog and purging on Redis."""

    # --- undo entries (see `metnos_exec.brokers.base`) ----------------------------------

    async def record_undo(
        self, lease: Lease, entries: Sequence[UndoEntry], *, undoes: Sequence[str] = ()
    ) -> bool:
        args: list[str | bytes] = [lease.job.id, lease.token, str(len(entries))]
        for entry in entries:
            args += [entry.id, encode(entry), " ".join(sorted(entry.blobs()))]
        return bool(await self._script("record_undo", *args, *undoes))

    async def settle_gate(self, job_id: str, result: Result) -> bool:
        if result.job_id != job_id or result.status == "awaiting_approval":
            raise ValueError("settle_gate takes the job's own final result")
        done = bool(await self._script("settle_gate", job_id, encode(result)))
        if done:
            self._wake_results()
        return done

    async def get_undo(self, entry_ids: Sequence[str]) -> list[UndoRecord]:
        ids = list(entry_ids)
        if not ids:
            await anyio.lowlevel.checkpoint()
            return []
        found: dict[str, UndoRecord] = {}
        for start in range(0, len(ids), BATCH):
            for entry_id, body, undone_by, at in await self._script(
                "get_undo", *ids[start : start + BATCH]
            ):
                try:
                    entry = decode_undo_entry(body)
                except BadMessage as exc:
                    raise BrokerCorrupt(
                        f"the stored undo entry {as_str(entry_id)} in {self.where} cannot be "
                        f"read: {exc.message}"
                    ) from None
                found[as_str(entry_id)] = UndoRecord(
                    entry=entry, undone_by=as_str(undone_by) or None, recorded_at=float(at)
                )
        return [found[i] for i in ids if i in found]

    async def undo_blobs(self) -> set[str]:
        return {as_str(d) for d in await self._guard(self._redis.hkeys(self.keys.blobs))}

    # --- the executor catalog (see `metnos_exec.devices.catalog`) -------------------------------

    async def publish_executors(self, infos: Sequence[ExecutorInfo]) -> None:
        if not infos:
            await anyio.lowlevel.checkpoint()
            return
        # One HSET: every entry replaces its name's at once.
        await self._guard(
            self._redis.hset(self.keys.executors, {i.name: encode_info(i) for i in infos})
        )

    async def executor_info(self, name: str) -> ExecutorInfo | None:
        body = await self._guard(self._redis.hget(self.keys.executors, name))
        return None if body is None else decode_info(body)

    async def executor_names(self) -> set[str]:
        return {as_str(n) for n in await self._guard(self._redis.hkeys(self.keys.executors))}

    # --- who serves the queue (see `metnos_exec.brokers.presence`) --------------------

    async def register_worker(self, info: WorkerInfo) -> None:
        await self._guard(self._redis.hset(self.keys.workers, {info.id: encode_worker(info)}))

    async def workers(self, *, gone_within_s: float = RECENTLY_GONE_S) -> list[WorkerInfo]:
        found = await self._guard(self._redis.hgetall(self.keys.workers))
        infos = [info for body in found.values() if (info := decode_worker(body)) is not None]
        keep, old = sort_out(infos, self._wall(), gone_within_s)
        if old:
            await self._guard(self._redis.hdel(self.keys.workers, list(old)))
        return keep

    async def list_jobs(
        self,
        *,
        states: Collection[str] = JOB_STATES,
        executor: str | None = None,
        device: str | None = None,
        limit: int = 50,
    ) -> list[JobListing]:
        if not states or limit <= 0:
            await anyio.lowlevel.checkpoint()
            return []
        flat = await self._script(
            "list_jobs", " ".join(states), executor or "", device or "", str(limit)
        )
        out = []
        for i in range(0, len(flat) - 7, 8):
            job_id, name, dev, state, attempt, worker, status, at = (
                as_str(x) for x in flat[i : i + 8]
            )
            out.append(
                JobListing(
                    job_id=job_id,
                    executor=name,
                    device=dev,
                    state=state,
                    attempt=int(attempt),
                    worker=worker or None,
                    status=status or None,
                    finished_at=float(at) if at else None,
                )
            )
        return out

    async def get_job(self, job_id: str) -> Job | None:
        body = await self._guard(self._redis.hget(self.keys.job(job_id), "body"))
        if body is None:
            return None
        found = decode_body(job_id, body)
        return found if isinstance(found, Job) else None

    async def queued_executors(self) -> dict[tuple[str, str], int]:
        flat = await self._script("queued_routes")
        counts: dict[tuple[str, str], int] = {}
        for i in range(0, len(flat) - 2, 3):
            key = (as_str(flat[i]), as_str(flat[i + 1]))
            counts[key] = counts.get(key, 0) + int(flat[i + 2])
        return counts

    async def purge(self, *, older_than_s: float) -> PurgeReport:
        """See `Broker.purge`. Redis has no transaction to share with a hook: each batch
        is one script, and the hooks get this broker as their ``store`` and the ids after
        it. Space is Redis's memory, freed as keys go (``reclaimed_bytes`` is ``None``)."""
        removed = collected = 0
        while True:
            ids_b, dropped = await self._script("purge", repr(float(older_than_s)), "500")
            ids = [as_str(x) for x in ids_b]
            if ids:
                for hook in self.purge_hooks:
                    hook.forget_jobs(self, ids)
            removed += len(ids)
            collected += int(dropped)
            if len(ids) < 500:
                break
        cut = self._wall() - older_than_s
        collected += sum(int(hook.collect(self, before=cut)) for hook in self.purge_hooks)
        return PurgeReport(jobs=removed, collected=collected, reclaimed_bytes=None)
