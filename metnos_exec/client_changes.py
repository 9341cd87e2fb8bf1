"""What `client.Client` asks of the device's undo journal above one job: approving or
rejecting a gated job's kept changes (`metnos_exec.undo.gates`), and checkpoints
(`metnos_exec.undo.checkpoints`). Each is a job with a reserved executor, routed to the
device that holds the journal, like an undo; `ChangeControl` is the `Client`'s part that
submits them and turns their refusals into the errors they name.
"""

from __future__ import annotations

from typing import Any, Protocol

from .brokers import Broker
from .errors import (
    ApprovalUnavailable,
    BadArguments,
    CheckpointUnknown,
    CommitConflict,
    UndoConflict,
    UndoUnavailable,
)
from .messages import (
    APPROVE_EXECUTOR,
    CHECKPOINT_EXECUTOR,
    REJECT_EXECUTOR,
    SERVER_DEVICE,
    Result,
)
from .undo.checkpoints import checkpoint_job_args

__all__ = ("ChangeControl",)


class _Submitter(Protocol):
    _broker: Broker

    async def submit(
        self, executor: str, args: dict[str, Any] | None = None, **fields: Any
    ) -> str: ...

    async def checkpoint_job(
        self, action: str, name: str | None = None, *, device: str | None = None, **fields: Any
    ) -> Result: ...

    async def _answer(
        self, executor: str, job_id: str, wait: float | None, fields: dict[str, Any]
    ) -> Result: ...


class ChangeControl:
    """Approval answers and checkpoints (see the module docstring); mixed into `Client`."""

    async def checkpoint_job(
        self: _Submitter,
        action: str,
        name: str | None = None,
        *,
        device: str | None = None,
        **fields: Any,
    ) -> Result:
        """Run a checkpoint job on `device` (``None``: the server's workers) and wait for
        it (see `metnos_exec.undo.checkpoints`); ``wait=S`` bounds the wait.

        Raises:
            CheckpointUnknown: no checkpoint of that name there. UndoConflict: a restore
                met files changed outside the jobs (nothing changed; the message names
                the paths and jobs). UndoUnavailable: an altered mark or entry, or a
                missing original. BadArguments: a bad or taken name.
            TimeoutError: no result within ``wait``.
        """
        wait = fields.pop("wait", None)
        fields.setdefault("correlation_id", f"checkpoint:{action}:{name or ''}")
        args = checkpoint_job_args(action, name)
        job_id = await self.submit(CHECKPOINT_EXECUTOR, args, device=device, **fields)
        result = await self._broker.wait_result(job_id, timeout=wait)
        if result is None:
            raise TimeoutError(f"no result for checkpoint job {job_id} within {wait} s")
        error = result.error
        if result.status == "rejected" and error is not None:
            for cls in (UndoConflict, UndoUnavailable, CheckpointUnknown, BadArguments):
                if error.code == cls.code:
                    raise cls(error.message)
        return result

    async def checkpoint(self: _Submitter, name: str, **fields: Any) -> Result:
        """Mark the device's undo journal as checkpoint `name` (``device=``, ``wait=``)."""
        return await self.checkpoint_job("create", name, **fields)

    async def checkpoints(self: _Submitter, **fields: Any) -> list[dict[str, Any]]:
        """The device's checkpoints, oldest first (``device=``, ``wait=``)."""
        output = (await self.checkpoint_job("list", **fields)).output
        return list(output.get("checkpoints", [])) if isinstance(output, dict) else []

    async def checkpoint_diff(self: _Submitter, name: str, **fields: Any) -> Result:
        """What restoring `name` would change (``output``: changes, conflicts); no write."""
        return await self.checkpoint_job("diff", name, **fields)

    async def restore_checkpoint(self: _Submitter, name: str, **fields: Any) -> Result:
        """Undo every job of the device since checkpoint `name`, all or nothing; the
        restore is itself undoable (``undo(<its job id>)``)."""
        return await self.checkpoint_job("restore", name, **fields)

    async def approve(
        self: _Submitter, job_id: str, *, wait: float | None = None, **fields: Any
    ) -> Result:
        """Commit the changes a gated job (``commit="approve"``) keeps, and wait; the gated
        job's final result (``succeeded``, with its ``undo_ids``). The answer is a job
        (``metnos:approve``) routed to the device that ran it, like an undo.

        Raises:
            CommitConflict: a file it changes was changed on the host since it ran; nothing
                was applied (the message names the paths); it still awaits an answer.
            ApprovalUnavailable: it is not awaiting approval, or its changes are not kept.
            TimeoutError: no answer within `wait`.
        """
        return await self._answer(APPROVE_EXECUTOR, job_id, wait, fields)

    async def reject(
        self: _Submitter, job_id: str, *, wait: float | None = None, **fields: Any
    ) -> Result:
        """Discard a gated job's kept changes, and wait; its final result (``rejected``,
        ``E_APPROVAL_REJECTED``). Raises as `approve`."""
        return await self._answer(REJECT_EXECUTOR, job_id, wait, fields)

    async def _answer(
        self: _Submitter, executor: str, job_id: str, wait: float | None, fields: dict[str, Any]
    ) -> Result:
        waiting = await self._broker.get_result(job_id)
        if waiting is None or waiting.status != "awaiting_approval":
            what = "no result yet" if waiting is None else f"status {waiting.status}"
            raise ApprovalUnavailable(f"job {job_id} is not awaiting approval ({what})")
        device = None if waiting.device == SERVER_DEVICE else waiting.device
        fields.setdefault("correlation_id", f"{executor.partition(':')[2]}:{job_id}")
        answer_id = await self.submit(executor, {"job_id": job_id}, device=device, **fields)
        answer = await self._broker.wait_result(answer_id, timeout=wait)
        if answer is None:
            raise TimeoutError(f"no answer from job {answer_id} within {wait} s")
        error = answer.error
        if answer.status != "succeeded":
            if error is not None and error.code == CommitConflict.code:
                raise CommitConflict(error.message)
            raise ApprovalUnavailable(
                error.message if error is not None else f"job {answer_id} {answer.status}"
            )
        final = await self._broker.get_result(job_id)
        assert final is not None
        return final
