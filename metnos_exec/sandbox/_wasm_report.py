"""What the wasm arm reports: a job's containment before it runs, its outcome after.

Private to the wasm arm (`metnos_exec.sandbox.wasm`, whose docstring states the walls).
`containment_report` says which walls a job gets from its mounts and limits;
`read_outcome` turns what the job's guest's process left (`_wasm_launch.Ran`: its verdict
line, else how the process ended) into the `SandboxOutcome`, saying in the report where
the guest was stopped and when its module was compiled for the job.

The memory verdicts are read here. The store limit makes `memory.grow` fail, and the
engine says nothing more: the outcome is `MemoryExceeded` when the guest ended abnormally
while its memory stood within one page of the limit (no further page could be granted),
or when the module's initial memory is over the limit. A guest whose single large request
failed far below the limit, and who handled that itself, keeps its own exit
(`Failure(code)`): an under-report, never an invented verdict. Tables follow the same
rule: `MemoryExceeded` when the guest ended abnormally while one exported table held more
than its share (`MAX_ELEMENTS_PER_TABLE`) minus 65,536 elements, or for a module declaring
a table over its share; else the guest's own exit.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from ..errors import HostFault, SandboxDenied
from ..logs import get_logger
from ._types import (
    AxisVerdict,
    ContainmentReport,
    Failure,
    FuelExhausted,
    Killed,
    MemoryExceeded,
    ResourceLimits,
    SandboxExit,
    SandboxJob,
    SandboxOutcome,
    Success,
    Timeout,
    Trap,
    Usage,
)
from ._wasm_guest import MAX_ELEMENTS_PER_TABLE, MAX_TABLE_ELEMENTS, PAGE, TABLE_STEP
from ._wasm_launch import Ran

_log = get_logger()

#: A writable preopen: the guest writes straight into the host folder, and nothing bounds
#: a file's size or the total (no staging in this arm; the worker backs up the declared
#: targets at most). Fuel and wall time bound the rate, not the disk.
WASM_DISK_REASON: Final[str] = (
    "disk not bounded: writes to writable preopens go straight to the host folders, with "
    "no per-file or total size limit (no staging in the wasm arm)"
)


def containment_report(job: SandboxJob) -> ContainmentReport:
    """The walls `job` gets in the wasm arm, axis by axis."""
    n = len(job.mounts)
    ro = sum(1 for m in job.mounts if not m.writable)
    lim = job.limits
    disk = f"; {WASM_DISK_REASON}" if n > ro else ""
    bounds = (
        f"; open files at most {lim.open_files} (the guest process's RLIMIT_NOFILE)"
        if lim.open_files is not None
        else "; open files bounded by the guest process's inherited RLIMIT_NOFILE"
    )
    if lim.cpu_time_s is not None:
        bounds += f"; CPU time at most {lim.cpu_time_s} s (epoch check, RLIMIT_CPU)"
    if lim.fuel is not None and lim.memory_bytes is not None:
        resources = AxisVerdict(
            "partial" if disk else "kept",
            "fuel budget and store memory limit both set; one instance, one memory, "
            f"tables at most {MAX_TABLE_ELEMENTS:,} table elements in all "
            f"({MAX_ELEMENTS_PER_TABLE:,} per table); the module's compile counts "
            "against the wall time" + bounds + disk,
        )
    else:
        missing = [
            name for name, v in (("fuel", lim.fuel), ("memory", lim.memory_bytes)) if v is None
        ]
        resources = AxisVerdict(
            "partial",
            f"no {' and no '.join(missing)} limit set; wall time still bounded" + bounds + disk,
        )
    return ContainmentReport(
        sandbox="wasm",
        files=AxisVerdict("kept", f"only {n} preopened folder(s) visible, {ro} of them read-only"),
        network=AxisVerdict(
            "kept",
            "WASI preview 1 cannot create sockets; socket imports fail to link"
            + ("" if not job.network else " (the job asked for network: not grantable)"),
        ),
        process_tree=AxisVerdict(
            "kept",
            "WASI preview 1 has no process creation; the guest runs in a process of "
            "its own, killed and reaped before the result",
        ),
        user=AxisVerdict("not_kept", "the engine runs in a process of the worker's own identity"),
        resources=resources,
    )


def read_outcome(
    job: SandboxJob, ran: Ran, wall: float, containment: ContainmentReport
) -> SandboxOutcome:
    """`job`'s outcome from what its guest's process left (`wall`: the seconds the arm
    waited for it), `containment` amended with what the run showed.

    Raises:
        HostFault: the guest's process failed, or ended without a verdict.
        SandboxDenied: the process refused the module (nothing ran).
    """
    assert job.wasm is not None
    lim = job.limits
    proc = ran.process
    verdict = ran.verdict or {}
    exit_ = _process_exit(ran, verdict, lim)
    stopped_in = verdict.get("stopped_in")
    if stopped_in is not None:
        # Stopped where no epoch check reaches: the process was ended, so nothing of
        # the guest goes on; the report says where it was.
        what = (
            "the guest was in a host call (blocked: a FIFO, a slow file) at its wall deadline"
            if stopped_in == "run"
            else "the module was still loading (compiling) at the wall deadline: the "
            "compile counts against the job's wall time"
        )
        _log.warning(
            "sandbox.guest_killed",
            module=job.wasm.module,
            why="timeout",
            stopped_in=stopped_in,
            wall_time_s=lim.wall_time_s,
            waited_s=round(wall, 3),
        )
        containment = _amended(containment, f"{what}; its process was killed")
    loaded = verdict.get("loaded") or {}
    if loaded.get("how") == "compiled":
        # Said, so that a slow compile (counted in the wall time) is not a mystery.
        containment = _amended(
            containment,
            f"the module was compiled for this job "
            f"({float(loaded.get('load_s', 0.0)):.2f} s of its wall time)",
        )
    peak = verdict.get("peak")
    exit_ = _memory_verdict(exit_, lim, peak, verdict.get("tables") or [])
    cpu = verdict.get("cpu_s", proc.cpu_s)
    return SandboxOutcome(
        stdout=proc.stdout,
        stderr=proc.stderr,
        exit=exit_,
        usage=Usage(
            wall_s=float(verdict.get("wall_s", wall)),
            cpu_s=None if cpu is None else float(cpu),
            peak_memory_bytes=peak,
            fuel_consumed=verdict.get("fuel"),
        ),
        containment=containment,
        stdout_truncated=proc.stdout_truncated,
        stderr_truncated=proc.stderr_truncated,
    )


def _process_exit(ran: Ran, verdict: dict[str, Any], lim: ResourceLimits) -> SandboxExit:
    """The guest's exit: its verdict's, else the process's end (a timeout notes in
    `verdict` the phase it stopped in)."""
    proc = ran.process
    if "fault" in verdict:
        raise HostFault(f"wasm arm: the guest's process failed: {verdict['fault']}")
    if "denied" in verdict:
        raise SandboxDenied(str(verdict["denied"]))
    if "exit" in verdict:
        return _exit_from(verdict["exit"])
    if proc.returncode == -signal.SIGXCPU and lim.cpu_time_s is not None:
        return Killed(signal.SIGXCPU, "cpu_time")
    if proc.timed_out:
        verdict["stopped_in"] = "run" if ran.loaded else "load"
        return Timeout()
    tail = proc.stderr[-2000:].decode("utf-8", "replace")
    raise HostFault(
        f"wasm arm: the guest's process ended without a verdict (status {proc.returncode}): {tail}"
    )


def _exit_from(tag: Mapping[str, Any]) -> SandboxExit:
    kind = tag["type"]
    if kind == "success":
        return Success()
    if kind == "failure":
        return Failure(int(tag["code"]))
    if kind == "fuel_exhausted":
        return FuelExhausted()
    if kind == "timeout":
        return Timeout()
    if kind == "memory_exceeded":
        return MemoryExceeded()
    if kind == "cpu":
        return Killed(signal.SIGXCPU, "cpu_time")
    return Trap(str(tag.get("message", "")))


def _memory_verdict(
    exit_: SandboxExit, lim: ResourceLimits, peak: int | None, tables: list[int]
) -> SandboxExit:
    """`MemoryExceeded` for a guest that failed at its memory or table limit (see the
    module docstring), else `exit_`."""
    if not isinstance(exit_, (Success, FuelExhausted, Timeout, Killed)):
        mem = lim.memory_bytes
        if mem is not None and peak is not None and peak + PAGE > mem:
            # The guest failed while its memory sat at the limit: not one more page
            # could be granted. That is the limit, not a guess from stderr. A guest
            # whose *single* large request failed far below the limit stays
            # `Failure`/`Trap`: we under-report rather than invent.
            return MemoryExceeded()
        if tables and max(tables) + TABLE_STEP > MAX_ELEMENTS_PER_TABLE:
            # The same rule for tables (exported ones: the only ones we can see).
            return MemoryExceeded()
    return exit_


def _amended(containment: ContainmentReport, note: str) -> ContainmentReport:
    """`containment` with `note` added to its resources axis' reason."""
    return msgspec.structs.replace(
        containment,
        resources=AxisVerdict(
            containment.resources.state, f"{containment.resources.reason}; {note}"
        ),
    )
