"""How the commands that wait for a job show it: its id, the wait (with elapsed-time
feedback, and a hint when no worker has leased the job), the result read by people or as
JSON, and the exit code its status means (`_STATUS_EXIT`).

Everything a job wrote is shown through `visible`: none of it may drive the terminal.
"""

from __future__ import annotations

import sys
import time
from typing import Final, TextIO

import msgspec

from .._terminal import visible
from ..brokers import JobState, redact_url
from ..changeset import describe_changes
from ..client import Client
from ..messages import Result
from ._common import _dump_json

_STATUS_EXIT: Final = {
    "succeeded": 0,
    "failed": 1,
    "timed_out": 1,
    "cancelled": 1,
    "dead": 1,
    "rejected": 3,
    "awaiting_approval": 6,
}


def _print_job_id(job_id: str, *, as_json: bool) -> None:
    if as_json:
        _dump_json({"job_id": job_id}, sys.stdout)
    else:
        sys.stdout.write(job_id + "\n")


def _print_result(result: Result, *, as_json: bool, out: TextIO, changes: bool = False) -> None:
    if as_json:
        _dump_json(result, out)
        return
    # Everything a job could have written (its output, stderr, a trap message, an error
    # quoting it) goes through `visible`: none of it may drive the operator's terminal.
    arm = result.containment.sandbox if result.containment else "-"
    lines = [
        visible(f"{result.status}  job {result.job_id}  (attempt {result.attempt}, sandbox {arm})")
    ]
    if result.error is not None:
        lines.append(visible(f"  error: {result.error.code}: {result.error.message}"))
    if result.exit is not None:
        exit_name = type(result.exit).__name__
        detail = msgspec.to_builtins(result.exit)
        extra = {k: v for k, v in detail.items() if k != "type"} if isinstance(detail, dict) else {}
        lines.append(visible(f"  exit: {exit_name}{' ' + str(extra) if extra else ''}"))
    if result.containment is not None:
        axes = result.containment.axes()
        partial = [name for name, v in axes.items() if v.state == "partial"]
        not_kept = [name for name, v in axes.items() if v.state == "not_kept"]
        parts = []
        if partial:
            parts.append("partial: " + ", ".join(partial))
        if not_kept:
            parts.append("not kept: " + ", ".join(not_kept))
        lines.append("  containment: " + ("; ".join(parts) if parts else "all walls kept"))
    if result.usage is not None:
        lines.append(f"  wall: {result.usage.wall_s:.3f} s")
    if result.undo_ids:
        # What `metnos-exec undo` needs to know exists (the human output hid it).
        ids = ", ".join(visible(u) for u in result.undo_ids)
        lines.append(f"  undo: {ids} (metnos-exec undo {visible(result.job_id)})")
    if result.output is not None:
        text = msgspec.json.format(msgspec.json.encode(result.output), indent=2).decode()
        if len(text) > 4000:
            text = text[:4000] + "\n  … (truncated; use --json for everything)"
        # JSON strings hold no raw line breaks: every newline here is the formatter's.
        lines.append("  output: " + visible(text, newlines=True).replace("\n", "\n  "))
    if result.stderr.strip():
        tail_ = visible(result.stderr.strip()[-1000:], newlines=True)
        lines.append("  stderr: " + tail_.replace("\n", "\n          "))
    if result.changes is not None:
        if changes:
            text = visible(describe_changes(result.changes), newlines=True)
            lines.append("  changes:\n    " + text.replace("\n", "\n    "))
        else:
            lines.append(
                f"  changes: {result.changes.total} path(s) "
                f"(metnos-exec result {visible(result.job_id)} --changes)"
            )
    out.write("\n".join(lines) + "\n")


class _Progress:
    """Elapsed-time feedback on stderr while waiting: a spinner on a TTY, else a line
    every `period_s` (so CI logs show liveness without flooding)."""

    _FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"

    def __init__(self, what: str, *, stream: TextIO | None = None, period_s: float = 10.0):
        self.what = what
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.period_s = period_s
        self.start = time.monotonic()
        self._last = self.start
        self._i = 0

    def tick(self, state: str = "") -> None:
        now = time.monotonic()
        elapsed = now - self.start
        if self.tty:
            frame = self._FRAMES[self._i % len(self._FRAMES)]
            self._i += 1
            self.stream.write(f"\r{frame} {self.what} {state} {elapsed:5.1f}s ")
            self.stream.flush()
        elif now - self._last >= self.period_s:
            self._last = now
            self.stream.write(f"… {self.what} {state} ({elapsed:.0f} s)\n")
            self.stream.flush()

    def done(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _never_leased(state: JobState | None) -> bool:
    return state is not None and state.state == "queued" and state.worker is None


_NO_WORKER = (
    "no worker has leased it: is a worker running on this queue? (metnos-exec worker "
    "--broker {url} --executors DIR)"
)


async def _wait_result(
    client: Client, job_id: str, wait: float | None
) -> tuple[Result | None, JobState | None]:
    """The result, or ``None`` at the deadline, with the job's last seen state."""
    progress = _Progress(f"waiting for {job_id}")
    deadline = None if wait is None else time.monotonic() + wait
    step = 0.1 if progress.tty else 1.0
    state: JobState | None = None
    try:
        while True:
            chunk = step if deadline is None else max(0.0, min(step, deadline - time.monotonic()))
            result = await client.broker.wait_result(job_id, timeout=chunk)
            if result is not None:
                return result, state
            state = await client.broker.get_job_state(job_id)
            if deadline is not None and time.monotonic() >= deadline:
                return None, state
            what: str = state.state if state else ""
            if _never_leased(state):
                what = "queued (no worker has taken it yet)"
            progress.tick(what)
    finally:
        progress.done()


def _pending_message(job_id: str, wait: float | None, state: JobState | None, url: str) -> str:
    base = f"no result for {job_id} within {wait:g} s" if wait is not None else f"{job_id}"
    if _never_leased(state):
        return f"{base}: {_NO_WORKER.format(url=redact_url(url))}"
    if state is not None:
        return f"{base}: it is {state.state} (attempt {state.attempt})"
    return base
