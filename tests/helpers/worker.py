"""A stand-in worker process for die-with-parent tests; arm-agnostic.

Usage::

    worker.py BACKEND [--no-reaper] [--arm MODULE:CLASS [--mount PATH]...] -- ARGV...

Runs ARGV (with this process's PATH as the whole environment) to completion on the anyio
BACKEND and exits; the test SIGKILLs it while the job runs and then checks that no job
process survived. Without ``--arm`` the job goes straight to
`metnos_exec.process.run_process` (``--no-reaper``: without the subreaper shim). With
``--arm`` it goes through that `Sandbox` arm (constructed without arguments) as a
`SandboxJob`, e.g. ``--arm metnos_exec.sandbox.bwrap:BwrapSandbox``; each ``--mount PATH``
makes PATH visible read-write at the same place (for pid files, or the job's script).
"""

from __future__ import annotations

import importlib
import os
import sys

import anyio

from metnos_exec.process import ProcessSpec, run_process
from metnos_exec.sandbox._types import Mount, ResourceLimits, SandboxJob

_LONG = 600.0


def main(args: list[str]) -> None:
    backend, rest = args[0], args[1:]
    reaper = True
    arm: str | None = None
    mounts: list[Mount] = []
    while rest[0] != "--":
        if rest[0] == "--no-reaper":
            reaper, rest = False, rest[1:]
        elif rest[0] == "--arm":
            arm, rest = rest[1], rest[2:]
        elif rest[0] == "--mount":
            mounts.append(Mount(host=rest[1], guest=rest[1], writable=True))
            rest = rest[2:]
        else:
            raise SystemExit(f"unknown option {rest[0]}")
    argv = tuple(rest[1:])
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}

    async def run() -> None:
        if arm is None:
            await run_process(ProcessSpec(argv=argv, env=env, reaper=reaper), timeout=_LONG)
            return
        module, _, name = arm.partition(":")
        sandbox = getattr(importlib.import_module(module), name)()
        limits = ResourceLimits(wall_time_s=_LONG, memory_bytes=None)
        await sandbox.run(SandboxJob(argv=argv, env=env, limits=limits, mounts=tuple(mounts)))

    anyio.run(run, backend=backend)


if __name__ == "__main__":
    main(sys.argv[1:])
