"""``metnos-exec``: run workers, submit jobs, read results and logs.

Commands: ``worker``, ``submit``, ``result``, ``cancel``, ``status``, ``purge``, ``tail``,
``undo``, ``bench``, ``codes``, ``doctor``, ``keygen``, ``sign``. ``metnos-exec COMMAND
--help`` explains each. The broker URL comes from ``--broker``, else ``$METNOS_BROKER``,
else ``sqlite:///./metnos.db``.

Exit codes (stable; scripts may rely on them):

====  =====================================================================
0     success (the job succeeded, the command did what was asked)
1     the job ended badly: failed, timed_out, cancelled or dead
2     usage or configuration error (bad option, bad ``--arg``, bad ``METNOS_*`` setting,
      a malformed or unknown broker URL, a broker whose extra is not installed, a job
      message over the size limit)
3     the job was rejected (capability, manifest, policy; an idempotency key conflict)
4     the broker's store is unavailable or failing (``E_BROKER_*``: cannot open, a missing
      SQLite file for readers, locked, full, read-only, deleted or replaced, corrupt)
5     not found (unknown job id, missing log file)
6     still pending: no result within the wait
7     not implemented yet (no command answers it today)
70    internal error (``E_INTERNAL``: a bug in metnos-exec; ``METNOS_DEBUG=1`` shows the
      traceback)
130   interrupted (Ctrl-C)
====  =====================================================================

Every error is printed as one line, ``metnos-exec: E_CODE: sentence``; a traceback is
shown only with ``METNOS_DEBUG=1``.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, NoReturn, TextIO

import anyio
import msgspec

from .._terminal import visible
from ..brokers import DEFAULT_RETENTION_S, BadBrokerURL, Broker, JobState, open_broker
from ..client import Client, NotImplementedYet, default_broker_url
from ..errors import (
    ERROR_CODES,
    AutonomyDenied,
    BadArguments,
    BadConfig,
    BadManifest,
    BadMessage,
    BrokerError,
    CapabilityDenied,
    IdempotencyConflict,
    MetnosError,
    MissingFolder,
    SandboxDenied,
    SandboxRequired,
    ServerPinned,
    SignatureError,
    ToolUnavailable,
    UndoConflict,
    UndoUnavailable,
    UnknownExecutor,
)
from ..messages import Result

__all__ = ("EXIT", "main")

#: Exit codes by meaning (see the module docstring).
EXIT: Final = {
    "ok": 0,
    "job_failed": 1,
    "usage": 2,
    "rejected": 3,
    "broker": 4,
    "not_found": 5,
    "pending": 6,
    "not_implemented": 7,
    "internal": 70,
    "interrupted": 130,
}

_EPILOG = """\
exit codes: 0 ok · 1 job failed/timed_out/cancelled/dead · 2 usage or configuration
error (also a bad broker URL) · 3 rejected (capability/manifest/policy/idempotency
conflict) · 4 broker store unavailable or failing (E_BROKER_*) · 5 not found · 6 still
pending · 7 not implemented yet · 70 internal error · 130 interrupted

broker URL: --broker, else $METNOS_BROKER, else sqlite:///./metnos.db
  sqlite:///rel/q.db is relative to the current folder; an absolute path takes four
  slashes: sqlite:////var/lib/metnos/q.db. memory:// lives in one process only (worker).
error codes (E_...): metnos-exec codes
"""

_BROKER_HELP = (
    "broker URL: sqlite:///relative/path.db or sqlite:////absolute/path.db (four slashes), "
    "memory:// (in-process only: for a worker's own tests), redis://host:port/db "
    "(default: $METNOS_BROKER or sqlite:///./metnos.db)"
)

_STATUS_EXIT: Final = {
    "succeeded": 0,
    "failed": 1,
    "timed_out": 1,
    "cancelled": 1,
    "dead": 1,
    "rejected": 3,
}


class _Exit(Exception):
    """Leave with `code` after printing `message` to stderr."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# --- helpers --------------------------------------------------------------------------


def _open(url: str, *, create: bool = False) -> Broker:
    """Open the broker for a client command.

    Readers (``result``, ``cancel``, ``status``) pass ``create=False``: a mistyped SQLite
    path must say "no queue file" (exit 4), not create an empty queue and answer "no such
    job". ``memory://`` is refused: a queue that dies with this process would lose what
    is submitted and could never hold what is asked for.
    """
    if url.partition(":")[0] == "memory":
        raise _Exit(
            EXIT["usage"],
            f"{url}: the memory broker lives inside one process and is gone when it ends; "
            "client commands need a shared broker (sqlite:///path.db, redis://...)",
        )
    try:
        return open_broker(url, create=create)
    except MetnosError as exc:
        raise _Exit(_exit_for(exc), str(exc)) from None
    except OSError as exc:
        raise _Exit(
            EXIT["broker"], f"{BrokerError.code}: cannot open broker {url}: {exc}"
        ) from None


#: Errors that refuse a job (or a request) as asked: exit 3.
_REJECTIONS: tuple[type[MetnosError], ...] = (
    IdempotencyConflict,
    BadArguments,
    CapabilityDenied,
    AutonomyDenied,
    UnknownExecutor,
    BadManifest,
    MissingFolder,
    SandboxRequired,
    SandboxDenied,
    ToolUnavailable,
    ServerPinned,
    SignatureError,
    UndoConflict,
    UndoUnavailable,
)


def _exit_for(exc: MetnosError) -> int:
    """The exit code an error means (see the module docstring)."""
    if isinstance(exc, BrokerError):
        return EXIT["broker"]
    if isinstance(exc, BadBrokerURL | BadConfig | BadMessage):
        return EXIT["usage"]
    if isinstance(exc, NotImplementedYet):
        return EXIT["not_implemented"]
    if isinstance(exc, _REJECTIONS):
        return EXIT["rejected"]
    return EXIT["internal"]


def _int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse type: a whole number >= `minimum` (`what` says so in the error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1, "at least 1")
_count = _int_at_least(0, "zero or more")


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _wait_seconds(text: str) -> float:
    """``--wait S``: 0 looks once, ``inf`` waits as long as it takes; a negative or NaN
    wait is refused (it gave up at once, blaming a missing worker, or never ended)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if value != value or value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {text}")
    return value


def _run(fn: Callable[[], Awaitable[int]]) -> int:
    try:
        return anyio.run(fn)
    except _Exit:
        raise
    except MetnosError as exc:
        raise _Exit(_exit_for(exc), str(exc)) from None
    except OSError as exc:
        raise _Exit(EXIT["broker"], f"{BrokerError.code}: the broker failed: {exc}") from None


def _parse_arg(text: str) -> tuple[str, str | None]:
    """``KEY=VALUE`` → the key and the value *as text*; ``KEY=null`` → ``None``.

    The text is sent as it is, named in the job's ``text_args``: the worker converts it
    to the type the executor's schema declares (``n=3`` an integer, ``text=42`` the
    string "42"), which only it knows. ``null`` means "absent, use the default".
    """
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise _Exit(EXIT["usage"], f"--arg {text!r}: expected KEY=VALUE")
    return key, None if value == "null" else value


def _dump_json(obj: Any, out: TextIO) -> None:
    out.write(msgspec.json.format(msgspec.json.encode(obj), indent=2).decode() + "\n")


def _print_job_id(job_id: str, *, as_json: bool) -> None:
    if as_json:
        _dump_json({"job_id": job_id}, sys.stdout)
    else:
        sys.stdout.write(job_id + "\n")


def _print_result(result: Result, *, as_json: bool, out: TextIO) -> None:
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
    if result.output is not None:
        text = msgspec.json.format(msgspec.json.encode(result.output), indent=2).decode()
        if len(text) > 4000:
            text = text[:4000] + "\n  … (truncated; use --json for everything)"
        # JSON strings hold no raw line breaks: every newline here is the formatter's.
        lines.append("  output: " + visible(text, newlines=True).replace("\n", "\n  "))
    if result.stderr.strip():
        tail_ = visible(result.stderr.strip()[-1000:], newlines=True)
        lines.append("  stderr: " + tail_.replace("\n", "\n          "))
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
        return f"{base}: {_NO_WORKER.format(url=url)}"
    if state is not None:
        return f"{base}: it is {state.state} (attempt {state.attempt})"
    return base


# --- commands -------------------------------------------------------------------------


def _cmd_worker(ns: argparse.Namespace) -> int:
    from ..worker import ARM_OVERRIDE_ENV, run_worker

    if ns.arm:
        os.environ[ARM_OVERRIDE_ENV] = ns.arm
    retention: Any = "env"
    if ns.retention_days is not None:
        retention = _retention(ns.retention_days, "--retention-days")
    try:
        return run_worker(
            ns.broker,
            ns.executors,
            concurrency=ns.concurrency,
            worker_id=ns.worker_id,
            device=ns.device,
            log_file=ns.log_file,
            log_level=ns.log_level,
            grace_s=ns.grace,
            burst=ns.burst,
            visibility_s=ns.visibility,
            prefetch=ns.prefetch,
            backend=ns.backend,
            home=ns.home,
            retention_s=retention,
            state_dir=ns.state_dir,
            trust_keys=ns.trust_key or (),
        )
    except BrokerError as exc:
        # The store (before serving: cannot open, read-only; while serving: only a fatal
        # error, the queue file deleted or replaced) stopped the worker.
        raise _Exit(EXIT["broker"], str(exc)) from None
    except MetnosError as exc:
        # Everything else raised before serving is configuration: options, METNOS_*
        # variables, the broker URL, the executors folder.
        raise _Exit(EXIT["usage"], str(exc)) from None
    except OSError as exc:
        raise _Exit(EXIT["broker"], f"{BrokerError.code}: the broker failed: {exc}") from None


def _retention(text: str, what: str) -> float | None:
    from ..worker import parse_retention_days

    try:
        return parse_retention_days(text, what=what)
    except BadConfig as exc:
        raise _Exit(EXIT["usage"], str(exc)) from None


def _cmd_submit(ns: argparse.Namespace) -> int:
    args: dict[str, Any] = {}
    if ns.args_json:
        try:
            loaded = msgspec.json.decode(ns.args_json.encode())
        except Exception as exc:  # not JSON, or nested too deeply to decode
            reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise _Exit(EXIT["usage"], f"--args-json: not JSON: {reason}") from None
        if not isinstance(loaded, dict):
            raise _Exit(EXIT["usage"], "--args-json: expected a JSON object")
        args.update(loaded)
    text_args: list[str] = []
    for item in ns.arg or ():
        key, value = _parse_arg(item)
        args[key] = value
        if value is None:
            if key in text_args:
                text_args.remove(key)
        elif key not in text_args:
            text_args.append(key)
    fields: dict[str, Any] = {}
    if text_args:
        fields["text_args"] = tuple(text_args)
    for name, attr in (
        ("timeout_s", "timeout"),
        ("autonomy", "autonomy"),
        ("device", "device"),
        ("max_attempts", "max_attempts"),
        ("idempotency_key", "idempotency_key"),
        ("correlation_id", "correlation_id"),
        ("priority", "priority"),
    ):
        value = getattr(ns, attr)
        if value is not None:
            fields[name] = value
    if ns.delay:
        fields["not_before"] = time.time() + ns.delay

    submitted: list[str] = []

    async def go() -> int:
        async with _open(ns.broker, create=True) as broker:
            client = Client(broker)
            job_id = await client.submit(ns.executor, args, **fields)
            submitted.append(job_id)
            if ns.wait is False:
                _print_job_id(job_id, as_json=ns.json)
                return 0
            if not ns.json:
                sys.stderr.write(f"submitted {job_id}\n")
            wait = None if ns.wait is True else float(ns.wait)
            result, state = await _wait_result(client, job_id, wait)
            if result is None:
                raise _Exit(EXIT["pending"], _pending_message(job_id, wait, state, ns.broker))
            _print_result(result, as_json=ns.json, out=sys.stdout)
            return _STATUS_EXIT[result.status]

    try:
        return _run(go)
    except KeyboardInterrupt:
        if not submitted:
            raise
        # Ctrl-C stops the waiting, not the job: say where it is and what to do with it.
        job = submitted[0]
        raise _Exit(
            EXIT["interrupted"],
            f"interrupted the wait; job {job} is not cancelled: a worker runs it "
            f"(metnos-exec result {job} to see it, metnos-exec cancel {job} to drop it)",
        ) from None


def _cmd_result(ns: argparse.Namespace) -> int:
    async def go() -> int:
        broker = _open(ns.broker)
        async with broker:
            client = Client(broker)
            if ns.wait:
                result, _ = await _wait_result(client, ns.job_id, ns.wait)
            else:
                result = await client.result(ns.job_id)
            if result is None:
                state = await broker.get_job_state(ns.job_id)
                if state is None:
                    raise _Exit(EXIT["not_found"], f"no job {ns.job_id}")
                message = f"job {ns.job_id} is {state.state}, no result yet"
                if _never_leased(state):
                    message += "; " + _NO_WORKER.format(url=ns.broker)
                raise _Exit(EXIT["pending"], message)
            _print_result(result, as_json=ns.json, out=sys.stdout)
            return _STATUS_EXIT[result.status]

    return _run(go)


def _cmd_cancel(ns: argparse.Namespace) -> int:
    async def go() -> int:
        async with _open(ns.broker) as broker:
            outcome = await broker.cancel(ns.job_id)
        if outcome == "unknown":
            raise _Exit(EXIT["not_found"], f"no job {ns.job_id}")
        messages = {
            "cancelled": "cancelled: it was waiting in the queue and will not run",
            "cancelling": (
                "cancelling: the worker running it will stop it (a result it stores first stands)"
            ),
            "finished": "already finished; nothing to cancel",
        }
        sys.stdout.write(f"{ns.job_id}: {messages[outcome]}\n")
        return 0

    return _run(go)


def _sandbox_status() -> dict[str, Any]:
    try:
        from ..sandbox import status as status_mod
    except ImportError as exc:
        return {"error": f"sandbox status unavailable: {exc}"}
    try:
        report = status_mod.status()
    except MetnosError as exc:  # e.g. METNOS_BWRAP naming no executable
        return {"error": str(exc)}
    built = msgspec.to_builtins(report)
    return built if isinstance(built, dict) else {"status": built}


def _scalar(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        return ", ".join(_scalar(v) for v in value) if value else "-"
    return str(value)


def _readable(doc: dict[str, Any], *, indent: str) -> list[str]:
    """Nested dicts as indented ``key: value`` lines (``status`` for people)."""
    lines = []
    for key, value in doc.items():
        if isinstance(value, dict):
            if not value:
                lines.append(f"{indent}{key}: -")
                continue
            lines.append(f"{indent}{key}:")
            lines.extend(_readable(value, indent=indent + "  "))
        else:
            lines.append(visible(f"{indent}{key}: {_scalar(value)}"))
    return lines


def _cmd_status(ns: argparse.Namespace) -> int:
    async def go() -> int:
        async with _open(ns.broker) as broker:
            stats = await broker.stats()
            dead = await broker.dead_letters(limit=5)
        sandbox = _sandbox_status()
        doc: dict[str, Any] = {
            "broker": {"url": ns.broker, **msgspec.to_builtins(stats)},
            "sandbox": sandbox,
            "recent_dead_letters": [
                {"job_id": d.job_id, "code": d.error.code, "message": d.error.message} for d in dead
            ],
        }
        if ns.json:
            _dump_json(doc, sys.stdout)
            return 0
        out = [f"broker {ns.broker}"]
        # `delayed` is the part of `queued` not yet due: shown inside it, not beside it.
        counts = [f"queued={stats.queued} ({stats.delayed} delayed)"]
        counts += [f"{k}={getattr(stats, k)}" for k in ("running", "done", "dead")]
        out.append("  " + "  ".join(counts))
        out.append("sandbox")
        out.extend(_readable(sandbox, indent="  "))
        if dead:
            out.append("recent dead letters")
            for d in dead:
                out.append(visible(f"  {d.job_id} {d.error.code}: {d.error.message}"))
        sys.stdout.write("\n".join(out) + "\n")
        return 0

    return _run(go)


def _cmd_tail(ns: argparse.Namespace) -> int:
    from ..logs import EVENTS, tail

    if ns.event and not any(name.startswith(ns.event) for name in EVENTS):
        # A typo would otherwise print nothing, as if no such record had been written.
        close = difflib.get_close_matches(ns.event, EVENTS, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise _Exit(
            EXIT["usage"],
            f"--event {ns.event!r}: no log event has that name or starts with it; {hint}"
            "the events are listed in metnos_exec/logs.py (EVENTS) and the README",
        )
    if not os.path.exists(ns.file):
        raise _Exit(EXIT["not_found"], f"no log file {ns.file}")
    color = ns.color if ns.color is not None else sys.stdout.isatty()
    try:
        tail(
            ns.file,
            job=ns.job,
            event=ns.event,
            level=ns.level,
            follow=ns.follow,
            color=color,
            raw=ns.json,
        )
    except BrokenPipeError:
        # `metnos-exec tail f | head`: the reader left; that is not an error.
        with contextlib.suppress(OSError):
            sys.stdout.close()
    return 0


def _cmd_purge(ns: argparse.Namespace) -> int:
    older_than = DEFAULT_RETENTION_S
    if ns.older_than_days is not None:
        older_than = _retention(ns.older_than_days, "--older-than-days") or 0.0
        if not older_than:
            raise _Exit(EXIT["usage"], "--older-than-days: 'never' purges nothing; give days")
    else:
        from ..worker import retention_from_env

        try:
            env_retention = retention_from_env()
        except BadConfig as exc:
            raise _Exit(EXIT["usage"], str(exc)) from None
        if env_retention is None:
            raise _Exit(
                EXIT["usage"],
                "METNOS_RETENTION_DAYS=never: nothing to purge; pass --older-than-days",
            )
        older_than = env_retention

    async def go() -> int:
        async with _open(ns.broker) as broker:
            report = await broker.purge(older_than_s=older_than)
            vacuumed = None
            vacuum = getattr(broker, "vacuum", None)
            if ns.vacuum and vacuum is not None:
                vacuumed = await vacuum()
        doc: dict[str, Any] = {
            "older_than_days": round(older_than / 86400, 6),
            **msgspec.to_builtins(report),
        }
        if vacuumed is not None:
            doc["vacuum_reclaimed_bytes"] = vacuumed
        if ns.json:
            _dump_json(doc, sys.stdout)
            return 0
        days = f"{older_than / 86400:g}"
        line = f"purged {report.jobs} finished job(s) older than {days} day(s)"
        if report.collected:
            line += f", collected {report.collected} item(s)"
        reclaimed = (report.reclaimed_bytes or 0) + (vacuumed or 0)
        if report.reclaimed_bytes is not None or vacuumed is not None:
            line += f"; {reclaimed:,} bytes given back to the file system"
        sys.stdout.write(line + "\n")
        if report.reclaimed_bytes is None and vacuumed is None and vacuum is not None:
            sys.stdout.write(
                "this queue file was made without incremental vacuum: run "
                "`metnos-exec purge --vacuum` once (it rewrites the file; stop heavy work "
                "first) and later purges shrink it by themselves\n"
            )
        return 0

    return _run(go)


def _cmd_undo(ns: argparse.Namespace) -> int:
    async def go() -> int:
        async with _open(ns.broker) as broker:
            client = Client(broker)
            try:
                undo_id = await client.submit_undo(ns.job_id)
            except UndoUnavailable as exc:
                if await broker.get_job_state(ns.job_id) is None:
                    raise _Exit(EXIT["not_found"], f"no job {ns.job_id}") from None
                raise _Exit(EXIT["rejected"], str(exc)) from None
            if ns.no_wait:
                _print_job_id(undo_id, as_json=ns.json)
                return 0
            if not ns.json:
                sys.stderr.write(f"undo of {ns.job_id} submitted as job {undo_id}\n")
            result, state = await _wait_result(client, undo_id, ns.wait)
            if result is None:
                raise _Exit(EXIT["pending"], _pending_message(undo_id, ns.wait, state, ns.broker))
            _print_result(result, as_json=ns.json, out=sys.stdout)
            return _STATUS_EXIT[result.status]

    return _run(go)


def _cmd_codes(ns: argparse.Namespace) -> int:
    if ns.json:
        _dump_json(ERROR_CODES, sys.stdout)
        return 0
    width = max(map(len, ERROR_CODES))
    sys.stdout.write(
        "".join(f"{code:<{width}}  {meaning}\n" for code, meaning in ERROR_CODES.items())
    )
    return 0


_MARK = {"ok": "ok  ", "weakened": "WEAK", "missing": "MISS", "info": "info"}


def _cmd_doctor(ns: argparse.Namespace) -> int:
    from ..doctor import diagnose

    async def go() -> Any:
        return await diagnose(
            broker_url=ns.broker,
            executors=ns.executors,
            device=ns.device,
            trust_keys=ns.trust_key or (),
        )

    report = anyio.run(go)
    if ns.json:
        _dump_json(report, sys.stdout)
    else:
        lines = [f"metnos-exec doctor (as {report.user}, uid {report.uid})"]
        for f in report.findings:
            need = " [required]" if f.required and f.state != "ok" else ""
            lines.append(f"{_MARK[f.state]} {f.check}: {f.detail}{need}")
            if f.state != "ok" and f.meaning:
                lines.append(f"       means: {f.meaning}")
            if f.state != "ok" and f.fix:
                lines.append(f"       fix:   {f.fix}")
        bad = [f.check for f in report.findings if f.required and f.state != "ok"]
        lines.append(
            "healthy: everything this configuration requires is here"
            if report.healthy
            else f"NOT healthy: required and missing: {', '.join(bad)}"
        )
        sys.stdout.write("\n".join(lines) + "\n")
    return 0 if report.healthy else 1


def _cmd_keygen(ns: argparse.Namespace) -> int:
    from ..devices.signing import generate_key, key_id, load_public_key

    try:
        priv, pub = generate_key(ns.out)
    except MetnosError as exc:
        raise _Exit(EXIT["usage"], str(exc)) from None
    except OSError as exc:
        raise _Exit(EXIT["usage"], f"cannot write {ns.out}: {exc.strerror}") from None
    kid = key_id(load_public_key(str(pub)).raw)
    sys.stdout.write(
        f"private key: {priv} (keep it secret; sign with --key {priv})\n"
        f"public key:  {pub} (key id {kid}; give it to workers: --trust-key {pub})\n"
    )
    return 0


def _cmd_sign(ns: argparse.Namespace) -> int:
    from ..devices.signing import SignatureFile, sign_folder

    try:
        out = sign_folder(ns.folder, ns.key)
    except MetnosError as exc:
        raise _Exit(EXIT["usage"], str(exc)) from None
    sig = msgspec.json.decode(out.read_bytes(), type=SignatureFile)
    sys.stdout.write(f"signed {len(sig.files)} files with key {sig.key_id}: {out}\n")
    return 0


def _cmd_bench(ns: argparse.Namespace) -> int:
    from ..bench import main as bench_main

    return bench_main(list(ns.argv or ()))


# --- parser ---------------------------------------------------------------------------


class _Formatter(argparse.RawDescriptionHelpFormatter):
    pass


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--broker",
        default=default_broker_url(),
        metavar="URL",
        help=_BROKER_HELP,
    )
    p = argparse.ArgumentParser(
        prog="metnos-exec",
        description="Run sandboxed executors from a job queue.",
        epilog=_EPILOG,
        formatter_class=_Formatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, help_: str, desc: str | None = None) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help_,
            description=desc or help_,
            epilog=_EPILOG,
            parents=[common],
            formatter_class=_Formatter,
        )

    w = add(
        "worker",
        "serve jobs until SIGTERM/Ctrl-C",
        "Serve jobs: lease, vet, sandbox, run, store results. SIGTERM or Ctrl-C drains "
        "(no new jobs; running ones get --grace seconds, then are cancelled and handed "
        "back); a second signal stops at once.",
    )
    w.add_argument("--executors", required=True, metavar="DIR", help="folder of executors")
    w.add_argument(
        "--concurrency", type=_positive_int, default=4, metavar="N", help="jobs at once (4)"
    )
    w.add_argument("--log-file", metavar="FILE", help="JSON-lines log file (default: stderr)")
    w.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    w.add_argument("--worker-id", metavar="ID", help="default: HOSTNAME-PID")
    w.add_argument("--device", default="server", metavar="ID", help="device id (server)")
    w.add_argument(
        "--grace", type=_non_negative_float, default=30.0, metavar="S", help="drain grace (30)"
    )
    w.add_argument(
        "--visibility",
        type=_positive_float,
        default=30.0,
        metavar="S",
        help="lease window: a job whose worker stops heart-beating is redelivered after it (30)",
    )
    w.add_argument(
        "--prefetch",
        type=_count,
        default=1,
        metavar="N",
        help="jobs leased ahead while every slot is busy, prepared and launched the moment "
        "a slot frees; 0 leaves them to other workers (1)",
    )
    w.add_argument(
        "--home", metavar="DIR", help="what ~ means in hints and arguments (default: $HOME)"
    )
    w.add_argument(
        "--retention-days",
        metavar="DAYS",
        help="purge finished jobs older than DAYS (a number, or 'never'), at start and "
        "hourly (default: $METNOS_RETENTION_DAYS, else 7)",
    )
    w.add_argument(
        "--state-dir",
        metavar="DIR",
        help="blobs (originals kept for undo), commit journals, staging mount points "
        "(default: $METNOS_STATE_DIR, else the queue's own folder in "
        "$XDG_STATE_HOME/metnos-exec/queues, else in ~/.local/state/metnos-exec/queues; "
        "an install from before keeps its one folder); an undo needs the blobs of the "
        "worker that committed",
    )
    w.add_argument(
        "--trust-key",
        action="append",
        metavar="PUB",
        help="verify every executor's signature with this public key (a file, or inline "
        "ed25519:BASE64) before planning its jobs, and run them from the verified copy; "
        "repeatable; also $METNOS_TRUST_KEYS (comma-separated). Required with --device",
    )
    w.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    w.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    # Tests and benchmarks only: run every job in the echo double (queue cost alone).
    w.add_argument("--arm", choices=["echo"], help=argparse.SUPPRESS)
    w.set_defaults(fn=_cmd_worker)

    s = add(
        "submit",
        "queue a job",
        "Queue a job and print its id (or, with --wait, its result).\n\n"
        "  metnos-exec submit write_note --arg 'path=~/notes/today.md' --arg 'text=buy milk' "
        "--wait\n\n"
        "Quote '~/...' so your shell leaves the ~ to the worker (its --home).",
    )
    s.add_argument("executor", help="executor name")
    s.add_argument(
        "--arg",
        action="append",
        metavar="KEY=VALUE",
        help="an argument, as text: the worker converts it to the type the executor "
        "declares (n=3 is the integer 3 for an integer argument, text=42 the text 42 for a "
        "string one; arrays and objects as JSON) and refuses it if it does not convert "
        "(repeatable). k=null means 'use the default'; use --args-json for the text null",
    )
    s.add_argument("--args-json", metavar="JSON", help="all arguments as one JSON object")
    s.add_argument("--timeout", type=_positive_float, metavar="S", help="wall-time budget")
    s.add_argument("--autonomy", choices=["read_only", "supervised", "full"])
    s.add_argument("--device", metavar="ID", help="target device (default: a server worker)")
    s.add_argument(
        "--max-attempts", type=_positive_int, metavar="N", help="deliveries before it is dead"
    )
    s.add_argument("--idempotency-key", metavar="KEY")
    s.add_argument("--correlation-id", metavar="ID")
    s.add_argument(
        "--priority",
        type=int,
        metavar="N",
        help="higher runs first; equal priorities run in submission order (default 0)",
    )
    s.add_argument(
        "--delay",
        type=_non_negative_float,
        metavar="S",
        help="do not run before S seconds from now",
    )
    s.add_argument(
        "--wait",
        nargs="?",
        const=True,
        default=False,
        type=_wait_seconds,
        metavar="S",
        help="wait for the result (at most S seconds if given) and exit by its status",
    )
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=_cmd_submit)

    r = add("result", "show a job's result")
    r.add_argument("job_id")
    r.add_argument(
        "--wait", type=_wait_seconds, default=0.0, metavar="S", help="wait up to S seconds"
    )
    r.add_argument("--json", action="store_true", help="the Result as JSON")
    r.set_defaults(fn=_cmd_result)

    c = add("cancel", "cancel a queued or running job")
    c.add_argument("job_id")
    c.set_defaults(fn=_cmd_cancel)

    st = add(
        "status",
        "sandbox arms available here and queue counts",
        "Queue counts, the sandbox arms available on this machine, recent dead letters. "
        "Error codes are listed by `metnos-exec codes`.",
    )
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=_cmd_status)

    t = add(
        "tail",
        "show (and follow) a worker's JSON log",
        "Show a JSON-lines log readably; filter by job, event (exact, or a family such as "
        "'job.') and minimum level.",
    )
    t.add_argument("file")
    t.add_argument("--job", metavar="JOB_ID")
    t.add_argument("--event", metavar="NAME")
    t.add_argument("--level", choices=["debug", "info", "warning", "error", "critical"])
    t.add_argument("-f", "--follow", action="store_true", help="keep following the file")
    t.add_argument("--color", dest="color", action="store_true", default=None)
    t.add_argument("--no-color", dest="color", action="store_false")
    t.add_argument("--json", action="store_true", help="print the matching raw JSON lines")
    t.set_defaults(fn=_cmd_tail)

    pu = add(
        "purge",
        "forget finished jobs past retention, and give the space back",
        "Forget finished jobs (results, dead letters, idempotency keys) older than the "
        "retention, and give the freed space back to the file system. Workers do this "
        "by themselves at start and hourly; queued and running jobs are never touched.",
    )
    pu.add_argument(
        "--older-than-days",
        metavar="DAYS",
        help="the retention (default: $METNOS_RETENTION_DAYS, else 7)",
    )
    pu.add_argument(
        "--vacuum",
        action="store_true",
        help="SQLite: also rewrite the whole file (needed once for a file made by an older "
        "version, so later purges shrink it; holds the queue for the rewrite)",
    )
    pu.add_argument("--json", action="store_true", help="machine-readable output")
    pu.set_defaults(fn=_cmd_purge)

    u = add(
        "undo",
        "undo a job's file changes",
        "Put back exactly what a job changed (content, names, modes, links). The undo is "
        "a job, run by a worker of the device that made the changes; it is refused "
        "(E_UNDO_CONFLICT, exit 3, nothing changed) when a file changed since. An undo "
        "can be undone: `metnos-exec undo <the undo job's id>`.",
    )
    u.add_argument("job_id")
    u.add_argument(
        "--wait", type=_positive_float, default=None, metavar="S", help="wait at most S seconds"
    )
    u.add_argument("--no-wait", action="store_true", help="print the undo job's id and exit")
    u.add_argument("--json", action="store_true", help="the undo's Result as JSON")
    u.set_defaults(fn=_cmd_undo)

    co = sub.add_parser(
        "codes",
        help="list the error codes (E_...) and what they mean",
        description="Every error code a result, dead letter or log record may carry.",
        formatter_class=_Formatter,
    )
    co.add_argument("--json", action="store_true", help="as one JSON object")
    co.set_defaults(fn=_cmd_codes)

    dr = add(
        "doctor",
        "check this machine for what a worker needs, with the fix for each gap",
        "Check bubblewrap and user namespaces, seccomp, landlock, cgroups and their "
        "delegation, overlay staging, the wasm engine and runtime (and its hash), the "
        "broker, the worker's user and its trust keys. Each finding says what it means "
        "for the containment report and the exact command that fixes it. Exit 0 when "
        "everything the configuration requires is here, 1 when something required is "
        "missing (METNOS_REQUIRE_SANDBOX other than never requires the kernel wall; "
        "--device requires a trust key; --executors requires their runtimes).",
    )
    dr.add_argument("--executors", metavar="DIR", help="the worker's executors (their runtimes)")
    dr.add_argument("--device", default="server", metavar="ID", help="the worker's device id")
    dr.add_argument("--trust-key", action="append", metavar="PUB", help="as for worker")
    dr.add_argument("--json", action="store_true", help="the findings as JSON")
    dr.set_defaults(fn=_cmd_doctor)

    kg = sub.add_parser(
        "keygen",
        help="make an Ed25519 key pair for signing executors",
        description="Write a new Ed25519 private key to OUT (PEM, mode 0600) and its "
        "public key to OUT.pub (one line, ed25519:BASE64), for `sign` and "
        "`worker --trust-key`. Needs the device extra (cryptography).",
        formatter_class=_Formatter,
    )
    kg.add_argument("--out", required=True, metavar="OUT", help="private key file to create")
    kg.set_defaults(fn=_cmd_keygen)

    sg = sub.add_parser(
        "sign",
        help="sign an executor folder",
        description="Hash every file of the executor folder (sorted relative paths, "
        "SHA-256, no timestamps; symbolic links and special files refused) and write "
        "the Ed25519 signature to FOLDER/manifest.sig. Re-sign after any change.",
        formatter_class=_Formatter,
    )
    sg.add_argument("folder", metavar="FOLDER", help="the executor folder (with manifest.toml)")
    sg.add_argument("--key", required=True, metavar="KEY", help="private key (from keygen)")
    sg.set_defaults(fn=_cmd_sign)

    b = add("bench", "run benchmarks from bench/ (all when none named)")
    b.add_argument(
        "argv",
        nargs=argparse.REMAINDER,
        metavar="NAME ...",
        help="benchmark names (e.g. queue_throughput) and their options; --list lists them",
    )
    b.set_defaults(fn=_cmd_bench)
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("metnos-exec")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        from .. import __version__

        return __version__


def _fail(code: int, message: str) -> NoReturn:
    if message:
        sys.stderr.write(f"metnos-exec: {visible(message, newlines=True)}\n")
    raise SystemExit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``metnos-exec``; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["bench"] and args[1:2] not in (["-h"], ["--help"]):
        # Everything after `bench` belongs to the benchmarks (argparse's REMAINDER will
        # not take a leading option such as `--list`).
        from ..bench import main as bench_main

        return bench_main(args[1:])
    parser = build_parser()
    ns = parser.parse_args(args)
    if argv is None and ns.fn is not _cmd_worker:
        # The process's entry point: the library's log records (a Redis broker's
        # `broker.error`, say) are for a worker's log; left to structlog's default they
        # went to stdout, into what a client command prints. Its failures reach the user
        # as the one-line error below.
        from ..logs import configure_logging

        configure_logging(level="critical")
    try:
        code: int = ns.fn(ns)
    except _Exit as exc:
        _fail(exc.code, exc.message)
    except KeyboardInterrupt:
        _fail(EXIT["interrupted"], "interrupted")
    except MetnosError as exc:
        _fail(_exit_for(exc), str(exc))
    except Exception as exc:
        # A bug: one line and a way to see more, not a traceback in a user's face.
        if os.environ.get("METNOS_DEBUG") == "1":
            raise
        _fail(
            EXIT["internal"],
            f"E_INTERNAL: {type(exc).__name__}: {exc} (a bug in metnos-exec; run again with "
            "METNOS_DEBUG=1 for the traceback, and please report it)",
        )
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
