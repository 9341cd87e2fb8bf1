"""The wasm arm on real wasmtime: reference assertions, budgets, preopens, the runtime pin.

python.wasm is compiled once per session into a session cache folder (`wasm_cache`) and
then loaded from the in-memory cache, so only the first wasm-python test pays the cold
compile (4-8 s).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import anyio
import pytest
from structlog.testing import capture_logs

from metnos_exec.errors import HostFault, SandboxDenied, SymlinkedFolder, ToolUnavailable
from metnos_exec.manifest import load_manifest
from metnos_exec.sandbox import wasm
from metnos_exec.sandbox._types import (
    PYTHON_WASM_MODULE,
    Failure,
    FuelExhausted,
    Killed,
    MemoryExceeded,
    Mount,
    ResourceLimits,
    Sandbox,
    SandboxJob,
    Success,
    Timeout,
    Trap,
    WasmProgram,
)
from metnos_exec.sandbox._wasm_engine import WasmEngine, load_wasmtime
from metnos_exec.sandbox._wasm_runtime import find_python_wasm, verified_python_wasm
from metnos_exec.sandbox.wasm import (
    KILL_AFTER_S,
    MAX_FUNCTION_LOCALS,
    MAX_TABLE_ELEMENTS,
    WASM_DISK_REASON,
    WASMTIME_PIN_REASON,
    WATCHDOG_SLACK_S,
    RuntimeMismatch,
    WasmSandbox,
    python_program,
    wasm_status,
)
from tests.conftest import need
from tests.sandbox.spares import (  # the fixtures: used through pytest_generate_tests
    parametrize_spares,
    spare_pool,  # noqa: F401
    spares_settled,
    wasm_spares,  # noqa: F401
)

WAT = Path(__file__).parent / "wat"
EXAMPLES = Path(__file__).parents[2] / "examples" / "executors"
WT = load_wasmtime()


def _runtime_available() -> bool:
    try:
        verified_python_wasm()
    except ToolUnavailable:
        return False
    return True


HAVE_ENGINE = WT is not None
#: Each async test runs with and without spare processes (tests/sandbox/spares.py).
pytest_generate_tests = parametrize_spares
HAVE_RUNTIME = HAVE_ENGINE and _runtime_available()
NO_ENGINE = "wasmtime is not installed (install metnos-exec[wasm])"
NO_RUNTIME = (
    "python.wasm is not installed (install metnos-exec[wasm-python] or set METNOS_PYTHON_WASM)"
)

FUEL = 1_000_000
PY_FUEL = 20_000_000_000
PY_MEM = 64 * 1024 * 1024


@pytest.fixture(scope="session")
def wasm_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Session cache folder, warmed so per-test fd checks do not see the engine's own
    one-time files (compiled module images stay mapped for the session)."""
    cache = tmp_path_factory.mktemp("wasm-cache")
    if HAVE_ENGINE:
        # Run each module once: the first instance of a module maps its memory image
        # (a memfd), and the first WASI call starts wasmtime's internal I/O runtime.
        arm = WasmSandbox(cache_dir=cache)
        if HAVE_RUNTIME:
            # A job's wall time covers its compile: python.wasm's cold one (5-20 s on a
            # loaded machine) is paid here, as the worker pays it at start-up.
            anyio.run(arm.preload)
        lim = ResourceLimits(fuel=2000, wall_time_s=5)
        jobs = [
            SandboxJob(wasm=WasmProgram(str(wat)), limits=lim)
            for wat in sorted(WAT.glob("*.wat"))
            if wat.name != "sock.wat"
        ]
        jobs.append(SandboxJob(wasm=WasmProgram(str(EXAMPLES / "wasm_hello/hello.wat"))))
        if HAVE_RUNTIME:
            jobs.append(
                SandboxJob(
                    wasm=WasmProgram(PYTHON_WASM_MODULE, ("python", "-c", "pass")),
                    limits=ResourceLimits(fuel=PY_FUEL),
                )
            )
        for job in jobs:
            anyio.run(arm.run, job)
        with pytest.raises(SandboxDenied):  # the verdict is cached from here on
            anyio.run(arm.run, SandboxJob(wasm=WasmProgram(str(WAT / "sock.wat"))))
    yield cache


@pytest.fixture
def arm(wasm_cache: Path) -> WasmSandbox:
    need(HAVE_ENGINE, NO_ENGINE)
    return WasmSandbox(cache_dir=wasm_cache)


@pytest.fixture
def py_arm(arm: WasmSandbox) -> WasmSandbox:
    need(HAVE_RUNTIME, NO_RUNTIME)
    return arm


def _guest_processes() -> list[int]:
    """The pids of this process's children that are a wasm guest's process (not a spare
    waiting for its job, or being started)."""
    pids = []
    in_use = wasm.spares_in_use()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            pids += [int(p) for p in (task / "children").read_text().split()]
    found = []
    for pid in pids:
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"_wasm_child.py" in cmd and (b"--spare" not in cmd or pid in in_use):
                found.append(pid)
    return found


def wat_job(name: str, *, fuel: int | None = FUEL, **kw: object) -> SandboxJob:
    limits = kw.pop("limits", None) or ResourceLimits(fuel=fuel)
    return SandboxJob(wasm=WasmProgram(str(WAT / f"{name}.wat"), (name,)), limits=limits, **kw)  # type: ignore[arg-type]


def py_job(
    folder: Path, code: str, *, mounts: tuple[Mount, ...] = (), **limits: object
) -> SandboxJob:
    """A wasm-python job running `code` as main.py from `folder` (mounted read-only)."""
    (folder / "main.py").write_text(textwrap.dedent(code))
    lim = {"fuel": PY_FUEL, "memory_bytes": PY_MEM, "wall_time_s": 20.0, **limits}
    return SandboxJob(
        wasm=WasmProgram(PYTHON_WASM_MODULE, python_program(str(folder / "main.py"))),
        mounts=(Mount(str(folder), str(folder), writable=False), *mounts),
        limits=ResourceLimits(**lim),  # type: ignore[arg-type]
    )


def test_protocol_and_pin_reason() -> None:
    assert isinstance(WasmSandbox(cache_dir=False), Sandbox)
    for needle in ("GHSA-2r75-cxrj-cmph", "GHSA-4ch3-9j33-3pmj", "45.0.3", "46.0.1"):
        assert needle in WASMTIME_PIN_REASON


# --- acceptance 1: the three reference assertions -------------------------------------


@pytest.mark.alone  # a budget of 0.3-1.5 s that includes a fresh guest's load
@pytest.mark.anyio
async def test_ok_within_fuel_is_success_byte_exact(arm: WasmSandbox) -> None:
    out = await arm.run(wat_job("ok"))
    assert out.exit == Success()
    assert out.stdout == b"ok\n"
    assert out.stderr == b""
    assert out.usage.fuel_consumed is not None and 0 < out.usage.fuel_consumed < FUEL
    assert out.containment.sandbox == "wasm"


@pytest.mark.anyio
async def test_path_open_denied_without_preopen_granted_with(
    arm: WasmSandbox, tmp_path: Path
) -> None:
    (tmp_path / "hello.txt").write_text("hi")
    denied = await arm.run(wat_job("open_or_7"))
    assert denied.exit == Failure(7)
    granted = await arm.run(wat_job("open_or_7", mounts=(Mount(str(tmp_path), "/data"),)))
    assert granted.exit == Success()


@pytest.mark.anyio
async def test_infinite_loop_small_fuel_is_fuel_exhausted_returned(arm: WasmSandbox) -> None:
    out = await arm.run(wat_job("spin", fuel=10_000))
    assert out.exit == FuelExhausted()
    assert out.usage.fuel_consumed == 10_000


# --- acceptance 2: memory --------------------------------------------------------------


@pytest.mark.anyio
async def test_table_growth_past_the_store_limit_is_memory_exceeded(arm: WasmSandbox) -> None:
    # Table elements live outside linear memory: without a store limit on them a guest
    # grew a table to 4 Mi elements (and could go on to 2^32) under a 1 MiB memory limit.
    lim = ResourceLimits(fuel=FUEL, memory_bytes=16 * 65536)
    job = wat_job("table_grow", limits=lim)
    out = await arm.run(job)
    assert out.exit == MemoryExceeded(), out
    assert MAX_TABLE_ELEMENTS < 64 * 65536
    resources = out.containment.resources
    assert resources.state == "kept"
    assert f"{MAX_TABLE_ELEMENTS:,} table elements" in resources.reason
    # A table declared over the limit is not even instantiated: the limit speaks, from
    # the module's own type.
    big = await arm.run(wat_job("table_big", limits=lim))
    assert big.exit == MemoryExceeded(), big
    nxt = await arm.run(wat_job("ok"))
    assert (nxt.exit, nxt.stdout) == (Success(), b"ok\n")


@pytest.mark.anyio
async def test_a_second_linear_memory_is_refused(arm: WasmSandbox) -> None:
    # The memory limit is per memory: a second one would double the budget.
    out = await arm.run(
        wat_job("two_memories", limits=ResourceLimits(fuel=FUEL, memory_bytes=65536 * 4))
    )
    assert isinstance(out.exit, Trap), out
    assert "memor" in out.exit.message


@pytest.mark.anyio
async def test_memory_growth_past_limit_is_memory_exceeded_and_worker_unharmed(
    arm: WasmSandbox,
) -> None:
    lim = ResourceLimits(fuel=FUEL, memory_bytes=8 * 65536)
    out = await arm.run(wat_job("grow", limits=lim))
    assert out.exit == MemoryExceeded()
    assert out.usage.peak_memory_bytes == 8 * 65536
    # Without a limit the same guest is stopped by fuel instead: the verdict above came
    # from the memory limit, not from the guest.
    out = await arm.run(wat_job("grow", limits=ResourceLimits(fuel=2000, memory_bytes=None)))
    assert out.exit == FuelExhausted()
    nxt = await arm.run(wat_job("ok"))
    assert (nxt.exit, nxt.stdout) == (Success(), b"ok\n")


@pytest.mark.anyio
async def test_initial_memory_over_limit_is_memory_exceeded_without_running(
    arm: WasmSandbox,
) -> None:
    out = await arm.run(wat_job("ok", limits=ResourceLimits(fuel=FUEL, memory_bytes=1000)))
    assert out.exit == MemoryExceeded()
    assert out.stdout == b""


@pytest.mark.anyio
async def test_python_memory_error_at_limit_is_memory_exceeded(
    py_arm: WasmSandbox, tmp_path: Path
) -> None:
    job = py_job(
        tmp_path,
        """
        chunks = []
        while True:
            chunks.append(bytearray(30_000))
        """,
        memory_bytes=32 * 1024 * 1024,
    )
    out = await py_arm.run(job)
    assert out.exit == MemoryExceeded()
    assert b"MemoryError" in out.stderr
    assert out.usage.peak_memory_bytes == 32 * 1024 * 1024


@pytest.mark.anyio
async def test_python_single_huge_allocation_is_reported_as_the_guests_failure(
    py_arm: WasmSandbox, tmp_path: Path
) -> None:
    # One request far past the limit fails while memory is far below it: the engine gives
    # no signal saying which limit refused it, so the arm reports the guest's own exit
    # rather than guess (documented under-report).
    job = py_job(tmp_path, "bytearray(200 * 1024 * 1024)\n", memory_bytes=32 * 1024 * 1024)
    out = await py_arm.run(job)
    assert out.exit == Failure(1)
    assert b"MemoryError" in out.stderr


# --- acceptance 3: timeout and cancellation --------------------------------------------

#: How late a stopped guest may be said to stop. The claim of these tests is that it is
#: stopped (at its deadline or its cancel, not at the budget it would otherwise run to);
#: a tight bound made them fail when a loaded 2-core machine scheduled late, and speed is
#: what the benchmarks measure.
_SLACK_S = 3.0


@pytest.mark.alone  # a budget of 0.3-1.5 s that includes a fresh guest's load
@pytest.mark.anyio
async def test_timeout_stops_a_looping_guest_by_its_epoch_deadline(arm: WasmSandbox) -> None:
    deadline = 0.3
    job = wat_job("spin", limits=ResourceLimits(fuel=10**15, wall_time_s=deadline))
    t0 = time.monotonic()
    with capture_logs() as logs:
        out = await arm.run(job)
    elapsed = time.monotonic() - t0
    assert out.exit == Timeout()
    # Stopped by the epoch deadline in the guest's own process (a fuel of 10**15 would
    # spin for hours), not by the watchdog or the arm's kill, which log guest_killed: the
    # mechanism is what is asserted, the end-to-end time only bounded loosely (a process
    # start and reap on a loaded 2-core machine is not the arm's latency).
    assert not [r for r in logs if r["event"] == "sandbox.guest_killed"], logs
    assert deadline <= elapsed < deadline + 1.0, elapsed
    # The deadline callback stops the guest before compiled code writes its fuel counter
    # back; the arm says "unknown" rather than the stale number.
    assert out.usage.fuel_consumed is None
    assert not _guest_processes()


@pytest.mark.anyio
async def test_cancelling_the_caller_scope_stops_the_guest(arm: WasmSandbox) -> None:
    job = wat_job("spin", limits=ResourceLimits(fuel=10**15, wall_time_s=30))
    t0 = time.monotonic()
    with anyio.move_on_after(0.3) as scope:
        await arm.run(job)
    elapsed = time.monotonic() - t0
    assert scope.cancelled_caught
    # Stopped at the cancel, not at its 30 s budget: the bound is loose on purpose (a root
    # suite beside other work once took 0.51 s here; how fast is the bench's question).
    assert elapsed < 0.3 + _SLACK_S, elapsed
    assert not _guest_processes()  # the guest's process is gone, reaped
    # and the arm still works
    assert (await arm.run(wat_job("ok"))).exit == Success()


@pytest.mark.anyio
async def test_explicit_cancel_scope_cancel_stops_the_guest(arm: WasmSandbox) -> None:
    job = wat_job("spin", limits=ResourceLimits(fuel=10**15, wall_time_s=30))
    t_cancel = 0.0

    async def canceller(scope: anyio.CancelScope) -> None:
        nonlocal t_cancel
        # Wait until the guest's process is there.
        with anyio.fail_after(5):
            # Polling with a deadline: the guest's process has no event to hand us.
            while not _guest_processes():  # noqa: ASYNC110
                await anyio.sleep(0.005)
        t_cancel = time.monotonic()
        scope.cancel()

    async with anyio.create_task_group() as tg:
        with anyio.CancelScope() as scope:
            tg.start_soon(canceller, scope)
            await arm.run(job)
    assert scope.cancelled_caught
    assert time.monotonic() - t_cancel < _SLACK_S  # not its 30 s budget
    assert not _guest_processes()


@pytest.mark.alone  # a budget of 0.3-1.5 s that includes a fresh guest's load
@pytest.mark.anyio
async def test_sleeping_python_guest_is_stopped_by_timeout_and_by_cancel(
    py_arm: WasmSandbox, tmp_path: Path
) -> None:
    # A guest blocked in poll_oneoff runs no wasm code, so epochs alone would not stop it.
    code = """
    import time
    t = time.monotonic()
    time.sleep(0.2)
    print(round(time.monotonic() - t, 1), flush=True)
    time.sleep(1000)
    print("never")
    """
    deadline = 1.5  # from the spawn: the guest's process starts in 0.1-0.5 s
    job = py_job(tmp_path, code, wall_time_s=deadline)
    t0 = time.monotonic()
    out = await py_arm.run(job)
    elapsed = time.monotonic() - t0
    assert out.exit == Timeout()
    slept = float(out.stdout)  # a short sleep still sleeps, and returns
    assert 0.2 <= slept < deadline, out.stdout
    assert deadline <= elapsed < deadline + _SLACK_S, elapsed  # not its sleep(1000)
    job = py_job(tmp_path, code, wall_time_s=30)
    t0 = time.monotonic()
    with anyio.move_on_after(0.5) as scope:
        await py_arm.run(job)
    assert scope.cancelled_caught
    assert time.monotonic() - t0 < 0.5 + _SLACK_S
    assert not _guest_processes()


@pytest.mark.anyio
async def test_python_clocks_and_select_under_the_shadowed_poll(
    py_arm: WasmSandbox, tmp_path: Path
) -> None:
    code = """
    import select, sys, time
    a, w = time.monotonic(), time.time()
    ready = select.select([sys.stdin], [], [], 5)[0]
    time.sleep(0.05)
    b = time.monotonic()
    print(int(abs(w - WALL) < 60), int(0.05 <= b - a < 30), int(bool(ready)), sys.stdin.read())
    """
    # What is claimed: the wall clock is the host's, the monotonic clock moves, a sleep
    # sleeps at least its time and select sees stdin ready. Not speed: the upper bounds are
    # loose (a loaded 2-core box once took over 1 s for this interpreter's 0.05 s sleep).
    job = py_job(tmp_path, f"WALL = {time.time()!r}\n" + textwrap.dedent(code))
    job = SandboxJob(wasm=job.wasm, mounts=job.mounts, limits=job.limits, stdin=b"in")
    out = await py_arm.run(job)
    assert out.exit == Success(), out.stderr
    assert out.stdout == b"1 1 1 in\n"


@pytest.mark.anyio
async def test_guest_cpu_clock_counts_from_the_jobs_start(arm: WasmSandbox) -> None:
    # Burn > 1 s of CPU on the arm's worker threads first, then read the CPU clock.
    for _ in range(4):
        await arm.run(wat_job("spin", limits=ResourceLimits(fuel=10**15, wall_time_s=0.3)))
    assert (await arm.run(wat_job("cputime"))).exit == Success()


# --- acceptance 4: wasm-python walls ---------------------------------------------------

_PY_WALLS = """
import json, os, socket
res = {}
def attempt(name, fn):
    try:
        fn()
        res[name] = "ok"
    except Exception as exc:
        res[name] = type(exc).__name__
def write_ro():
    with open(RO + "/new.txt", "w") as f:
        f.write("x")
def modify_ro():
    with open(RO + "/keep.txt", "a") as f:
        f.write("x")
def write_rw():
    with open(RW + "/out.txt", "w") as f:
        f.write("written")
def connect():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.connect(("127.0.0.1", 9))
def read_outside():
    open("/etc/passwd").read()
def list_outside():
    os.listdir(OUTSIDE)
attempt("write_ro", write_ro)
attempt("modify_ro", modify_ro)
attempt("write_rw", write_rw)
attempt("connect", connect)
attempt("read_outside", read_outside)
attempt("list_outside", list_outside)
attempt("read_ro", lambda: open(RO + "/keep.txt").read())
print(json.dumps(res))
"""


@pytest.mark.anyio
async def test_python_guest_walls(py_arm: WasmSandbox, tmp_path: Path) -> None:
    app, ro, rw, outside = (tmp_path / n for n in ("app", "ro", "rw", "outside"))
    for d in (app, ro, rw, outside):
        d.mkdir()
    (ro / "keep.txt").write_text("keep")
    (outside / "secret.txt").write_text("s")
    code = f"RO, RW, OUTSIDE = {str(ro)!r}, {str(rw)!r}, {str(outside)!r}\n" + _PY_WALLS
    job = py_job(
        app, code, mounts=(Mount(str(ro), str(ro)), Mount(str(rw), str(rw), writable=True))
    )
    out = await py_arm.run(job)
    assert out.exit == Success(), out.stderr
    res = json.loads(out.stdout)
    assert res["read_ro"] == "ok"
    assert res["write_ro"] != "ok" and not (ro / "new.txt").exists()
    assert res["modify_ro"] != "ok" and (ro / "keep.txt").read_text() == "keep"
    assert res["write_rw"] == "ok" and (rw / "out.txt").read_text() == "written"
    assert res["connect"] != "ok"
    assert res["read_outside"] != "ok"
    assert res["list_outside"] != "ok"


_PY_BYPASS = """
import json, os
res = {}
def attempt(name, fn):
    try:
        fn()
        res[name] = "ok"
    except Exception as exc:
        res[name] = type(exc).__name__
# GHSA-2r75-cxrj-cmph: O_TRUNC with read-only rights on a read-only preopen.
attempt("trunc_rdonly", lambda: os.close(os.open(RO + "/victim.txt", os.O_RDONLY | os.O_TRUNC)))
attempt("trunc_wronly", lambda: os.close(os.open(RO + "/victim.txt", os.O_WRONLY | os.O_TRUNC)))
# GHSA-4ch3-9j33-3pmj: links and renames across permission domains.
attempt("link_out", lambda: os.link(RO + "/victim.txt", RW + "/alias.txt"))
def write_alias():
    with open(RW + "/alias.txt", "w") as f:
        f.write("pwned")
if res["link_out"] == "ok":
    attempt("write_alias", write_alias)
attempt("rename_out", lambda: os.rename(RO + "/victim.txt", RW + "/moved.txt"))
attempt("rename_in", lambda: os.rename(RW + "/mine.txt", RO + "/planted.txt"))
attempt("link_in", lambda: os.link(RW + "/mine.txt", RO + "/planted2.txt"))
attempt("unlink_ro", lambda: os.unlink(RO + "/victim.txt"))
attempt("symlink_ro", lambda: os.symlink("/", RO + "/escape"))
print(json.dumps(res))
"""


@pytest.mark.anyio
async def test_read_only_preopen_bypasses_are_closed(py_arm: WasmSandbox, tmp_path: Path) -> None:
    app, ro, rw = (tmp_path / n for n in ("app", "ro", "rw"))
    for d in (app, ro, rw):
        d.mkdir()
    (ro / "victim.txt").write_text("precious")
    (rw / "mine.txt").write_text("mine")
    code = f"RO, RW = {str(ro)!r}, {str(rw)!r}\n" + _PY_BYPASS
    job = py_job(
        app, code, mounts=(Mount(str(ro), str(ro)), Mount(str(rw), str(rw), writable=True))
    )
    out = await py_arm.run(job)
    assert out.exit == Success(), out.stderr
    res = json.loads(out.stdout)
    assert all(v != "ok" for v in res.values()), res
    assert (ro / "victim.txt").read_text() == "precious"
    assert sorted(p.name for p in ro.iterdir()) == ["victim.txt"]
    assert sorted(p.name for p in rw.iterdir()) == ["mine.txt"]


# --- a preopen swapped for a symlink (the wasm arm's side of issue 8's defect 2) ---------


@pytest.mark.anyio
async def test_a_preopen_swapped_for_a_symlink_is_refused_not_followed(
    arm: WasmSandbox, tmp_path: Path
) -> None:
    # Planned while `data` was a real folder; swapped for a link to a private folder
    # before the arm ran. Preopened by path, the guest opened the private file (exit 0)
    # and the report said files `kept`.
    data, private = tmp_path / "data", tmp_path / "private"
    data.mkdir()
    private.mkdir()
    (private / "hello.txt").write_text("private")
    job = wat_job("open_or_7", mounts=(Mount(str(data), "/data"),))
    data.rmdir()
    data.symlink_to(private)
    with pytest.raises(SymlinkedFolder, match="data") as ei:
        await arm.run(job)
    assert ei.value.code == "E_SYMLINKED_FOLDER"
    # A link anywhere on the way is refused too, naming it.
    (tmp_path / "real" / "inner").mkdir(parents=True)
    (tmp_path / "real" / "inner" / "hello.txt").write_text("x")
    (tmp_path / "via").symlink_to(tmp_path / "real")
    with pytest.raises(SymlinkedFolder, match="via"):
        await arm.run(wat_job("open_or_7", mounts=(Mount(str(tmp_path / "via/inner"), "/d"),)))
    # The same folder named by its real path runs.
    real = await arm.run(wat_job("open_or_7", mounts=(Mount(str(tmp_path / "real/inner"), "/d"),)))
    assert real.exit == Success()


_PY_SWAP_VICTIM = """
import json, os
seen = sorted(os.listdir(DATA))
with open(os.path.join(DATA, "planted"), "w") as f:
    f.write("x")
print(json.dumps({"seen": seen}))
"""


@pytest.mark.anyio
async def test_a_swap_after_the_check_preopens_what_was_checked(
    py_arm: WasmSandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The window: the arm has checked the folder, then it is swapped for a link to a
    # private folder just before wasmtime opens the preopen. What was checked (moved
    # away, the same inode) is what the guest gets, never the link's target.
    assert WT is not None
    app, data, private = (tmp_path / n for n in ("app", "data", "private"))
    for d in (app, data, private):
        d.mkdir()
    (data / "mine.txt").write_text("the job's own")
    (private / "secret.txt").write_text("private")
    import metnos_exec.sandbox._wasm_launch as wasm_mod

    real_open = wasm_mod._open_preopen

    def open_then_swap(host: str) -> int:
        fd = real_open(host)  # checked and opened; the guest's process preopens `fd`
        if host == str(data) and not data.is_symlink():
            data.rename(tmp_path / "moved")
            data.symlink_to(private)
        return fd

    monkeypatch.setattr(wasm_mod, "_open_preopen", open_then_swap)
    code = f"DATA = {str(data)!r}\n" + _PY_SWAP_VICTIM
    job = py_job(app, code, mounts=(Mount(str(data), str(data), writable=True),))
    out = await py_arm.run(job)
    assert data.is_symlink()  # the swap did happen
    assert out.exit == Success(), out.stderr
    assert json.loads(out.stdout) == {"seen": ["mine.txt"]}
    assert (tmp_path / "moved" / "planted").exists()
    assert sorted(p.name for p in private.iterdir()) == ["secret.txt"]


@pytest.mark.anyio
async def test_python_env_is_only_the_jobs_and_stdin_is_fed(
    py_arm: WasmSandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("METNOS_SECRET_FOR_TEST", "leak")
    job = py_job(
        tmp_path,
        """
        import json, os, sys
        print(json.dumps({"env": dict(os.environ), "stdin": sys.stdin.read()}))
        """,
    )
    job = SandboxJob(
        wasm=job.wasm,
        mounts=job.mounts,
        limits=job.limits,
        env={"A": "1"},
        stdin=b'{"x": 1}',
    )
    out = await py_arm.run(job)
    assert out.exit == Success(), out.stderr
    assert json.loads(out.stdout) == {"env": {"A": "1"}, "stdin": '{"x": 1}'}


@pytest.mark.anyio
async def test_python_exit_codes_and_output_cap(py_arm: WasmSandbox, tmp_path: Path) -> None:
    job = py_job(tmp_path, "import sys\nprint('x' * 5000)\nsys.exit(3)\n", output_bytes=100)
    out = await py_arm.run(job)
    assert out.exit == Failure(3)
    assert out.stdout == b"x" * 100
    assert out.stdout_truncated and not out.stderr_truncated
    # Codes >= 126 reach us without the code (wasmtime refuses them): never invented.
    job = py_job(tmp_path, "import sys\nsys.exit(200)\n")
    out = await py_arm.run(job)
    assert isinstance(out.exit, Trap)
    assert "126" in out.exit.message


@pytest.mark.anyio
async def test_python_output_printed_before_a_fuel_trap_is_kept(
    py_arm: WasmSandbox, tmp_path: Path
) -> None:
    job = py_job(
        tmp_path, "print('before', flush=False)\nwhile True:\n    pass\n", fuel=500_000_000
    )
    out = await py_arm.run(job)
    assert out.exit == FuelExhausted()
    assert out.stdout == b"before\n"


@pytest.mark.anyio
async def test_python_mount_hiding_the_stdlib_is_refused(
    py_arm: WasmSandbox, tmp_path: Path
) -> None:
    for guest in ("/", "/usr", "/usr/local", "/usr/local/lib", "/usr/local/lib/python3.12/json"):
        job = py_job(tmp_path, "print(1)", mounts=(Mount(str(tmp_path), guest),))
        with pytest.raises(SandboxDenied, match="standard library"):
            await py_arm.run(job)
    # A sibling folder does not shadow the stdlib and is allowed.
    job = py_job(tmp_path, "print(1)", mounts=(Mount(str(tmp_path), "/usr/local/lib/other"),))
    assert (await py_arm.run(job)).exit == Success()


# --- acceptance 5: runs in a row -------------------------------------------------------


@pytest.mark.anyio
async def test_two_runs_in_a_row_do_not_share_state(arm: WasmSandbox) -> None:
    first = await arm.run(wat_job("counter"))
    second = await arm.run(wat_job("counter"))
    assert first.exit == second.exit == Success()
    # A failed run in between leaves nothing behind either.
    assert (await arm.run(wat_job("spin", fuel=100))).exit == FuelExhausted()
    assert (await arm.run(wat_job("counter"))).exit == Success()


# --- acceptance 6: absence is a verdict ------------------------------------------------


@pytest.mark.anyio
async def test_missing_runtime_is_tool_unavailable_and_wat_still_runs(
    wasm_cache: Path, tmp_path: Path
) -> None:
    need(HAVE_ENGINE, NO_ENGINE)
    env = {"METNOS_PYTHON_WASM": str(tmp_path / "missing.wasm")}
    arm = WasmSandbox(cache_dir=wasm_cache, env=env, use_runtime_package=False)
    with pytest.raises(ToolUnavailable) as info:
        await arm.run(py_job(tmp_path, "print(1)"))
    assert info.value.code == "E_TOOL_UNAVAILABLE"
    assert "METNOS_PYTHON_WASM" in info.value.message
    assert (await arm.run(wat_job("ok"))).stdout == b"ok\n"
    assert find_python_wasm({}, use_package=False) is None
    with pytest.raises(ToolUnavailable):
        verified_python_wasm({}, use_package=False)
    status = wasm_status(env, use_runtime_package=False)
    assert status["engine"]["importable"] is True
    assert status["python_runtime"]["present"] is False
    assert status["python_runtime"]["verified"] is False


@pytest.mark.anyio
async def test_runtime_with_wrong_hash_is_refused(wasm_cache: Path, tmp_path: Path) -> None:
    need(HAVE_ENGINE, NO_ENGINE)
    fake = tmp_path / "python.wasm"
    fake.write_bytes((WAT / "ok.wat").read_bytes())
    arm = WasmSandbox(cache_dir=wasm_cache, env={"METNOS_PYTHON_WASM": str(fake)})
    with pytest.raises(RuntimeMismatch) as info:
        await arm.run(py_job(tmp_path, "print(1)"))
    assert info.value.code == "E_RUNTIME_MISMATCH"
    assert isinstance(info.value, ToolUnavailable)


@pytest.mark.anyio
async def test_missing_engine_is_tool_unavailable_naming_another_arm() -> None:
    arm = WasmSandbox(cache_dir=False, wasmtime_module=None)
    job = SandboxJob(wasm=WasmProgram(str(WAT / "ok.wat")))
    with pytest.raises(ToolUnavailable) as info:
        await arm.run(job)
    assert "bwrap" in info.value.message
    assert arm.containment(job).user.state == "not_kept"


def test_module_imports_and_refuses_without_wasmtime() -> None:
    # A fresh interpreter where `import wasmtime` fails: the arm must still import and
    # answer with a verdict, not an ImportError.
    code = textwrap.dedent(
        """
        import sys
        sys.modules["wasmtime"] = None
        import anyio
        from metnos_exec.sandbox._types import SandboxJob, WasmProgram
        from metnos_exec.sandbox.wasm import WasmSandbox, wasm_status
        assert wasm_status()["engine"]["importable"] is False
        try:
            anyio.run(WasmSandbox(cache_dir=False).run, SandboxJob(wasm=WasmProgram("x.wat")))
        except Exception as exc:
            print(getattr(exc, "code", type(exc).__name__))
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout == b"E_TOOL_UNAVAILABLE\n"


@pytest.mark.anyio
async def test_a_fault_in_the_guests_process_is_a_host_fault(
    arm: WasmSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert WT is not None

    # A fault inside the guest's process (here: the module is not the one the arm
    # keyed, as if it changed while the job started) is the host's, never a verdict.
    import metnos_exec.sandbox.wasm as wasm_mod

    monkeypatch.setattr(wasm_mod, "_module_key", lambda source, version: "0" * 40)
    with pytest.raises(HostFault, match="changed while the job was starting"):
        await arm.run(wat_job("ok"))


@pytest.mark.anyio
async def test_engine_older_than_the_pin_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    need(HAVE_ENGINE, NO_ENGINE)
    import metnos_exec.sandbox.wasm as wasm_mod

    monkeypatch.setattr(wasm_mod, "wasmtime_version", lambda: "45.0.0")
    with pytest.raises(ToolUnavailable, match=r"50\.0\.1"):
        await WasmSandbox(cache_dir=False).run(wat_job("ok"))
    assert wasm_status()["engine"]["has_preopen_fixes"] is False


def test_status_reports_engine_and_runtime(wasm_cache: Path) -> None:
    need(HAVE_ENGINE, NO_ENGINE)
    status = wasm_status(cache_dir=wasm_cache)
    assert status["engine"]["importable"] is True
    assert status["engine"]["version"].startswith("50.")
    assert status["engine"]["has_preopen_fixes"] is True
    assert status["cache_dir"] == str(wasm_cache)
    assert status["python_runtime"]["verified"] is HAVE_RUNTIME
    env = {"METNOS_CACHE_DIR": "/somewhere"}
    assert wasm_status(env)["cache_dir"] == "/somewhere/wasm"
    assert WasmSandbox(env=env).cache_dir == Path("/somewhere/wasm")


# --- denial at link time, containment, cache -------------------------------------------


@pytest.mark.anyio
async def test_socket_import_fails_to_link_with_sandbox_denied(arm: WasmSandbox) -> None:
    with pytest.raises(SandboxDenied) as info:
        await arm.run(wat_job("sock"))
    assert info.value.code == "E_SANDBOX_DENIED"
    assert "sock_connect" in info.value.message


@pytest.mark.anyio
async def test_exit_code_out_of_wasi_range_is_a_trap_not_a_code(arm: WasmSandbox) -> None:
    out = await arm.run(wat_job("exit_code"))
    assert isinstance(out.exit, Trap)


@pytest.mark.anyio
async def test_missing_module_is_a_host_fault(arm: WasmSandbox, tmp_path: Path) -> None:
    with pytest.raises(HostFault):
        await arm.run(SandboxJob(wasm=WasmProgram(str(tmp_path / "nope.wasm"))))


@pytest.mark.anyio
async def test_preload_fills_the_cache_before_any_job(tmp_path: Path) -> None:
    need(HAVE_ENGINE, NO_ENGINE)
    assert WT is not None
    src = tmp_path / "ok.wat"
    src.write_bytes((WAT / "ok.wat").read_bytes())
    arm = WasmSandbox(cache_dir=tmp_path / "cache")
    [(path, how, _)] = await arm.preload(python=False, modules=(str(src),))
    assert (path, how) == (str(src), "compiled")
    assert len(list((tmp_path / "cache").glob("*.cwasm"))) == 1
    [(_, how, _)] = await arm.preload(python=False, modules=(str(src),))
    assert how == "disk"
    out = await arm.run(SandboxJob(wasm=WasmProgram(str(src)), limits=ResourceLimits(fuel=FUEL)))
    assert out.exit == Success()
    assert "compiled for this job" not in out.containment.resources.reason
    # A job that compiles its module says so, with the seconds its wall time paid.
    cold = WasmSandbox(cache_dir=tmp_path / "cold")
    out = await cold.run(SandboxJob(wasm=WasmProgram(str(src)), limits=ResourceLimits(fuel=FUEL)))
    assert out.exit == Success()
    assert "the module was compiled for this job" in out.containment.resources.reason
    assert len(list((tmp_path / "cache").glob("*.cwasm"))) == 1


def test_containment_report() -> None:
    arm = WasmSandbox(cache_dir=False)
    both = SandboxJob(
        wasm=WasmProgram("x.wasm"),
        mounts=(Mount("/a", "/a"), Mount("/b", "/b", writable=True)),
        limits=ResourceLimits(fuel=10, memory_bytes=1 << 20),
    )
    rep = arm.containment(both)
    assert rep.sandbox == "wasm"
    assert [rep.files.state, rep.network.state, rep.process_tree.state] == ["kept"] * 3
    assert rep.user.state == "not_kept"
    assert "1 of them read-only" in rep.files.reason
    # A writable preopen writes straight to the host's disk, unbounded: never `kept`.
    assert rep.resources.state == "partial"
    assert WASM_DISK_REASON in rep.resources.reason
    assert "fuel budget and store memory limit both set" in rep.resources.reason
    read_only = SandboxJob(
        wasm=WasmProgram("x.wasm"),
        mounts=(Mount("/a", "/a"),),
        limits=ResourceLimits(fuel=10, memory_bytes=1 << 20),
    )
    rep = arm.containment(read_only)
    # The guest's files are its own process's descriptors, bounded by its RLIMIT_NOFILE.
    assert rep.resources.state == "kept" and WASM_DISK_REASON not in rep.resources.reason
    assert "RLIMIT_NOFILE" in rep.resources.reason
    assert "process of its own" in rep.process_tree.reason
    no_preopen = SandboxJob(
        wasm=WasmProgram("x.wasm"), limits=ResourceLimits(fuel=10, memory_bytes=1 << 20)
    )
    assert arm.containment(no_preopen).resources.state == "kept"
    no_fuel = SandboxJob(wasm=WasmProgram("x.wasm"), limits=ResourceLimits(fuel=None))
    rep = arm.containment(no_fuel)
    assert rep.resources.state == "partial" and "fuel" in rep.resources.reason
    assert rep.lost() == ["user", "resources"]


def test_module_cache_memory_then_disk_never_recompiles(wasm_cache: Path, tmp_path: Path) -> None:
    need(HAVE_ENGINE, NO_ENGINE)
    assert WT is not None
    src = tmp_path / "ok.wat"
    src.write_bytes((WAT / "ok.wat").read_bytes())
    cache = tmp_path / "cache"
    first = WasmEngine(WT)
    a = first.load(src, cache)
    b = first.load(src, cache)
    assert (a.source, b.source) == ("compiled", "memory")
    files = list(cache.iterdir())
    assert [f.name for f in files] == [f"{a.key}.cwasm"]
    assert oct(cache.stat().st_mode & 0o777) == "0o700"
    # A restarted worker (new engine, same config) loads from disk.
    second = WasmEngine(WT)
    assert second.load(src, cache).source == "disk"
    # A file others could have written is not trusted: recompiled and rewritten.
    os.chmod(files[0], 0o666)
    third = WasmEngine(WT)
    assert third.load(src, cache).source == "compiled"
    assert files[0].stat().st_mode & 0o022 == 0
    # A corrupt file is recompiled, never loaded.
    files[0].write_bytes(b"\0not a module")
    os.chmod(files[0], 0o600)
    assert WasmEngine(WT).load(src, cache).source == "compiled"
    # Editing the module changes the key.
    src.write_text(src.read_text().replace("ok\\n", "OK\\n"))
    assert first.load(src, cache).key != a.key


# --- examples --------------------------------------------------------------------------


@pytest.mark.anyio
async def test_example_wasm_hello(arm: WasmSandbox) -> None:
    folder = EXAMPLES / "wasm_hello"
    manifest = load_manifest(folder / "manifest.toml")
    assert manifest.runtime == "wasm"
    job = SandboxJob(
        wasm=WasmProgram(str(folder / manifest.entry), (manifest.name,)),
        stdin=b"{}",
        limits=ResourceLimits(fuel=manifest.limits.fuel),
    )
    out = await arm.run(job)
    assert out.exit == Success()
    assert json.loads(out.stdout) == {"greeting": "hello from wasm"}


@pytest.mark.anyio
async def test_example_word_count(py_arm: WasmSandbox, tmp_path: Path) -> None:
    folder = (EXAMPLES / "word_count").resolve()
    manifest = load_manifest(folder / "manifest.toml")
    assert manifest.runtime == "wasm-python"
    notes = tmp_path / "notes"
    (notes / "sub").mkdir(parents=True)
    (notes / "a.md").write_text("the cat and the hat\n")
    (notes / "sub" / "b.txt").write_text("The end. the END!\n")
    (notes / "skip.bin").write_bytes(b"\xff\xfe the")
    job = SandboxJob(
        wasm=WasmProgram(PYTHON_WASM_MODULE, python_program(str(folder / manifest.entry))),
        stdin=json.dumps({"path": str(notes), "top": 2}).encode(),
        mounts=(Mount(str(folder), str(folder)), Mount(str(notes), str(notes))),
        limits=ResourceLimits(
            fuel=manifest.limits.fuel,
            memory_bytes=manifest.limits.memory_mb * 1024 * 1024,
            wall_time_s=manifest.limits.timeout_s,
        ),
    )
    out = await py_arm.run(job)
    assert out.exit == Success(), out.stderr
    result = json.loads(out.stdout)
    assert result == {"files": 2, "words": 9, "top": [["the", 4], ["end", 2]]}


@pytest.mark.anyio
async def test_example_word_count_through_the_planner(py_arm: WasmSandbox, tmp_path: Path) -> None:
    from metnos_exec.manifest import ExecutorRegistry
    from metnos_exec.plan import plan_invocation

    home = tmp_path / "home"
    notes = home / "notes"
    notes.mkdir(parents=True)
    (notes / "today.md").write_text("buy milk, buy bread\n")
    executor = ExecutorRegistry.load(EXAMPLES)["word_count"]
    inv = plan_invocation(executor, {"path": str(notes), "top": 1}, home=str(home))
    out = await py_arm.run(inv.job)
    assert out.exit == Success(), out.stderr
    assert json.loads(out.stdout) == {"files": 1, "words": 4, "top": [["buy", 2]]}
    # The planner's mounts are what the guest saw: its own folder read-only, the notes
    # folder read-only (fs:read), nothing else.
    assert {(m.host, m.writable) for m in inv.job.mounts} == {
        (_real(executor.path), False),
        (_real(notes), False),
    }


@pytest.mark.anyio
async def test_example_word_count_of_one_note(py_arm: WasmSandbox, tmp_path: Path) -> None:
    """Given one note rather than a folder it counts that note (it said 0 files, 0 words:
    `os.walk` of a file yields nothing)."""
    from metnos_exec.manifest import ExecutorRegistry
    from metnos_exec.plan import plan_invocation

    home = tmp_path / "home"
    notes = home / "notes"
    notes.mkdir(parents=True)
    (notes / "today.md").write_text("buy milk, buy bread\n")
    executor = ExecutorRegistry.load(EXAMPLES)["word_count"]
    inv = plan_invocation(executor, {"path": "~/notes/today.md", "top": 1}, home=str(home))
    out = await py_arm.run(inv.job)
    assert out.exit == Success(), out.stderr
    assert json.loads(out.stdout) == {"files": 1, "words": 4, "top": [["buy", 2]]}


def _real(path: str | os.PathLike[str]) -> str:
    return os.path.realpath(path)


# --- preloading in a process of its own --------------------------------------------------


@pytest.mark.anyio
async def test_a_cancelled_preload_kills_its_compile(tmp_path: Path) -> None:
    """A stopping worker need not wait for a cold compile: the preload's process is killed
    (and reaped) at once, and leaves no cache entry behind."""
    need(HAVE_ENGINE, NO_ENGINE)
    src = _slow_module(tmp_path, functions=60, locals_=3000)
    arm = WasmSandbox(cache_dir=tmp_path / "cache")
    t0 = time.monotonic()
    with anyio.move_on_after(0.5) as scope:
        await arm.preload(python=False, modules=(str(src),))
    assert scope.cancelled_caught
    assert time.monotonic() - t0 < 0.5 + 1.0
    assert not _guest_processes()
    assert not list((tmp_path / "cache").glob("*.cwasm"))


# A hook registered before any engine exists runs after the arm's own (atexit is LIFO):
# by then every engine, linker, module and linked module must be closed. Left to
# finalizers, they ran while the interpreter tore wasmtime's modules down and printed
# "Exception ignored in: <function Managed.__del__ ...> TypeError" at the end of CI runs.
_EXIT_CHECK = """
import atexit, sys
from pathlib import Path
seen = []

def check():
    open_ = [type(o).__name__ for o in seen if o._Managed__ptr is not None]
    sys.stdout.write("open:" + ",".join(open_) + "\\n")
    sys.stdout.flush()

atexit.register(check)
import anyio
from metnos_exec.sandbox._types import ResourceLimits, SandboxJob, WasmProgram
from metnos_exec.sandbox._wasm_engine import WasmEngine, load_wasmtime
from metnos_exec.sandbox.wasm import WasmSandbox

wt = load_wasmtime()
own = WasmEngine(wt)
own.load(Path(sys.argv[1]), None)
seen += [own.engine, own.linker]
for loaded in own._memory.values():
    seen += [loaded.module, loaded.pre]
arm = WasmSandbox(cache_dir=False)
job = SandboxJob(wasm=WasmProgram(sys.argv[1], ("x",)), limits=ResourceLimits(fuel=10000))
print(type(anyio.run(arm.run, job).exit).__name__)
"""


def test_engines_are_closed_at_exit_not_left_to_finalizers() -> None:
    need(HAVE_ENGINE, NO_ENGINE)
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_CHECK, str(EXAMPLES / "wasm_hello/hello.wat")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["Success", "open:"], done
    assert "Managed" not in done.stderr, done.stderr


# A worker told to stop during the cold compile of python.wasm (4-8 s) exits at once: the
# compile's process is killed and reaped (it was a daemon thread of the worker, and the
# exit hook closing the engines once crashed the process in wasmtime under it).
_EXIT_DURING_COMPILE = """
import os, sys
from pathlib import Path
import anyio
from metnos_exec.sandbox.wasm import WasmSandbox

def children():
    out = []
    for task in Path("/proc/self/task").iterdir():
        out += (task / "children").read_text().split()
    return out

async def main():
    arm = WasmSandbox(cache_dir=sys.argv[1])
    async with anyio.create_task_group() as tg:
        tg.start_soon(arm.preload)
        with anyio.fail_after(30):
            while not children():
                await anyio.sleep(0.01)
        await anyio.sleep(0.3)  # well into the compile (its process is up)
        tg.cancel_scope.cancel()  # the worker stops
    print("left", len(children()), flush=True)

anyio.run(main)
"""


def test_exiting_during_a_cold_compile_kills_it(tmp_path: Path) -> None:
    need(HAVE_RUNTIME, NO_RUNTIME)
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_DURING_COMPILE, str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "left 0\n", done
    assert "Managed" not in done.stderr and "memory allocation" not in done.stderr, done.stderr
    assert time.monotonic() - t0 < 20
    assert not list((tmp_path / "cache").glob("*.cwasm"))


@pytest.mark.anyio
async def test_table_elements_are_bounded_in_all_not_per_table(arm: WasmSandbox) -> None:
    # The store limit on table elements is per table: four tables of 1 Mi elements each
    # grew (4 Mi in all) while the report said "at most 1,048,576 table elements".
    lim = ResourceLimits(fuel=FUEL, memory_bytes=16 * 65536)
    out = await arm.run(wat_job("four_tables", limits=lim))
    assert out.exit != Failure(42), "four tables grew past the total"
    assert isinstance(out.exit, Failure) and out.exit.code in (11, 12, 13, 14), out
    assert out.containment.resources.state == "kept"


@pytest.mark.anyio
async def test_a_module_file_over_the_size_cap_is_refused_before_it_is_read(
    arm: WasmSandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 1 GB module file was read whole into the worker (2.1 GB RSS, 7 s outside the
    # wall clock) and then reported as a host fault, retried elsewhere.
    import metnos_exec.sandbox._wasm_engine as engine_mod

    monkeypatch.setattr(engine_mod, "MAX_MODULE_BYTES", 1 << 20)
    big = tmp_path / "big.wasm"
    with big.open("wb") as f:
        f.write(b"\0asm\1\0\0\0")
        f.truncate(2 << 20)  # sparse
    with pytest.raises(SandboxDenied, match="bytes"):
        await arm.run(SandboxJob(wasm=WasmProgram(str(big)), limits=ResourceLimits(fuel=FUEL)))
    nxt = await arm.run(wat_job("ok"))
    assert (nxt.exit, nxt.stdout) == (Success(), b"ok\n")


@pytest.mark.anyio
async def test_a_module_that_is_not_webassembly_is_refused_not_a_host_fault(
    arm: WasmSandbox, tmp_path: Path
) -> None:
    # The executor's fault, the same on every worker: a host fault was retried on each.
    bad = tmp_path / "bad.wasm"
    # Fixed garbage: random bytes sometimes read as a code section declaring more locals
    # than the complexity bound, a refusal of another wording.
    bad.write_bytes(b"\0asm\1\0\0\0" + random.Random(15).randbytes(64))
    with pytest.raises(SandboxDenied, match="not valid WebAssembly"):
        await arm.run(SandboxJob(wasm=WasmProgram(str(bad)), limits=ResourceLimits(fuel=FUEL)))
    text = tmp_path / "bad.wat"
    text.write_text("(module (func $f (unknown_instruction)))")
    with pytest.raises(SandboxDenied, match="not valid WebAssembly"):
        await arm.run(SandboxJob(wasm=WasmProgram(str(text)), limits=ResourceLimits(fuel=FUEL)))


@pytest.mark.anyio
async def test_a_guests_descriptors_are_its_own_process_and_bounded(
    arm: WasmSandbox, tmp_path: Path
) -> None:
    # Every file a guest opened was a descriptor of the worker's process, and nothing
    # bounded how many: one opened 19,984 (the worker's whole RLIMIT_NOFILE, so its
    # broker connection and every concurrent job failed to open anything). Now they are
    # its own process's, under `limits.open_files`: 2,000 opens fail, the worker's table
    # is untouched (and the test needs no more than a login's 1,024).
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "f").write_text("x")
    job = SandboxJob(
        wasm=WasmProgram(str(WAT / "open_many.wat"), ("open_many",)),
        mounts=(Mount(str(folder), "/in", writable=False),),
        limits=ResourceLimits(fuel=FUEL * 100, memory_bytes=65536 * 4, open_files=64),
    )
    await spares_settled()
    before = len(os.listdir("/proc/self/fd"))
    out = await arm.run(job)
    assert out.exit == Failure(1), out  # an open failed before the 2,000th
    await spares_settled()  # the next spare's pipes are the worker's, not the guest's
    assert len(os.listdir("/proc/self/fd")) <= before
    assert out.containment.resources.state == "kept"
    assert "open files at most 64" in out.containment.resources.reason
    # The bound is the job's: granted 2,100, the same guest holds its 2,000 (the guest's
    # process may raise its soft limit up to the worker's hard one, not beyond).
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard >= 2200:
        lim = ResourceLimits(fuel=FUEL * 100, memory_bytes=65536 * 4, open_files=2100)
        within = SandboxJob(wasm=job.wasm, mounts=job.mounts, limits=lim)
        assert (await arm.run(within)).exit == Success()


# --- a guest never runs after its result (issue 15, items 1, 10, 11) ---------------------


def _fifo_job(folder: Path, wall_time_s: float) -> SandboxJob:
    os.mkfifo(folder / "fifo")
    return SandboxJob(
        wasm=WasmProgram(str(WAT / "fifo_then_write.wat"), ("fifo_then_write",)),
        mounts=(Mount(str(folder), "/out", writable=True),),
        limits=ResourceLimits(fuel=FUEL, memory_bytes=65536 * 4, wall_time_s=wall_time_s),
    )


def _exists(path: Path) -> bool:
    return path.exists()  # one stat: not worth a thread


async def _guest_resumes(folder: Path) -> bool:
    """Give the FIFO the guest waits on a writer; True when a guest then wrote ``late``.

    ENXIO means nobody waits in the open: nothing of the job can resume. Otherwise the
    open returns, and a guest still alive goes on (straight-line code, no epoch check)
    to create ``late``: polled for up to 3 s.
    """
    try:
        fd = os.open(folder / "fifo", os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        assert exc.errno == errno.ENXIO, exc
        return False
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            if _exists(folder / "late"):
                return True
            await anyio.sleep(0.02)
        return _exists(folder / "late")
    finally:
        os.close(fd)


async def _wait_for(path: Path, within: float) -> None:
    with anyio.fail_after(within):
        while not _exists(path):  # noqa: ASYNC110
            await anyio.sleep(0.01)


@pytest.mark.alone  # a budget of 0.3-1.5 s that includes a fresh guest's load
@pytest.mark.anyio
async def test_a_guest_blocked_in_a_host_call_never_runs_after_its_timeout(
    arm: WasmSandbox, tmp_path: Path
) -> None:
    # Issue 15, item 1: the guest was abandoned at its deadline with process_tree `kept`;
    # when its open returned it went on and wrote into its preopen after the job ended
    # (onto a folder already committed or restored).
    threads = set(threading.enumerate())
    with capture_logs() as logs, anyio.fail_after(20):
        out = await arm.run(_fifo_job(tmp_path, 0.5))
    assert out.exit == Timeout(), out
    killed = [r for r in logs if r["event"] == "sandbox.guest_killed"]
    assert [(r["why"], r["stopped_in"]) for r in killed] == [("timeout", "run")], logs
    assert "host call" in out.containment.resources.reason
    assert (tmp_path / "started").exists()  # it did reach the open
    resumed = await _guest_resumes(tmp_path)
    assert not resumed, "the guest wrote into its preopen after its result"
    # Nor does it leave a thread in the worker (the guest runs in a process of its own).
    left = [t.name for t in set(threading.enumerate()) - threads if t.is_alive()]
    assert not any(n == "metnos-wasm-guest" for n in left), left
    assert out.containment.process_tree.state == "kept"


@pytest.mark.anyio
async def test_a_guest_blocked_in_a_host_call_never_runs_after_its_cancel(
    arm: WasmSandbox, tmp_path: Path
) -> None:
    job = _fifo_job(tmp_path, 30.0)
    with capture_logs() as logs, anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(arm.run, job)
            await _wait_for(tmp_path / "started", 15)
            tg.cancel_scope.cancel()
    # A cancelled guest leaves a record too (an abandoned one left none).
    assert [r["why"] for r in logs if r["event"] == "sandbox.guest_killed"] == ["cancelled"]
    resumed = await _guest_resumes(tmp_path)
    assert not resumed, "the cancelled guest wrote into its preopen after the cancel"


@pytest.mark.anyio
async def test_a_cancel_during_a_compile_stops_it(arm: WasmSandbox, tmp_path: Path) -> None:
    # The compile runs where it can be stopped: cancelled, it ends with the job (the
    # no-leak check after the test sees no process left), and no cache entry is written.
    src = _slow_module(tmp_path, functions=60, locals_=3000)
    cache = tmp_path / "cache"
    cold = WasmSandbox(cache_dir=cache)
    t0 = time.monotonic()
    with anyio.move_on_after(0.5):
        await cold.run(SandboxJob(wasm=WasmProgram(str(src)), limits=ResourceLimits(fuel=FUEL)))
    assert time.monotonic() - t0 < 0.5 + 2.0
    assert not list(cache.glob("*.cwasm"))


def _slow_module(folder: Path, *, functions: int, locals_: int) -> Path:
    """A WASI command of `functions` functions, each with `locals_` i64 locals all live
    across a loop: register allocation is superlinear in them (issue 15, item 10: a
    0.4 MB module of this shape compiled for a minute)."""
    lines = ["(module", '  (memory (export "memory") 1)']
    for f in range(functions):
        lines.append(f"  (func $f{f} (param i32) (result i64)")
        lines.append("    (local " + " i64" * locals_ + ")")
        lines.append("    (loop $l")
        for i in range(1, locals_ + 1):
            nxt = i % locals_ + 1
            lines.append(f"      (local.set {i} (i64.add (local.get {i}) (local.get {nxt})))")
        lines.append("      (br_if $l (local.tee 0 (i32.sub (local.get 0) (i32.const 1)))))")
        lines.append("    (local.get 1))")
    lines.append('  (func (export "_start") (drop (call $f0 (i32.const 1))))')
    lines.append(")")
    path = folder / f"slow_{functions}x{locals_}.wat"
    path.write_text("\n".join(lines))
    return path


@pytest.mark.anyio
async def test_a_module_over_the_complexity_bound_is_refused_before_compiling(
    arm: WasmSandbox, tmp_path: Path
) -> None:
    src = _slow_module(tmp_path, functions=2, locals_=MAX_FUNCTION_LOCALS + 1)
    t0 = time.monotonic()
    with anyio.fail_after(10), pytest.raises(SandboxDenied, match="locals"):
        await arm.run(SandboxJob(wasm=WasmProgram(str(src)), limits=ResourceLimits(fuel=FUEL)))
    assert time.monotonic() - t0 < 5.0
    # python.wasm's largest function has 187 locals: the bound is far from real code.
    nxt = await arm.run(wat_job("ok"))
    assert (nxt.exit, nxt.stdout) == (Success(), b"ok\n")


@pytest.mark.anyio
async def test_a_compile_counts_against_the_jobs_wall_time(
    arm: WasmSandbox, tmp_path: Path
) -> None:
    # Under the bound but slow to compile (tens of seconds here): the job's wall time
    # covers its compile, and the compile is stopped with it.
    src = _slow_module(tmp_path, functions=60, locals_=3000)
    cold = WasmSandbox(cache_dir=tmp_path / "cache")
    job = SandboxJob(wasm=WasmProgram(str(src)), limits=ResourceLimits(fuel=FUEL, wall_time_s=1))
    t0 = time.monotonic()
    with anyio.fail_after(1 + KILL_AFTER_S + 5):
        out = await cold.run(job)
    assert time.monotonic() - t0 < 1 + WATCHDOG_SLACK_S + 1.5
    assert out.exit == Timeout(), out
    assert "compil" in out.containment.resources.reason


@pytest.mark.anyio
async def test_cpu_time_budget_stops_a_spinning_guest(arm: WasmSandbox) -> None:
    # Issue 15, item 11: `cpu_s` was ignored (3-4 CPU-seconds under cpu_s = 1, succeeded).
    job = wat_job("spin", limits=ResourceLimits(fuel=None, wall_time_s=20, cpu_time_s=1))
    t0 = time.monotonic()
    with anyio.fail_after(15):
        out = await arm.run(job)
    assert out.exit == Killed(signal.SIGXCPU, "cpu_time"), out
    assert time.monotonic() - t0 < 10
    assert out.usage.cpu_s is not None and 0.9 <= out.usage.cpu_s < 3.0, out.usage


@pytest.mark.anyio
async def test_a_job_waits_for_the_preload_only_within_its_wall_time(tmp_path: Path) -> None:
    # Issue 15, item 10: the first job on a fresh worker waited 52 s for the worker's own
    # preload of its module, outside its 20 s budget. Now the wait counts against it.
    need(HAVE_ENGINE, NO_ENGINE)
    src = _slow_module(tmp_path, functions=60, locals_=3000)
    arm = WasmSandbox(cache_dir=tmp_path / "cache")
    job = SandboxJob(wasm=WasmProgram(str(src)), limits=ResourceLimits(fuel=FUEL, wall_time_s=1))
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(arm.preload, python=False, modules=(str(src),)))
        with anyio.fail_after(10):
            while not _guest_processes():  # noqa: ASYNC110
                await anyio.sleep(0.01)
        t0 = time.monotonic()
        with anyio.fail_after(1 + KILL_AFTER_S + 5):
            out = await arm.run(job)
        assert time.monotonic() - t0 < 1 + WATCHDOG_SLACK_S + 1.5
        assert out.exit == Timeout(), out
        assert "compil" in out.containment.resources.reason
        tg.cancel_scope.cancel()
    assert not _guest_processes()


@pytest.mark.anyio
async def test_a_refusal_quoting_a_huge_import_name_is_still_a_refusal(
    arm: WasmSandbox, tmp_path: Path
) -> None:
    # The refusal names the import, which the module chooses: its verdict line from the
    # guest's process must stay one whole line (PIPE_BUF), not a host fault.
    name = "x" * 20_000
    src = tmp_path / "long_import.wat"
    src.write_text(
        f'(module (import "wasi_snapshot_preview1" "{name}" (func))'
        ' (memory (export "memory") 1) (func (export "_start")))'
    )
    with pytest.raises(SandboxDenied, match="imports"):
        await arm.run(SandboxJob(wasm=WasmProgram(str(src)), limits=ResourceLimits(fuel=FUEL)))
