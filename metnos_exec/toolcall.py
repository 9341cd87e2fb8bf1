"""A model's tool call in, the provider-shaped result out (`Client.run_tool_call`).

Three shapes of call are understood, as dicts or as the SDKs' objects (read through
``model_dump()`` or their attributes; no SDK is imported), each answered in its own shape:

* OpenAI Chat Completions: ``{"id", "type": "function", "function": {"name",
  "arguments": JSON text}}`` → ``{"role": "tool", "tool_call_id", "content"}``;
* OpenAI Responses: ``{"type": "function_call", "call_id", "name", "arguments"}`` →
  ``{"type": "function_call_output", "call_id", "output"}``;
* Anthropic: ``{"type": "tool_use", "id", "name", "input": {...}}`` →
  ``{"type": "tool_result", "tool_use_id", "content", "is_error"}``.

The text the model reads (`result_text`) is the executor's JSON output, then one line on
how the job was contained (the sandbox, which walls held, which did not and why) and its
undo ids. A job that did not succeed (refused before it ran, failed, out of time,
cancelled, given up) starts with ``ERROR:`` and says what was refused and why, and the
Anthropic result has ``is_error: true``; so does a call the queue could not take (unknown
tool, arguments that are not a JSON object), so that the model can adapt instead of the
loop stopping.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final, Literal

import msgspec

from .errors import BadMessage
from .messages import Result

__all__ = ("ToolCall", "error_result", "parse_tool_call", "result_text", "tool_result")

Provider = Literal["openai-chat", "openai-responses", "anthropic"]

#: How much of a job's stderr an error text quotes (its end, where the traceback is).
_STDERR_TAIL: Final = 600
_REASON_CAP: Final = 160

_NOT_SUCCEEDED: Final = {
    "rejected": "was refused before it ran; nothing ran",
    "failed": "failed",
    "timed_out": "ran out of time and was stopped",
    "cancelled": "was cancelled",
    "dead": "was given up after its last attempt",
    "awaiting_approval": "ran; its file changes wait for an approval (metnos-exec approve)",
}


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """One tool call, whatever its provider.

    Attributes:
        provider: whose shape it came in (and the result goes out in).
        id: the call's id (``id``, or the Responses item's ``call_id``).
        name: the tool's name.
        args: its arguments (``None`` when they are not a JSON object: see `problem`).
        problem: why the call cannot be run as given, for the model to read.
    """

    provider: Provider
    id: str
    name: str
    args: dict[str, Any] | None = None
    problem: str | None = None


def _as_dict(obj: Any) -> dict[str, Any]:
    """`obj` as a dict: a mapping, a pydantic model (the SDKs'), or any object's attributes."""
    if isinstance(obj, Mapping):
        return dict(obj)
    dump = getattr(obj, "model_dump", None)
    if callable(dump):
        dumped = dump()
        if isinstance(dumped, Mapping):
            return dict(dumped)
    names = ("type", "id", "call_id", "name", "arguments", "input", "function")
    return {n: getattr(obj, n) for n in names if getattr(obj, n, None) is not None}


def _decode_arguments(text: Any) -> tuple[dict[str, Any] | None, str | None]:
    if isinstance(text, Mapping):  # some frameworks hand the arguments over decoded
        return dict(text), None
    if text is None or (isinstance(text, str) and not text.strip()):
        return {}, None  # a call of a tool without arguments
    if not isinstance(text, str):
        return None, f"the arguments must be a JSON object, got {type(text).__name__}"
    try:
        value = json.loads(text)
    except ValueError as exc:
        return None, f"the arguments are not valid JSON ({exc}): {text[:200]!r}"
    if not isinstance(value, dict):
        return None, f"the arguments must be a JSON object, got {type(value).__name__}"
    return value, None


def parse_tool_call(call: Any) -> ToolCall:
    """Read `call` (see the module docstring for the three shapes).

    Raises:
        BadMessage: `call` is none of the three shapes (it has no result shape either).
    """
    raw = _as_dict(call)
    kind = raw.get("type")
    if kind == "tool_use":
        provider: Provider = "anthropic"
        call_id, name = raw.get("id"), raw.get("name")
        args, problem = _decode_arguments(raw.get("input") if "input" in raw else {})
    elif kind == "function_call":
        provider = "openai-responses"
        call_id, name = raw.get("call_id"), raw.get("name")
        args, problem = _decode_arguments(raw.get("arguments"))
    elif "function" in raw and kind in ("function", None):
        provider = "openai-chat"
        function = _as_dict(raw["function"])
        call_id, name = raw.get("id"), function.get("name")
        args, problem = _decode_arguments(function.get("arguments"))
    else:
        raise BadMessage(
            "not a tool call: expected an OpenAI tool_call ({id, type: function, function}), "
            "a Responses function_call ({type: function_call, call_id, name, arguments}) or "
            f"an Anthropic tool_use block ({{type: tool_use, id, name, input}}); got {kind!r}"
        )
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise BadMessage(f"a {provider} tool call needs a string id and name")
    return ToolCall(provider=provider, id=call_id, name=name, args=args, problem=problem)


def _cap(text: str, n: int = _REASON_CAP) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def containment_line(result: Result) -> str:
    """One readable line: the job, the sandbox, which walls held, the undo ids."""
    line = f"[metnos-exec] job {result.job_id} {result.status}"
    report = result.containment
    if report is not None:
        lost = {name: v for name, v in report.axes().items() if v.state != "kept"}
        if not lost:
            line += f" in the {report.sandbox} sandbox (every wall held)"
        else:
            walls = "; ".join(f"{n} {v.state}: {_cap(v.reason)}" for n, v in lost.items())
            line += f" in the {report.sandbox} sandbox (walls not fully held: {walls})"
    if result.undo_ids:
        line += (
            f"; its file changes can be undone (`metnos-exec undo {result.job_id}`; "
            f"undo ids: {', '.join(result.undo_ids)})"
        )
    return line + "."


def result_text(result: Result) -> str:
    """What the model reads about `result` (see the module docstring)."""
    lines: list[str] = []
    if result.status != "succeeded":
        what = _NOT_SUCCEEDED.get(result.status, result.status)
        error = result.error
        why = f" ({error.code}): {error.message}" if error is not None else ""
        lines.append(f"ERROR: the tool call {what}{why}")
    if result.output is not None:
        lines.append(json.dumps(result.output, ensure_ascii=False))
    if result.status != "succeeded" and result.stderr.strip():
        lines.append(f"stderr (end): {result.stderr.strip()[-_STDERR_TAIL:]}")
    lines.append(containment_line(result))
    return "\n".join(lines)


def _shaped(call: ToolCall, text: str, is_error: bool) -> dict[str, Any]:
    if call.provider == "anthropic":
        return {
            "type": "tool_result",
            "tool_use_id": call.id,
            "content": text,
            "is_error": is_error,
        }
    if call.provider == "openai-responses":
        return {"type": "function_call_output", "call_id": call.id, "output": text}
    return {"role": "tool", "tool_call_id": call.id, "content": text}


def tool_result(call: ToolCall, result: Result) -> dict[str, Any]:
    """The provider-shaped result of `call` that ran as `result`."""
    return _shaped(call, result_text(result), result.status != "succeeded")


def error_result(call: ToolCall, message: str) -> dict[str, Any]:
    """The provider-shaped error result of `call` that could not be run (`message`: why)."""
    return _shaped(call, f"ERROR: {message}", True)
