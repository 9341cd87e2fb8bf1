"""Serving undo jobs (``executor = "metnos.undo"``, see `metnos_exec.undo.apply`): no
sandbox and no executor. The entries that undo the target job are applied under the
folders' locks, the redo entry is recorded, then the result is acked; a store that fails
is tried again with backoff, as for any settlement.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.to_thread

from ..brokers.base import Lease
from ..errors import BadArguments, HostFault, MetnosError, UndoUnavailable
from ..logs import get_logger
from ..messages import UNDO_EXECUTOR, ErrorInfo, UndoEntry
from ..undo.apply import AppliedUndo, apply_undo, entries_to_undo
from ..undo.folder_lock import FolderLock
from ..undo.journal import Blocked
from ..undo.staging import Staging
from .commits import _PATHS_LOGGED, Commits, _log_recorded
from .state import _Running

__all__ = ("UndoJobs",)


_log = get_logger()


class UndoJobs(Commits):
    """The supervisor's layer that serves undo jobs (see the module docstring)."""

    async def _serve_undo(self, running: _Running) -> None:
        """Run an undo job (see `metnos_exec.undo.apply`): no sandbox, no executor."""
        lease = running.lease
        job = lease.job
        _log.info("job.received", max_attempts=job.max_attempts, timeout_s=job.timeout_s)
        target = job.args.get("job_id")
        if not isinstance(target, str) or not target or set(job.args) != {"job_id"}:
            await self._reject(
                lease, BadArguments(f"{UNDO_EXECUTOR} takes one argument, job_id (a job id)")
            )
            return
        staging = self.staging
        # Its last worker may have died mid-undo.
        if self._owes_recovery(lease) and not await self._recover_for(lease):
            await self._release(lease, "the store failed while a commit was recovered")
            return
        try:
            entries = await entries_to_undo(self.broker, target, device=self.device)
        except UndoUnavailable as exc:
            await self._reject(lease, exc)
            return
        _log.info("job.started", undo_of=target, entries=[e.id for e in entries])
        started_at = self.clock()
        done = await self._apply_undo(lease, staging, target, entries)
        if done is not None:
            held, applied = done
            with held, anyio.CancelScope(shield=True):
                await self._store_undo(lease, target, entries, applied, started_at)

    async def _apply_undo(
        self, lease: Lease, staging: Staging, target: str, entries: Sequence[UndoEntry]
    ) -> tuple[FolderLock, AppliedUndo] | None:
        """Apply `entries` under their folders' locks; ``None``: refused or retried (the
        locks released). Else the locks, still held until the undo is settled."""
        job = lease.job
        # An undo is a committer of its folders like a commit: from its first check to its
        # settlement no other commit, undo or roll-back of them runs (`folder_lock`).
        held: FolderLock | None = None
        try:
            async with staging.commit_lock:
                roots = tuple(dict.fromkeys(root for e in entries for root in e.roots))
                held = await anyio.to_thread.run_sync(FolderLock, roots)
                applied = await anyio.to_thread.run_sync(
                    functools.partial(
                        apply_undo,
                        entries,
                        job_id=target,
                        undo_job_id=job.id,
                        device=self.device,
                        store=staging.store,
                        journal=staging.journal,
                        fsync=staging.fsync,
                    )
                )
        except MetnosError as exc:  # UndoConflict: nothing changed
            if held is not None:
                held.release()
            await self._reject(lease, exc)
            return None
        except (HostFault, OSError, Blocked) as exc:
            if held is not None:
                held.release()
            await self._retry(lease, ErrorInfo(code=HostFault.code, message=f"undo failed: {exc}"))
            return None
        except BaseException:
            if held is not None:
                held.release()
            raise
        assert held is not None
        return held, applied

    async def _store_undo(
        self,
        lease: Lease,
        target: str,
        entries: Sequence[UndoEntry],
        applied: AppliedUndo,
        started_at: float,
        *,
        output: dict[str, Any] | None = None,
    ) -> bool:
        """Record the applied undo's redo entry, ack its result, settle it on the host
        (`output`: the result's, a checkpoint restore's); whether it was stored."""
        recorded = await self._settle(
            "record_undo",
            lease,
            lambda: self.broker.record_undo(lease, [applied.redo], undoes=[e.id for e in entries]),
        )
        if not recorded:
            await anyio.to_thread.run_sync(functools.partial(applied.settle, stored=False))
            if recorded is False:
                self._count_lost()
                _log.warning("lease.lost", visibility_s=self.visibility_s, during="undo")
            return False
        paths = applied.redo.paths()
        result = self._result(
            lease,
            "succeeded",
            output=output
            or {
                "undone": target,
                "entries": [e.id for e in entries],
                "paths": len(paths),
            },
            undo_ids=(applied.redo.id,),
            started_at=started_at,
        )
        try:
            stored = await self._ack(lease, result)
        except BaseException:
            applied.handle.close(remove=False)  # recover() decides, see _commit
            applied.tree.close()
            raise
        left = await anyio.to_thread.run_sync(functools.partial(applied.settle, stored=stored))
        if stored:
            if output is None:
                _log.info(
                    "undo.applied",
                    undone=target,
                    entries=[e.id for e in entries],
                    paths=paths[:_PATHS_LOGGED],
                    path_count=len(paths),
                )
            _log_recorded(applied.redo)
        elif left:
            _log.warning(
                "undo.conflict",
                reason="roll-back left paths",
                paths=[str(c) for c in left[:20]],
            )
        return stored
