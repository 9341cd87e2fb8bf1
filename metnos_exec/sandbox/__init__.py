"""The sandbox seam and its arms: what every arm (bwrap, wasm, direct, absent, and the
test doubles echo and fault) promises.

Arms live one per module behind the `Sandbox` Protocol (`_types.py`); `select.choose_arm`
is the one registry that maps a runtime to an arm and walks the fallback ladder.

An arm has a stable `name` and takes a `SandboxJob`: the command (a native argv, or a
wasm module), the guest's whole environment (nothing is inherited from the worker), its
stdin, the host folders it may see (`Mount`, read-only unless writable), whether it may
use the network (and, with `egress`, only where), and its budgets (`ResourceLimits`). The
policy is decided upstream (`metnos_exec.plan`); the arm only expresses it with the walls
it has.

`run` returns a `SandboxOutcome`: the output (capped, with truncation flags), the exit,
the usage measured (never guessed: ``None`` when unknown) and the containment report.
Everything a guest can do to itself is an ordinary `SandboxExit` (a failure, a kill, a
timeout at the wall-time budget, a memory or fuel limit); `run` raises only `HostFault`
(the harness broke: no verdict on the job exists) or a `MetnosError` verdict reached
before launch (an absent engine, a refused mount). An arm whose launched run is cancelled
kills it and, when it can measure it, leaves its outcome with `record_stopped` before the
cancellation goes on.

`containment` reports, without running, which walls the arm would hold; the outcome's
report says which held. It names the arm used and gives each of the five axes (`AXES`:
files, network, process tree, user, resources) a state, ``kept``, ``partial`` or
``not_kept``, with the reason: a wall the host lacks is reported ``partial`` and why,
never claimed. An arm that can run a job whose writes are staged says so
(``stages_writes``, `SandboxJob.stage`, `staged`).

A new arm is one module here, registered in `select.py`, and passes
``tests/sandbox/test_conformance.py``: no run poisons the next, every outcome is well
formed, a denial is observable (the job fails, or its report says ``not_kept``), and
budgets hold.
"""

from __future__ import annotations

from ._types import (
    AXES,
    PYTHON_WASM_MODULE,
    AxisVerdict,
    ContainmentReport,
    Failure,
    FuelExhausted,
    Killed,
    MemoryExceeded,
    Mount,
    ResourceLimits,
    Sandbox,
    SandboxExit,
    SandboxJob,
    SandboxOutcome,
    Success,
    Timeout,
    Trap,
    Usage,
    WasmProgram,
)

__all__ = (
    "AXES",
    "PYTHON_WASM_MODULE",
    "AxisVerdict",
    "ContainmentReport",
    "Failure",
    "FuelExhausted",
    "Killed",
    "MemoryExceeded",
    "Mount",
    "ResourceLimits",
    "Sandbox",
    "SandboxExit",
    "SandboxJob",
    "SandboxOutcome",
    "Success",
    "Timeout",
    "Trap",
    "Usage",
    "WasmProgram",
)
