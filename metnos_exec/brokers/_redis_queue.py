"""The Redis broker's queue: submitting (also through the inbox other-language producers
write to), leasing (with the takeover of lapsed leases), heart-beating and settling a job.
Each step is one script of ``redis.lua`` (`SCRIPTS`), fenced by the lease token."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Collection, Sequence
from typing import Final

import anyio.lowlevel

from ..errors import BadMessage, BrokerUnavailable, IdempotencyConflict, SubmitOutcomeUnknown
from ..logs import get_logger
from ..messages import (
    E_CANCELLED,
    MAX_JOB_BYTES,
    SERVER_DEVICE,
    ErrorInfo,
    Job,
    Result,
    check_job_size,
    decode_job,
    encode,
    encode_job,
    new_job_id,
)
from ._common import check_lease_args, decode_body, lapsed_error
from ._redis_client import BATCH, as_str, error_fields, inbox_text
from ._redis_wait import RedisWaits, WorkCursor
from .base import (
    MAX_UNSTARTED_LAPSES,
    HeartbeatReply,
    Lease,
    RetryOutcome,
    SubmitReceipt,
    check_idempotent_reuse,
)

__all__ = ("RedisQueue",)

_log = get_logger()
#: What an inbox entry may have beyond its job's bound (its `id` field, field names).
_INBOX_SLACK: Final = 4096
#: How much of an oversized inbox entry's `job` its dead letter keeps.
_EXCERPT: Final = 64 * 1024
#: The longest job id (`messages.Job.id`).
_MAX_ID: Final = 128


@contextlib.asynccontextmanager
async def _outcome_unknown(job_id: str, count: int = 1, done: int = 0) -> AsyncIterator[None]:
    """A submit call that failed after it may have reached Redis says the outcome is
    unknown (`SubmitOutcomeUnknown`) instead of "nothing was queued": a caller who
    believed that and submitted anew would run the job twice. `done`: jobs of the same
    batch already queued by earlier calls."""
    try:
        yield
    except BrokerUnavailable as exc:
        if type(exc) is not BrokerUnavailable or not getattr(exc, "maybe_done", False):
            raise
        what = f"job {job_id}" if count == 1 else f"{count} jobs from {job_id} on"
        earlier = f" ({done} before them were queued)" if done else ""
        raise SubmitOutcomeUnknown(
            f"{exc.message}; the submit was sent, so {what} may be queued{earlier}: the "
            f"result or status of {job_id} says, and submitting the same id again queues "
            "nothing twice",
            job_id,
        ) from None


class RedisQueue(RedisWaits):
    """Producing and consuming on Redis (see the module docstring)."""

    @staticmethod
    def _submit_args(job: Job) -> list[str | bytes]:
        return [
            job.id,
            encode_job(job),  # held to the size and depth bounds (BadMessage)
            job.device or SERVER_DEVICE,
            str(job.priority),
            str(job.max_attempts),
            job.idempotency_key or "",
            "" if job.not_before is None else repr(float(job.not_before)),
            job.executor,  # its route: a worker reads only the executors it serves
        ]

    @staticmethod
    def _receipt(job: Job, reply: Sequence[bytes]) -> SubmitReceipt:
        status, job_id, original = as_str(reply[0]), as_str(reply[1]), reply[2]
        if status == "new":
            return SubmitReceipt(job_id)
        if original:
            decoded = decode_body(job_id, original)
            # A stored body that no longer decodes cannot be compared (as with SQLite).
            # The key matched, or else the id did (`admit` checks the id first).
            if isinstance(decoded, Job):
                check_idempotent_reuse(decoded, job, by_id=job_id == job.id)
        return SubmitReceipt(job_id, duplicate=True)

    async def submit(self, job: Job) -> SubmitReceipt:
        async with _outcome_unknown(job.id):
            [reply] = await self._script("submit", *self._submit_args(job))
        self._wake_workers()
        return self._receipt(job, reply)

    async def submit_many(self, jobs: Sequence[Job]) -> list[SubmitReceipt]:
        """Queue several jobs, `BATCH` per script call. Not one transaction as with
        SQLite: an `IdempotencyConflict` is raised after the whole batch was handled (the
        conflicting job alone is not queued)."""
        receipts: list[SubmitReceipt] = []
        conflict: IdempotencyConflict | None = None
        # Every job's bounds checked before any is queued (base.py: all or none).
        encoded = [self._submit_args(job) for job in jobs]
        for start in range(0, len(jobs), BATCH):
            chunk = jobs[start : start + BATCH]
            args = [a for one in encoded[start : start + BATCH] for a in one]
            async with _outcome_unknown(chunk[0].id, len(chunk), start):
                replies = await self._script("submit", *args)
            for job, reply in zip(chunk, replies, strict=True):
                try:
                    receipts.append(self._receipt(job, reply))
                except IdempotencyConflict as exc:
                    conflict = conflict or exc
        self._wake_workers()
        if conflict is not None:
            raise conflict
        return receipts

    async def submit_raw(self, data: bytes) -> str:
        check_job_size(len(data))
        try:
            job = decode_job(data)
        except BadMessage:
            # Through the producers' door, like any other-language message: the first
            # server worker to look dead-letters it.
            job_id = new_job_id()
            await self._guard(
                self._redis.xadd(self.keys.inbox, {b"id": job_id, b"job": bytes(data)})
            )
            self._wake_workers()
            return job_id
        return (await self.submit(job)).job_id

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
        check_lease_args(visibility_s, limit)
        dev = device or SERVER_DEVICE
        start_n = limit if started is None else started
        served = ["*"] if executors is None else sorted(set(executors))
        leases, inbox = await self._lease_once(worker_id, visibility_s, dev, limit, start_n, served)
        # Only server workers open the inbox: a bad message is dead-lettered by the
        # server, and a device never routes jobs for others.
        if inbox and dev == SERVER_DEVICE:
            try:
                await self._admit_inbox(worker_id)
                if len(leases) < limit:
                    more, _ = await self._lease_once(
                        worker_id,
                        visibility_s,
                        dev,
                        limit - len(leases),
                        max(0, start_n - len(leases)),
                        served,
                    )
                    leases += more
            except Exception as exc:
                if not leases:
                    raise
                # The leases taken are this worker's already (the first ones count as
                # started): raising would strand them until they lapse, an attempt used
                # for nothing. The inbox is tried again at the next lease.
                _log.error(
                    "broker.error",
                    broker=self.where,
                    op="admit_inbox",
                    error=f"{type(exc).__name__}: {exc}",
                )
        return leases

    async def _lease_once(
        self,
        worker_id: str,
        visibility_s: float,
        dev: str,
        limit: int,
        start_n: int,
        served: list[str],
    ) -> tuple[list[Lease], int]:
        _now, inbox, taken, finals, until_s, wake_id, inbox_id, next_in = await self._script(
            "lease",
            worker_id,
            repr(float(visibility_s)),
            dev,
            str(limit),
            os.urandom(8).hex(),
            str(start_n),
            str(MAX_UNSTARTED_LAPSES),
            *served,
        )
        until = float(until_s)
        self._work_cursor = WorkCursor(
            device=dev,
            served=None if served == ["*"] else frozenset(served),
            wake=as_str(wake_id),
            inbox=as_str(inbox_id) if dev == SERVER_DEVICE else None,
            next_in=float(next_in) if next_in else None,
            at=anyio.current_time(),
        )
        out: list[Lease] = []
        for i, (id_b, body, attempt_b, token_b) in enumerate(taken):
            job_id = as_str(id_b)
            decoded = decode_body(job_id, body)
            if isinstance(decoded, ErrorInfo):
                await self._bad_leased(
                    job_id, body, decoded, as_str(token_b), int(attempt_b), worker_id, dev
                )
                continue
            out.append(
                Lease(
                    job=decoded,
                    attempt=int(attempt_b),
                    token=as_str(token_b),
                    lease_until=until,
                    worker=worker_id,
                    device=dev,
                    visibility_s=visibility_s,
                    # The script started the first `start_n` it handed out (in order).
                    started=i < start_n,
                )
            )
        for final in finals:
            await self._settle_lapsed(final, dev)
        return out, int(inbox)

    async def _bad_leased(
        self,
        job_id: str,
        body: bytes,
        error: ErrorInfo,
        token: str,
        attempt: int,
        worker: str,
        dev: str,
    ) -> None:
        result, letter = self._dead_records(
            None, job_id, error, raw=bytes(body), attempt=attempt, worker=worker, device=dev
        )
        await self._settle("dead_letter", [token], job_id, token, result, letter)
        _log.error("job.bad_message", job_id=job_id, executor=None, **error_fields(error))

    async def _settle_lapsed(self, final: Sequence[bytes], dev: str) -> None:
        """Settle a lapsed lease with no delivery left (dead) or a cancel pending."""
        job_id, body, attempt, token = as_str(final[0]), final[1], int(final[2]), as_str(final[3])
        worker, cancel = as_str(final[4]), as_str(final[5]) == "1"
        started, lapses = as_str(final[6]) == "1", int(final[7])
        if cancel:
            result = Result(
                job_id=job_id,
                status="cancelled",
                error=ErrorInfo(
                    code=E_CANCELLED, message="cancelled while running; its worker was lost"
                ),
                worker=worker,
                device=dev,
                attempt=attempt,
                finished_at=self._wall(),
            )
            await self._settle("ack", [token], job_id, token, encode(result), "cancelled")
            self._wake_results()
            return
        decoded = decode_body(job_id, body)
        job = decoded if isinstance(decoded, Job) else None
        error = lapsed_error(started=started, attempt=attempt, lapses=lapses)
        result_b, letter_b = self._dead_records(
            None, job_id, error, job=job, attempt=attempt, worker=worker, device=dev
        )
        if await self._settle("dead_letter", [token], job_id, token, result_b, letter_b):
            _log.warning(
                "job.dead_lettered",
                job_id=job_id,
                # The job's own executor and worker, not the sweeping worker's context.
                executor=job.executor if job else None,
                worker=worker,
                device=dev,
                **error_fields(error),
            )
        self._wake_results()

    async def _admit_inbox(self, worker_id: str) -> None:
        """Queue (or dead-letter) what other-language producers put in the inbox.

        Entries over ``MAX_JOB_BYTES`` are cut down in Redis first (``inbox_trim``: an
        excerpt, the size, the id bounded), so no worker reads one whole and no dead
        letter keeps it whole; an id longer than a job id may be is replaced by a new one.
        """
        await self._script(
            "inbox_trim", str(MAX_JOB_BYTES + _INBOX_SLACK), str(_EXCERPT), str(BATCH)
        )
        entries = await self._guard(self._redis.xrange(self.keys.inbox, count=BATCH))
        if not entries:
            return
        args: list[str | bytes] = []
        bad: list[tuple[str, ErrorInfo]] = []
        for entry in entries:
            eid = as_str(entry.identifier)
            fields = {inbox_text(k): v for k, v in entry.field_values.items()}
            raw = fields.get("job")
            given = inbox_text(fields["id"]) if "id" in fields else None
            error: ErrorInfo | None = None
            if "oversize" in fields:
                size = inbox_text(fields["oversize"])
                error = ErrorInfo(
                    code=BadMessage.code,
                    message=f"inbox entry of {size} bytes is over MAX_JOB_BYTES "
                    f"({MAX_JOB_BYTES}); its first {_EXCERPT} bytes are kept",
                )
            elif raw is None:
                error = ErrorInfo(code=BadMessage.code, message="inbox entry has no `job` field")
            else:
                try:
                    job = decode_job(raw)
                except BadMessage as exc:
                    error = ErrorInfo(code=exc.code, message=exc.message)
                else:
                    if given is not None and given != job.id:
                        error = ErrorInfo(
                            code=BadMessage.code,
                            message=f"job message rejected: body id {job.id!r} differs "
                            f"from the entry's id {given!r}",
                        )
            if error is None:
                # Re-encoded: a body without an id got one here, and it must stay put.
                args += [eid, "job", *self._submit_args(job)]
                continue
            job_id = given or new_job_id()
            if not 1 <= len(job_id) <= _MAX_ID:
                # A job id is at most 128 characters; a producer's 1 MB "id" is not one.
                error = ErrorInfo(
                    code=error.code,
                    message=f"{error.message} (the entry's id, {job_id[:32]!r}..., is over "
                    f"{_MAX_ID} characters: this id replaces it)",
                )
                job_id = new_job_id()
            body = bytes(raw or b"")[:MAX_JOB_BYTES]
            result, letter = self._dead_records(None, job_id, error, raw=body, worker=worker_id)
            args += [eid, "bad", job_id, body, result, letter, "", "", "", ""]
            bad.append((job_id, error))
        await self._script("admit_inbox", *args)
        for job_id, error in bad:
            _log.error("job.bad_message", job_id=job_id, executor=None, **error_fields(error))
        if bad:
            self._wake_results()

    async def heartbeat(self, lease: Lease, *, visibility_s: float | None = None) -> HeartbeatReply:
        window = lease.visibility_s if visibility_s is None else visibility_s
        reply = await self._script("heartbeat", lease.job.id, lease.token, repr(float(window)))
        if reply is None:
            return HeartbeatReply(ok=False)
        until, cancel = reply
        return HeartbeatReply(
            ok=True, cancel_requested=as_str(cancel) == "1", lease_until=float(until)
        )

    async def mark_started(self, lease: Lease) -> bool:
        return (await self.mark_started_many([lease]))[0]

    async def mark_started_many(self, leases: Sequence[Lease]) -> list[bool]:
        if not leases:
            await anyio.lowlevel.checkpoint()
            return []
        oks: list[bool] = []
        for start in range(0, len(leases), BATCH):
            args = [a for le in leases[start : start + BATCH] for a in (le.job.id, le.token)]
            oks += [bool(x) for x in await self._script("mark_started", *args)]
        return oks

    async def ack(self, lease: Lease, result: Result) -> bool:
        return (await self.ack_many([(lease, result)]))[0]

    async def ack_many(self, items: Sequence[tuple[Lease, Result]]) -> list[bool]:
        oks: list[bool] = [False] * len(items)
        called = False
        for start in range(0, len(items), BATCH):
            args: list[str | bytes] = []
            tokens: list[str] = []
            where: list[int] = []
            for i, (lease, result) in enumerate(items[start : start + BATCH], start):
                if result.job_id != lease.job.id:
                    continue
                args += [lease.job.id, lease.token, encode(result), result.status]
                tokens.append(lease.token)
                where.append(i)
            if not where:
                continue
            replies = await self._settle("ack", tokens, *args)
            called = True
            for i, ok in zip(where, replies, strict=True):
                oks[i] = bool(ok)
        if any(oks):
            self._wake_results()
        if not called:
            await anyio.lowlevel.checkpoint()  # every async call yields once
        return oks

    async def retry(self, lease: Lease, *, error: ErrorInfo, delay_s: float) -> RetryOutcome:
        result, letter = self._dead_records(lease, lease.job.id, error)
        outcome = as_str(
            await self._settle(
                "retry",
                [lease.token],
                lease.job.id,
                lease.token,
                repr(max(0.0, float(delay_s))),
                result,
                letter,
            )
        )
        if outcome == "dead":
            self._wake_results()
        elif outcome == "scheduled" and delay_s <= 0:
            self._wake_workers()
        assert outcome in ("scheduled", "dead", "lost"), outcome
        return outcome  # type: ignore[return-value]

    async def dead_letter(self, lease: Lease, *, error: ErrorInfo) -> bool:
        result, letter = self._dead_records(lease, lease.job.id, error)
        ok = bool(
            await self._settle(
                "dead_letter", [lease.token], lease.job.id, lease.token, result, letter
            )
        )
        self._wake_results()
        return ok

    async def release(self, lease: Lease) -> bool:
        ok = bool(await self._settle("release", [lease.token], lease.job.id, lease.token))
        self._wake_workers()
        return ok

    # --- control and inspection -------------------------------------------------------
