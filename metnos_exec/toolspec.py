"""An executor as a tool: its name and its arguments as JSON Schema, for every tool format
(`metnos_exec.tools`: MCP, OpenAI, Anthropic) and for `Client.run_tool_call`.

The manifest's argument schema maps 1:1 onto JSON Schema: each argument is a property of
its ``type``, with its ``description``, ``enum`` and ``default``; required arguments are
listed in ``required``; no other property is accepted (``additionalProperties: false``),
as the worker refuses unknown arguments too. Tool names must match
``^[a-zA-Z0-9_-]{1,64}$`` (OpenAI's rule, the strictest): a manifest name already does;
the reserved undo executor (``metnos:undo``) becomes ``metnos_undo``.
"""

from __future__ import annotations

import re
from typing import Any, Final

from .manifest import ArgSpec, Manifest

__all__ = ("TOOL_NAME_RE", "arg_schema", "executor_for_tool", "input_schema", "tool_name")

#: What every tool format accepts as a tool name.
TOOL_NAME_RE: Final = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def tool_name(executor: str) -> str:
    """The tool name of `executor`: itself when allowed, else with every other character
    replaced by ``_`` and cut to 64 (names are unique while executors' names are: a
    manifest name is ``[a-z][a-z0-9_-]{0,63}``, and only reserved names hold ``:``)."""
    if TOOL_NAME_RE.fullmatch(executor):
        return executor
    return re.sub(r"[^a-zA-Z0-9_-]", "_", executor)[:64] or "_"


def executor_for_tool(name: str, executors: Any) -> str | None:
    """The executor among `executors` (names) whose tool name is `name`, or ``None``."""
    for executor in executors:
        if tool_name(executor) == name:
            return str(executor)
    return None


def arg_schema(spec: ArgSpec) -> dict[str, Any]:
    """One argument as a JSON Schema property."""
    out: dict[str, Any] = {"type": spec.type}
    if spec.description:
        out["description"] = spec.description
    if spec.enum is not None:
        out["enum"] = list(spec.enum)
    if spec.default is not None:
        out["default"] = spec.default
    return out


def input_schema(manifest: Manifest) -> dict[str, Any]:
    """The executor's arguments as one JSON Schema object (a tool's input schema)."""
    required = [name for name, spec in manifest.args.items() if spec.required]
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {name: arg_schema(spec) for name, spec in manifest.args.items()},
        "additionalProperties": False,
    }
    if required:
        schema["required"] = required
    return schema
