"""``metnos-exec checkpoint``: mark a device's undo journal, list the marks, show what a
restore would change, and restore (every later job undone, all or nothing). Each is a
checkpoint job that a worker of the device runs (`metnos_exec.undo.checkpoints`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .._terminal import visible
from ..client import Client
from ..messages import CHECKPOINT_EXECUTOR, Result
from ..undo.checkpoints import checkpoint_job_args
from ._common import EXIT, Subparsers, _dump_json, _Exit, _open, _positive_float, _run, add_command
from ._results import _STATUS_EXIT, _pending_message, _print_result, _wait_result


def _summary(action: str, result: Result) -> list[str]:
    out: Any = result.output if isinstance(result.output, dict) else {}
    if action == "list":
        marks = out.get("checkpoints", [])
        lines = [f"{len(marks)} checkpoint(s) on device {out.get('device', '?')}"]
        lines += [f"  {m['name']}  (job {m['job_id']}, boundary {m['boundary']})" for m in marks]
        return lines
    if action == "diff":
        lines = [f"{out.get('change_count', 0)} change(s) by jobs {', '.join(out.get('jobs', []))}"]
        lines += [f"  {c['kind']:9} {c['path']}" for c in out.get("changes", [])]
        lines += [
            f"  CONFLICT {c['path']} ({c['why']}; job {c['job']})" for c in out.get("conflicts", [])
        ]
        return lines
    if action == "create":
        mark = out.get("checkpoint", {})
        return [f"checkpoint {mark.get('name')} made on device {mark.get('device')}"]
    return [
        f"restored {out.get('restored')}: {len(out.get('jobs', []))} job(s) undone, "
        f"{out.get('paths', 0)} path(s) (undo it: metnos-exec undo {result.job_id})"
    ]


def _cmd_checkpoint(ns: argparse.Namespace) -> int:
    async def go() -> int:
        async with _open(ns.broker) as broker:
            client = Client(broker)
            args = checkpoint_job_args(ns.action, getattr(ns, "name", None))
            job_id = await client.submit(CHECKPOINT_EXECUTOR, args, device=ns.device)
            result, state = await _wait_result(client, job_id, ns.wait)
            if result is None:
                raise _Exit(EXIT["pending"], _pending_message(job_id, ns.wait, state, ns.broker))
            if ns.json:
                _dump_json(result, sys.stdout)
            elif result.status != "succeeded":
                _print_result(result, as_json=False, out=sys.stdout)
            else:
                sys.stdout.write(visible("\n".join(_summary(ns.action, result)), newlines=True))
                sys.stdout.write("\n")
            return _STATUS_EXIT[result.status]

    return _run(go)


def register(subparsers: Subparsers) -> None:
    """Add ``checkpoint`` (``create``, ``list``, ``diff``, ``restore``)."""
    c = add_command(
        subparsers,
        "checkpoint",
        "mark a device's undo journal; restore it later",
        "A checkpoint names a point in a device's undo journal. `restore NAME` undoes "
        "every job of that device since, latest first, all or nothing: a file changed "
        "outside the jobs meanwhile refuses it (E_UNDO_CONFLICT, exit 3, the paths and "
        "jobs named, nothing changed). A restore is undoable: `metnos-exec undo <its job "
        "id>`. Each command is a job a worker of the device runs.",
    )
    sub = c.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, help_ in (
        ("create", "mark the journal now as NAME"),
        ("list", "the device's checkpoints"),
        ("diff", "what restoring NAME would change (no write)"),
        ("restore", "undo every job since NAME, all or nothing"),
    ):
        p = sub.add_parser(action, help=help_, description=help_)
        if action != "list":
            p.add_argument("name", help="the checkpoint's name")
        p.add_argument("--device", default=None, help="the device (default: the server)")
        p.add_argument(
            "--wait", type=_positive_float, default=None, metavar="S", help="wait at most S s"
        )
        p.add_argument("--json", action="store_true", help="the job's Result as JSON")
        p.add_argument("--broker", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        p.set_defaults(fn=_cmd_checkpoint)
