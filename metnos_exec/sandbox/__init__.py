"""The sandbox seam and its arms.

Arms live one per module behind the `Sandbox` Protocol (`_types.py`); `select.choose_arm`
is the one registry that maps a runtime to an arm and walks the fallback ladder.
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
