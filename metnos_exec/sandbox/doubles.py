"""Test doubles behind the sandbox seam: `EchoSandbox` and `FaultSandbox`.

Neither runs anything. Their containment reports say exactly that — every axis is
``kept`` with the reason "nothing runs: test double" — so a result produced by a double can
never be mistaken for one where a real wall stood or fell. They exist for unit tests of the
supervisor, the queue and the conformance suite, never for production dispatch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import final

from ..errors import HostFault
from ._types import (
    AxisVerdict,
    ContainmentReport,
    Failure,
    FuelExhausted,
    SandboxExit,
    SandboxJob,
    SandboxOutcome,
    Success,
    Timeout,
    Trap,
    Usage,
)

__all__ = ("EchoSandbox", "FaultScriptExhausted", "FaultSandbox")

_NOTHING_RUNS = AxisVerdict("kept", "nothing runs: test double")


def _report(arm: str) -> ContainmentReport:
    return ContainmentReport(
        sandbox=arm,
        files=_NOTHING_RUNS,
        network=_NOTHING_RUNS,
        process_tree=_NOTHING_RUNS,
        user=_NOTHING_RUNS,
        resources=_NOTHING_RUNS,
    )


def _cap(data: bytes, limit: int) -> tuple[bytes, bool]:
    if len(data) > limit:
        return data[:limit], True
    return data, False


@final
class EchoSandbox:
    """Returns the job's stdin as stdout, followed by scripted output; records every job.

    Args:
        stdout: bytes appended after the echoed stdin.
        stderr: bytes returned as stderr.
        exit: the exit every run reports (default `Success`).
    """

    name = "echo"

    def __init__(
        self, stdout: bytes = b"", stderr: bytes = b"", exit: SandboxExit | None = None
    ) -> None:
        self.stdout = stdout
        self.stderr = stderr
        self.exit: SandboxExit = Success() if exit is None else exit
        #: Every job `run` received, in order.
        self.jobs: list[SandboxJob] = []

    async def run(self, job: SandboxJob) -> SandboxOutcome:
        start = time.monotonic()
        self.jobs.append(job)
        cap = job.limits.output_bytes
        out, out_cut = _cap(job.stdin + self.stdout, cap)
        err, err_cut = _cap(self.stderr, cap)
        return SandboxOutcome(
            stdout=out,
            stderr=err,
            exit=self.exit,
            usage=Usage(wall_s=time.monotonic() - start),
            containment=self.containment(job),
            stdout_truncated=out_cut,
            stderr_truncated=err_cut,
        )

    def containment(self, job: SandboxJob) -> ContainmentReport:
        return _report(self.name)


class FaultScriptExhausted(AssertionError):
    """`FaultSandbox.run` was called more times than its script has entries.

    An `AssertionError` on purpose: it means the *test* is wrong, and it must neither look
    like a job failure (`MetnosError`) nor like a host fault a supervisor would handle.
    """


@final
class FaultSandbox:
    """Pops a preset sequence of exits, one per run, then stops.

    Each script entry is either a `SandboxExit` (returned as the outcome's exit) or an
    exception instance (raised from `run`, e.g. `HostFault("pipe broke")`). When the
    script is used up, `run` raises `FaultScriptExhausted`.

    Args:
        script: the exits and exceptions to produce, in order.
        stdout: stdout reported with every returned exit.
        stderr: stderr reported with every returned exit.
    """

    name = "fault"

    def __init__(
        self,
        script: Iterable[SandboxExit | BaseException],
        *,
        stdout: bytes = b"",
        stderr: bytes = b"",
    ) -> None:
        self._script: deque[SandboxExit | BaseException] = deque(script)
        self.stdout = stdout
        self.stderr = stderr
        self.jobs: list[SandboxJob] = []

    @property
    def remaining(self) -> int:
        return len(self._script)

    async def run(self, job: SandboxJob) -> SandboxOutcome:
        start = time.monotonic()
        self.jobs.append(job)
        if not self._script:
            raise FaultScriptExhausted(
                f"FaultSandbox script exhausted after {len(self.jobs) - 1} run(s)"
            )
        step = self._script.popleft()
        if isinstance(step, BaseException):
            raise step
        cap = job.limits.output_bytes
        out, out_cut = _cap(self.stdout, cap)
        err, err_cut = _cap(self.stderr, cap)
        return SandboxOutcome(
            stdout=out,
            stderr=err,
            exit=step,
            usage=Usage(wall_s=time.monotonic() - start),
            containment=self.containment(job),
            stdout_truncated=out_cut,
            stderr_truncated=err_cut,
        )

    def containment(self, job: SandboxJob) -> ContainmentReport:
        return _report(self.name)

    @classmethod
    def standard(cls) -> FaultSandbox:
        """The spec's sequence: failure, fuel exhausted, trap, timeout, host fault."""
        return cls(
            [
                Failure(1),
                FuelExhausted(),
                Trap("unreachable executed"),
                Timeout(),
                HostFault("fault double: scripted host fault"),
            ]
        )
