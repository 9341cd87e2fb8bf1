"""Progress from executors: the channel a running guest reports on, and the worker's reader.

The protocol, for executor authors (README, "Reporting progress"):

- A guest whose environment has ``METNOS_PROGRESS_FD=N`` may write progress lines to
  descriptor ``N``, an inherited pipe (the bwrap and direct arms). Without the variable
  nobody listens: an executor checks it, and reports nothing when it is absent. Its one
  JSON result still goes to stdout; the two cannot be confused.
- One JSON object per line, UTF-8, ending in ``\\n``:
  ``{"progress": 0.0..1.0, "message": "..."}``; either key may be left out, not both.
  A line is at most `MAX_LINE_BYTES` bytes with its newline; a message is cut to
  `MAX_MESSAGE_CHARS` characters.
- Rate: the worker reads at most `READ_BYTES` every `READ_EVERY_S` seconds; of the lines
  one read brings, only the last is parsed (the others are counted as ``dropped``), and
  the latest value is stored at most once a second. A guest writing faster than that
  fills the pipe and its writes block: the job is throttled, never the worker.
- A malformed line (not JSON, not an object, a ``progress`` that is not a number from 0
  to 1, a ``message`` that is not a string, a line too long) is ignored and counted
  (``malformed``); it never fails the job.

The supervisor opens `reporting_progress` around `Sandbox.run` with a sink; an arm that
supports the channel (`progress_sink` is not ``None``) opens a `ProgressChannel`, puts its
`ProgressChannel.env` in the guest's environment, passes `ProgressChannel.write_fd` to
the child, runs `ProgressChannel.pump` beside it (`ProcessSpec.beside`) and calls
`ProgressChannel.finish` once the child is gone. The sink is called on the event loop,
at most once a read, and must be cheap (the supervisor keeps the value in memory).

The wasm arm does not offer the channel (WASI preview 1 gives a guest no descriptor but
its stdio and preopened folders; see the README): its guests get no variable.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
from collections.abc import Callable, Iterator
from typing import Any, Final, NamedTuple

import anyio
import msgspec

__all__ = (
    "MAX_LINE_BYTES",
    "MAX_MESSAGE_CHARS",
    "PROGRESS_FD_ENV",
    "READ_BYTES",
    "READ_EVERY_S",
    "ProgressChannel",
    "ProgressReader",
    "ProgressReport",
    "ProgressSink",
    "open_channel",
    "parse_line",
    "progress_sink",
    "reporting_progress",
)

#: The guest's variable naming the descriptor it may write progress lines to.
PROGRESS_FD_ENV: Final = "METNOS_PROGRESS_FD"
#: The longest progress line, newline included; a longer one is malformed.
MAX_LINE_BYTES: Final = 1024
#: A message is cut to this many characters.
MAX_MESSAGE_CHARS: Final = 200
#: Bytes the worker reads from one job's channel at a time ...
READ_BYTES: Final = 16 * 1024
#: ... and how long it waits before the next read: at most 160 KiB a second a job.
READ_EVERY_S: Final = 0.1
#: Bytes read at the end of a run (what the guest wrote since the last read, at most a
#: pipe's worth).
_FINAL_BYTES: Final = 64 * 1024


class ProgressReport(NamedTuple):
    """What the reader knows of a job's progress: the latest good line's values (both
    ``None``/``""`` before one) and the counts of lines read, dropped and malformed."""

    fraction: float | None
    message: str
    lines: int
    dropped: int
    malformed: int


ProgressSink = Callable[[ProgressReport], None]

_decoder = msgspec.json.Decoder()


def parse_line(line: bytes) -> tuple[float | None, str] | None:
    """A progress line's (fraction, message), or ``None`` when it is malformed."""
    if len(line) >= MAX_LINE_BYTES:
        return None
    try:
        doc: Any = _decoder.decode(line)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or ("progress" not in doc and "message" not in doc):
        return None
    fraction = doc.get("progress")
    message = doc.get("message", "")
    if fraction is not None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            return None
        if not (0.0 <= fraction <= 1.0) or math.isnan(fraction):
            return None
        fraction = float(fraction)
    if not isinstance(message, str):
        return None
    return fraction, message[:MAX_MESSAGE_CHARS]


class ProgressReader:
    """Splits a channel's bytes into lines and keeps the latest good one (see the module
    docstring for what is dropped and what is malformed)."""

    def __init__(self, sink: ProgressSink) -> None:
        self._sink = sink
        self._partial = b""
        #: Inside a line already too long: skip to its newline.
        self._skipping = False
        self.fraction: float | None = None
        self.message = ""
        self.lines = 0
        self.dropped = 0
        self.malformed = 0

    def report(self) -> ProgressReport:
        return ProgressReport(self.fraction, self.message, self.lines, self.dropped, self.malformed)

    def feed(self, data: bytes) -> None:
        """Take one read's bytes; tell the sink when something changed."""
        parts = data.split(b"\n")
        head, rest = parts[0], parts[-1]
        complete: list[bytes] = []
        if len(parts) > 1:
            if self._skipping:
                self._skipping = False  # the tail of a line counted malformed already
            else:
                complete.append(self._partial + head)
            complete += parts[1:-1]
            self._partial = b""
        elif self._skipping:
            rest = b""
        else:
            rest = self._partial + rest
        if len(rest) >= MAX_LINE_BYTES:
            self._skipping, rest = True, b""
            self.lines += 1
            self.malformed += 1
        self._partial = rest
        if complete:
            self._take(complete)
        if complete or self._skipping:
            self._sink(self.report())

    def _take(self, complete: list[bytes]) -> None:
        """Parse the last of `complete` (a line that is not JSON counts as malformed, the
        earlier ones as dropped)."""
        self.lines += len(complete)
        self.dropped += len(complete) - 1
        parsed = parse_line(complete[-1])
        if parsed is None:
            self.malformed += 1
            return
        fraction, message = parsed
        if fraction is not None:
            self.fraction = fraction
        self.message = message


class ProgressChannel:
    """One job's progress pipe: the guest's end (`write_fd`, inherited, blocking) and the
    worker's (read without blocking, at the bounded rate).

    Raises:
        OSError: no pipe could be made (the caller runs the job without the channel).
    """

    def __init__(self, sink: ProgressSink) -> None:
        self.read_fd, self.write_fd = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(self.read_fd, False)
        self.reader = ProgressReader(sink)

    def env(self) -> dict[str, str]:
        """The guest's variable naming its end of the pipe."""
        return {PROGRESS_FD_ENV: str(self.write_fd)}

    async def pump(self) -> None:
        """Read the channel at the bounded rate until the guest's ends are all closed (or
        the run cancels it). Never raises but for cancellation."""
        fd = self.read_fd
        while True:
            try:
                chunk = os.read(fd, READ_BYTES)
            except BlockingIOError:
                await anyio.wait_readable(fd)
                continue
            except OSError:
                return  # nothing to read any more; progress is advice, the job goes on
            if not chunk:
                return
            self.reader.feed(chunk)
            # The rate bound: a flooding guest blocks on the full pipe meanwhile.
            await anyio.sleep(READ_EVERY_S)

    def finish(self) -> None:
        """Read what the guest wrote since the last read (the run is over), then close
        both ends. Idempotent."""
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1
        if self.read_fd < 0:
            return
        with contextlib.suppress(OSError):
            left = _FINAL_BYTES
            while left > 0 and (chunk := os.read(self.read_fd, min(left, READ_BYTES))):
                self.reader.feed(chunk)
                left -= len(chunk)
        os.close(self.read_fd)
        self.read_fd = -1


#: The sink of the run the current task is in (`reporting_progress`).
_SINK: contextvars.ContextVar[ProgressSink | None] = contextvars.ContextVar(
    "metnos_exec_progress_sink", default=None
)


@contextlib.contextmanager
def reporting_progress(sink: ProgressSink | None) -> Iterator[None]:
    """Hand `sink` to the arm's run started while this is open (``None``: no channel)."""
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


def progress_sink() -> ProgressSink | None:
    """The sink an arm should report this run's progress to, or ``None``."""
    return _SINK.get()


def open_channel() -> ProgressChannel | None:
    """A channel for the current run when someone listens (`reporting_progress`), else
    ``None``; also ``None`` when no pipe can be made (out of descriptors: the job runs
    without progress rather than not at all)."""
    sink = _SINK.get()
    if sink is None:
        return None
    try:
        return ProgressChannel(sink)
    except OSError:
        return None
