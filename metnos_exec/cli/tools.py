"""``metnos-exec tools``: the executors as tool definitions for a model API, as one JSON
document (`metnos_exec.tools.export`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..errors import BadManifest
from ..tools.export import FORMATS, ToolFormat, definitions_from_catalog, definitions_from_folder
from ._common import EXIT, Subparsers, _dump_json, _Exit, _open, _run, add_command


def _strict_notes(definitions: list[dict[str, Any]]) -> None:
    for d in definitions:
        params = d.get("function", d).get("parameters", {})
        if "$comment" in params:
            name = d.get("function", d)["name"]
            print(f"metnos-exec: note: {name}: {params['$comment']}", file=sys.stderr)


def _cmd_tools(ns: argparse.Namespace) -> int:
    fmt: ToolFormat = ns.format
    if ns.executors is not None:
        try:
            definitions, errors = definitions_from_folder(ns.executors, fmt)
        except BadManifest as exc:
            raise _Exit(EXIT["usage"], str(exc)) from None
        for error in errors.values():
            print(f"metnos-exec: left out: {error}", file=sys.stderr)
        where = f"the folder {ns.executors}"
    else:
        definitions = []

        async def go() -> int:
            async with _open(ns.broker) as broker:
                definitions.extend(await definitions_from_catalog(broker, fmt))
            return 0

        _run(go)
        where = "the catalog (no server worker has published its executors to this broker)"
    if not definitions:
        raise _Exit(
            EXIT["not_found"],
            f"no executor to export from {where}; start a worker, or give --executors DIR",
        )
    _strict_notes(definitions)
    _dump_json(definitions, sys.stdout)
    return 0


def register(subparsers: Subparsers) -> None:
    """Add ``tools``."""
    t = add_command(
        subparsers,
        "tools",
        "print the executors as tool definitions for a model API (JSON)",
        "Print one JSON array of tool definitions, one per executor, ready to pass as a "
        "model API's `tools`: OpenAI Chat Completions (openai), OpenAI Responses "
        "(openai-responses), Anthropic Messages (anthropic) or MCP Tool objects (mcp). "
        "The executors come from --executors DIR, else from the catalog the server "
        "workers publish to the broker. OpenAI tools are strict unless strict mode would "
        "change what the tool accepts; such a tool is exported with strict: false and the "
        "reason in its parameters' $comment (and on stderr). Run a model's call with "
        "Client.run_tool_call.",
    )
    t.add_argument(
        "--format",
        choices=FORMATS,
        default="openai",
        help="the tool format (default: %(default)s)",
    )
    t.add_argument(
        "--executors",
        metavar="DIR",
        default=None,
        help="the executors folder to read (default: the broker's published catalog)",
    )
    t.set_defaults(fn=_cmd_tools)
