"""Serving checkpoint jobs (``executor = "metnos:checkpoint"``, see
`metnos_exec.undo.checkpoints` and `metnos_exec.undo.restore`): no sandbox, no executor.

``create`` writes the device's sealed mark; ``list`` and ``diff`` read (``diff`` plans
the restore, writes nothing); ``restore`` lists the entries sealed after the mark, keeps
those that stand (their job's stored result lists them), takes the folders' locks, lists
again (a commit settled meanwhile is seen), then checks and applies the composed undo
and settles it like an undo job (`UndoJobs._store_undo`): its redo entry is recorded,
the entries it undid are marked, its result acked.
"""

from __future__ import annotations

import functools
from typing import Any

import anyio
import anyio.to_thread

from ..brokers.base import Lease
from ..errors import BadArguments, HostFault, MetnosError
from ..logs import get_logger
from ..messages import CHECKPOINT_EXECUTOR, ErrorInfo, UndoEntry
from ..undo.checkpoints import ACTIONS, CheckpointBook, CheckpointMark, roots_of
from ..undo.folder_lock import FolderLock
from ..undo.journal import Blocked
from ..undo.restore import apply_restore, describe, plan_restore
from .state import _Running
from .undo_jobs import UndoJobs

__all__ = ("CheckpointJobs",)

_log = get_logger()
#: Paths and conflicts listed in a result or a log record at most.
_LISTED = 200


class CheckpointJobs(UndoJobs):
    """The supervisor's layer that serves checkpoint jobs (see the module docstring)."""

    async def _serve_checkpoint(self, running: _Running) -> None:
        lease = running.lease
        job = lease.job
        _log.info("job.received", max_attempts=job.max_attempts, timeout_s=job.timeout_s)
        action, name = job.args.get("action"), job.args.get("name")
        if (
            action not in ACTIONS
            or not set(job.args) <= {"action", "name"}
            or (action != "list" and not isinstance(name, str))
        ):
            await self._reject(
                lease,
                BadArguments(
                    f"{CHECKPOINT_EXECUTOR} takes action ({', '.join(ACTIONS)}) and name "
                    "(but for list)"
                ),
            )
            return
        if self._owes_recovery(lease) and not await self._recover_for(lease):
            await self._release(lease, "the store failed while a commit was recovered")
            return
        book = CheckpointBook(self.staging.store.root)
        started_at = self.clock()
        try:
            if action == "restore":
                await self._restore(lease, book, str(name), started_at)
                return
            output = await self._read_or_mark(lease, book, str(action), name)
        except MetnosError as exc:
            if action == "restore":
                _log.warning("checkpoint.refused", name=name, code=exc.code, message=exc.message)
            await self._reject(lease, exc)
            return
        except (HostFault, OSError) as exc:
            await self._retry(lease, ErrorInfo(code=HostFault.code, message=f"checkpoint: {exc}"))
            return
        await self._ack(
            lease, self._result(lease, "succeeded", output=output, started_at=started_at)
        )

    async def _read_or_mark(
        self, lease: Lease, book: CheckpointBook, action: str, name: object
    ) -> dict[str, Any]:
        """``create``, ``list``, ``diff``: the result's output."""
        if action == "create":
            mark = await anyio.to_thread.run_sync(
                functools.partial(book.create, str(name), device=self.device, job_id=lease.job.id)
            )
            _log.info("checkpoint.created", name=mark.name, boundary=mark.boundary)
            return {"checkpoint": _shown(mark)}
        if action == "list":
            marks = await anyio.to_thread.run_sync(
                functools.partial(book.listed, device=self.device)
            )
            return {"device": self.device, "checkpoints": [_shown(m) for m in marks]}
        mark = book.get(str(name), device=self.device)
        entries = await self._standing(book, mark)
        composed, conflicts = await anyio.to_thread.run_sync(
            functools.partial(plan_restore, entries, name=mark.name)
        )
        return {
            "checkpoint": _shown(mark),
            "jobs": list(dict.fromkeys(e.job_id for e in entries)),
            "changes": [describe(op) for op in composed.ops[:_LISTED]],
            "change_count": len(composed.ops),
            "conflicts": [
                {"path": c.path, "why": c.reason, "job": job} for c, job in conflicts[:_LISTED]
            ],
        }

    async def _standing(self, book: CheckpointBook, mark: CheckpointMark) -> list[UndoEntry]:
        """The entries sealed after `mark` whose job's stored result lists them."""
        entries = await anyio.to_thread.run_sync(book.entries_after, mark)
        listed: dict[str, tuple[str, ...]] = {}
        for job_id in dict.fromkeys(e.job_id for e in entries):
            result = await self.broker.get_result(job_id)
            ok = result is not None and result.status == "succeeded"
            listed[job_id] = result.undo_ids if ok and result is not None else ()
        return [e for e in entries if e.id in listed[e.job_id]]

    async def _restore(
        self, lease: Lease, book: CheckpointBook, name: str, started_at: float
    ) -> None:
        """Restore checkpoint `name` (see the module docstring)."""
        mark = book.get(name, device=self.device)
        staging = self.staging
        held: FolderLock | None = None
        try:
            async with staging.commit_lock:
                for _ in range(5):
                    entries = await self._standing(book, mark)
                    roots = roots_of(entries)
                    held = await anyio.to_thread.run_sync(FolderLock, roots)
                    again = await self._standing(book, mark)
                    if roots_of(again) == roots or set(roots_of(again)) <= set(roots):
                        entries = again
                        break
                    held.release()
                    held = None
                if held is None:
                    raise OSError("the device's entries kept changing while the locks were taken")
                _log.info("job.started", checkpoint=name, entries=[e.id for e in entries])
                applied = await anyio.to_thread.run_sync(
                    functools.partial(
                        apply_restore,
                        entries,
                        name=name,
                        restore_job_id=lease.job.id,
                        device=self.device,
                        store=staging.store,
                        journal=staging.journal,
                        fsync=staging.fsync,
                    )
                )
        except MetnosError:
            if held is not None:
                held.release()
            raise
        except (HostFault, OSError, Blocked) as exc:
            if held is not None:
                held.release()
            await self._retry(lease, ErrorInfo(code=HostFault.code, message=f"restore: {exc}"))
            return
        except BaseException:
            if held is not None:
                held.release()
            raise
        if applied is None:
            held.release()
            output = {"restored": name, "jobs": [], "entries": [], "paths": 0}
            await self._ack(lease, self._result(lease, "succeeded", output=output))
            _log.info("checkpoint.restored", name=name, jobs=[], entries=[], paths=0)
            return
        jobs = list(dict.fromkeys(e.job_id for e in reversed(entries)))
        with held, anyio.CancelScope(shield=True):
            stored = await self._store_undo(
                lease,
                name,
                applied.undone,
                applied,
                started_at,
                output={
                    "restored": name,
                    "jobs": jobs,
                    "entries": [e.id for e in entries],
                    "paths": len(applied.redo.paths()),
                },
            )
        if stored:
            paths = applied.redo.paths()
            _log.info(
                "checkpoint.restored",
                name=name,
                jobs=jobs,
                entries=[e.id for e in entries],
                paths=paths[:_LISTED],
                path_count=len(paths),
            )


def _shown(mark: CheckpointMark) -> dict[str, Any]:
    return {
        "name": mark.name,
        "device": mark.device,
        "created_at": mark.created_at,
        "job_id": mark.job_id,
        "boundary": mark.boundary,
    }
