"""What every command shares: the exit codes and the errors they stand for, the
``--broker`` option and the epilog every command's help ends with, the argparse types of
the options, and the way a command opens its broker and runs its coroutine, so that a
failure leaves as one line with the exit code it means.

The exit codes are listed, with what each means, in the package's docstring
(`metnos_exec.cli`); `EXIT` names them.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any, Final, TextIO, TypeAlias

import anyio
import msgspec

from ..brokers import BadBrokerURL, Broker, open_broker, redact_url
from ..client import NotImplementedYet, default_broker_url
from ..errors import (
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

#: What ``add_subparsers`` returns: each command group's ``register`` adds its commands.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

#: Exit codes by meaning (see the package docstring).
EXIT: Final = {
    "ok": 0,
    "job_failed": 1,
    "usage": 2,
    "rejected": 3,
    "broker": 4,
    "not_found": 5,
    "pending": 6,
    "not_implemented": 7,
    "finished": 8,
    "internal": 70,
    "interrupted": 130,
}

_EXIT_CODES = """\
exit codes: 0 ok · 1 job failed/timed_out/cancelled/dead · 2 usage or configuration
error (also a bad broker URL) · 3 rejected (capability/manifest/policy/idempotency
conflict) · 4 broker store unavailable or failing (E_BROKER_*) · 5 not found · 6 still
pending · 7 not implemented yet · 8 already finished (cancel: nothing to cancel) · 70
internal error · 130 interrupted
"""

_BROKER_URLS = """
broker URL: --broker, else $METNOS_BROKER, else sqlite:///./metnos.db
  sqlite:///rel/q.db is relative to the current folder; an absolute path takes four
  slashes: sqlite:////var/lib/metnos/q.db. memory:// lives in one process only (worker).
"""

_CODES = "error codes (E_...): metnos-exec codes\n"

#: The epilog every command's help ends with (the broker URLs only where it takes one).
_EPILOG = _EXIT_CODES + _BROKER_URLS + _CODES

_BROKER_HELP = (
    "broker URL: sqlite:///relative/path.db or sqlite:////absolute/path.db (four slashes), "
    "memory:// (in-process only: for a worker's own tests), redis://host:port/db "
    "(default: $METNOS_BROKER or sqlite:///./metnos.db)"
)


class _Exit(Exception):
    """Leave with `code` after printing `message` to stderr."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _no_job(job_id: str, url: str) -> _Exit:
    """Exit 5 for a job id the queue does not know, naming the queue asked (a wrong
    --broker or $METNOS_BROKER is the usual cause) and what else makes one unknown."""
    return _Exit(
        EXIT["not_found"],
        f"no job {job_id} in {redact_url(url)} (a mistyped id, another queue: check "
        "--broker or $METNOS_BROKER; or a finished job forgotten by a purge)",
    )


def _check_url(url: str) -> None:
    """Refuse a malformed broker URL or option (exit 2) before a command does anything
    else: ``worker`` would start its keeper and configure its logs, ``doctor`` report on
    the host, before the URL was read. Nothing is made (``create=False``: SQLite's missing
    file stays missing); what the store itself says (missing, corrupt, unreachable) is
    left to the command's own open, which reports it its way."""
    try:
        broker = open_broker(url, create=False)
    except BadBrokerURL as exc:
        raise _Exit(EXIT["usage"], str(exc)) from None
    except (MetnosError, OSError):
        return
    del broker  # the command opens its own (an SQLite connection is closed with it)


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
            EXIT["broker"], f"{BrokerError.code}: cannot open broker {redact_url(url)}: {exc}"
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
    """The exit code an error means (see the package docstring)."""
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
        raise os_error_exit(exc) from None


def os_error_exit(exc: OSError) -> _Exit:
    """The exit for an `OSError` no layer below turned into a `MetnosError`.

    A broker wraps its store's failures (`BrokerError`), so one that reaches a command
    with a file name is about a file the command itself was given or keeps (a log, an
    output, a folder): a configuration error naming the file, not "the broker failed",
    which sent operators to a healthy queue. Without a file name (a socket's error that
    escaped a client library) it is still reported as the broker's.
    """
    if exc.filename is not None:
        where = f"{exc.filename} -> {exc.filename2}" if exc.filename2 is not None else exc.filename
        reason = exc.strerror or type(exc).__name__
        return _Exit(EXIT["usage"], f"{BadConfig.code}: {where}: {reason}")
    return _Exit(EXIT["broker"], f"{BrokerError.code}: the broker failed: {exc}")


def _retention(text: str, what: str) -> float | None:
    from ..worker import parse_retention_days

    try:
        return parse_retention_days(text, what=what)
    except BadConfig as exc:
        raise _Exit(EXIT["usage"], str(exc)) from None


def _dump_json(obj: Any, out: TextIO) -> None:
    out.write(msgspec.json.format(msgspec.json.encode(obj), indent=2).decode() + "\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    pass


def _common_options() -> argparse.ArgumentParser:
    """The options every command with a broker takes (``--broker``), as a parent parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--broker",
        default=default_broker_url(),
        metavar="URL",
        help=_BROKER_HELP,
    )
    return common


def add_command(
    subparsers: Subparsers,
    name: str,
    help_: str,
    desc: str | None = None,
    *,
    broker: bool = True,
) -> argparse.ArgumentParser:
    """A command with the epilog (`desc` defaults to `help_`) and, when it opens a queue
    (`broker`), the shared ``--broker``: a command that reads no queue (``tail``) does not
    offer one it would ignore."""
    return subparsers.add_parser(
        name,
        help=help_,
        description=desc or help_,
        epilog=_EPILOG if broker else _EXIT_CODES + "\n" + _CODES,
        parents=[_common_options()] if broker else [],
        formatter_class=_Formatter,
    )
