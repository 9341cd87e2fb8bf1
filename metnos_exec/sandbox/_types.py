"""The sandbox seam: what to run, what came back, and which walls stood.

Every arm (bwrap, wasm, direct, absent, echo, fault) takes a `SandboxJob` and returns a
`SandboxOutcome`. `Sandbox.run` raises only `HostFault` (the harness itself broke) or a
`MetnosError` verdict decided before launch (absent engine, denied import); everything a
guest can do to itself is an ordinary `SandboxExit`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Literal, Protocol, runtime_checkable

import msgspec

from .egress.policy import EgressPolicy
from .egress.record import EgressRecord

__all__ = (
    "AXES",
    "AxisVerdict",
    "ContainmentReport",
    "Failure",
    "FuelExhausted",
    "Killed",
    "MemoryExceeded",
    "Mount",
    "PYTHON_WASM_MODULE",
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
    "record_stopped",
    "stopped_outcomes",
)

AxisState = Literal["kept", "not_kept", "partial"]
ArmName = Literal["bwrap", "wasm", "none", "echo", "fault", "absent"]

#: The five containment axes, in report order.
AXES: tuple[str, ...] = ("files", "network", "process_tree", "user", "resources")


class Mount(msgspec.Struct, frozen=True):
    """A host path made visible to the guest at `guest`; read-only unless `writable`.

    ``staged``: `host` is a staging overlay below the staging namespace's base (see
    `metnos_exec.undo.staging`), visible only inside that namespace (`SandboxJob.stage`): the
    arm binds it by path, without checking it on the worker's side.
    """

    host: str
    guest: str
    writable: bool = False
    staged: bool = False


class ResourceLimits(msgspec.Struct, frozen=True):
    """Budgets for one run. `None` means "no limit of this kind"."""

    wall_time_s: float = 30.0
    memory_bytes: int | None = 256 * 1024 * 1024
    pids: int | None = 64
    output_bytes: int = 1024 * 1024
    fuel: int | None = None
    cpu_time_s: int | None = None
    file_size_bytes: int | None = 64 * 1024 * 1024
    open_files: int | None = 256
    #: Bytes a staged job may write into its writable folders (the staging tmpfs size).
    disk_bytes: int | None = 256 * 1024 * 1024


#: `WasmProgram.module` sentinel for CPython-on-WASI: the wasm arm resolves it to the
#: pinned, hash-verified python.wasm (never a path an executor could choose).
PYTHON_WASM_MODULE = "metnos:python-3.12"


class WasmProgram(msgspec.Struct, frozen=True):
    """A WASI preview 1 module and the argv the guest sees (argv[0] is the program name)."""

    module: str
    args: tuple[str, ...] = ()


class SandboxJob(msgspec.Struct, frozen=True):
    """What to run. Exactly one of `argv` (native) or `wasm` is set.

    Attributes:
        argv: host-side command for native arms (first element resolved inside the guest).
        wasm: the module for the wasm arm.
        env: the guest's whole environment (nothing is inherited).
        stdin: bytes fed to the guest's stdin, then closed.
        mounts: host paths the guest may see.
        network: whether the guest may use the network at all.
        egress: with `network`, the hosts it may reach: the job gets a network namespace
            of its own whose only way out is the worker's wall
            (`metnos_exec.sandbox.egress`). ``None`` with `network`: the host network
            (the operator asked for it).
        cwd: working directory inside the guest.
        limits: budgets.
        warm: warm sandboxes kept for jobs like this one (see the field).
        stage: a staged job's key (``None``: not staged): the bwrap arm asks the staging
            layer registered under it (`metnos_exec.sandbox.staged`) to mount its
            overlays for the uid the job runs as, and starts bubblewrap inside the
            staging namespace, where they are.
    """

    argv: tuple[str, ...] = ()
    wasm: WasmProgram | None = None
    env: dict[str, str] = msgspec.field(default_factory=dict)
    stdin: bytes = b""
    mounts: tuple[Mount, ...] = ()
    network: bool = False
    cwd: str | None = None
    limits: ResourceLimits = msgspec.field(default_factory=ResourceLimits)
    stage: str | None = None
    egress: EgressPolicy | None = None
    #: Warm sandboxes to keep for this job's template (the manifest's ``warm``; ``None``:
    #: the worker's default): `metnos_exec.sandbox._bwrap_warm`.
    warm: int | None = None


# --- exits ----------------------------------------------------------------------------


class Success(msgspec.Struct, frozen=True, tag="success"):
    pass


class Failure(msgspec.Struct, frozen=True, tag="failure"):
    code: int


class FuelExhausted(msgspec.Struct, frozen=True, tag="fuel_exhausted"):
    pass


class Timeout(msgspec.Struct, frozen=True, tag="timeout"):
    pass


class MemoryExceeded(msgspec.Struct, frozen=True, tag="memory_exceeded"):
    pass


class Killed(msgspec.Struct, frozen=True, tag="killed"):
    """Killed by a signal. `limit` names the budget when the kernel told us which one
    (SIGXCPU → ``"cpu_time"``, SIGXFSZ → ``"file_size"``); never guessed from stderr."""

    signal: int
    limit: str | None = None


class Trap(msgspec.Struct, frozen=True, tag="trap"):
    message: str


SandboxExit = Success | Failure | FuelExhausted | Timeout | MemoryExceeded | Killed | Trap


# --- outcome --------------------------------------------------------------------------


class AxisVerdict(msgspec.Struct, frozen=True):
    state: AxisState
    reason: str


class ContainmentReport(msgspec.Struct, frozen=True):
    """Whether each wall held, with the arm actually used."""

    sandbox: str
    files: AxisVerdict
    network: AxisVerdict
    process_tree: AxisVerdict
    user: AxisVerdict
    resources: AxisVerdict

    def axes(self) -> dict[str, AxisVerdict]:
        return {name: getattr(self, name) for name in AXES}

    def lost(self) -> list[str]:
        """Axes not fully kept."""
        return [name for name, v in self.axes().items() if v.state != "kept"]


class Usage(msgspec.Struct, frozen=True):
    wall_s: float
    cpu_s: float | None = None
    peak_memory_bytes: int | None = None
    fuel_consumed: int | None = None


class SandboxOutcome(msgspec.Struct, frozen=True):
    stdout: bytes
    stderr: bytes
    exit: SandboxExit
    usage: Usage
    containment: ContainmentReport
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    #: Each connection the job made through the network wall (``()``: none, or no wall).
    egress: tuple[EgressRecord, ...] = ()


#: Where an arm leaves the outcome of a run stopped from outside (`stopped_outcomes`).
_STOPPED: contextvars.ContextVar[list[SandboxOutcome] | None] = contextvars.ContextVar(
    "metnos_exec_stopped_outcomes", default=None
)


@contextlib.contextmanager
def stopped_outcomes() -> Iterator[list[SandboxOutcome]]:
    """Collect what arms measured of runs stopped from outside while this is open.

    A caller that may cancel `Sandbox.run` after launch (a cancel request, a drain, a
    lost lease, its own backstop) opens this around the call: an arm whose launched run
    is cancelled kills it, measures it (usage, the containment that held) and leaves the
    outcome here (`record_stopped`) before the cancellation goes on. The list stays empty
    when nothing was launched, or the arm cannot tell.
    """
    sink: list[SandboxOutcome] = []
    token = _STOPPED.set(sink)
    try:
        yield sink
    finally:
        _STOPPED.reset(token)


def record_stopped(outcome: SandboxOutcome) -> None:
    """Leave `outcome` of a run stopped from outside for the caller (`stopped_outcomes`)."""
    sink = _STOPPED.get()
    if sink is not None:
        sink.append(outcome)


@runtime_checkable
class Sandbox(Protocol):
    """One arm of the seam."""

    #: Stable arm name: "bwrap", "wasm", "none" (direct), "absent", "echo", "fault".
    name: str

    async def run(self, job: SandboxJob) -> SandboxOutcome:
        """Run `job` to an outcome.

        A run cancelled after launch leaves its measured outcome with `record_stopped`
        (the bwrap arm does) before the cancellation goes on.

        Raises:
            HostFault: the harness itself broke; no verdict about the guest exists.
            MetnosError: a verdict reached before launch (e.g. `ToolUnavailable`).
        """
        ...

    def containment(self, job: SandboxJob) -> ContainmentReport:
        """The report this arm would give for `job`, without running it."""
        ...
