"""``metnos-exec approve`` / ``reject``: answer a job's approval gate (`Client.approve`,
`Client.reject`): the answer is a job a worker of the device that ran it serves."""

from __future__ import annotations

import argparse
import sys

from ..client import Client
from ..errors import ApprovalUnavailable, CommitConflict
from ._common import EXIT, Subparsers, _Exit, _no_job, _open, _positive_float, _run, add_command
from ._results import _STATUS_EXIT, _print_result


def _cmd_answer(ns: argparse.Namespace) -> int:
    async def go() -> int:
        async with _open(ns.broker) as broker:
            client = Client(broker)
            call = client.approve if ns.command == "approve" else client.reject
            try:
                final = await call(ns.job_id, wait=ns.wait)
            except (ApprovalUnavailable, CommitConflict) as exc:
                if await broker.get_job_state(ns.job_id) is None:
                    raise _no_job(ns.job_id, ns.broker) from None
                raise _Exit(EXIT["rejected"], f"{exc.code}: {exc}") from None
            except TimeoutError as exc:
                raise _Exit(EXIT["pending"], str(exc)) from None
            _print_result(final, as_json=ns.json, out=sys.stdout, changes=ns.changes)
            return _STATUS_EXIT[final.status] if final.status != "rejected" else 0

    return _run(go)


def register(subparsers: Subparsers) -> None:
    """Add ``approve`` and ``reject``."""
    for name, what, detail in (
        (
            "approve",
            "commit a gated job's kept changes",
            "Commit what a job submitted with --approve (or an executor whose manifest says "
            'commit = "approve") changed, as its change set shows (metnos-exec result JOB '
            "--changes). Refused with E_COMMIT_CONFLICT (exit 3, nothing applied) when a "
            "file it changes was changed on the host since it ran.",
        ),
        (
            "reject",
            "discard a gated job's kept changes",
            "Discard what a gated job changed: its result becomes rejected "
            "(E_APPROVAL_REJECTED); the folders never saw a byte of it.",
        ),
    ):
        c = add_command(subparsers, name, what, detail)
        c.add_argument("job_id", help="the job awaiting approval")
        c.add_argument(
            "--wait", type=_positive_float, default=None, metavar="S", help="wait at most S seconds"
        )
        c.add_argument("--changes", action="store_true", help="list the change set too")
        c.add_argument("--json", action="store_true", help="the job's final Result as JSON")
        c.set_defaults(fn=_cmd_answer)
