"""The commands of one job: ``submit`` (queue it, and with ``--wait`` wait for its
result), ``result`` (show it) and ``cancel`` (drop it from the queue, or stop it)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import msgspec

from ..brokers import redact_url
from ..client import Client
from ..errors import SubmitOutcomeUnknown
from ..messages import describe_progress
from ._common import (
    EXIT,
    Subparsers,
    _Exit,
    _no_job,
    _non_negative_float,
    _open,
    _positive_float,
    _positive_int,
    _run,
    _wait_seconds,
    add_command,
)
from ._results import (
    _NO_WORKER,
    _STATUS_EXIT,
    _never_leased,
    _pending_message,
    _print_job_id,
    _print_result,
    _wait_result,
)


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
        ("id", "id"),
        ("priority", "priority"),
        ("result_ttl_s", "result_ttl"),
        ("commit", "commit"),
        ("branch_of", "branch_of"),
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
    except SubmitOutcomeUnknown as exc:
        raise SubmitOutcomeUnknown(
            f"{exc.message} (retry with: metnos-exec submit {ns.executor} ... --id {exc.job_id};"
            f" see it with: metnos-exec result {exc.job_id})",
            exc.job_id,
        ) from None
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
                    raise _no_job(ns.job_id, ns.broker)
                message = f"job {ns.job_id} is {state.state}, no result yet"
                progress = await broker.get_progress(ns.job_id)
                if progress is not None and state.state == "running":
                    message += f"; {describe_progress(progress)}"
                if _never_leased(state):
                    message += "; " + _NO_WORKER.format(url=redact_url(ns.broker))
                raise _Exit(EXIT["pending"], message)
            _print_result(result, as_json=ns.json, out=sys.stdout, changes=ns.changes)
            return _STATUS_EXIT[result.status]

    return _run(go)


def _cmd_cancel(ns: argparse.Namespace) -> int:
    async def go() -> int:
        async with _open(ns.broker) as broker:
            outcome = await broker.cancel(ns.job_id)
            result = await broker.get_result(ns.job_id) if outcome == "finished" else None
        if outcome == "unknown":
            raise _no_job(ns.job_id, ns.broker)
        if outcome == "finished":
            # Not an error, but not a cancel either: a script must be able to tell (exit 8).
            status = result.status if result is not None else "its result already stored"
            raise _Exit(
                EXIT["finished"],
                f"job {ns.job_id} had already finished ({status}): nothing was cancelled; "
                f"its result stands (metnos-exec result {ns.job_id})",
            )
        messages = {
            "cancelled": "cancelled: it was waiting in the queue and will not run",
            "cancelling": (
                "cancelling: the worker running it will stop it (a result it stores first stands)"
            ),
        }
        sys.stdout.write(f"{ns.job_id}: {messages[outcome]}\n")
        return 0

    return _run(go)


def _add_when_options(s: argparse.ArgumentParser) -> None:
    """``submit``'s options for when the job runs and how long it is kept."""
    s.add_argument(
        "--priority",
        type=int,
        metavar="N",
        help="higher runs first; equal priorities run in submission order (default 0)",
    )
    s.add_argument(
        "--result-ttl",
        type=_positive_float,
        metavar="S",
        help="forget the finished job S seconds after it finished, at the next purge, "
        "rather than after the retention (default: the retention)",
    )
    s.add_argument(
        "--delay",
        type=_non_negative_float,
        metavar="S",
        help="do not run before S seconds from now",
    )


def _add_gate_options(s: argparse.ArgumentParser) -> None:
    """``--approve`` and ``--branch-of`` (README, "Approval gates")."""
    s.add_argument(
        "--approve",
        action="store_const",
        const="approve",
        dest="commit",
        help="keep the job's file changes until `metnos-exec approve JOB` (or reject): "
        "its result is awaiting_approval with its change set",
    )
    s.add_argument(
        "--branch-of",
        metavar="JOB",
        help="a candidate beside that gated job, on the same base: approving one "
        "candidate discards the others",
    )


def register(subparsers: Subparsers) -> None:
    """Add ``submit``, ``result`` and ``cancel``."""
    s = add_command(
        subparsers,
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
    s.add_argument(
        "--autonomy",
        choices=["read_only", "supervised", "full"],
        help="read_only refuses mutating executors and makes writes read-only; full may "
        "open the network whatever the executor declares (default: supervised)",
    )
    s.add_argument("--device", metavar="ID", help="target device (default: a server worker)")
    s.add_argument(
        "--max-attempts", type=_positive_int, metavar="N", help="deliveries before it is dead"
    )
    s.add_argument(
        "--id",
        metavar="ID",
        help="the job's id (default: a new ULID); submitting the same id again queues "
        "nothing twice, so a submit that ended E_SUBMIT_UNKNOWN can be retried with it",
    )
    s.add_argument(
        "--idempotency-key",
        metavar="KEY",
        help="a key of the caller's: a second submit with the same key queues nothing and "
        "answers with the first job's id",
    )
    s.add_argument(
        "--correlation-id",
        metavar="ID",
        help="a tag of the caller's (the agent step, say), on every log record of the job",
    )
    _add_when_options(s)
    _add_gate_options(s)
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

    r = add_command(subparsers, "result", "show a job's result")
    r.add_argument("job_id", help="the id submit printed")
    r.add_argument(
        "--wait", type=_wait_seconds, default=0.0, metavar="S", help="wait up to S seconds"
    )
    r.add_argument("--json", action="store_true", help="the Result as JSON")
    r.add_argument(
        "--changes",
        action="store_true",
        help="list the job's change set (each path created, modified, deleted or renamed, "
        "with a diff for small text files)",
    )
    r.set_defaults(fn=_cmd_result)

    c = add_command(subparsers, "cancel", "cancel a queued or running job")
    c.add_argument("job_id", help="the id submit printed")
    c.set_defaults(fn=_cmd_cancel)
