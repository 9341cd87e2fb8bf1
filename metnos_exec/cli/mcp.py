"""``metnos-exec mcp``: serve every executor as a Model Context Protocol tool over the queue
(`metnos_exec.tools.mcp_server` does the serving; this is its command line)."""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import MetnosError
from ._common import EXIT, Subparsers, _Exit, _exit_for, _open, _positive_float, add_command

#: Where the bearer token comes from when ``--token`` is not given.
TOKEN_ENV = "METNOS_MCP_TOKEN"


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: give HOST:PORT (e.g. 127.0.0.1:8765)")
    return (host or "127.0.0.1"), int(port)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds, 0 or more")
    return value


def _cmd_mcp(ns: argparse.Namespace) -> int:
    try:
        from ..tools import mcp_server
    except ImportError as exc:
        raise _Exit(
            EXIT["usage"],
            f"metnos-exec mcp needs the mcp extra ({exc}): pip install 'metnos-exec[mcp]'",
        ) from None
    from ..manifest import ExecutorRegistry

    token = ns.token or os.environ.get(TOKEN_ENV) or None
    if ns.http is not None:
        try:
            mcp_server.check_http_bind(ns.http[0], token)
        except ValueError as exc:
            raise _Exit(EXIT["usage"], str(exc)) from None
    try:
        registry = None if ns.executors is None else ExecutorRegistry.load(ns.executors)
    except MetnosError as exc:
        raise _Exit(EXIT["usage"], str(exc)) from None

    async def go() -> int:
        from ..client import Client

        async with _open(ns.broker, create=True) as broker:
            client = Client(broker)
            gateway = mcp_server.McpGateway(
                client,
                registry,
                undo_tool=ns.undo_tool,
                assume_staged=ns.assume_staged,
                progress_every=ns.progress_every,
                log=(lambda _line: None) if ns.quiet else None,
                tasks=None if ns.no_tasks else mcp_server.TaskPolicy(ns.tasks_over),
            )
            if ns.http is None:
                await mcp_server.serve_stdio(gateway)
            else:
                host, port = ns.http

                def ready(bound: int) -> None:
                    shown = f"[{host}]" if ":" in host else host
                    print(f"metnos-exec mcp: http://{shown}:{bound}/mcp", file=sys.stderr)
                    sys.stderr.flush()

                await mcp_server.serve_http(gateway, host, port, token=token, ready=ready)
        return 0

    import anyio

    try:
        out: int = anyio.run(go, backend=ns.backend)
    except MetnosError as exc:
        raise _Exit(_exit_for(exc), str(exc)) from None
    return out


def register(subparsers: Subparsers) -> None:
    """Add ``mcp``."""
    m = add_command(
        subparsers,
        "mcp",
        "serve the executors as MCP tools (stdio or streamable HTTP)",
        "Serve every executor as a Model Context Protocol tool: a tool call is a job on "
        "the queue, run by a worker, its result the tool's result (refusals and failed "
        "jobs as error results the model can read; the containment report, the job id "
        "and the undo ids in _meta). Needs the mcp extra: pip install 'metnos-exec[mcp]'. "
        "Start workers on the same --broker. HTTP binds 127.0.0.1 unless told otherwise, "
        f"and any address but 127.0.0.1, ::1 or localhost needs --token (or ${TOKEN_ENV}).",
    )
    how = m.add_mutually_exclusive_group(required=True)
    how.add_argument("--stdio", action="store_true", help="speak MCP on stdin/stdout")
    how.add_argument(
        "--http",
        type=_host_port,
        metavar="HOST:PORT",
        help="streamable HTTP at http://HOST:PORT/mcp (port 0: any free one, printed)",
    )
    m.add_argument(
        "--executors",
        metavar="DIR",
        default=None,
        help="the executors' folder (default: the catalog the server workers publish)",
    )
    m.add_argument(
        "--token",
        default=None,
        help=f"bearer token every HTTP request must carry (default: ${TOKEN_ENV})",
    )
    m.add_argument(
        "--undo-tool",
        action="store_true",
        help="also serve metnos_undo: undo the file changes of an earlier call",
    )
    m.add_argument(
        "--assume-staged",
        action="store_true",
        help="every worker stages writes (overlayfs): file-only writers are then "
        "annotated destructiveHint=false",
    )
    m.add_argument(
        "--progress-every",
        type=_positive_float,
        default=1.0,
        metavar="S",
        help="seconds between progress notifications while a job runs (default 1)",
    )
    m.add_argument(
        "--tasks-over",
        type=_non_negative_float,
        default=30.0,
        metavar="S",
        help="answer a call as an MCP Task (io.modelcontextprotocol/tasks; task id = job id) "
        "when the client declares the extension and the tool's timeout exceeds S seconds "
        "(0: every call; default 30)",
    )
    m.add_argument(
        "--no-tasks",
        action="store_true",
        help="never answer with a task, and do not advertise the tasks extension",
    )
    m.add_argument(
        "--quiet", action="store_true", help="no line on stderr per call (job id, verdict)"
    )
    m.add_argument(
        "--backend",
        choices=("asyncio", "trio"),
        default="asyncio",
        help="the event loop (asyncio or trio, for either transport)",
    )
    m.set_defaults(fn=_cmd_mcp)
