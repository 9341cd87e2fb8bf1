"""Test doubles behind the sandbox seam: `EchoSandbox` and `FaultSandbox`.

Neither runs anything. Their containment reports say exactly that — every axis is
``kept`` with the reason "nothing runs: test double" — so a result produced by a double can
never be mistaken for one where a real wall stood or fell. They exist for unit tests of the
supervisor, the queue and the conformance suite, never for production dispatch.

`EchoSandbox` can wait before it answers (``delay_s``: a fixed time, or a range drawn
from per run), as a tool call waiting on the network does: the fleet benchmark
(``bench/fleet.py``) measures the queue and the supervisor with jobs that wait. A worker
process gets it from ``METNOS_ECHO_DELAY_S`` (`echo_from_env`), read only with
``METNOS_ARM_OVERRIDE=echo``, itself a test and bench hook.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Final, final

import anyio

from ..errors import BadConfig, HostFault
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

__all__ = (
    "ECHO_DELAY_ENV",
    "EchoSandbox",
    "FaultScriptExhausted",
    "FaultSandbox",
    "echo_from_env",
    "parse_echo_delay",
)

#: The echo double's wait per run, for a worker started with ``METNOS_ARM_OVERRIDE=echo``:
#: seconds (``0.1``), or a range ``LO-HI`` (``0.05-0.2``) drawn from uniformly per run.
ECHO_DELAY_ENV: Final = "METNOS_ECHO_DELAY_S"

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
        delay_s: seconds each run waits before it answers (a sleep: no CPU, cancellable),
            or ``(lo, hi)``: a time drawn uniformly from that range per run.
    """

    name = "echo"

    def __init__(
        self,
        stdout: bytes = b"",
        stderr: bytes = b"",
        exit: SandboxExit | None = None,
        *,
        delay_s: float | tuple[float, float] = 0.0,
    ) -> None:
        self.stdout = stdout
        self.stderr = stderr
        self.exit: SandboxExit = Success() if exit is None else exit
        lo, hi = delay_s if isinstance(delay_s, tuple) else (delay_s, delay_s)
        if not 0 <= lo <= hi:
            raise ValueError(f"delay_s: expected 0 <= lo <= hi, got {delay_s!r}")
        self.delay_s = (float(lo), float(hi))
        #: Every job `run` received, in order.
        self.jobs: list[SandboxJob] = []

    async def run(self, job: SandboxJob) -> SandboxOutcome:
        start = time.monotonic()
        self.jobs.append(job)
        lo, hi = self.delay_s
        if hi > 0:
            await anyio.sleep(lo if lo == hi else random.uniform(lo, hi))
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


def parse_echo_delay(text: str, *, what: str = ECHO_DELAY_ENV) -> tuple[float, float]:
    """``0.1`` → ``(0.1, 0.1)``; ``0.05-0.2`` → ``(0.05, 0.2)`` (seconds).

    Raises:
        BadConfig: not a number of seconds from 0 to 3600, nor a range ``LO-HI`` of them
            with ``LO <= HI``.
    """
    parts = text.strip().split("-")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) == 1:
        values *= 2
    if len(values) != 2 or not 0 <= values[0] <= values[1] <= 3600:
        raise BadConfig(
            f"{what}={text!r}: expected seconds (0.1) or a range LO-HI (0.05-0.2), 0-3600"
        )
    return values[0], values[1]


def echo_from_env(environ: Mapping[str, str]) -> EchoSandbox:
    """The echo double a worker with ``METNOS_ARM_OVERRIDE=echo`` runs every job in,
    waiting ``METNOS_ECHO_DELAY_S`` per run (none when unset).

    Raises:
        BadConfig: a bad ``METNOS_ECHO_DELAY_S`` (`parse_echo_delay`).
    """
    text = environ.get(ECHO_DELAY_ENV, "")
    return EchoSandbox(delay_s=parse_echo_delay(text) if text.strip() else 0.0)


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
