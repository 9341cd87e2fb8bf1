"""MCP Tasks (the ``io.modelcontextprotocol/tasks`` extension, 2026-07-28) over the queue.

A long tool call need not hold its request open: the server answers ``tools/call`` with a
task handle (``resultType: "task"``) and the client polls ``tasks/get`` until the task is
terminal, then reads the tool's result inlined in it. A job queue is exactly the store the
extension asks for, so a task *is* a job:

- **task id = job id.** The handle is returned once the job is submitted (stored in the
  broker: a ``tasks/get`` for it resolves at once, as the extension requires).
- **Status from the queue**: a queued or running job is ``working`` (its state in
  ``statusMessage``); a job with a result is ``completed``, with ``result`` the very
  ``CallToolResult`` a synchronous call returns (`mcp_spec.tool_result`: a refused or
  failed job is a completed task whose result has ``isError``, since the extension keeps
  ``failed`` for JSON-RPC errors only); a cancelled job is ``cancelled``. A job whose
  changes await approval (issue 21's gates) is ``input_required``, its ``statusMessage``
  naming the job and the commands that answer it (``metnos-exec approve`` / ``reject``;
  the answer is not taken through ``tasks/update``), its change set in ``_meta``; once
  answered it is ``completed`` with the job's final result.
- ``tasks/cancel`` cancels the job (`Client.cancel`) and acknowledges; the job's own result
  then says whether the cancel came in time. ``tasks/update`` is acknowledged (no task of
  ours ever has input requests outstanding).
- **Durable**: the task is the broker's job, so it outlives the request, the client's
  connection and this server process: any server on the same queue answers ``tasks/get``
  for it until the workers' retention purges the result (``ttlMs``: the default retention,
  `DEFAULT_RETENTION_S`; an operator who purges sooner shortens it).
- ``createdAt`` is the job id's own timestamp (a ULID's first 48 bits).

Which calls become tasks is the server's choice (the extension makes it so): only for a
client that declares the extension on that request (its ``_meta`` client capabilities),
only on a 2026-07-28 session (the shape does not exist on the handshake-era wire), and
only for a tool whose manifest timeout exceeds `TaskPolicy.over_s` (``--tasks-over``; 0:
every call). Anything else is served synchronously, as before. A call refused at submit is
an ``isError`` result, never a task. ``tasks/*`` from a client that does not declare the
extension is refused with ``-32021`` (missing required client capability).

Not served: ``tasks/result`` and ``tasks/list`` (the 2025-11-25 experimental utility; the
extension replaced the first by the inlined ``result`` and dropped the second), and
``notifications/tasks`` (optional; clients poll). The ``metnos_undo`` tool takes only the
synchronous calls of its server: a task's changes are undone with ``metnos-exec undo
<task id>`` (its undo ids are in the inlined result's ``_meta``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

import mcp_types as types
import msgspec
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from ..brokers.base import DEFAULT_RETENTION_S
from ..errors import MetnosError
from ..toolspec import executor_for_tool
from .mcp_spec import error_result, tool_result

if TYPE_CHECKING:
    from mcp.server.lowlevel import Server

    from ..manifest import Manifest
    from .mcp_server import McpGateway

__all__ = ("TASKS_EXTENSION", "TaskPolicy", "install", "wants_task")

#: The extension's identifier (SEP-2663).
TASKS_EXTENSION: Final = "io.modelcontextprotocol/tasks"

#: How many tasks' executors a server remembers (for the output schema check), newest kept.
MAX_REMEMBERED: Final = 10_000

#: The poll interval suggested to clients, in milliseconds.
POLL_INTERVAL_MS: Final = 500

_CROCKFORD: Final = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


class TaskPolicy:
    """When a ``tools/call`` becomes a task.

    Args:
        over_s: a tool whose manifest timeout is above this many seconds is run as a task
            (for a client that declares the extension); ``0``: every call.
        ttl_s: how long a finished task stays readable (the workers' result retention).
    """

    def __init__(self, over_s: float = 30.0, *, ttl_s: float = DEFAULT_RETENTION_S) -> None:
        self.over_s = over_s
        self.ttl_s = ttl_s
        #: The executor of each task this process created (the newest `MAX_REMEMBERED`): a
        #: result names no executor, and its output is checked against that executor's
        #: output schema. A task of another process (or of this one before a restart) is
        #: shown without the check.
        self.executors: dict[str, str] = {}


class TaskParams(types.RequestParams):
    """``tasks/get`` and ``tasks/cancel`` params."""

    task_id: str


class UpdateTaskParams(types.RequestParams):
    """``tasks/update`` params (the responses are never needed: nothing is outstanding)."""

    task_id: str
    input_responses: dict[str, Any] | None = None


def _declares(ctx: Any) -> bool:
    """Whether this request's client declares the extension, on a 2026-07-28 session."""
    if getattr(ctx, "protocol_version", None) not in MODERN_PROTOCOL_VERSIONS:
        return False
    meta: Mapping[str, Any] = ctx.meta or {}
    caps = meta.get(types.CLIENT_CAPABILITIES_META_KEY)
    extensions = caps.get("extensions") if isinstance(caps, Mapping) else None
    return isinstance(extensions, Mapping) and TASKS_EXTENSION in extensions


def wants_task(policy: TaskPolicy | None, ctx: Any, manifest: Manifest) -> bool:
    """Whether this call is answered with a task handle (see the module's text)."""
    if policy is None or not _declares(ctx):
        return False
    return policy.over_s == 0 or manifest.limits.timeout_s > policy.over_s


def _iso(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).isoformat().replace("+00:00", "Z")


def _created_s(job_id: str) -> float:
    """The creation time a ULID job id carries (now, for an id that is not one)."""
    try:
        value = 0
        for ch in job_id[:10].upper():
            value = value * 32 + _CROCKFORD.index(ch)
        return value / 1000.0
    except ValueError:
        return time.time()


def _task(
    policy: TaskPolicy, job_id: str, status: str, message: str, updated: float
) -> dict[str, Any]:
    return {
        "taskId": job_id,
        "status": status,
        "statusMessage": message,
        "createdAt": _iso(_created_s(job_id)),
        "lastUpdatedAt": _iso(updated),
        "ttlMs": int(policy.ttl_s * 1000),
        "pollIntervalMs": POLL_INTERVAL_MS,
    }


async def create_task(
    gateway: McpGateway, policy: TaskPolicy, executor: str, args: dict[str, Any]
) -> dict[str, Any]:
    """Submit the job and return its handle (``CreateTaskResult``), or an ``isError``
    result for a call refused at submit."""
    try:
        job_id = await gateway.client.submit(executor, args, correlation_id=f"mcp:{executor}")
    except MetnosError as exc:
        return error_result(exc.code, str(exc))
    policy.executors[job_id] = executor
    while len(policy.executors) > MAX_REMEMBERED:
        del policy.executors[next(iter(policy.executors))]  # the oldest task
    gateway.note(f"mcp: {executor}: job {job_id} submitted as a task")
    return {
        "resultType": "task",
        **_task(policy, job_id, "working", f"job {job_id} queued", time.time()),
    }


def _refuse_undeclared(ctx: Any) -> None:
    if not _declares(ctx):
        raise MCPError(
            code=types.MISSING_REQUIRED_CLIENT_CAPABILITY,
            message="Missing required client capability",
            data={"requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}},
        )


def _unknown(job_id: str) -> MCPError:
    return MCPError(
        code=types.INVALID_PARAMS,
        message=f"Failed to retrieve task: no job {job_id!r} on this queue (never submitted, "
        "or its result was purged after the retention period)",
    )


async def get_task(gateway: McpGateway, policy: TaskPolicy, job_id: str) -> dict[str, Any]:
    """The task's ``DetailedTask`` from the queue (see the module's text)."""
    broker = gateway.client.broker
    result = await broker.get_result(job_id)
    if result is not None:
        done = result.finished_at or time.time()
        if result.status == "cancelled":
            return _task(policy, job_id, "cancelled", f"job {job_id} cancelled", done)
        if result.status == "awaiting_approval":
            message = (
                f"job {job_id} awaits approval of its file changes: metnos-exec approve "
                f"{job_id} (or reject {job_id})"
            )
            task = _task(policy, job_id, "input_required", message, done)
            return {**task, "_meta": {"changes": msgspec.to_builtins(result.changes)}}
        executor = policy.executors.get(job_id)
        manifest = None if executor is None else (await gateway.manifests()).get(executor)
        out = tool_result(result, manifest)
        task = _task(policy, job_id, "completed", f"job {job_id} {result.status}", done)
        return {**task, "result": out}
    state = await broker.get_job_state(job_id)
    if state is None:
        raise _unknown(job_id)
    where = "cancel requested" if state.cancel_requested else state.state
    return _task(policy, job_id, "working", f"job {job_id} {where}", time.time())


def install(server: Server[Any], gateway: McpGateway, policy: TaskPolicy) -> None:
    """Advertise the extension on `server`, answer the calls `wants_task` picks with a
    task, and serve ``tasks/get``, ``tasks/cancel`` and ``tasks/update`` from the queue.

    ``tools/call`` is wrapped here (the SDK's low-level ``on_call_tool`` is typed for the
    core results only): every call the policy does not pick goes to `McpGateway.call_tool`
    unchanged.
    """

    async def on_call(ctx: Any, params: types.CallToolRequestParams) -> Any:
        if not _declares(ctx):  # the common case costs one dict lookup, nothing more
            return await gateway.call_tool(ctx, params)
        manifests = await gateway.manifests()
        executor = executor_for_tool(params.name, manifests)
        if executor is not None and wants_task(policy, ctx, manifests[executor]):
            out = await create_task(gateway, policy, executor, dict(params.arguments or {}))
            if out.get("resultType") == "task":
                return out  # the extension's shape: the SDK passes it through unsieved
            return types.CallToolResult.model_validate(out)
        return await gateway.call_tool(ctx, params)

    async def on_get(ctx: Any, params: TaskParams) -> dict[str, Any]:
        _refuse_undeclared(ctx)
        return await get_task(gateway, policy, params.task_id)

    async def on_cancel(ctx: Any, params: TaskParams) -> dict[str, Any]:
        _refuse_undeclared(ctx)
        if await gateway.client.broker.get_job_state(params.task_id) is None:
            raise _unknown(params.task_id)
        outcome = await gateway.client.cancel(params.task_id)
        gateway.note(f"mcp: task {params.task_id}: cancel requested ({outcome})")
        return {}

    async def on_update(ctx: Any, params: UpdateTaskParams) -> dict[str, Any]:
        _refuse_undeclared(ctx)
        if await gateway.client.broker.get_job_state(params.task_id) is None:
            raise _unknown(params.task_id)
        return {}

    server.extensions[TASKS_EXTENSION] = {}
    server.add_request_handler("tools/call", types.CallToolRequestParams, on_call)
    server.add_request_handler("tasks/get", TaskParams, on_get)
    server.add_request_handler("tasks/cancel", TaskParams, on_cancel)
    server.add_request_handler("tasks/update", UpdateTaskParams, on_update)
