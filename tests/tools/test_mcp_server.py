"""Issue 19, acceptance 1 and 2: ``metnos-exec mcp`` as a subprocess, driven by the ``mcp``
SDK's own client (a client no one here wrote), with a real worker and the real sandbox
serving the queue: over stdio on asyncio and trio, and over streamable HTTP on loopback,
with a bearer token required on another address.

The worker serves the example executors plus ``sleepy`` (written here: it sleeps), in a
copy of the examples folder, with HOME a temp folder holding notes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from metnos_exec.client import Client
from metnos_exec.manifest import ExecutorRegistry
from tests.helpers.worker_cli import wait_for_event, worker_argv

pytest.importorskip("mcp", reason="the mcp extra is not installed")
from mcp import Client as McpClient
from mcp import StdioServerParameters

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "executors"
EXAMPLE_NAMES = sorted(ExecutorRegistry.load(EXAMPLES))

SLEEPY = {
    "manifest.toml": """\
        name = "sleepy"
        version = "1.0.0"
        description = "Sleep for a while (a test's long job)"
        runtime = "python"
        entry = "main.py"

        [args.seconds]
        type = "number"
        default = 60

        [limits]
        timeout_s = 120
        """,
    "main.py": """\
        import json, sys, time
        args = json.load(sys.stdin)
        time.sleep(args.get("seconds", 60))
        print(json.dumps({"slept": args.get("seconds", 60)}))
        """,
}

#: Reports half way, then waits (60 s at most) for ~/notes/go, which the test creates once
#: the MCP client saw the executor's progress forwarded.
STEPPER = {
    "manifest.toml": """\
        name = "stepper"
        version = "1.0.0"
        description = "Report progress half way, then wait for a file (a test's job)"
        runtime = "python"
        entry = "main.py"

        [[capabilities]]
        name = "fs:read"
        hints = ["~/notes/**"]

        [limits]
        timeout_s = 90
        """,
    "main.py": """\
        import json, os, sys, time
        json.load(sys.stdin)
        out = os.fdopen(int(os.environ["METNOS_PROGRESS_FD"]), "w", buffering=1)
        out.write(json.dumps({"progress": 0.5, "message": "half way"}) + "\\n")
        gate, end = os.path.expanduser("~/notes/go"), time.monotonic() + 60
        while not os.path.exists(gate) and time.monotonic() < end:
            time.sleep(0.05)
        print(json.dumps({"released": os.path.exists(gate)}))
        """,
}


@dataclass
class Queue:
    """A worker serving `broker` with `executors`; `env` is what the server runs with."""

    broker: str
    executors: Path
    env: dict[str, str]
    cwd: Path
    home: Path


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[Queue]:
    from tests.sandbox.test_bwrap import need_bwrap

    need_bwrap()
    executors = tmp_path / "executors"
    shutil.copytree(EXAMPLES, executors)
    (executors / "sleepy").mkdir()
    for name, text in SLEEPY.items():
        (executors / "sleepy" / name).write_text(textwrap.dedent(text))
    (executors / "stepper").mkdir()
    for name, text in STEPPER.items():
        (executors / "stepper" / name).write_text(textwrap.dedent(text))
    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True)
    (home / "notes" / "today.md").write_text("milk\n")
    env = {**os.environ, "HOME": str(home)}
    env.pop("METNOS_ARM_OVERRIDE", None)
    broker = f"sqlite:///{tmp_path / 'q.db'}"
    log = tmp_path / "worker.jsonl"
    worker = subprocess.Popen(
        worker_argv(broker, executors, log, "--concurrency", "2"),
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_for_event(log, "worker.started", worker, timeout=60)
        yield Queue(broker, executors, env, tmp_path, home)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)


def _server_argv(q: Queue, *extra: str) -> list[str]:
    return [
        "-m",
        "metnos_exec",
        "mcp",
        "--broker",
        q.broker,
        "--executors",
        str(q.executors),
        "--progress-every",
        "0.2",
        *extra,
    ]


def _stdio(q: Queue, backend: str) -> McpClient:
    params = StdioServerParameters(
        command=sys.executable,
        args=_server_argv(q, "--stdio", "--backend", backend),
        env=q.env,
        cwd=str(q.cwd),
    )
    return McpClient(params)


# --- the checks, one per acceptance point, shared by both transports --------------------


async def check_tools(client: McpClient) -> None:
    tools = {t.name: t for t in (await client.list_tools()).tools}
    assert sorted(tools) == sorted([*EXAMPLE_NAMES, "sleepy", "stepper"])
    read = tools["read_notes"]
    assert read.input_schema["properties"]["path"]["type"] == "string"
    assert read.input_schema["additionalProperties"] is False
    assert read.output_schema is not None  # read_notes declares its output
    assert read.output_schema["required"] == ["kind", "path"]
    assert tools["word_count"].output_schema is None
    a = read.annotations
    assert a is not None and a.read_only_hint is True and a.open_world_hint is False
    assert a.idempotent_hint is False
    fetch = tools["fetch_url"].annotations
    assert fetch is not None and fetch.open_world_hint is True and fetch.read_only_hint is False
    delete = tools["delete_note"].annotations
    assert delete is not None and delete.read_only_hint is False
    assert delete.destructive_hint is True  # no --assume-staged: writers are destructive
    assert delete.open_world_hint is False


async def check_read_notes(client: McpClient, q: Queue) -> None:
    out = await client.call_tool("read_notes", {"path": str(q.home / "notes" / "today.md")})
    assert out.is_error is False, out.content
    assert out.structured_content is not None
    assert out.structured_content["text"] == "milk\n"
    # The SDK client validated it against the listed outputSchema (it raises otherwise);
    # say so here too, with a validator of our own choosing.
    import jsonschema

    listed = {t.name: t for t in (await client.list_tools()).tools}["read_notes"]
    jsonschema.Draft202012Validator(listed.output_schema).validate(out.structured_content)
    folder = await client.call_tool("read_notes", {"path": str(q.home / "notes")})
    assert folder.is_error is False, folder.content
    assert folder.structured_content is not None
    assert folder.structured_content["notes"][0]["path"] == "today.md"
    assert "milk" in out.content[0].text  # type: ignore[union-attr]
    meta = out.meta or {}
    assert meta["status"] == "succeeded" and meta["job_id"]
    assert meta["containment"]["sandbox"] == "bwrap"
    assert meta["containment"]["files"]["state"] == "kept"
    assert meta["undo_ids"] == []


async def check_refusal(client: McpClient) -> None:
    out = await client.call_tool("read_notes", {"path": "/etc/passwd"})
    assert out.is_error is True
    text = out.content[0].text  # type: ignore[union-attr]
    assert "refused" in text and "E_CAPABILITY_DENIED" in text and "/etc/passwd" in text
    assert (out.meta or {})["error_code"] == "E_CAPABILITY_DENIED"


async def check_cancel(client: McpClient, q: Queue) -> None:
    """Cancel a long call once its job runs; the job's result is then ``cancelled``."""
    seen: list[str] = []
    running = anyio.Event()

    async def progress(value: float, total: float | None, message: str | None) -> None:
        seen.append(message or "")
        if message and " running," in message:
            running.set()

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:

            async def call() -> None:
                await client.call_tool("sleepy", {"seconds": 60}, progress_callback=progress)

            tg.start_soon(call)
            await running.wait()
            tg.cancel_scope.cancel()
    job_id = re.match(r"job (\S+) ", seen[0])
    assert job_id is not None, seen
    async with Client(q.broker) as queue_client:
        with anyio.fail_after(60):
            result = await queue_client.result(job_id.group(1), wait=60)
    assert result is not None and result.status == "cancelled", result


# --- stdio ------------------------------------------------------------------------------


@pytest.mark.parametrize("server_backend", ["asyncio", "trio"])
async def test_stdio(queue: Queue, server_backend: str) -> None:
    """Acceptance 1: both client backends (the anyio_backend fixture) against a server on
    each backend."""
    async with _stdio(queue, server_backend) as client:
        await check_tools(client)
        await check_read_notes(client, queue)
        await check_refusal(client)
        await check_cancel(client, queue)


async def test_stdio_progress_and_undo_tool(queue: Queue) -> None:
    """Progress notices name the job and its state; with --undo-tool, a write is undone."""
    q = queue
    params = StdioServerParameters(
        command=sys.executable,
        args=_server_argv(q, "--stdio", "--undo-tool"),
        env=q.env,
        cwd=str(q.cwd),
    )
    messages: list[str] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        messages.append(message or "")

    note = q.home / "notes" / "new.md"
    async with McpClient(params) as client:
        assert "metnos_undo" in {t.name for t in (await client.list_tools()).tools}
        wrote = await client.call_tool(
            "write_note", {"path": str(note), "text": "hi"}, progress_callback=progress
        )
        assert wrote.is_error is False, wrote.content
        assert messages and messages[0].startswith("job ") and "queued" in messages[0]
        meta = wrote.meta or {}
        assert meta["undo_ids"], meta
        assert note.exists()
        undone = await client.call_tool("metnos_undo", {"job_id": meta["job_id"]})
        assert undone.is_error is False, undone.content
        assert not note.exists()
        again = await client.call_tool("metnos_undo", {"job_id": "01NOTAJOBOFTHISSERVER000"})
        assert again.is_error is True


async def test_stdio_forwards_the_executors_progress(queue: Queue) -> None:
    """The executor's fraction and message reach the MCP client's progress callback
    (``progress`` the fraction, ``total`` 1), while the job runs."""
    q = queue
    gate = q.home / "notes" / "go"
    seen: list[tuple[float, float | None, str]] = []

    async def progress(value: float, total: float | None, message: str | None) -> None:
        seen.append((value, total, message or ""))
        if total == 1.0 and "half way" in (message or ""):
            gate.write_text("")  # seen: let the executor finish

    async with _stdio(q, "asyncio") as client:
        with anyio.fail_after(90):
            out = await client.call_tool("stepper", {}, progress_callback=progress)
    assert out.is_error is False, out.content
    assert out.structured_content == {"released": True}
    forwarded = [s for s in seen if s[1] == 1.0]
    assert forwarded, seen
    value, _, message = forwarded[0]
    assert value == 0.5 and " running, " in message and message.endswith(": half way")


# --- streamable HTTP --------------------------------------------------------------------


class HttpServer:
    def __init__(self, q: Queue, host: str, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, *_server_argv(q, "--http", f"{host}:0", *extra)],
            cwd=q.cwd,
            env=q.env,
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            found = re.search(r"(http://\S+/mcp)", line)
            if found:
                self.url = found.group(1)
                break
        else:
            raise AssertionError(f"the server exited ({self.proc.wait()}) without a URL")

    def stop(self) -> None:
        """SIGINT, and the server must exit by itself (hypercorn's graceful shutdown)."""
        self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("the HTTP server did not stop on SIGINT") from None
        finally:
            assert self.proc.stderr is not None
            self.proc.stderr.close()
        assert code == 0, code


@pytest.mark.parametrize("server_backend", ["asyncio", "trio"])
async def test_http_on_loopback(queue: Queue, server_backend: str) -> None:
    """Acceptance 2: the same checks through streamable HTTP on 127.0.0.1 (no token), a
    server on each backend (hypercorn serves both) and both client backends."""
    server = HttpServer(queue, "127.0.0.1", "--backend", server_backend)
    try:
        async with McpClient(server.url) as client:
            await check_tools(client)
            await check_read_notes(client, queue)
            await check_refusal(client)
            await check_cancel(client, queue)
    finally:
        server.stop()


def _http_client(token: str | None) -> Any:
    import httpx2

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx2.AsyncClient(headers=headers, timeout=30)


def test_http_elsewhere_refuses_to_start_without_a_token(tmp_path: Path) -> None:
    """Bound to 127.0.0.2 (not the loopback default: 127.0.0.1, ::1, localhost) and given
    no token, the server refuses to start (exit 2) and says what it needs."""
    env = {k: v for k, v in os.environ.items() if k != "METNOS_MCP_TOKEN"}
    q = Queue(f"sqlite:///{tmp_path / 'q.db'}", EXAMPLES, env, tmp_path, tmp_path)
    for host in ("127.0.0.2",):  # (other hosts: test_mcp_spec's bind rule, no process)
        refused = subprocess.run(
            [sys.executable, *_server_argv(q, "--http", f"{host}:0")],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 2, refused.stderr
        assert "needs a bearer token" in refused.stderr and host in refused.stderr


@pytest.mark.parametrize("server_backend", ["asyncio", "trio"])
async def test_http_elsewhere_needs_the_token(queue: Queue, server_backend: str) -> None:
    """Bound to 127.0.0.2 with --token: a request without the token (or with another) gets
    401; a client that sends it is served."""
    from mcp.client.streamable_http import streamable_http_client

    server = HttpServer(queue, "127.0.0.2", "--token", "s3cret", "--backend", server_backend)
    try:
        async with _http_client(None) as http:
            bare = await http.post(
                server.url,
                json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                headers={"Accept": "application/json, text/event-stream"},
            )
        assert bare.status_code == 401
        async with _http_client("wrong") as http:
            wrong = await http.post(server.url, json={})
        assert wrong.status_code == 401
        async with (
            _http_client("s3cret") as http,
            McpClient(streamable_http_client(server.url, http_client=http)) as client,
        ):
            await check_read_notes(client, queue)
    finally:
        server.stop()
