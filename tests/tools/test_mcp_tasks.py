"""MCP Tasks (``io.modelcontextprotocol/tasks``, 2026-07-28) over the queue: a long call
answered with a task handle whose id is the job id, polled with ``tasks/get`` (status from
the queue, the synchronous call's result inlined), cancelled with ``tasks/cancel``, and
still readable from a new connection to a new server process.

Driven by the ``mcp`` SDK's client over stdio and streamable HTTP, servers on asyncio and
trio: the extension is declared with the SDK's own `ClientExtension` machinery (a
`ResultClaim` for ``resultType: "task"``), and ``tasks/*`` are sent as raw JSON-RPC
requests through the SDK session's `send_request` (the SDK has no tasks helpers)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, ClassVar, Literal

import anyio
import pytest

from metnos_exec.client import Client
from metnos_exec.messages import MAX_ARGS_DEPTH
from tests.tools import test_mcp_server as served
from tests.tools.test_mcp_server import HttpServer, Queue, _server_argv

pytest.importorskip("mcp", reason="the mcp extra is not installed")
import mcp_types as types
from mcp import Client as McpClient
from mcp import StdioServerParameters
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp.shared.exceptions import MCPError
from pydantic import ConfigDict

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap, pytest.mark.slow]

#: The worker and executors of test_mcp_server (the same fixture, registered here too).
queue = served.queue

TASKS = "io.modelcontextprotocol/tasks"


class TaskHandle(types.Result):
    """A ``CreateTaskResult`` as the extension defines it (``resultType: "task"``)."""

    result_type: Literal["task"] = "task"  # type: ignore[assignment]
    task_id: str
    status: str
    status_message: str | None = None
    created_at: str
    last_updated_at: str
    ttl_ms: int | None = None
    poll_interval_ms: int | None = None


class DetailedTask(types.Result):
    """A ``tasks/get`` answer: every field kept (``result`` and ``error`` are inlined)."""

    model_config = ConfigDict(extra="allow")


class _TaskIdParams(types.RequestParams):
    task_id: str


class GetTask(types.Request[_TaskIdParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    params: _TaskIdParams
    name_param: ClassVar[str | None] = "taskId"  # SEP-2663: Mcp-Name carries the task id


class CancelTask(types.Request[_TaskIdParams, Literal["tasks/cancel"]]):
    method: Literal["tasks/cancel"] = "tasks/cancel"
    params: _TaskIdParams
    name_param: ClassVar[str | None] = "taskId"


async def get_task(client: McpClient, task_id: str) -> dict[str, Any]:
    out = await client.session.send_request(
        GetTask(params=_TaskIdParams(task_id=task_id)), DetailedTask
    )
    return out.model_dump(by_alias=True, mode="json")


async def cancel_task(client: McpClient, task_id: str) -> None:
    await client.session.send_request(
        CancelTask(params=_TaskIdParams(task_id=task_id)), DetailedTask
    )


async def poll(
    client: McpClient, task_id: str, done: Callable[[dict[str, Any]], bool], seen: list[str]
) -> dict[str, Any]:
    with anyio.fail_after(90):
        while True:
            task = await get_task(client, task_id)
            seen.append(task["status"])
            if done(task):
                return task
            await anyio.sleep(task.get("pollIntervalMs", 500) / 1000)


async def _resolve(handle: TaskHandle, ctx: ClaimContext) -> types.CallToolResult:
    """What a tasks-aware client does with a handle: poll, then read the inlined result."""
    with anyio.fail_after(90):
        while True:
            got = await ctx.session.send_request(
                GetTask(params=_TaskIdParams(task_id=handle.task_id)), DetailedTask
            )
            task = got.model_dump(by_alias=True, mode="json")
            if task["status"] == "completed":
                return types.CallToolResult.model_validate(task["result"])
            assert task["status"] == "working", task
            await anyio.sleep(0.2)


class TasksExtension(ClientExtension):
    """Declares the extension and claims ``resultType: "task"`` on ``tools/call``."""

    identifier = TASKS

    def claims(self) -> list[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=TaskHandle, resolve=_resolve)]


def _stdio(q: Queue, backend: str, *extra: str, tasks: bool = True) -> McpClient:
    params = StdioServerParameters(
        command=sys.executable,
        args=_server_argv(q, "--stdio", "--backend", backend, *extra),
        env=q.env,
        cwd=str(q.cwd),
    )
    return McpClient(params, extensions=[TasksExtension()] if tasks else None)


@asynccontextmanager
async def _connect(
    q: Queue, transport: str, backend: str, *extra: str, tasks: bool = True
) -> AsyncIterator[McpClient]:
    if transport == "stdio":
        async with _stdio(q, backend, *extra, tasks=tasks) as client:
            yield client
        return
    server = HttpServer(q, "127.0.0.1", "--backend", backend, *extra)
    try:
        async with McpClient(
            server.url, extensions=[TasksExtension()] if tasks else None
        ) as client:
            yield client
    finally:
        server.stop()


@pytest.mark.parametrize("server_backend", ["asyncio", "trio"])
@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_a_long_call_is_a_task_that_can_be_cancelled(
    queue: Queue, transport: str, server_backend: str
) -> None:
    """sleepy (timeout 120 s, over the default 30): a task handle whose id is the job id;
    tasks/get says working; tasks/cancel cancels the job; the task ends cancelled."""
    async with _connect(queue, transport, server_backend) as client:
        assert TASKS in (client.server_capabilities.extensions or {})
        handle = await client.session.call_tool("sleepy", {"seconds": 60}, allow_claimed=True)
        assert isinstance(handle, TaskHandle), handle
        assert handle.status == "working" and handle.ttl_ms and handle.ttl_ms > 0
        async with Client(queue.broker) as queue_client:
            state = await queue_client.broker.get_job_state(handle.task_id)
            assert state is not None  # the task id is the job id, stored before the answer
        seen: list[str] = []
        await poll(client, handle.task_id, lambda t: "running" in t["statusMessage"], seen)
        await cancel_task(client, handle.task_id)
        task = await poll(client, handle.task_id, lambda t: t["status"] != "working", seen)
        assert task["status"] == "cancelled" and "result" not in task, task
        async with Client(queue.broker) as queue_client:
            result = await queue_client.result(handle.task_id, wait=30)
        assert result is not None and result.status == "cancelled"
        # A short tool stays synchronous (timeout 10 s, not over 30).
        quick = await client.call_tool("read_notes", {"path": str(queue.home / "notes")})
        assert quick.is_error is False and (quick.meta or {})["status"] == "succeeded"


@pytest.mark.parametrize("server_backend", ["asyncio", "trio"])
async def test_a_task_result_is_the_synchronous_result_and_outlives_the_connection(
    queue: Queue, server_backend: str
) -> None:
    """--tasks-over 0: every call is a task. The SDK client resolves it through the claim
    (call_tool returns the CallToolResult, validated against read_notes' outputSchema); a
    refused job is a completed task with an isError result, a call refused at submit no
    task at all; and the task is read again from a new server process after the first one
    is gone."""
    note = str(queue.home / "notes" / "today.md")
    async with _stdio(queue, server_backend, "--tasks-over", "0") as client:
        out = await client.call_tool("read_notes", {"path": note})
        assert out.is_error is False, out.content
        assert out.structured_content is not None and out.structured_content["text"] == "milk\n"
        meta = out.meta or {}
        assert meta["status"] == "succeeded" and meta["containment"]["sandbox"] == "bwrap"
        # Refused by the worker's first wall: a completed task whose result is the error
        # (the extension keeps "failed" for JSON-RPC errors).
        refused = await client.call_tool("read_notes", {"path": "/etc/passwd"})
        assert refused.is_error is True and "E_CAPABILITY_DENIED" in refused.content[0].text  # type: ignore[union-attr]
        # Refused at submit (arguments nested past MAX_ARGS_DEPTH): an isError result at
        # once, no task.
        deep: Any = "x"
        for _ in range(MAX_ARGS_DEPTH + 5):
            deep = [deep]
        bad = await client.session.call_tool("read_notes", {"path": deep}, allow_claimed=True)
        assert isinstance(bad, types.CallToolResult) and bad.is_error is True, bad
        assert "refused" in bad.content[0].text  # type: ignore[union-attr]
        handle = await client.session.call_tool("read_notes", {"path": note}, allow_claimed=True)
        assert isinstance(handle, TaskHandle)
        await poll(client, handle.task_id, lambda t: t["status"] == "completed", [])
    async with _stdio(queue, server_backend) as again:  # a new process, a new connection
        task = await get_task(again, handle.task_id)
        assert task["status"] == "completed", task
        result = types.CallToolResult.model_validate(task["result"])
        assert result.is_error is False and result.structured_content is not None
        assert result.structured_content["text"] == "milk\n"
        assert (result.meta or {})["job_id"] == handle.task_id
        with pytest.raises(MCPError) as unknown:
            await get_task(again, "01NOTAJOBOFTHISQUEUE00000")
        assert unknown.value.code == types.INVALID_PARAMS
        assert "no job" in unknown.value.message


async def test_without_the_extension_calls_stay_synchronous_and_tasks_are_refused(
    queue: Queue,
) -> None:
    """A client that does not declare the extension never gets a task (even with
    --tasks-over 0), and its tasks/get is refused with -32021."""
    async with _stdio(queue, "asyncio", "--tasks-over", "0", tasks=False) as client:
        out = await client.call_tool("read_notes", {"path": str(queue.home / "notes")})
        assert out.is_error is False and (out.meta or {})["status"] == "succeeded"
        with pytest.raises(MCPError) as refused:
            await get_task(client, (out.meta or {})["job_id"])
        assert refused.value.code == types.MISSING_REQUIRED_CLIENT_CAPABILITY


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a pure rule: one backend is enough
def test_which_calls_become_tasks_and_when_a_task_was_created(anyio_backend: str) -> None:
    """The policy (unit, with a stand-in request context): the extension declared on the
    request, a 2026-07-28 session, and a tool timeout over the threshold (0: any); the
    task's createdAt is its job id's ULID time."""
    import time
    from types import SimpleNamespace

    import msgspec

    from metnos_exec.manifest import Manifest
    from metnos_exec.messages import new_job_id
    from metnos_exec.tools.mcp_tasks import TaskPolicy, _created_s, wants_task

    def manifest(timeout_s: float) -> Manifest:
        base = {"name": "x", "version": "1", "runtime": "python", "entry": "main.py"}
        return msgspec.convert({**base, "limits": {"timeout_s": timeout_s}}, Manifest)

    declared = {types.CLIENT_CAPABILITIES_META_KEY: {"extensions": {TASKS: {}}}}
    modern = SimpleNamespace(protocol_version="2026-07-28", meta=declared)
    legacy = SimpleNamespace(protocol_version="2025-11-25", meta=declared)
    silent = SimpleNamespace(protocol_version="2026-07-28", meta={})
    policy = TaskPolicy(30)
    assert wants_task(policy, modern, manifest(120))
    assert not wants_task(policy, modern, manifest(30))
    assert not wants_task(policy, legacy, manifest(120))
    assert not wants_task(policy, silent, manifest(120))
    assert not wants_task(None, modern, manifest(120))
    assert wants_task(TaskPolicy(0), modern, manifest(1))
    assert abs(_created_s(new_job_id()) - time.time()) < 2


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # argument parsing: no event loop
def test_tasks_over_takes_seconds_zero_or_more(
    anyio_backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from metnos_exec.cli import main

    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit) as exited:
            main(["mcp", "--stdio", "--executors", ".", "--tasks-over", bad])
        assert exited.value.code == 2, bad
        assert "--tasks-over" in capsys.readouterr().err
