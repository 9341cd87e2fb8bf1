"""``metnos-exec``: run workers, submit jobs, read results and logs.

Commands: ``worker``, ``submit``, ``result``, ``cancel``, ``status``, ``purge``, ``tail``,
``web``, ``top``, ``undo``, ``tools``, ``mcp``, ``bench``, ``codes``, ``doctor``,
``keygen``, ``sign``.
``metnos-exec COMMAND --help`` explains each. The broker URL comes from ``--broker``,
else ``$METNOS_BROKER``, else ``sqlite:///./metnos.db``.

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
8     already finished: ``cancel`` of a job that had its result (named; nothing cancelled)
70    internal error (``E_INTERNAL``: a bug in metnos-exec; ``METNOS_DEBUG=1`` shows the
      traceback)
130   interrupted (Ctrl-C)
====  =====================================================================

Every error is printed as one line, ``metnos-exec: E_CODE: sentence``; a traceback is
shown only with ``METNOS_DEBUG=1``.

Each command group is one module that adds its subparsers next to the code that runs
them (its ``register``): `worker`; `jobs` (``submit``, ``result``, ``cancel``); `queue`
(``status``, ``tail``, ``purge``); `web` (``web``, ``top``: the live view); `undo`;
`checkpoint` (``create``, ``list``, ``diff``, ``restore``);
`tools` (tool definitions for a model API);
`mcp` (the MCP server); `codes`; `doctor`; `keys` (``keygen``, ``sign``); `bench`.
`_common` holds what they share (`EXIT`, the ``--broker`` option, the epilog, the option
types, opening a broker), `_results` how a job waited for is shown.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from .._terminal import visible
from ..errors import MetnosError
from . import (
    approval,
    bench,
    checkpoint,
    codes,
    doctor,
    jobs,
    keys,
    mcp,
    queue,
    tools,
    undo,
    web,
    worker,
)
from ._common import _EPILOG, EXIT, _Exit, _exit_for, _Formatter
from ._results import _print_result as _print_result

__all__ = ("EXIT", "main")

#: The command groups, in the order ``metnos-exec --help`` lists their commands.
_GROUPS = (
    worker,
    jobs,
    queue,
    web,
    undo,
    approval,
    checkpoint,
    tools,
    mcp,
    codes,
    doctor,
    keys,
    bench,
)


def build_parser() -> argparse.ArgumentParser:
    """The ``metnos-exec`` parser: ``--version``, and each group's commands."""
    p = argparse.ArgumentParser(
        prog="metnos-exec",
        description="Run sandboxed executors from a job queue.",
        epilog=_EPILOG,
        formatter_class=_Formatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for group in _GROUPS:
        group.register(sub)
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
    if argv is None and ns.fn is not worker._cmd_worker:
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
