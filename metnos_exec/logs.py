"""Structured logs: one JSON object per line, a fixed event vocabulary, and `tail`.

structlog is configured once, at the entry point (`configure_logging`, called by the CLI,
the demo and `run_worker`); library code only ever calls
``structlog.get_logger("metnos_exec")`` and binds per-job context with
``structlog.contextvars.bound_contextvars`` so the job id, executor, worker, device and
sandbox arm appear on every record of a job without being passed around. A traced job's
records also carry ``trace_id`` and ``span_id`` (hex, as in a W3C ``traceparent``), bound
the same way by `metnos_exec.observe.tracing` when its span opens: a log line finds its
trace, and a trace its log lines.

A line looks like::

    {"ts":"2026-11-30T09:00:00.123Z","level":"info","event":"job.finished",
     "job_id":"01JDX9...","executor":"write_note","worker":"w1","device":"server",
     "sandbox":"bwrap","status":"succeeded",...}

Event names are a fixed, documented vocabulary (`EVENTS`): operators grep and alert on
them, so a new event is added here first, never invented at a call site.

Writing a record never raises: a log file on a full disk (the same disk as the queue,
often) must not take the worker down with it. A record that cannot be written is dropped
and counted, and the first record written again is preceded by one ``log.dropped``
record saying how many were lost.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import msgspec
import structlog

from ._terminal import visible

__all__ = (
    "EVENTS",
    "LEVELS",
    "configure_logging",
    "finished_level",
    "get_logger",
    "iter_records",
    "render_record",
    "tail",
)

#: The event vocabulary. Keys are the ``event`` values a record may carry; values say
#: when it is emitted and which fields (beyond the bound job context) it carries.
EVENTS: Mapping[str, str] = {
    "worker.started": "a worker began serving (executors, concurrency, backend: asyncio|trio)",
    "worker.draining": "SIGTERM/SIGINT received: no new leases; running jobs get grace_s",
    "worker.stopped": "the worker left its run loop (released: leases handed back)",
    "worker.signal": "a signal arrived (signal); the first drains, the second cuts grace",
    "worker.error": "an unexpected error in the worker's own loop (error); it keeps serving",
    "worker.no_keeper": "the keeper could not start: a worker killed while a job starts may "
    "leave that job's sandbox running (detail)",
    "files.tightened": "a private file or folder of the worker (queue, state, caches) was "
    "open to other users: their bits taken off (path, was, now, detail)",
    "files.exposed": "a private file or folder other users can reach was left as it is: "
    "not the worker's, a shared sticky folder, or not changeable (path, mode, detail)",
    "broker.error": "a broker call failed (the worker: op, code, error, failures, fatal; "
    "job_id, retry_in_s for a result kept to store again; gave_up when it no longer will "
    "be; the Redis broker: broker, error); no new job is leased until the store works",
    "broker.not_durable": "at start: a restart of the store would lose what it "
    "acknowledged (detail; e.g. Redis without appendonly); `doctor` says the fix",
    "broker.data_lost": "the store's data set is not the one this process saw (a Redis "
    "restarted without persistence, or flushed): once per loss, with cause (restart, flush, "
    "unknown), last_seen (the counts then: what was lost), last_seen_at, run_id_before, "
    "run_id_now, detail; kept for `status` and `doctor` for a week",
    "broker.restarted": "the Redis server restarted or failed over and kept the queue's data "
    "(broker, prefix, run_id_before, run_id_now)",
    "broker.recovered": "the store works again after failures (op, failures, down_s; Redis: "
    "broker, down_s)",
    "queue.purged": "finished jobs past retention were forgotten (jobs, collected, "
    "reclaimed_bytes, older_than_s)",
    "log.dropped": "records could not be written (count), e.g. on a full disk",
    "executor.load_failed": "a manifest in the executors folder failed to load (error)",
    "executor.verified": "an executor's signature verified at start (executor, copy: the "
    "private read-only copy its jobs run from)",
    "executor.signature_failed": "an executor's signature check failed at start (code, "
    "error); its jobs are refused with E_SIGNATURE until it is re-signed",
    "executor.not_packable": "a packable executor failed its dry run in the sandbox at "
    "start (import, error); its jobs are refused with E_BAD_MANIFEST",
    "fetch.started": "robust_fetch began a download (url, dest, size when known)",
    "fetch.progress": "download progress when stderr is not a terminal (url, done, total)",
    "fetch.retry": "a range or copy is fetched again (url, reason, attempt)",
    "fetch.finished": "a download matched its pinned SHA-256 (url, dest, bytes, seconds)",
    "fetch.failed": "a download gave up (url, code, error)",
    "fetch.part_discarded": "a .part that is not a regular file (a symlink) was removed, "
    "not written through (part, reason)",
    "worker.preloaded": "a wasm module made ready before the first job (module, how, seconds)",
    "worker.preload_failed": "a wasm module could not be preloaded (module, code, error)",
    "job.received": "a job was leased (attempt, max_attempts)",
    "job.rejected": "the job was refused before anything ran (code, message)",
    "capability.inactive": "a declared capability grants nothing for this job (detail)",
    "job.started": "the sandbox arm was chosen and the executor launched (timeout_s)",
    "sandbox.degraded": "the kernel wall is down; requested/used arm, reason, axes_lost",
    "egress.allowed": "the network wall relayed a connection of the job (host, port, via, "
    "address, sent, received, reason)",
    "egress.refused": "the network wall refused a connection or DNS question of the job "
    "(host, port, via, reason)",
    "broker.key_set_aside": "a queue key held what the queue does not write (another type, a "
    "counter or priority that is not a number); set aside with its content (key, problem, "
    "kept_as, reason)",
    "egress.throttled": "a job opened connections (or asked DNS questions) faster than its "
    "rate; the wall takes them later, once per job (rate, burst, reason)",
    "sandbox.spare_failed": "a spare guest process of the wasm arm could not be started or "
    "died before its job; jobs start fresh processes instead (arm, error)",
    "sandbox.guest_killed": "a wasm guest's process was killed where no epoch check could "
    "stop it: blocked in a host call or still compiling at its wall deadline, or its job "
    "cancelled (module, why, stopped_in, waited_s)",
    "sandbox.teardown_failed": "a step of a job's teardown, run after its result was "
    "stored, failed (error): a slot whose cgroup could not be emptied is not lent again",
    "job.finished": "the job reached a final result (status, exit, usage, containment)",
    "job.cancelled": "a running job was cancelled on request (before job.finished)",
    "job.stopped": "a launched run was stopped and gets no result from this worker "
    "(reason: drain, lease_lost, host_fault), with what it measured (usage, containment)",
    "job.retry_scheduled": "a transient failure; redelivery after delay_s (code, attempt)",
    "job.dead_lettered": "max_attempts reached; the last error is kept (code, message)",
    "job.released": "a running job was handed back un-attempted during drain",
    "job.bad_message": "the broker dead-lettered a malformed message (E_BAD_MESSAGE)",
    "lease.lost": "a heartbeat found the lease gone (expired and re-leased elsewhere)",
    "undo.recorded": "a job's file changes were committed and their undo entry stored "
    "(entry_id, method: staged|backup, ops, paths, blobs, reverses)",
    "undo.applied": "an undo job restored a job's files (undone: its id, entries, paths)",
    "checkpoint.created": "a checkpoint marked the device's undo journal (name, boundary)",
    "checkpoint.restored": "a checkpoint restore undid every later job on the device (name, "
    "jobs, entries, paths)",
    "checkpoint.refused": "a checkpoint restore changed nothing (name, code, paths and jobs "
    "of the conflicts)",
    "approval.waiting": "a gated job's changes are kept until approved or rejected (paths, "
    "expires_at)",
    "approval.granted": "an approval committed a gated job's changes (approved: its id, undo "
    "entry, paths)",
    "approval.rejected": "a gated job's changes were discarded on request, or because another "
    "branch was approved (reason)",
    "approval.expired": "nobody answered a gated job's approval in time: its changes were "
    "discarded",
    "undo.conflict": "files could not be put back (a roll-back or a restore of backed-up "
    "targets met later changes; paths)",
    "commit.filtered": "part of a staged change was not committed as is (path, what: a "
    "stripped setuid/setgid bit, a fifo/socket/device left out)",
    "journal.recovered": "a commit a dead worker left half-done was settled at start "
    "(job_id, action: kept|rolled_back, ops, left), or left for the queue or device that "
    "wrote it (action: skipped, reason; once per journal)",
    "blobs.collected": "blobs no stored undo entry needs were deleted at worker start "
    "(removed, removed_bytes, kept)",
    "staging.unavailable": "overlay staging cannot work on this worker (reason); writing "
    "jobs fall back to backups of their declared targets",
}


class _SafeStream:
    """The log's output: one ``write`` per record, and never an exception.

    A record that cannot be written (no space, a file size limit, a closed stream) is
    dropped and counted; the next record that can be written is preceded by a
    ``log.dropped`` record with that count. A record cut short (the disk filled up in its
    middle) is ended with a newline first, so every other line stays a whole record.
    """

    def __init__(self, stream: BinaryIO, *, owned: bool) -> None:
        self._stream = stream
        self._owned = owned
        self.dropped = 0
        self._torn = False

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = self._stream.write(view)
            if n is None:  # a buffered stream took it all (or raised)
                return
            if n <= 0:
                raise OSError("the log stream took nothing")
            if n < len(view):
                self._torn = True  # until the rest is written
            view = view[n:]
        self._torn = False

    def write(self, data: bytes) -> None:
        try:
            if self._torn:
                self._write_all(b"\n")
            if self.dropped:
                note = {
                    "ts": _timestamp(None, "", {})["ts"],
                    "level": "warning",
                    "event": "log.dropped",
                    "count": self.dropped,
                }
                self._write_all(_ENCODER.encode(note) + b"\n")
                self.dropped = 0
            self._write_all(data)
            self._stream.flush()
        except (OSError, ValueError):  # ENOSPC, EFBIG, EIO; ValueError: closed file
            self.dropped += 1

    def flush(self) -> None:
        # Flushed in `write`: BytesLogger flushes after each record, and a failure there
        # has already been counted.
        pass

    def close(self) -> None:
        """Close the file if `configure_logging` opened it (never stderr)."""
        if self._owned:
            self._stream.close()


#: Levels in increasing severity, as written in the ``level`` field.
LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error", "critical")

_LEVEL_NUMS: dict[str, int] = {name: int(logging.getLevelName(name.upper())) for name in LEVELS}

_FIRST_KEYS = ("ts", "level", "event")

#: `job.finished` levels by result status: what an operator filtering on ``warning`` must
#: see. A cancellation was asked for and a rejection is already logged (``job.rejected``,
#: at warning), so both stay ``info``.
_FINISHED_LEVELS: Mapping[str, str] = {
    "succeeded": "info",
    "cancelled": "info",
    "rejected": "info",
    "failed": "warning",
    "timed_out": "warning",
    "dead": "error",
    "awaiting_approval": "info",
}


def finished_level(status: str, *, stored: bool = True) -> int:
    """The level (a `logging` number, for ``logger.log``) of a ``job.finished`` record.

    Failures (``failed``, ``timed_out``) are warnings and ``dead`` an error, so
    ``tail --level warning`` shows them; a result that was not stored (``stored=False``:
    the lease was lost and another delivery owns the job) is at least a warning. An
    unknown status is a warning too: it cannot be assumed to be good news.
    """
    level = _LEVEL_NUMS[_FINISHED_LEVELS.get(status, "warning")]
    if not stored:
        level = max(level, _LEVEL_NUMS["warning"])
    return level


#: (unix second, its ISO-8601 prefix): formatted once a second, not once a record.
_second: tuple[int, str] = (-1, "")


def _timestamp(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    # structlog's TimeStamper gives microseconds; operators asked for ms and a `Z`.
    global _second
    now = time.time()
    sec = int(now)
    cached = _second  # one read: another thread may swap it meanwhile
    if cached[0] != sec:
        cached = _second = (sec, time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(sec)))
    event_dict["ts"] = f"{cached[1]}{int((now - sec) * 1000):03d}Z"
    return event_dict


def _order_keys(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> dict[str, Any]:
    # ts, level, event first: a human reading raw lines finds them at the same column.
    ordered = {k: event_dict[k] for k in _FIRST_KEYS if k in event_dict}
    ordered.update((k, v) for k, v in event_dict.items() if k not in ordered)
    return ordered


def _enc_hook(obj: Any) -> Any:
    # Anything msgspec cannot encode natively is rendered as text rather than lost:
    # a log line that fails to serialise would hide the very event it reports.
    if isinstance(obj, BaseException):
        return f"{type(obj).__name__}: {obj}"
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, set | frozenset):
        return sorted(obj, key=repr)
    return repr(obj)


_ENCODER = msgspec.json.Encoder(enc_hook=_enc_hook)


def _serialize(obj: Any, **_: Any) -> bytes:
    """`JSONRenderer` serializer: msgspec, with Structs and odd values handled.

    `JSONRenderer(serializer=msgspec.json.encode)` raises "Extra keyword arguments"
    because the renderer passes ``default=...``; this wrapper swallows the keywords.
    """
    return _ENCODER.encode(obj)


#: structlog's registry of the context variables ``bind_contextvars`` made (key prefix
#: included). Private to structlog, hence the fallback: without it, records are merged by
#: `structlog.contextvars.merge_contextvars` (the same result, a scan of the whole context).
_CONTEXT_VARS: Mapping[str, Any] | None = getattr(structlog.contextvars, "_CONTEXT_VARS", None)
_PREFIX_LEN = len(getattr(structlog.contextvars, "STRUCTLOG_KEY_PREFIX", "structlog_"))
_STACK_INFO = structlog.processors.StackInfoRenderer()
_METHOD_LEVELS = {"warn": "warning", "exception": "error"}


def _json_line(_: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> bytes:
    """One record as one JSON line, in one pass.

    The same record as structlog's chain ``merge_contextvars, add_log_level, _timestamp,
    StackInfoRenderer, dict_tracebacks, _order_keys, JSONRenderer`` (ts, level and event
    first; the call's fields, then the bound context; a field given in the call wins over
    the context), without a dict copy and a call per step: a worker logs three records
    per job, and that chain cost about a fifth of an echo job's CPU.
    """
    if "stack_info" in event_dict or "exc_info" in event_dict:
        event_dict = structlog.processors.dict_tracebacks(
            None, method_name, _STACK_INFO(None, method_name, event_dict)
        )
    # ts, level, event first (a human reading raw lines finds them at the same column);
    # the processors' ts and level win over a call's own, as in the chain.
    record: dict[str, Any] = {"ts": None, "level": None, "event": None}
    record.update(event_dict)
    if "event" not in event_dict:
        del record["event"]
    if _CONTEXT_VARS is None:
        structlog.contextvars.merge_contextvars(None, method_name, record)
    else:
        for name, var in tuple(_CONTEXT_VARS.items()):
            value = var.get()
            if value is not Ellipsis:
                record.setdefault(name[_PREFIX_LEN:], value)
    record["level"] = _METHOD_LEVELS.get(method_name, method_name)
    _timestamp(None, "", record)
    return _ENCODER.encode(record) + b"\n"


class _LineLogger:
    """structlog's wrapped logger for `_json_line`: each record is already a whole line
    (newline included), written with a single call to `_SafeStream.write`."""

    def __init__(self, file: _SafeStream) -> None:
        self._file = file
        self._lock = threading.Lock()

    def msg(self, line: bytes) -> None:
        with self._lock:  # threads log too (to_thread work): lines never interleave
            self._file.write(line)

    log = debug = info = warn = warning = msg
    err = error = critical = exception = fatal = failure = msg


def _line_bound_logger(min_level: int) -> type[Any]:
    """structlog's filtering bound logger for `level`, with a direct path for
    `_json_line`: no event dict copied, no chain walked, no `(args, kwargs)` tuple built.
    Any other configuration (``capture_logs`` in tests, a processor added) takes
    structlog's own path."""
    base: Any = structlog.make_filtering_bound_logger(min_level)

    class _LineBoundLogger(base):  # type: ignore[misc]
        def _proxy_to_logger(
            self, method_name: str, event: str | None = None, **event_kw: Any
        ) -> Any:
            processors = self._processors
            if len(processors) == 1 and processors[0] is _json_line and not self._context:
                if event is not None:
                    event_kw["event"] = event
                return self._logger.msg(_json_line(None, method_name, event_kw))
            return super()._proxy_to_logger(method_name, event, **event_kw)

    return _LineBoundLogger


class _LineLoggerFactory:
    def __init__(self, file: _SafeStream) -> None:
        self._file = file  # what `structlog.get_config()["logger_factory"]._file` names
        self._logger = _LineLogger(file)

    def __call__(self, *args: Any) -> _LineLogger:
        return self._logger


def configure_logging(
    *,
    file: str | os.PathLike[str] | BinaryIO | None = None,
    level: str = "info",
    json: bool = True,
) -> None:
    """Configure structlog for the whole process. Call once, at the entry point.

    Args:
        file: a path (appended to, created with its parent folder) or a binary stream;
            ``None`` writes to stderr.
        level: the lowest level written (debug, info, warning, error, critical).
        json: one JSON object per line (default); ``False`` renders readable lines for
            people (structlog's console renderer) — only for interactive use.

    Raises:
        ValueError: unknown level.
    """
    if level not in _LEVEL_NUMS:
        raise ValueError(f"unknown log level {level!r}; use one of {', '.join(LEVELS)}")
    stream: BinaryIO
    owned = False
    if file is None:
        stream = sys.stderr.buffer
    elif isinstance(file, str | os.PathLike):
        path = Path(file)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Kept open for the process lifetime on purpose: logging is process-wide state,
        # configured once; the OS closes it at exit. Unbuffered: one write(2) per record,
        # so a record is written whole or not at all (no half line left in a buffer to
        # come out later when the disk is full).
        stream = open(path, "ab", buffering=0)  # noqa: SIM115
        owned = True
    else:
        stream = file
    safe: Any = _SafeStream(stream, owned=owned)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _timestamp,
        structlog.processors.StackInfoRenderer(),
        structlog.processors.dict_tracebacks,
    ]
    wrapper: Any = structlog.make_filtering_bound_logger(_LEVEL_NUMS[level])
    if json:
        processors: list[Any] = [_json_line]
        factory: Any = _LineLoggerFactory(safe)
        wrapper = _line_bound_logger(_LEVEL_NUMS[level])
    else:
        processors = [
            *shared,
            structlog.dev.ConsoleRenderer(colors=False, timestamp_key="ts"),
        ]
        factory = structlog.BytesLoggerFactory(file=safe)
        processors.append(lambda _l, _m, s: s.encode() if isinstance(s, str) else s)
    structlog.configure(
        processors=processors,
        wrapper_class=wrapper,
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )


class _CurrentStderr:
    """`_SafeStream`'s stream for a process that configured no logging: whatever
    ``sys.stderr`` is when a record is written (a test's capture, a redirected stream)."""

    def write(self, data: bytes | memoryview) -> int:
        err = sys.stderr
        if err is not None:
            err.flush()  # text written before stays before
            buffer = getattr(err, "buffer", None)
            if buffer is not None:
                buffer.write(bytes(data))
            else:
                err.write(bytes(data).decode(errors="replace"))
        return len(data)

    def flush(self) -> None:
        err = sys.stderr
        if err is not None:
            getattr(err, "buffer", err).flush()


_unconfigured: Any = None


def _unconfigured_logger() -> Any:
    global _unconfigured
    if _unconfigured is None:
        stream: Any = _CurrentStderr()
        _unconfigured = structlog.wrap_logger(
            _LineLogger(_SafeStream(stream, owned=False)),
            processors=[_json_line],
            wrapper_class=_line_bound_logger(_LEVEL_NUMS["warning"]),
            cache_logger_on_first_use=True,
        )
    return _unconfigured


class _PackageLogger:
    """The package's logger: structlog's, as configured, once anything configured
    structlog (`configure_logging`, an application, ``capture_logs``); until then
    warnings and errors as JSON lines on stderr, and nothing else.

    structlog's own default prints every record to stdout: a program using the Python API
    (a client, an agent printing its transcript) found the library's records in the
    middle of its own output. A library's records belong to whoever configures logging,
    and, unconfigured, only the ones a person must see go to stderr (as the standard
    library's `logging` does).
    """

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        if structlog.is_configured():
            return getattr(_CONFIGURED, name)
        return getattr(_unconfigured_logger(), name)


_CONFIGURED: Any = structlog.get_logger("metnos_exec")
_PACKAGE_LOGGER = _PackageLogger()


def get_logger() -> Any:
    """The package logger, what library code logs with (see `_PackageLogger`): never
    ``structlog.get_logger`` directly, whose default writes to stdout."""
    return _PACKAGE_LOGGER


# --- reading logs back ----------------------------------------------------------------


def _matches(
    rec: Mapping[str, Any], job: str | None, event: str | None, min_level: int | None
) -> bool:
    if job is not None and rec.get("job_id") != job:
        return False
    if event is not None:
        ev = rec.get("event")
        # "job." selects a family; an exact name selects one event.
        if not (ev == event or (event.endswith(".") and str(ev).startswith(event))):
            return False
    if min_level is not None:
        lv = _LEVEL_NUMS.get(str(rec.get("level", "info")), logging.INFO)
        if lv < min_level:
            return False
    return True


_DECODER = msgspec.json.Decoder(dict[str, Any])

#: ``event`` of a record made up for a line that is not a JSON object.
_UNPARSED = "<unparsed>"


def _read_lines(
    path: Path,
    *,
    follow: bool,
    poll_s: float,
    should_stop: Callable[[], bool] | None,
) -> Iterator[bytes]:
    """Yield complete lines; when following, survive rotation and truncation.

    Rotation (the path now names a new inode) → finish the old file, then reopen from
    the start of the new one. Truncation (size below our offset) → restart at 0. A line
    still being written (no newline yet) is held back until it is complete.
    """
    f = open(path, "rb")  # noqa: SIM115 - closed in finally, reopened on rotation
    try:
        inode = os.fstat(f.fileno()).st_ino
        pending = b""
        while True:
            chunk = f.read(65536)
            if chunk:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                yield from lines
                continue
            if not follow:
                if pending:
                    yield pending
                return
            if should_stop is not None and should_stop():
                return
            try:
                st = os.stat(path)
            except FileNotFoundError:
                st = None
            if st is not None and st.st_ino != inode:
                f.close()
                f = open(path, "rb")  # noqa: SIM115
                inode = os.fstat(f.fileno()).st_ino
                pending = b""
                continue
            if st is not None and st.st_size < f.tell():
                f.seek(0)
                pending = b""
                continue
            # A CLI follower polls the file like `tail -f`; there is nothing to await.
            time.sleep(poll_s)
    finally:
        f.close()


def iter_records(
    path: str | os.PathLike[str],
    *,
    job: str | None = None,
    event: str | None = None,
    level: str | None = None,
    follow: bool = False,
    poll_s: float = 0.2,
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[dict[str, Any]]:
    """Records of a JSON-lines log file that match the filters.

    Lines that are not JSON objects are yielded as ``{"event": "<unparsed>", "raw": ...}``
    (never silently dropped) unless a filter excludes them.

    Args:
        job: keep records whose ``job_id`` equals this.
        event: an exact event name, or a family ending in ``.`` (``"job."``).
        level: the lowest level kept.
        follow: keep reading as the file grows (``tail -f``).
        should_stop: polled while following; return True to stop.
    """
    min_level = None if level is None else _LEVEL_NUMS[level]
    for line in _read_lines(Path(path), follow=follow, poll_s=poll_s, should_stop=should_stop):
        if not line.strip():
            continue
        try:
            rec = _DECODER.decode(line)
        except Exception:  # not JSON, or JSON a decoder cannot take (nested too deeply)
            rec = {"event": _UNPARSED, "raw": line.decode(errors="replace")}
        if _matches(rec, job, event, min_level):
            yield rec


def render_record(rec: Mapping[str, Any], *, color: bool = False) -> str:
    """One readable line for a person (structlog's console style), without a newline."""
    renderer = structlog.dev.ConsoleRenderer(colors=color, timestamp_key="ts", pad_event_to=22)
    # Records carry what jobs sent (stderr excerpts, messages quoting arguments, a raw line
    # that was not JSON): spelled out, so none of it drives the reader's terminal. Other
    # values are rendered with repr(), which escapes them already.
    fields = {
        visible(str(key)): visible(value, newlines=key == "exception")
        if isinstance(value, str)
        else value
        for key, value in rec.items()
    }
    level = str(fields.get("level", "info"))
    return str(renderer(None, level, fields)).rstrip("\n")


def tail(
    path: str | os.PathLike[str],
    *,
    job: str | None = None,
    event: str | None = None,
    level: str | None = None,
    follow: bool = False,
    color: bool = False,
    raw: bool = False,
    out: TextIO | None = None,
    should_stop: Callable[[], bool] | None = None,
    poll_s: float = 0.2,
) -> int:
    """Print matching records of `path`, readable (default) or as raw JSON lines.

    With `raw`, a line that is not a JSON object is printed as it is in the file (a
    reader asked for the file's lines, not for a record invented to carry one).

    Returns:
        how many records were printed.
    """
    stream = out if out is not None else sys.stdout
    n = 0
    for rec in iter_records(
        path,
        job=job,
        event=event,
        level=level,
        follow=follow,
        poll_s=poll_s,
        should_stop=should_stop,
    ):
        if not raw:
            line = render_record(rec, color=color)
        elif rec.get("event") == _UNPARSED and set(rec) == {"event", "raw"}:
            line = rec["raw"]
        else:
            line = _ENCODER.encode(rec).decode()
        stream.write(line + "\n")
        stream.flush()
        n += 1
    return n
