"""``metnos-exec doctor``: the findings of `metnos_exec.doctor.diagnose`, for people (one
line each, with what it means and the fix when it is not ``ok``) or as JSON; exit 0 when
healthy, 1 when something the configuration requires is missing."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import anyio

from ._common import Subparsers, _check_url, _dump_json, add_command

_MARK = {"ok": "ok  ", "weakened": "WEAK", "missing": "MISS", "info": "info"}


def _cmd_doctor(ns: argparse.Namespace) -> int:
    from ..doctor import diagnose

    _check_url(ns.broker)  # a mistyped URL is a usage error, not a finding about the host

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


def register(subparsers: Subparsers) -> None:
    """Add ``doctor``."""
    dr = add_command(
        subparsers,
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
