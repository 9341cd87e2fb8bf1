"""Approval gates on the worker (`metnos_exec.undo.gates`): keeping a gated job's changes,
serving the answers (``executor = "metnos:approve"`` / ``"metnos:reject"``: no sandbox, no
executor, routed to the device that ran the job, like an undo), and expiring the gates
nobody answered.

A gated job (``Job.commit = "approve"``, ``Job.branch_of``, or its manifest's ``commit =
"approve"``) must be staged: one whose writes would go straight into the real folders (a
backup run) is refused before it runs (``E_APPROVAL_UNAVAILABLE``, with the reason). On
success its plan is kept (`keep_gate`), then its ``awaiting_approval`` result acked; its
sandbox and slot are already gone. An approval commits the kept plan through the journal
(`GateCommit`), records the undo entry under its own lease, moves the gated job's result to
``succeeded`` (`Broker.settle_gate`: the first answer wins), then settles the journal: a
crash anywhere in between is settled by `Staging.recover` exactly as a commit's. Approving
one job of a branch group (``branch_of``) rejects the others kept here.
"""

from __future__ import annotations

import functools

import anyio
import anyio.to_thread
import msgspec

from ..brokers.base import Lease
from ..errors import (
    ApprovalUnavailable,
    BadArguments,
    CommitConflict,
    HostFault,
)
from ..logs import get_logger
from ..messages import APPROVE_EXECUTOR, ErrorInfo, Job, Result
from ..undo.blobs import BlobMissing
from ..undo.gates import GateCommit, GateRecord, GateStore, keep_gate
from ..undo.journal import Blocked
from ..undo.overlay_run import OverlayRun
from ..undo.staging import Reversible
from .commits import _PATHS_LOGGED, _log_recorded
from .state import _Running
from .undo_jobs import UndoJobs

__all__ = ("GateJobs",)

_log = get_logger()


class GateJobs(UndoJobs):
    """The supervisor's layer of approval gates (see the module docstring)."""

    _gates: GateStore | None = None

    @property
    def gates(self) -> GateStore:
        """The gates kept in the staging's state folder."""
        if self._gates is None:
            self._gates = GateStore(self.staging.state_dir, fsync=self.staging.fsync)
        return self._gates

    def _gated(self, job: Job) -> bool:
        """Whether `job`'s changes wait for an approval."""
        if job.commit == "approve" or job.branch_of is not None:
            return True
        if job.executor not in self.registry:
            return False
        return self.registry[job.executor].manifest.commit == "approve"

    async def _refuse_ungated(self, lease: Lease, reversible: Reversible) -> bool:
        """Refuse a gated job whose writes cannot be staged (before it runs). ``True``:
        refused (the caller stops)."""
        if reversible.method == "staged" or not self._gated(lease.job):
            return False
        with anyio.CancelScope(shield=True):
            await reversible.discard()
        await self._reject(
            lease,
            ApprovalUnavailable(
                f"the job asks for approval, but its writes cannot be staged here "
                f"({reversible.no_staging or 'no overlay staging'}): nothing ran. An approval "
                "gate needs overlay staging (bubblewrap with the staging namespace)"
            ),
        )
        return True

    async def _keep_for_approval(
        self, lease: Lease, result: Result, reversible: Reversible
    ) -> None:
        """Keep a succeeded gated job's plan, then ack its ``awaiting_approval`` result."""
        job = lease.job
        with anyio.CancelScope(shield=True), self.observer.phase("commit", job):
            try:
                reply = await self.broker.heartbeat(lease)
            except Exception:
                reply = None
            if reply is not None and not reply.ok:
                self._count_lost()
                _log.warning("lease.lost", visibility_s=self.visibility_s, during="approval")
                return
            assert isinstance(reversible, OverlayRun)
            keep = functools.partial(
                keep_gate,
                reversible,
                self.gates,
                queue=self.broker.queue_id,
                group=job.branch_of or job.id,
                ttl_s=self.approval_ttl_s,
                now=self.clock(),
            )
            try:
                record = await anyio.to_thread.run_sync(keep)
            except CommitConflict as exc:
                error = ErrorInfo(code=exc.code, message=exc.message)
                await self._ack(
                    lease, msgspec.structs.replace(result, status="failed", error=error)
                )
                return
            except (HostFault, OSError) as exc:
                text = exc.message if isinstance(exc, HostFault) else str(exc)
                await self._retry(
                    lease, ErrorInfo(code=HostFault.code, message=f"gate not kept: {text}")
                )
                return
            waiting = msgspec.structs.replace(
                result, status="awaiting_approval", changes=record.changes
            )
            stored = await self._ack(lease, waiting)
            if not stored:
                await anyio.to_thread.run_sync(self.gates.remove, job.id)
                return
            paths = [e.path for e in record.changes.entries]
            _log.info(
                "approval.waiting",
                paths=paths[:_PATHS_LOGGED],
                path_count=record.changes.total,
                expires_at=record.expires_at,
                group=record.group,
            )

    # --- the answers ----------------------------------------------------------------

    async def _serve_answer(self, running: _Running) -> None:
        """Serve an approve or reject job (see the module docstring)."""
        lease = running.lease
        job = lease.job
        approve = job.executor == APPROVE_EXECUTOR
        _log.info("job.received", max_attempts=job.max_attempts, timeout_s=job.timeout_s)
        target = job.args.get("job_id")
        if not isinstance(target, str) or not target or set(job.args) != {"job_id"}:
            await self._reject(
                lease, BadArguments(f"{job.executor} takes one argument, job_id (a job id)")
            )
            return
        if self._owes_recovery(lease) and not await self._recover_for(lease):
            await self._release(lease, "the store failed while a commit was recovered")
            return
        stored = await self.broker.get_result(target)
        if stored is None or stored.status != "awaiting_approval":
            await self._not_awaiting(lease, target, stored, approve=approve)
            return
        record = await anyio.to_thread.run_sync(self.gates.load, target)
        if record is None:
            await self._reject(
                lease,
                ApprovalUnavailable(
                    f"job {target} awaits approval, but its staged changes are not kept by "
                    f"this worker (state folder {self.staging.state_dir}): answer it from "
                    "the worker that ran it (same device and state folder); nothing changed"
                ),
            )
            return
        if record.expires_at <= self.clock():
            await self._discard_gate(record, stored, code="E_APPROVAL_EXPIRED", event="expired")
            await self._reject(
                lease,
                ApprovalUnavailable(
                    f"job {target}'s approval gate expired unanswered; its changes were discarded"
                ),
            )
            return
        _log.info("job.started", answer_to=target, approve=approve)
        if not approve:
            await self._discard_gate(
                record, stored, code="E_APPROVAL_REJECTED", event="rejected", by=job.id
            )
            await self._ack(lease, self._result(lease, "succeeded", output={"rejected": target}))
            return
        await self._approve(lease, record, stored)

    async def _not_awaiting(
        self, lease: Lease, target: str, stored: Result | None, *, approve: bool
    ) -> None:
        """Answer a job whose target is not awaiting approval (a redelivered approval whose
        first delivery got as far as the final result is done already)."""
        if stored is not None:
            await anyio.to_thread.run_sync(self.gates.remove, target)  # a leftover
        if (
            approve
            and lease.attempt > 1
            and stored is not None
            and stored.status == "succeeded"
            and stored.undo_ids
        ):
            output = {"approved": target, "undo_ids": list(stored.undo_ids)}
            await self._ack(lease, self._result(lease, "succeeded", output=output))
            return
        what = "unknown, or not finished" if stored is None else f"its status is {stored.status}"
        await self._reject(
            lease,
            ApprovalUnavailable(f"job {target} is not awaiting approval ({what}); nothing changed"),
        )

    async def _approve(self, lease: Lease, record: GateRecord, stored: Result) -> None:
        staging = self.staging
        try:
            async with staging.commit_lock:
                applied = await anyio.to_thread.run_sync(
                    GateCommit.apply, staging, self.gates, record
                )
        except CommitConflict as exc:
            _log.warning("job.rejected", code=exc.code, message=exc.message)
            error = ErrorInfo(code=exc.code, message=exc.message)
            await self._ack(lease, self._result(lease, "failed", error=error))
            return
        except (HostFault, OSError, Blocked, BlobMissing) as exc:
            await self._retry(
                lease, ErrorInfo(code=HostFault.code, message=f"approval failed: {exc}")
            )
            return
        with anyio.CancelScope(shield=True):
            await self._settle_approval(lease, record, stored, applied)

    async def _settle_approval(
        self, lease: Lease, record: GateRecord, stored: Result, applied: GateCommit
    ) -> None:
        """Record the entry, move the gated job's result to ``succeeded``, settle."""
        target, entry = record.job_id, applied.entry
        recorded = await self._settle(
            "record_undo", lease, lambda: self.broker.record_undo(lease, [entry])
        )
        if not recorded:
            await anyio.to_thread.run_sync(functools.partial(applied.settle, stored=False))
            return
        final = msgspec.structs.replace(
            stored,
            status="succeeded",
            undo_ids=(entry.id,),
            changes=msgspec.structs.replace(record.changes, committed=True),
            finished_at=self.clock(),
        )
        try:
            settled = await self._settle(
                "settle_gate", lease, lambda: self.broker.settle_gate(target, final)
            )
        except BaseException:
            await anyio.to_thread.run_sync(applied.abandon)
            raise
        if settled is None:  # given up: whether it was stored is for the journal to find
            await anyio.to_thread.run_sync(applied.abandon)
            return
        await anyio.to_thread.run_sync(functools.partial(applied.settle, stored=settled))
        if not settled:
            await self._reject(
                lease,
                ApprovalUnavailable(f"job {target} was answered meanwhile; nothing changed"),
            )
            return
        await anyio.to_thread.run_sync(self.gates.remove, target)
        paths = entry.paths()
        _log.info(
            "approval.granted",
            approved=target,
            entry_id=entry.id,
            paths=paths[:_PATHS_LOGGED],
            path_count=len(paths),
        )
        _log_recorded(entry)
        output = {"approved": target, "undo_ids": [entry.id], "paths": len(paths)}
        await self._ack(lease, self._result(lease, "succeeded", output=output))
        await self._discard_branches(record)

    async def _discard_branches(self, approved: GateRecord) -> None:
        """Reject the other candidates of `approved`'s branch group kept here."""
        for record in await anyio.to_thread.run_sync(self.gates.records):
            if record.group != approved.group or record.job_id == approved.job_id:
                continue
            stored = await self.broker.get_result(record.job_id)
            if stored is not None and stored.status == "awaiting_approval":
                await self._discard_gate(
                    record,
                    stored,
                    code="E_APPROVAL_REJECTED",
                    event="rejected",
                    by=approved.job_id,
                    branch=True,
                )

    async def _discard_gate(
        self,
        record: GateRecord,
        stored: Result,
        *,
        code: str,
        event: str,
        by: str = "",
        branch: bool = False,
    ) -> bool:
        """Discard a gate: its job's result becomes ``rejected`` (`code`), its kept
        changes go. ``False``: the result was final already (answered meanwhile)."""
        if code == "E_APPROVAL_EXPIRED":
            message = "nobody approved the job's changes in time; they were discarded"
        elif branch:
            message = f"another branch (job {by}) was approved; nothing was committed"
        else:
            message = f"rejected (by job {by}); nothing was committed"
        final = msgspec.structs.replace(
            stored,
            status="rejected",
            error=ErrorInfo(code=code, message=message),
            finished_at=self.clock(),
        )
        settled = await self.broker.settle_gate(record.job_id, final)
        await anyio.to_thread.run_sync(self.gates.remove, record.job_id)
        if settled:
            _log.info(
                f"approval.{event}",
                gated=record.job_id,
                reason="branch" if branch else event,
                by=by or None,
            )
        return settled

    # --- expiry ----------------------------------------------------------------------

    async def expire_gates(self) -> int:
        """Discard this worker's gates past their expiry (and leftovers of answered
        jobs); how many expired."""
        expired = 0
        now = self.clock()
        for record in await anyio.to_thread.run_sync(self.gates.records):
            if record.queue and record.queue != self.broker.queue_id:
                continue
            if record.device != self.device:
                continue
            stored = await self.broker.get_result(record.job_id)
            if stored is not None and stored.status != "awaiting_approval":
                await anyio.to_thread.run_sync(self.gates.remove, record.job_id)
                continue
            if record.expires_at > now:
                continue
            if stored is None:  # kept, its result never stored (the worker died)
                await anyio.to_thread.run_sync(self.gates.remove, record.job_id)
                continue
            if await self._discard_gate(record, stored, code="E_APPROVAL_EXPIRED", event="expired"):
                expired += 1
        return expired

    async def _gate_loop(self) -> None:
        while True:
            try:
                await self.expire_gates()
            except Exception as exc:
                self._broker_failed("expire_gates", exc)
            await anyio.sleep(self.approval_check_s)
