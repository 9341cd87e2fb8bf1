"""An executor as a Model Context Protocol tool, and a job's `Result` as a tool result.

Plain dicts in the MCP wire shape (camelCase keys): this module imports no MCP SDK, so
the rules are testable without the extra and readable in one place.

**Annotations** are hints for a client deciding whether to ask its user first. They are
derived from the *declared* capabilities, every one of them, ``when`` clauses ignored (a
capability that some arguments activate is counted as if active: a client sees one
annotation for every call of the tool, so it must hold for the worst call):

- ``readOnlyHint``: true only when the executor declares no ``fs:write``, is not
  ``mutating``, and declares no ``network:*`` and no ``provider:*`` capability. A network
  request can change the world (a POST, a sent mail) even when no local file changes,
  so a tool that talks to the network is never called read-only.
- ``openWorldHint``: true when it declares a ``network:*`` or ``provider:*`` capability;
  false otherwise (its world is the folders of its ``fs`` hints).
- ``destructiveHint`` (only said for a tool that is not read-only): false only when
  every effect the tool can have is a file write under ``fs:write`` (no network, no
  provider: what leaves the machine no undo brings back) *and* the operator told the
  server that every worker stages writes (``assume_staged``, ``--assume-staged``). The
  server cannot see the workers' hosts: where overlay staging is unavailable a worker
  falls back to backing up the declared targets only (``sandbox.degraded``, reason
  ``no_staging``; the undo entry says what it does not cover in ``lost``), and then a
  write is not fully undoable. So by default every writer is ``destructiveHint: true``.
- ``idempotentHint``: the manifest's ``idempotent`` (false unless its author says so).

**Results**: a succeeded job is ``structuredContent`` (its JSON output: an object as it
is, any other value as ``{"result": value}``, since MCP before 2026-07-28 allows only an
object there) and one text block (the output as JSON, a string output as itself). When
the manifest declares its output (``[output.*]``, the tool's ``outputSchema``), MCP
requires ``structuredContent`` to conform: an output that does not is an ``isError``
result (``error_code`` ``E_BAD_OUTPUT``) whose text says what broke the schema and
shows the output, never structured content that a client's validator would reject. Any
other verdict is ``isError: true`` with a text that names the verdict, the error code and
its sentence, so a model can adapt; never a protocol error. ``_meta`` holds ``job_id``,
``status``, ``containment`` (the report of which walls held), ``undo_ids``, and for an
error ``error_code``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Final

import msgspec

from ..manifest import Manifest
from ..messages import UNDO_EXECUTOR, Result
from ..toolspec import input_schema, output_problem, output_schema, tool_name

__all__ = (
    "BAD_STRUCTURED_OUTPUT",
    "UNDO_TOOL",
    "tool_annotations",
    "error_result",
    "tool_definition",
    "tool_result",
    "undo_tool_definition",
)

#: The name of the undo tool (``--undo-tool``).
UNDO_TOOL: Final = tool_name(UNDO_EXECUTOR)

#: The ``error_code`` of a succeeded job whose output breaks the tool's ``outputSchema``.
BAD_STRUCTURED_OUTPUT: Final = "E_BAD_OUTPUT"

#: Capability kinds whose effects leave the machine.
_OPEN_WORLD_KINDS: Final = ("network", "provider")

#: What a failed or refused job's text starts with, by status.
_VERDICT: Final = {
    "rejected": "refused: the job was not run",
    "failed": "the job failed",
    "timed_out": "the job ran out of time and was stopped",
    "cancelled": "the job was cancelled",
    "dead": "the job was given up after its retries",
    "awaiting_approval": "the job ran; its file changes wait for an approval",
}


def _kinds(manifest: Manifest) -> set[str]:
    return {cap.name.partition(":")[0] for cap in manifest.capabilities}


def tool_annotations(manifest: Manifest, *, assume_staged: bool = False) -> dict[str, Any]:
    """The tool annotations of `manifest` (see the module's text for each rule)."""
    names = {cap.name for cap in manifest.capabilities}
    open_world = bool(_kinds(manifest) & set(_OPEN_WORLD_KINDS))
    writes = "fs:write" in names or manifest.is_mutating
    out: dict[str, Any] = {
        "title": manifest.name,
        "readOnlyHint": not writes and not open_world,
        "openWorldHint": open_world,
        "idempotentHint": manifest.idempotent,
    }
    if not out["readOnlyHint"]:
        out["destructiveHint"] = not (assume_staged and writes and not open_world)
    return out


def _description(manifest: Manifest) -> str:
    text = (manifest.description or f"Run the {manifest.name} executor").rstrip(".")
    hints = [f"{cap.name} {', '.join(cap.hints)}".strip() for cap in manifest.capabilities]
    where = f" It may use: {'; '.join(hints)}." if hints else " It uses no files or network."
    return (
        f"{text}.{where} Runs sandboxed as a metnos-exec job (timeout "
        f"{manifest.limits.timeout_s:g} s); arguments outside those hints are refused."
    )


def tool_definition(manifest: Manifest, *, assume_staged: bool = False) -> dict[str, Any]:
    """`manifest` as an MCP tool (``tools/list`` entry); ``outputSchema`` when the manifest
    declares its output (``[output.*]``)."""
    out: dict[str, Any] = {
        "name": tool_name(manifest.name),
        "description": _description(manifest),
        "inputSchema": input_schema(manifest),
    }
    declared = output_schema(manifest)
    if declared is not None:
        out["outputSchema"] = declared
    out["annotations"] = tool_annotations(manifest, assume_staged=assume_staged)
    out["_meta"] = {"executor": manifest.name, "version": manifest.version}
    return out


def undo_tool_definition() -> dict[str, Any]:
    """The ``metnos_undo`` tool: undo the file changes of a call this server made."""
    return {
        "name": UNDO_TOOL,
        "description": (
            "Undo the file changes of an earlier tool call of this server: give the job_id "
            "from that call's _meta (only calls whose _meta listed undo_ids can be undone). "
            "Refused, with nothing changed, when a file changed since."
        ),
        "inputSchema": {
            "type": "object",
            "properties": {
                "job_id": {"type": "string", "description": "the job_id of the call to undo"}
            },
            "required": ["job_id"],
            "additionalProperties": False,
        },
        "annotations": {
            "title": "undo",
            "readOnlyHint": False,
            "destructiveHint": True,
            "idempotentHint": False,
            "openWorldHint": False,
        },
    }


def _builtins(value: Any) -> Any:
    return msgspec.to_builtins(value) if value is not None else None


def _meta(result: Result) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "job_id": result.job_id,
        "status": result.status,
        "containment": _builtins(result.containment),
        "undo_ids": list(result.undo_ids),
    }
    if result.error is not None:
        meta["error_code"] = result.error.code
    if result.usage is not None:
        meta["usage"] = _builtins(result.usage)
    if result.changes is not None:
        meta["changes"] = _builtins(result.changes)
    return meta


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def _lost_walls(result: Result) -> Iterable[str]:
    return () if result.containment is None else result.containment.lost()


def tool_result(result: Result, manifest: Manifest | None = None) -> dict[str, Any]:
    """`result` as an MCP ``CallToolResult`` (see the module's text), its output checked
    against `manifest`'s output schema when it declares one."""
    meta = _meta(result)
    problem = None if manifest is None else output_problem(manifest, result.output)
    if result.status in ("succeeded", "awaiting_approval") and problem is not None:
        meta["error_code"] = BAD_STRUCTURED_OUTPUT
        text = (
            f"the job succeeded (job {result.job_id}) but its output does not match the "
            f"tool's output schema: {problem}. {BAD_STRUCTURED_OUTPUT}; the output was: "
            f"{_text(result.output)[:2000]}"
        )
        return {"content": [{"type": "text", "text": text}], "isError": True, "_meta": meta}
    if result.status in ("succeeded", "awaiting_approval"):
        output = result.output
        structured = output if isinstance(output, dict) else {"result": output}
        text = _text(output)
        if result.status == "awaiting_approval":
            meta["awaiting_approval"] = True
            text = (
                f"the job ran; its file changes await approval (job {result.job_id}): "
                f"`metnos-exec approve {result.job_id}` commits them, `metnos-exec reject "
                f"{result.job_id}` discards them; the change set is in _meta.changes. "
                f"Output: {text}"
            )
        return {
            "content": [{"type": "text", "text": text}],
            "structuredContent": structured,
            "isError": False,
            "_meta": meta,
        }
    lines = [f"{_VERDICT.get(result.status, result.status)} (job {result.job_id})."]
    if result.error is not None:
        lines.append(f"{result.error.code}: {result.error.message}")
    if result.status == "failed" and result.stderr:
        lines.append(f"stderr (end): {result.stderr[-1000:]}")
    lost = list(_lost_walls(result))
    if lost:
        lines.append(f"walls not fully kept: {', '.join(lost)}")
    return {"content": [{"type": "text", "text": "\n".join(lines)}], "isError": True, "_meta": meta}


def error_result(code: str, message: str, **meta: Any) -> dict[str, Any]:
    """An ``isError`` tool result for a call refused before any job ran (a bad argument,
    an unknown executor, the queue's store failing...)."""
    return {
        "content": [{"type": "text", "text": f"refused: {code}: {message}"}],
        "isError": True,
        "_meta": {"error_code": code, **meta},
    }
