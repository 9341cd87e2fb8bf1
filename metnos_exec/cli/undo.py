"""``metnos-exec undo``: put back what a job changed, as an undo job that a worker of the
device which made the changes runs (`Client.submit_undo`)."""

from __future__ import annotations

import argparse
import sys

from ..client import Client
from ..errors import UndoUnavailable
from ._common import (
    EXIT,
    Subparsers,
    _Exit,
    _no_job,
    _open,
    _positive_float,
    _run,
    add_command,
)
from ._results import _STATUS_EXIT, _pending_message, _print_job_id, _print_result, _wait_result


def _cmd_undo(ns: argparse.Namespace) -> int:
    async def go() -> int:
        async with _open(ns.broker) as broker:
            client = Client(broker)
            try:
                undo_id = await client.submit_undo(ns.job_id)
            except UndoUnavailable as exc:
                if await broker.get_job_state(ns.job_id) is None:
                    raise _no_job(ns.job_id, ns.broker) from None
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


def register(subparsers: Subparsers) -> None:
    """Add ``undo``."""
    u = add_command(
        subparsers,
        "undo",
        "undo a job's file changes",
        "Put back exactly what a job changed (content, names, modes, links). The undo is "
        "a job, run by a worker of the device that made the changes; it is refused "
        "(E_UNDO_CONFLICT, exit 3, nothing changed) when a file changed since. An undo "
        "can be undone: `metnos-exec undo <the undo job's id>`.",
    )
    u.add_argument("job_id", help="the job whose file changes to undo")
    u.add_argument(
        "--wait", type=_positive_float, default=None, metavar="S", help="wait at most S seconds"
    )
    u.add_argument("--no-wait", action="store_true", help="print the undo job's id and exit")
    u.add_argument("--json", action="store_true", help="the undo's Result as JSON")
    u.set_defaults(fn=_cmd_undo)
