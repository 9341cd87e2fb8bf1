"""The Python API the agent loop uses: submit, await a result, run, cancel, undo.

Async (anyio: asyncio or trio)::

    async with Client("sqlite:///./metnos.db") as client:
        result = await client.run("read_note", {"path": "~/notes/today.md"}, timeout=30)
        if result.status == "succeeded":
            print(result.output)

Every failure is a `MetnosError` with a code: the queue's store failing is a `BrokerError`
(``E_BROKER_UNAVAILABLE``, ``E_BROKER_BUSY``, ``E_BROKER_FULL``, ``E_BROKER_READONLY``,
...), never a database library's own exception; a bad job is `BadMessage`. The one
exception that is not is `TimeoutError` from `Client.run`: no result yet is not an error
of the queue.

A model's tool call (OpenAI or Anthropic, as the SDK gives it) in, the message to send
back out (`run_tool_call`; the definitions to offer come from `metnos_exec.tools`)::

    reply = await client.run_tool_call(response.choices[0].message.tool_calls[0])

While a job runs, its executor may report progress (README, "Reporting progress"): read
the latest with `Client.progress`, or follow it while waiting::

    result = await client.run("slow_count", {"n": 5}, on_progress=print)

Synchronous, for scripts and notebooks (runs an event loop in a helper thread)::

    with SyncClient("sqlite:///./metnos.db") as client:
        job_id = client.submit("write_note", {"path": "~/notes/x.md", "text": "hi"})
        print(client.result(job_id, wait=10))
"""

from __future__ import annotations

import difflib
import inspect
import os
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, ExitStack
from types import TracebackType
from typing import Any, Final, TypeVar

import anyio
import msgspec
from anyio.from_thread import BlockingPortal, start_blocking_portal

from .brokers import Broker, CancelOutcome, open_broker
from .client_changes import ChangeControl
from .devices.catalog import device_refusal
from .errors import (
    BadMessage,
    BrokerError,
    MetnosError,
    ServerPinned,
    UndoConflict,
    UndoUnavailable,
    UnknownExecutor,
)
from .messages import (
    APPROVE_EXECUTOR,
    CHECKPOINT_EXECUTOR,
    REJECT_EXECUTOR,
    SERVER_DEVICE,
    UNDO_EXECUTOR,
    Job,
    Progress,
    Result,
)
from .observe import submit_context
from .observe.metrics import submitted as count_submitted
from .toolcall import error_result, parse_tool_call, tool_result
from .toolspec import executor_for_tool
from .undo.apply import undo_job_args

__all__ = (
    "DEFAULT_BROKER_URL",
    "PROGRESS_POLL_S",
    "Client",
    "ProgressCallback",
    "NotImplementedYet",
    "SyncClient",
    "default_broker_url",
)

#: How often a wait with ``on_progress`` reads the job's progress (workers store it at
#: most once a second).
PROGRESS_POLL_S: Final = 0.5

#: What ``on_progress`` may be: a plain function or a coroutine function.
ProgressCallback = Callable[[Progress], Awaitable[None] | None]

#: Used when neither an argument nor ``METNOS_BROKER`` names a broker.
DEFAULT_BROKER_URL: Final = "sqlite:///./metnos.db"

T = TypeVar("T")


def default_broker_url() -> str:
    """``$METNOS_BROKER``, else `DEFAULT_BROKER_URL`."""
    return os.environ.get("METNOS_BROKER") or DEFAULT_BROKER_URL


class NotImplementedYet(MetnosError):
    """The operation is part of the interface but not built yet (it names the issue)."""

    code = "E_NOT_IMPLEMENTED"


class Client(ChangeControl):
    """Async client of the queue.

    Args:
        broker: a broker URL (``sqlite:///...``, ``memory://``, ``redis://...``), an open
            `Broker` (not closed by the client), or ``None`` for `default_broker_url`.

    Raises:
        BadBrokerURL: the URL names no broker this installation can open.
        BrokerError: the store cannot be opened (missing file for readers, read-only...).
    """

    def __init__(self, broker: str | Broker | None = None) -> None:
        if isinstance(broker, Broker):
            self._broker = broker
            self._owns = False
        else:
            self._broker = open_broker(broker or default_broker_url())
            self._owns = True
        #: Executor names seen in the published catalog (it only grows: a name in it
        #: needs no second look).
        self._known: set[str] = set()
        self._looked_at = -1e9  # monotonic time of the last look at an empty catalog

    @property
    def broker(self) -> Broker:
        return self._broker

    async def __aenter__(self) -> Client:
        if self._owns:
            # A broker may hold resources that live in the task that enters it (the
            # Redis client's connections): entered here, left in `aclose`.
            await self._broker.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the broker if this client opened it."""
        if self._owns:
            await self._broker.close()

    async def submit(self, executor: str, args: dict[str, Any] | None = None, **fields: Any) -> str:
        """Queue a job and return its id.

        Args:
            executor: the executor's name.
            args: its arguments.
            **fields: other `Job` fields: ``timeout_s``, ``autonomy``, ``device``,
                ``max_attempts``, ``idempotency_key``, ``correlation_id``, ``priority``,
                ``not_before``, ``id``, ``commit="approve"`` (an approval gate: see
                `approve`), ``branch_of=JOB`` (a candidate beside that gated job); and
                ``speculative=True``: the same as ``commit="approve"``.

        Returns:
            The job id; for a repeated idempotency key, the first submission's id.

        Raises:
            BadMessage: a field of the wrong type or range (the message names it), or a
                job over ``MAX_JOB_BYTES`` encoded or ``MAX_ARGS_DEPTH`` deep.
            IdempotencyConflict: the ``idempotency_key`` (or the ``id``) already names a
                job with another executor or other arguments (its id is
                ``original_job_id``).
            UnknownExecutor: the server workers have published their executors and none
                has this name (a typo, or a worker with that executor not started yet);
                nothing is queued. Before any worker published, every name is accepted
                (the job waits for a worker that serves it).
            ServerPinned: the job targets a device, and the executor as published by the
                server workers must stay on the server (not packable, or provider
                authority for these arguments); nothing is queued (see `catalog`).
            SubmitOutcomeUnknown: the submit was sent and its answer lost (a timeout, a
                dropped connection): the job may be queued. Its ``job_id`` is the job's
                id, which is its idempotency key: ``submit(..., id=exc.job_id)`` again
                queues nothing twice (and ``result(exc.job_id)`` says what happened).
            BrokerError: any other store failure; nothing was queued.
        """
        if fields.pop("speculative", False):
            fields["commit"] = "approve"
        job = _make_job(executor, args or {}, fields)
        await self._check_known(job)
        if job.device is not None and job.device != SERVER_DEVICE:
            info = await self._broker.executor_info(job.executor)
            why = None if info is None else device_refusal(info.manifest, job.args)
            if why is not None:
                raise ServerPinned(
                    f"{job.executor} may only run on a server worker, not on device "
                    f"{job.device!r}: {why}; submit it without --device"
                )
        with submit_context(job.executor, job.id) as trace:
            if trace is not None and job.trace is None:
                job = msgspec.structs.replace(job, trace=trace)
            receipt = await self._broker.submit(job)
        # The producer's `metnos_jobs_submitted_total` (a no-op without prometheus-client).
        count_submitted(job.executor)
        return receipt.job_id

    async def _check_known(self, job: Job) -> None:
        """Refuse a server job for an executor no server worker ever published: with
        executor routing it would wait for a worker that does not exist. (A device job is
        checked by its device: devices publish nothing.)"""
        on_server = job.device is None or job.device == SERVER_DEVICE
        if not on_server or job.executor in _RESERVED or job.executor in self._known:
            return
        if not self._known and time.monotonic() - self._looked_at < 1.0:
            return  # nothing published a moment ago: a producer ahead of its workers
        self._known = await self._broker.executor_names()
        self._looked_at = time.monotonic()
        if self._known and job.executor not in self._known:
            close = difflib.get_close_matches(job.executor, self._known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UnknownExecutor(
                f"no worker on this queue serves an executor named {job.executor!r}{hint}; "
                f"the executors published are: {', '.join(sorted(self._known)[:20])}. "
                "Start a worker whose --executors folder has it, then submit again"
            )

    async def result(
        self,
        job_id: str,
        *,
        wait: bool | float = False,
        on_progress: ProgressCallback | None = None,
    ) -> Result | None:
        """The job's result.

        Args:
            wait: ``False`` returns at once (``None`` while there is no result); ``True``
                waits as long as it takes; a number waits at most that many seconds.
            on_progress: while waiting, called with each new `Progress` the job's
                executor reported (read every `PROGRESS_POLL_S`); may be async.
        """
        if wait is False:
            return await self._broker.get_result(job_id)
        timeout = None if wait is True else float(wait)
        return await self._wait(job_id, timeout, on_progress)

    async def progress(self, job_id: str) -> Progress | None:
        """The latest progress the job's executor reported (``None``: none yet, or an
        unknown job). `Progress.attempt` says which delivery reported it."""
        return await self._broker.get_progress(job_id)

    async def _wait(
        self, job_id: str, wait_s: float | None, on_progress: ProgressCallback | None
    ) -> Result | None:
        """`Broker.wait_result` for at most `wait_s` (``None``: forever), reading the
        progress between short waits when asked."""
        if on_progress is None:
            return await self._broker.wait_result(job_id, timeout=wait_s)
        deadline = None if wait_s is None else anyio.current_time() + wait_s
        last: Progress | None = None
        while True:
            step = PROGRESS_POLL_S
            if deadline is not None:
                step = max(0.0, min(step, deadline - anyio.current_time()))
            # A wait that returns as soon as the result is stored: a short step costs
            # no latency, only a progress read per step.
            result = await self._broker.wait_result(job_id, timeout=step)
            if result is not None:
                return result
            if deadline is not None and anyio.current_time() >= deadline:
                return None
            progress = await self._broker.get_progress(job_id)
            if progress is not None and progress != last:
                last = progress
                called = on_progress(progress)
                if inspect.isawaitable(called):
                    await called

    async def run(
        self,
        executor: str,
        args: dict[str, Any] | None = None,
        *,
        # The job's budget (shipped as ``timeout_s``), not a deadline for this call.
        timeout: float | None = None,  # noqa: ASYNC109
        wait: float | None = None,
        on_progress: ProgressCallback | None = None,
        **fields: Any,
    ) -> Result:
        """Submit and await the result.

        Args:
            timeout: the job's wall-time budget (``timeout_s``); ``None``: the manifest's.
            wait: how long to wait for a result (default: the job's timeout plus time to
                be picked up, or forever when no timeout is given).
            on_progress: called with each new `Progress` while it runs (see `result`).

        Raises:
            TimeoutError: no result within `wait` (the job stays queued; cancel it if
                you no longer want it).
        """
        if timeout is not None:
            fields["timeout_s"] = timeout
        job_id = await self.submit(executor, args, **fields)
        if wait is None and timeout is not None:
            wait = timeout * 3 + 30
        result = await self._wait(job_id, wait, on_progress)
        if result is None:
            raise TimeoutError(f"no result for job {job_id} within {wait} s")
        return result

    async def run_tool_call(
        self,
        call: Any,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the job's budget, as in `run`)
        wait: float | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """Run a model's tool call and return the result in its provider's shape.

        Args:
            call: an OpenAI Chat ``tool_call``, a Responses ``function_call`` item or an
                Anthropic ``tool_use`` block, as a dict or as the SDK's object (see
                `metnos_exec.toolcall` for the shapes in and out).
            timeout, wait, **fields: as for `run`.

        Returns:
            ``{"role": "tool", ...}``, ``{"type": "function_call_output", ...}`` or
            ``{"type": "tool_result", ..., "is_error"}``: the executor's JSON output with
            a line on its containment and undo ids; for a job that did not succeed, or a
            call the queue refused (an unknown tool, arguments that are not a JSON
            object, a job the queue will not take), a text starting ``ERROR:`` that says
            what was refused and why (``is_error`` true for Anthropic). No result within
            `wait` is an error result too, naming the job (still queued or running).

        Raises:
            BadMessage: `call` is not a tool call of any of the three shapes.
            BrokerError: the queue's store failed (not the model's doing: the loop, not
                the model, has to handle it).
        """
        parsed = parse_tool_call(call)
        if parsed.problem is not None or parsed.args is None:
            return error_result(parsed, f"{parsed.name}: {parsed.problem}; nothing ran")
        executor = parsed.name
        if executor not in self._known:
            executor = executor_for_tool(parsed.name, await self._broker.executor_names()) or (
                parsed.name
            )
        try:
            result = await self.run(executor, parsed.args, timeout=timeout, wait=wait, **fields)
        except BrokerError:
            raise
        except MetnosError as exc:
            return error_result(parsed, f"the call was refused ({exc}); nothing ran")
        except TimeoutError as exc:
            return error_result(parsed, f"{exc}; it may still run, its result is not known")
        return tool_result(parsed, result)

    async def cancel(self, job_id: str) -> CancelOutcome:
        """Cancel a queued or running job; see `Broker.cancel` for the outcomes."""
        return await self._broker.cancel(job_id)

    async def submit_undo(self, job_id: str, **fields: Any) -> str:
        """Queue the undo of `job_id`'s file changes; return the undo job's id.

        The undo is a job (``executor = "metnos:undo"``) routed to the device that made the
        changes: it runs there and nowhere else. See `metnos_exec.undo.apply`.

        Args:
            **fields: other `Job` fields (``max_attempts``, ``correlation_id``, ...).

        Raises:
            UndoUnavailable: the job has no result yet, or recorded no file change.
        """
        result = await self._broker.get_result(job_id)
        if result is None:
            raise UndoUnavailable(f"job {job_id} has no result (unknown, or not finished yet)")
        if not result.undo_ids:
            raise UndoUnavailable(
                f"job {job_id} recorded no file changes (status {result.status}); nothing to undo"
            )
        device = None if result.device == SERVER_DEVICE else result.device
        fields.setdefault("correlation_id", f"undo:{job_id}")
        return await self.submit(UNDO_EXECUTOR, undo_job_args(job_id), device=device, **fields)

    async def undo(self, job_id: str, *, wait: float | None = None, **fields: Any) -> Result:
        """Undo the file changes `job_id` made, and wait for it (`submit_undo`, then the
        result). An undo can itself be undone: ``undo(<the undo job's id>)``.

        Args:
            wait: seconds to wait for the undo's result (default: as long as it takes).

        Returns:
            The undo job's result (``succeeded``; ``undo_ids`` holds the entry that redoes
            the job; or a ``failed``/``dead`` result when the undo itself broke).

        Raises:
            UndoConflict: files changed since the job; nothing was changed (the message
                names them).
            UndoUnavailable: nothing to undo (no result, no change recorded, purged,
                already undone, another device's).
            TimeoutError: no result within `wait` (the undo job stays queued).
        """
        undo_id = await self.submit_undo(job_id, **fields)
        result = await self._broker.wait_result(undo_id, timeout=wait)
        if result is None:
            raise TimeoutError(f"no result for undo job {undo_id} within {wait} s")
        error = result.error
        if result.status == "rejected" and error is not None:
            if error.code == UndoConflict.code:
                raise UndoConflict(error.message)
            if error.code == UndoUnavailable.code:
                raise UndoUnavailable(error.message)
        return result


_RESERVED: Final = (UNDO_EXECUTOR, CHECKPOINT_EXECUTOR, APPROVE_EXECUTOR, REJECT_EXECUTOR)


def _make_job(executor: str, args: dict[str, Any], fields: dict[str, Any]) -> Job:
    try:
        # Through the validating decoder, so constraints (max_attempts >= 1, ...) hold
        # for Python callers exactly as for producers on the wire.
        return msgspec.convert({"executor": executor, "args": args, **fields}, Job)
    except msgspec.ValidationError as exc:
        raise BadMessage(f"job rejected: {exc}") from None
    except Exception as exc:  # a value msgspec cannot take at all (nesting, a type, ...)
        raise BadMessage(f"job rejected: {type(exc).__name__}: {exc}") from None


class SyncClient(AbstractContextManager["SyncClient"]):
    """Blocking wrapper around `Client`, with the same methods.

    It runs an event loop in one helper thread (an anyio blocking portal) for its whole
    life: use it as a context manager, or call `close`.
    """

    def __init__(self, broker: str | None = None, *, backend: str = "asyncio") -> None:
        self._stack = ExitStack()
        self._closed = False
        self._portal: BlockingPortal = self._stack.enter_context(
            start_blocking_portal(backend=backend)
        )
        try:
            self._client = self._portal.call(Client, broker)
            # Entered in one task of the portal that lives until `close`: the Redis
            # client's connections belong to the task that opens them.
            self._stack.enter_context(self._portal.wrap_async_context_manager(self._client))
        except BaseException:
            self._stack.close()
            raise

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._portal.call(lambda: fn(*args, **kwargs))

    def submit(self, executor: str, args: dict[str, Any] | None = None, **fields: Any) -> str:
        """See `Client.submit`."""
        out: str = self._call(self._client.submit, executor, args, **fields)
        return out

    def result(
        self,
        job_id: str,
        *,
        wait: bool | float = False,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> Result | None:
        """See `Client.result` (`on_progress` is called on the client's helper thread)."""
        out: Result | None = self._call(
            self._client.result, job_id, wait=wait, on_progress=on_progress
        )
        return out

    def progress(self, job_id: str) -> Progress | None:
        """See `Client.progress`."""
        out: Progress | None = self._call(self._client.progress, job_id)
        return out

    def run(
        self,
        executor: str,
        args: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
        wait: float | None = None,
        on_progress: Callable[[Progress], None] | None = None,
        **fields: Any,
    ) -> Result:
        """See `Client.run` (`on_progress` is called on the client's helper thread)."""
        out: Result = self._call(
            self._client.run,
            executor,
            args,
            timeout=timeout,
            wait=wait,
            on_progress=on_progress,
            **fields,
        )
        return out

    def run_tool_call(
        self, call: Any, *, timeout: float | None = None, wait: float | None = None, **fields: Any
    ) -> dict[str, Any]:
        """See `Client.run_tool_call`."""
        out: dict[str, Any] = self._call(
            self._client.run_tool_call, call, timeout=timeout, wait=wait, **fields
        )
        return out

    def cancel(self, job_id: str) -> CancelOutcome:
        """See `Client.cancel`."""
        out: CancelOutcome = self._call(self._client.cancel, job_id)
        return out

    def submit_undo(self, job_id: str, **fields: Any) -> str:
        """See `Client.submit_undo`."""
        out: str = self._call(self._client.submit_undo, job_id, **fields)
        return out

    def undo(self, job_id: str, *, wait: float | None = None, **fields: Any) -> Result:
        """See `Client.undo`."""
        out: Result = self._call(self._client.undo, job_id, wait=wait, **fields)
        return out

    def checkpoint(self, name: str, **fields: Any) -> Result:
        """See `Client.checkpoint`."""
        out: Result = self._call(self._client.checkpoint, name, **fields)
        return out

    def checkpoints(self, **fields: Any) -> list[dict[str, Any]]:
        """See `Client.checkpoints`."""
        out: list[dict[str, Any]] = self._call(self._client.checkpoints, **fields)
        return out

    def checkpoint_diff(self, name: str, **fields: Any) -> Result:
        """See `Client.checkpoint_diff`."""
        out: Result = self._call(self._client.checkpoint_diff, name, **fields)
        return out

    def restore_checkpoint(self, name: str, **fields: Any) -> Result:
        """See `Client.restore_checkpoint`."""
        out: Result = self._call(self._client.restore_checkpoint, name, **fields)
        return out

    def close(self) -> None:
        """Close the broker and stop the helper thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # Leaving the client's context closes the broker it opened (`Client.aclose`).
        self._stack.close()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
