"""``metnos-exec mcp``: every executor as a Model Context Protocol tool, over the queue.

Built on the ``mcp`` SDK's low-level `mcp.server.lowlevel.Server` (2.x line; the extra
``metnos-exec[mcp]``): ``tools/list`` and ``tools/call`` handlers, nothing else. What a
tool is and how a result reads is `mcp_spec`; this module is the wiring.

A call submits a job (`Client.submit`) and waits for its result; while it waits it sends
``notifications/progress`` when the caller gave a progress token: one right after the
submit (``job <id> queued``: the job id, so a client can follow it elsewhere), then every
`McpGateway.progress_every` seconds the job's state and the time since the submit, with
the executor's own progress when it reports some (README, "Reporting progress"): its
message after the state, and its fraction as the notification's ``progress`` with
``total`` 1 (without one, ``progress`` counts the seconds, with no total). A
``notifications/cancelled`` from the client cancels the handler (the SDK does) and the
handler cancels the job (`Client.cancel`, shielded), whose result is then ``cancelled``.
A job's own failure is an ``isError`` result; only a call this server cannot place (an
unknown tool) is a protocol error.

Transports: stdio (what desktop clients start) and streamable HTTP. HTTP binds loopback
(``127.0.0.1``) by default; "loopback" for the no-token default means exactly
``127.0.0.1``, ``::1`` and ``localhost``. Any other address (``0.0.0.0``, a LAN address,
even ``127.0.0.2``) needs a bearer token (`serve_http` refuses to start without one):
another address is a choice to be reached by others, and we do not guess who. When a
token is set, every request must carry ``Authorization: Bearer <token>`` (compared in
constant time), on loopback too; a request without it gets 401 and never reaches MCP.

asyncio and trio: the SDK is anyio-based and both transports serve on either backend
(streamable HTTP through hypercorn, which runs on asyncio and trio alike).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

import anyio
import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError

from ..client import Client
from ..errors import MetnosError, UndoConflict, UndoUnavailable
from ..manifest import ExecutorRegistry, Manifest
from ..toolspec import executor_for_tool
from . import mcp_tasks
from .mcp_spec import UNDO_TOOL, error_result, tool_definition, tool_result, undo_tool_definition
from .mcp_tasks import TaskPolicy

__all__ = (
    "LOOPBACK_HOSTS",
    "McpGateway",
    "TaskPolicy",
    "needs_token",
    "serve_http",
    "serve_stdio",
)

#: The addresses `serve_http` binds without a token.
LOOPBACK_HOSTS: Final = frozenset({"127.0.0.1", "::1", "localhost"})

#: Seconds between two "running" progress notifications.
PROGRESS_EVERY_S: Final = 1.0


def needs_token(host: str) -> bool:
    """Whether binding `host` requires a bearer token: anything but the loopback default."""
    return host.strip("[]").lower() not in LOOPBACK_HOSTS


class McpGateway:
    """The MCP server's state: the queue client, where tools come from, the options.

    Args:
        client: an entered `Client` on the queue.
        registry: the executors' folder (``--executors``), or ``None``: the catalog the
            server workers publish (`Broker.executor_names`/`executor_info`), read again
            at every ``tools/list`` so a worker started later adds its tools.
        undo_tool: serve ``metnos_undo`` (``--undo-tool``).
        assume_staged: the operator says every worker stages writes (see `mcp_spec`).
        log: where one line per call goes (stderr: stdout is the wire on stdio).
        tasks: when calls may be answered as MCP Tasks (`mcp_tasks`); ``None``: never.
    """

    def __init__(
        self,
        client: Client,
        registry: ExecutorRegistry | None = None,
        *,
        undo_tool: bool = False,
        assume_staged: bool = False,
        progress_every: float = PROGRESS_EVERY_S,
        log: Callable[[str], None] | None = None,
        tasks: TaskPolicy | None = None,
    ) -> None:
        self.client = client
        self.tasks = tasks
        self.undo_tool = undo_tool
        self.assume_staged = assume_staged
        self.progress_every = progress_every
        self._fixed = None if registry is None else {n: e.manifest for n, e in registry.items()}
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        #: Jobs of this server whose results carried undo ids (what the undo tool takes).
        self._undoable: set[str] = set()

    def note(self, line: str) -> None:
        """Log one line about a call (stderr, unless ``--quiet``)."""
        self._log(line)

    async def manifests(self) -> dict[str, Manifest]:
        """The executors served, by name."""
        if self._fixed is not None:
            return self._fixed
        out: dict[str, Manifest] = {}
        for name in sorted(await self.client.broker.executor_names()):
            info = await self.client.broker.executor_info(name)
            if info is not None:
                out[name] = info.manifest
        return out

    def server(self) -> Server[Any]:
        """The SDK server with this gateway's handlers."""
        from .. import __version__

        server: Server[Any] = Server(
            "metnos-exec",
            version=__version__,
            instructions=(
                "Each tool runs one sandboxed metnos-exec job. A refusal (a path or URL "
                "outside the tool's hints) comes back as an error result that says why."
            ),
            on_list_tools=self.list_tools,
            on_call_tool=self.call_tool,
        )
        if self.tasks is not None:
            mcp_tasks.install(server, self, self.tasks)
        return server

    async def list_tools(
        self, ctx: Any, params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        tools = [
            tool_definition(m, assume_staged=self.assume_staged)
            for m in (await self.manifests()).values()
        ]
        if self.undo_tool:
            tools.append(undo_tool_definition())
        return types.ListToolsResult.model_validate({"tools": tools})

    async def call_tool(
        self, ctx: Any, params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        args = dict(params.arguments or {})
        if self.undo_tool and params.name == UNDO_TOOL:
            out = await self._undo(args)
        else:
            manifests = await self.manifests()
            executor = executor_for_tool(params.name, manifests)
            if executor is None:
                raise MCPError(code=types.INVALID_PARAMS, message=f"unknown tool {params.name!r}")
            out = await self._run(ctx.session, executor, args, manifests[executor])
        return types.CallToolResult.model_validate(out)

    async def _run(
        self, session: Any, executor: str, args: dict[str, Any], manifest: Manifest
    ) -> dict[str, Any]:
        try:
            job_id = await self.client.submit(executor, args, correlation_id=f"mcp:{executor}")
        except MetnosError as exc:
            self._log(f"mcp: {executor}: refused at submit: {exc.code}")
            return error_result(exc.code, str(exc))
        started = time.monotonic()
        self._log(f"mcp: {executor}: job {job_id} submitted")
        await _progress(session, 0.0, f"job {job_id} queued")
        wait = manifest.limits.timeout_s * 3 + 30
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._tick, session, job_id, started)
                result = await self.client.result(job_id, wait=wait)
                tg.cancel_scope.cancel()
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                outcome = await self.client.cancel(job_id)
                self._log(f"mcp: {executor}: job {job_id} cancelled by the client ({outcome})")
            raise
        if result is None:
            await self.client.cancel(job_id)
            return error_result(
                "E_TIMEOUT",
                f"no result for job {job_id} within {wait:g} s (is a worker serving "
                f"{executor} on this queue?); the job was cancelled",
                job_id=job_id,
            )
        self._log(f"mcp: {executor}: job {job_id} {result.status}")
        if result.undo_ids:
            self._undoable.add(job_id)
        return tool_result(result, manifest)

    async def _tick(self, session: Any, job_id: str, started: float) -> None:
        fraction: float | None = None  # the executor's last, once it gave one
        while True:
            await anyio.sleep(self.progress_every)
            state = await self.client.broker.get_job_state(job_id)
            elapsed = time.monotonic() - started
            where = state.state if state is not None else "unknown"
            text = f"job {job_id} {where}, {elapsed:.0f} s"
            reported = await self.client.progress(job_id) if where == "running" else None
            if reported is not None and state is not None and reported.attempt == state.attempt:
                fraction = reported.fraction if reported.fraction is not None else fraction
                if reported.message:
                    text += f": {reported.message}"
            if fraction is None:
                await _progress(session, elapsed, text)
            else:
                await _progress(session, fraction, text, total=1.0)

    async def _undo(self, args: dict[str, Any]) -> dict[str, Any]:
        job_id = args.get("job_id")
        if not isinstance(job_id, str) or job_id not in self._undoable:
            return error_result(
                UndoUnavailable.code,
                f"{job_id!r} is not a call of this server whose result listed undo_ids",
            )
        try:
            result = await self.client.undo(job_id, wait=120)
        except (UndoConflict, UndoUnavailable) as exc:
            return error_result(exc.code, str(exc), job_id=job_id)
        except TimeoutError as exc:
            return error_result("E_TIMEOUT", str(exc), job_id=job_id)
        if result.status == "succeeded":
            self._undoable.discard(job_id)
        return tool_result(result)


async def _progress(
    session: Any, progress: float, message: str, *, total: float | None = None
) -> None:
    # A no-op when the caller sent no progress token (the SDK checks).
    await session.report_progress(progress, total, message)


async def serve_stdio(gateway: McpGateway) -> None:
    """Serve MCP over this process's stdin and stdout until stdin closes."""
    server = gateway.server()
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]


def bearer_guard(app: ASGIApp, token: str) -> ASGIApp:
    """`app` behind ``Authorization: Bearer <token>``: 401 for an HTTP request without it."""
    want = f"Bearer {token}".encode()

    async def guarded(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            got = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not hmac.compare_digest(got, want):
                body = b'{"error": "a bearer token is required (Authorization: Bearer ...)"}'
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"www-authenticate", b'Bearer realm="metnos-exec"'),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await app(scope, receive, send)

    return guarded


def check_http_bind(host: str, token: str | None) -> None:
    """Refuse (`ValueError`, with the sentence) a bind that needs a token and has none, or
    an address that is not one."""
    bare = host.strip("[]")
    if bare.lower() != "localhost":
        try:
            ipaddress.ip_address(bare)
        except ValueError:
            raise ValueError(f"{host!r} is not an IP address (or localhost)") from None
    if needs_token(host) and not token:
        raise ValueError(
            f"serving MCP on {host} (not 127.0.0.1, ::1 or localhost) needs a bearer token: "
            "pass --token or set METNOS_MCP_TOKEN"
        )


async def serve_http(
    gateway: McpGateway,
    host: str,
    port: int,
    *,
    token: str | None = None,
    ready: Callable[[int], None] | None = None,
) -> None:
    """Serve MCP over streamable HTTP at ``http://host:port/mcp`` until SIGINT or SIGTERM.

    Served by hypercorn, which runs on asyncio and trio (the backend this is called on).
    `ready(port)` is called once the socket listens (the bound port: ``HOST:0`` works).

    Raises:
        ValueError: no token for an address that needs one (`check_http_bind`).
    """
    import sniffio
    from hypercorn.config import Config

    check_http_bind(host, token)
    bare = host.strip("[]")
    app: ASGIApp = gateway.server().streamable_http_app(host=bare)
    if token:
        app = bearer_guard(app, token)
    # We bind the socket ourselves so the port is known (and announced) before hypercorn
    # takes it over by its descriptor; connections made in between wait in the backlog.
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bare, port))
        sock.listen(128)
        config = Config()
        # A duplicate: hypercorn's socket object owns (and closes) its own descriptor.
        config.bind = [f"fd://{os.dup(sock.fileno())}"]
        config.accesslog = None
        config.graceful_timeout = 2.0
        if ready is not None:
            ready(sock.getsockname()[1])
        if sniffio.current_async_library() == "trio":
            from hypercorn.trio import serve as serve_trio

            await serve_trio(app, config, shutdown_trigger=_until_signalled, mode="asgi")  # type: ignore[arg-type]
        else:
            from hypercorn.asyncio import serve as serve_asyncio

            await serve_asyncio(app, config, shutdown_trigger=_until_signalled, mode="asgi")  # type: ignore[arg-type]


async def _until_signalled() -> None:
    """Return at the first SIGINT or SIGTERM (hypercorn then shuts down gracefully)."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return
