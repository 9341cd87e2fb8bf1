"""How a run's outcome becomes a `Result`: the table from the arm's exit to a status and
an error code, and the reading of the executor's stdout (one JSON document, or its raw
text and ``E_BAD_OUTPUT``). Pure functions: nothing here touches the store.

- ``Success`` → ``succeeded`` (``failed`` with ``E_BAD_OUTPUT`` when stdout is not one
  JSON document, or nests deeper than `MAX_OUTPUT_DEPTH`);
- ``Timeout`` → ``timed_out`` (``E_TIMEOUT``);
- ``Failure`` → ``failed`` (``E_EXIT``), ``Killed`` → ``E_KILLED``, ``MemoryExceeded`` →
  ``E_MEMORY``, ``FuelExhausted`` → ``E_FUEL``, ``Trap`` → ``E_TRAP``; anything else →
  ``E_FAILED``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import msgspec

from ..brokers.base import Lease
from ..messages import ErrorInfo, Result, cap_text
from ..sandbox._types import (
    ContainmentReport,
    Failure,
    FuelExhausted,
    Killed,
    MemoryExceeded,
    SandboxExit,
    SandboxOutcome,
    Success,
    Timeout,
    Trap,
    Usage,
)

__all__ = ("EX_TEMPFAIL", "MAX_OUTPUT_DEPTH", "RAW_OUTPUT_CAP_BYTES")

#: sysexits.h ``EX_TEMPFAIL``: an executor exiting with it asks to be retried later.
EX_TEMPFAIL: Final = 75

#: How much of a non-JSON stdout is kept (as text in ``Result.output``) for diagnosis.
RAW_OUTPUT_CAP_BYTES: Final = 4096

#: Deepest nesting of arrays and objects an executor's output may have (serde_json's
#: default). Deeper is ``E_BAD_OUTPUT``. Why a bound at all: the JSON decoder, the broker's
#: encoder and every reader of the result recurse once per level, so a job printing
#: 400,000 ``[`` exhausted the worker's stack (a ``RecursionError`` that came back as a
#: host fault); and a depth that decodes here could still fail when a reader with less
#: stack left encodes it again.
MAX_OUTPUT_DEPTH: Final = 128


def _exit_fields(exit_: SandboxExit | None) -> dict[str, Any]:
    if exit_ is None:
        return {"exit": None}
    return {"exit": msgspec.to_builtins(exit_)}


def _stopped_usage(
    measured: SandboxOutcome | None, started_at: float | None, clock: Callable[[], float]
) -> Usage | None:
    """The usage of a run stopped from outside: measured by its arm, else its wall time
    (``None``: it never launched)."""
    if measured is not None:
        return measured.usage
    return None if started_at is None else Usage(wall_s=clock() - started_at)


def _containment_summary(report: ContainmentReport | None) -> dict[str, Any] | None:
    if report is None:
        return None
    return {"sandbox": report.sandbox, **{k: v.state for k, v in report.axes().items()}}


def _outcome_result(
    make: Callable[..., Result], lease: Lease, outcome: SandboxOutcome, started_at: float
) -> Result:
    """The result of a run the arm finished (`make`: the supervisor's result builder)."""
    exit_ = outcome.exit
    stderr, stderr_cut = cap_text(outcome.stderr)
    common: dict[str, Any] = {
        "exit": exit_,
        "stderr": stderr,
        "stderr_truncated": outcome.stderr_truncated or stderr_cut,
        "stdout_truncated": outcome.stdout_truncated,
        "containment": outcome.containment,
        "usage": outcome.usage,
        "started_at": started_at,
        "egress": outcome.egress,
    }
    output, bad = _parse_output(outcome.stdout)
    if isinstance(exit_, Success):
        if bad is not None:
            return make(lease, "failed", output=output, error=bad, **common)
        return make(lease, "succeeded", output=output, **common)
    if isinstance(exit_, Timeout):
        budget = lease.job.timeout_s
        limit = f"{budget:g} s" if budget is not None else "manifest"
        err = ErrorInfo(code="E_TIMEOUT", message=f"the job exceeded its {limit} wall-time budget")
        return make(lease, "timed_out", output=output, error=err, **common)
    return make(lease, "failed", output=output, error=_exit_error(exit_), **common)


def _exit_error(exit_: SandboxExit) -> ErrorInfo:
    if isinstance(exit_, Failure):
        return ErrorInfo(code="E_EXIT", message=f"the executor exited with code {exit_.code}")
    if isinstance(exit_, Killed):
        why = f" ({exit_.limit} limit)" if exit_.limit else ""
        return ErrorInfo(
            code="E_KILLED", message=f"the executor was killed by signal {exit_.signal}{why}"
        )
    if isinstance(exit_, MemoryExceeded):
        return ErrorInfo(code="E_MEMORY", message="the executor exceeded its memory budget")
    if isinstance(exit_, FuelExhausted):
        return ErrorInfo(code="E_FUEL", message="the executor ran out of fuel")
    if isinstance(exit_, Trap):
        return ErrorInfo(code="E_TRAP", message=f"the guest trapped: {exit_.message}")
    return ErrorInfo(code="E_FAILED", message=f"the executor ended with {exit_!r}")


_ANY_JSON = msgspec.json.Decoder()


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` nests arrays/objects more than `limit` levels (iterative: a
    recursive walk would fail exactly where this check is needed)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _parse_output(stdout: bytes) -> tuple[Any, ErrorInfo | None]:
    """One JSON document, or the raw text (capped) and an ``E_BAD_OUTPUT`` error.

    Whatever the bytes are, the answer is one of those two: no input from a job may
    surface as an internal error or a host fault.
    """
    if not stdout.strip():
        return None, ErrorInfo(
            code="E_BAD_OUTPUT", message="the executor wrote nothing to stdout (expected JSON)"
        )
    try:
        value = _ANY_JSON.decode(stdout)
    except msgspec.DecodeError as exc:
        why = f"stdout is not one JSON document ({exc})"
    except RecursionError:
        why = f"stdout nests arrays or objects deeper than {MAX_OUTPUT_DEPTH} levels"
    else:
        # Only a document with more brackets than the limit can be deeper than it: the
        # common case costs two counts in C, not a walk.
        brackets = stdout.count(b"[") + stdout.count(b"{")
        if brackets <= MAX_OUTPUT_DEPTH or not _deeper_than(value, MAX_OUTPUT_DEPTH):
            return value, None
        why = f"stdout nests arrays or objects deeper than {MAX_OUTPUT_DEPTH} levels"
    raw, _ = cap_text(stdout, RAW_OUTPUT_CAP_BYTES)
    return raw, ErrorInfo(code="E_BAD_OUTPUT", message=f"{why}; the raw text is in output")
