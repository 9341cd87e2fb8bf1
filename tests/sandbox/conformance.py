"""The conformance suite every sandbox arm must pass (spec §2).

An arm plugs in by describing itself as an `ArmUnderTest`: a factory for the arm, and
builders for a handful of jobs written in the arm's own language (native argv or a wasm
module). The suite then checks four properties:

* **no poisoning** — a well-formed run, a denied run, and the same well-formed run again
  give identical, successful results: nothing one run does leaks into the next;
* **well-formed outcomes** — every outcome has the right types, a containment report with
  the five axes in valid states and the arm's own name, non-negative usage, output within
  its cap, and truncation flags that agree with the output (a flood job checks the cap);
* **denial is observable** — a job doing something the job did not grant (reading a file
  outside its mounts, ...) either does not succeed (or is refused before launch with a
  `MetnosError`), or the arm's report says that axis was ``not_kept``; and the same job
  *with* the grant succeeds, so the denial is a capability decision, not a broken test;
* **budgets hold** — a job that outlives its wall time ends as `Timeout` within the
  budget plus a stated slack.

`CHECKS` maps each property to its coroutine; `tests/sandbox/test_conformance.py`
parametrises it over every arm. Builders for the common job shapes are here too
(`native_jobs`, `wasm_jobs`) so a new arm only writes its factory.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from metnos_exec.errors import MetnosError
from metnos_exec.sandbox._types import (
    AXES,
    ContainmentReport,
    Failure,
    FuelExhausted,
    Killed,
    MemoryExceeded,
    Mount,
    ResourceLimits,
    Sandbox,
    SandboxJob,
    SandboxOutcome,
    Success,
    Timeout,
    Trap,
    WasmProgram,
)

__all__ = (
    "CHECKS",
    "ArmUnderTest",
    "JobBuilder",
    "assert_well_formed",
    "native_jobs",
    "wasm_jobs",
)

#: Builds a job for one check; gets a fresh per-test folder for its fixtures.
JobBuilder = Callable[[Path], SandboxJob]
#: Builds the arm for one check (the check's name is passed so scripted doubles can
#: script it); may be sync or async.
ArmFactory = Callable[[str], "Sandbox | Awaitable[Sandbox]"]

_EXITS = (Success, Failure, FuelExhausted, Timeout, MemoryExceeded, Killed, Trap)
_STATES = frozenset({"kept", "not_kept", "partial"})


@dataclass(frozen=True)
class ArmUnderTest:
    """One arm, described for the suite.

    Attributes:
        name: the arm's `Sandbox.name` (what its reports must say).
        make: builds the arm for a check (``"poison"``, ``"well_formed"``, ``"flood"``,
            ``"denial"``, ``"granted"``, ``"budget"``).
        well_formed: a job that succeeds and prints `expected_stdout`.
        expected_stdout: the exact stdout of `well_formed`.
        flood: a job printing more than its ``limits.output_bytes``.
        forbidden: a job that tries something not granted (see `forbidden_axis`).
        granted: the same attempt with the grant; must succeed.
        forbidden_axis: the containment axis `forbidden` tests.
        over_budget: a job that would run far longer than its wall time.
        budget_slack_s: how far past its wall time a timed-out job may end.
        not_applicable: check name → why it does not apply to this arm (skipped).
    """

    name: str
    make: ArmFactory
    well_formed: JobBuilder
    expected_stdout: bytes
    flood: JobBuilder | None = None
    forbidden: JobBuilder | None = None
    granted: JobBuilder | None = None
    forbidden_axis: str = "files"
    over_budget: JobBuilder | None = None
    budget_slack_s: float = 3.0
    not_applicable: dict[str, str] | None = None


async def _arm(arm: ArmUnderTest, check: str) -> Sandbox:
    made = arm.make(check)
    sandbox = await made if inspect.isawaitable(made) else made
    assert isinstance(sandbox, Sandbox), f"{sandbox!r} does not implement the Sandbox seam"
    assert sandbox.name == arm.name, f"arm reports name {sandbox.name!r}, expected {arm.name!r}"
    return sandbox


def _assert_report(report: ContainmentReport, arm_name: str) -> None:
    assert isinstance(report, ContainmentReport)
    assert report.sandbox == arm_name, f"report names {report.sandbox!r}, arm is {arm_name!r}"
    axes = report.axes()
    assert tuple(axes) == AXES
    for axis, verdict in axes.items():
        assert verdict.state in _STATES, f"{axis}: invalid state {verdict.state!r}"
        assert isinstance(verdict.reason, str) and verdict.reason.strip(), f"{axis}: no reason"


def assert_well_formed(outcome: SandboxOutcome, job: SandboxJob, arm_name: str) -> None:
    """Every structural promise of a `SandboxOutcome`."""
    assert isinstance(outcome, SandboxOutcome), type(outcome)
    assert isinstance(outcome.stdout, bytes) and isinstance(outcome.stderr, bytes)
    assert isinstance(outcome.exit, _EXITS), f"unknown exit {outcome.exit!r}"
    ex = outcome.exit
    if isinstance(ex, Failure):
        assert type(ex.code) is int and ex.code != 0, f"Failure with code {ex.code!r}"
    if isinstance(ex, Killed):
        assert type(ex.signal) is int and 0 < ex.signal < 65, f"Killed by {ex.signal!r}"
    if isinstance(ex, Trap):
        assert isinstance(ex.message, str) and ex.message
    u = outcome.usage
    assert isinstance(u.wall_s, float | int) and math.isfinite(u.wall_s) and u.wall_s >= 0
    for field in ("cpu_s", "peak_memory_bytes", "fuel_consumed"):
        value = getattr(u, field)
        assert value is None or value >= 0, f"usage.{field} = {value!r}"
    _assert_report(outcome.containment, arm_name)
    cap = job.limits.output_bytes
    for stream in ("stdout", "stderr"):
        data, cut = getattr(outcome, stream), getattr(outcome, f"{stream}_truncated")
        assert isinstance(cut, bool)
        assert len(data) <= cap, f"{stream}: {len(data)} bytes exceed the cap of {cap}"
        if cut:
            # Truncated means the cap was reached: the kept part is exactly the cap.
            assert len(data) == cap, f"{stream} truncated at {len(data)}, cap is {cap}"
    # The outcome must survive the wire (the queue stores it as JSON).
    wire = msgspec.json.encode(outcome)
    assert msgspec.json.decode(wire, type=SandboxOutcome) == outcome


async def _run(sandbox: Sandbox, job: SandboxJob, arm_name: str) -> SandboxOutcome:
    _assert_report(sandbox.containment(job), arm_name)
    outcome = await sandbox.run(job)
    assert_well_formed(outcome, job, arm_name)
    return outcome


def _describe(o: SandboxOutcome) -> str:
    return f"exit={o.exit!r} stdout={o.stdout[:200]!r} stderr={o.stderr[-500:]!r}"


# --- the checks -----------------------------------------------------------------------


async def check_no_poisoning(arm: ArmUnderTest, tmp: Path) -> None:
    sandbox = await _arm(arm, "poison")
    job = arm.well_formed(tmp)
    first = await _run(sandbox, job, arm.name)
    assert isinstance(first.exit, Success), _describe(first)
    assert first.stdout == arm.expected_stdout, _describe(first)
    if arm.forbidden is not None:
        # A run that was denied (or failed) in between must leave nothing behind either.
        with contextlib.suppress(MetnosError):
            await _run(sandbox, arm.forbidden(tmp), arm.name)
    second = await _run(sandbox, job, arm.name)
    assert isinstance(second.exit, Success), _describe(second)
    assert second.stdout == first.stdout
    assert second.stderr == first.stderr


async def check_well_formed(arm: ArmUnderTest, tmp: Path) -> None:
    sandbox = await _arm(arm, "well_formed")
    job = arm.well_formed(tmp)
    outcome = await _run(sandbox, job, arm.name)
    assert not outcome.stdout_truncated and not outcome.stderr_truncated
    if arm.flood is None:
        return
    flood_arm = await _arm(arm, "flood")
    flood_job = arm.flood(tmp)
    flooded = await _run(flood_arm, flood_job, arm.name)
    assert flooded.stdout_truncated, _describe(flooded)
    assert len(flooded.stdout) == flood_job.limits.output_bytes


async def check_denial(arm: ArmUnderTest, tmp: Path) -> None:
    assert arm.forbidden is not None
    sandbox = await _arm(arm, "denial")
    job = arm.forbidden(tmp)
    try:
        outcome = await _run(sandbox, job, arm.name)
    except MetnosError:
        pass  # refused before launch (e.g. SandboxDenied): observable by the caller
    else:
        verdict = getattr(outcome.containment, arm.forbidden_axis)
        assert not isinstance(outcome.exit, Success) or verdict.state != "kept", (
            f"{arm.name}: a forbidden job succeeded while the {arm.forbidden_axis} axis is "
            f"reported kept ({verdict.reason}); {_describe(outcome)}"
        )
    if arm.granted is not None:
        granted_arm = await _arm(arm, "granted")
        ok = await _run(granted_arm, arm.granted(tmp), arm.name)
        assert isinstance(ok.exit, Success), (
            f"the granted twin failed, so the denial proves nothing: {_describe(ok)}"
        )


async def check_budget(arm: ArmUnderTest, tmp: Path) -> None:
    assert arm.over_budget is not None
    sandbox = await _arm(arm, "budget")
    job = arm.over_budget(tmp)
    start = time.monotonic()
    outcome = await _run(sandbox, job, arm.name)
    elapsed = time.monotonic() - start
    assert isinstance(outcome.exit, Timeout), _describe(outcome)
    bound = job.limits.wall_time_s + arm.budget_slack_s
    assert elapsed <= bound, f"timed out after {elapsed:.2f}s, bound {bound:.2f}s"


async def check_tiny_budget(arm: ArmUnderTest, tmp: Path) -> None:
    """A budget shorter than the arm's own start-up (``--timeout 0.001``) is the job's
    timeout, never a host fault: a host fault is retried, and the same budget would fail
    the same way on every attempt."""
    assert arm.over_budget is not None
    sandbox = await _arm(arm, "tiny_budget")
    over = arm.over_budget(tmp)
    job = msgspec.structs.replace(
        over, limits=msgspec.structs.replace(over.limits, wall_time_s=0.001)
    )
    start = time.monotonic()
    outcome = await _run(sandbox, job, arm.name)
    elapsed = time.monotonic() - start
    assert isinstance(outcome.exit, Timeout), _describe(outcome)
    assert elapsed <= arm.budget_slack_s, f"timed out after {elapsed:.2f}s"


CHECKS: dict[str, Callable[[ArmUnderTest, Path], Awaitable[None]]] = {
    "no_poisoning": check_no_poisoning,
    "well_formed": check_well_formed,
    "denial": check_denial,
    "budget": check_budget,
    "tiny_budget": check_tiny_budget,
}


def applicable(arm: ArmUnderTest, check: str) -> str | None:
    """None if `check` applies to `arm`, else the reason it does not."""
    if arm.not_applicable and check in arm.not_applicable:
        return arm.not_applicable[check]
    if check == "denial" and arm.forbidden is None:
        return f"{arm.name}: no forbidden job described"
    if check in ("budget", "tiny_budget") and arm.over_budget is None:
        return f"{arm.name}: no over-budget job described"
    return None


# --- job builders for the common shapes ------------------------------------------------

_PY = os.path.realpath(sys.executable)
_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}

_UPPER = "import sys; sys.stdout.write(sys.stdin.read().upper())"
_FLOOD = "import sys; sys.stdout.write('x' * 200000); sys.stdout.flush()"
_READ_SECRET = (
    "import sys\n"
    "try:\n"
    "    sys.stdout.write(open(sys.argv[1]).read())\n"
    "except OSError as e:\n"
    "    sys.stderr.write(repr(e)); sys.exit(3)\n"
)
_SLEEP = "import time; time.sleep(60)"


def _py(code: str, *args: str, **kw: Any) -> SandboxJob:
    return SandboxJob(argv=(_PY, "-I", "-S", "-c", code, *args), env=dict(_ENV), **kw)


def _secret(tmp: Path) -> Path:
    folder = tmp / "conformance-secret"
    folder.mkdir(exist_ok=True)
    (folder / "key.txt").write_text("s3cret")
    return folder


def native_jobs() -> dict[str, Any]:
    """`ArmUnderTest` keyword arguments for an arm that runs native argv jobs.

    The forbidden job reads a file under the test's tmp folder that is not mounted; its
    granted twin mounts that folder read-only.
    """
    return {
        "well_formed": lambda tmp: _py(_UPPER, stdin=b"ping"),
        "expected_stdout": b"PING",
        "flood": lambda tmp: _py(_FLOOD, limits=ResourceLimits(output_bytes=1000)),
        "forbidden": lambda tmp: _py(_READ_SECRET, str(_secret(tmp) / "key.txt")),
        "granted": lambda tmp: _py(
            _READ_SECRET,
            str(_secret(tmp) / "key.txt"),
            mounts=(Mount(str(_secret(tmp)), str(_secret(tmp)), False),),
        ),
        "forbidden_axis": "files",
        "over_budget": lambda tmp: _py(_SLEEP, limits=ResourceLimits(wall_time_s=0.5)),
    }


# Hand-written WASI preview 1 modules (no external artifact).
WAT_OK = """
(module
  (import "wasi_snapshot_preview1" "fd_write"
    (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0) "\\10\\00\\00\\00\\03\\00\\00\\00")
  (data (i32.const 16) "ok\\n")
  (func (export "_start")
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 32)))))
"""

#: Writes 4 KiB of "x": 64 calls of fd_write with one 64-byte iovec each (WASI may write
#: only part of a multi-iovec call, so one call per block keeps the count exact).
WAT_FLOOD = """
(module
  (import "wasi_snapshot_preview1" "fd_write"
    (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0) "\\00\\04\\00\\00\\40\\00\\00\\00")
  (data (i32.const 1024)
    "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx")
  (func (export "_start") (local $i i32)
    (loop $again
      (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 2048)))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $again (i32.lt_u (local.get $i) (i32.const 64))))))
"""

#: path_open("key.txt") through the first preopen (fd 3); proc_exit(7) if it fails.
WAT_OPEN_OR_7 = """
(module
  (import "wasi_snapshot_preview1" "path_open"
    (func $path_open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (memory (export "memory") 1)
  (data (i32.const 64) "key.txt")
  (func (export "_start")
    (if (call $path_open (i32.const 3) (i32.const 0) (i32.const 64) (i32.const 7)
                         (i32.const 0) (i64.const 2) (i64.const 0) (i32.const 0)
                         (i32.const 128))
      (then (call $proc_exit (i32.const 7))))))
"""

WAT_SPIN = """
(module
  (memory (export "memory") 1)
  (func (export "_start") (local $i i32)
    (loop $again
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $again))))
"""


WATS: dict[str, str] = {"ok": WAT_OK, "flood": WAT_FLOOD, "open": WAT_OPEN_OR_7, "spin": WAT_SPIN}


def compile_wats(folder: Path) -> dict[str, Path]:
    """Compile every module of the suite into `folder` (``<name>.wasm``), once."""
    import wasmtime

    out = {}
    for name, wat in WATS.items():
        path = folder / f"{name}.wasm"
        if not path.exists():
            path.write_bytes(wasmtime.wat2wasm(wat))
        out[name] = path
    return out


def wasm_jobs(modules: dict[str, Path]) -> dict[str, Any]:
    """`ArmUnderTest` keyword arguments for an arm that runs WASI preview 1 modules.

    Args:
        modules: from `compile_wats` (compiled once per session, so an engine that keeps
            compiled images mapped does not look like a per-test fd leak).
    """
    fuel = ResourceLimits(fuel=10_000_000)

    def _wasm(name: str, **kw: Any) -> SandboxJob:
        return SandboxJob(wasm=WasmProgram(module=str(modules[name]), args=(name,)), **kw)

    return {
        "well_formed": lambda tmp: _wasm("ok", limits=fuel),
        "expected_stdout": b"ok\n",
        "flood": lambda tmp: _wasm(
            "flood", limits=msgspec.structs.replace(fuel, output_bytes=1000)
        ),
        "forbidden": lambda tmp: _wasm("open", limits=fuel),
        "granted": lambda tmp: _wasm(
            "open",
            limits=fuel,
            mounts=(Mount(str(_secret(tmp)), "/secret", False),),
        ),
        "forbidden_axis": "files",
        # Fuel to spare: only the wall clock (epoch interruption) can stop it in time.
        "over_budget": lambda tmp: _wasm(
            "spin",
            limits=ResourceLimits(wall_time_s=0.5, fuel=10**15),
        ),
    }
