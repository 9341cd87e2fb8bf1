"""Pooled spawner slots (`ProcessSpec.cgroup_pool`) and the bwrap arm's fast spawn path.

A slot is a spawner thread moved once into its own pids cgroup (cgroup v1); a run forks
from it, so the child starts in the cgroup without a per-run migration. These tests check
what that must not change: the pids wall, the tree kill, that the worker itself is never
signalled, that a slot is lent to one run at a time and reused once empty; and that the
bwrap arm really takes the vfork path (no pre-exec work) while the limits still bind.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from metnos_exec import process
from metnos_exec.process import ProcessResult, ProcessSpec, run_process
from metnos_exec.sandbox import bwrap as bwrap_mod
from metnos_exec.sandbox._types import ResourceLimits, SandboxJob, Success
from metnos_exec.sandbox.flags import (
    derive_rlimits,
    guest_python,
    prlimit_prefix,
    shell_limits_prefix,
)
from tests.conftest import need, need_privileged
from tests.process.test_process import forker

PY = sys.executable
ENV = {"PATH": "/usr/bin:/bin"}


def need_slots() -> None:
    need_privileged(
        slots_available(), "no cgroup v1 pids hierarchy (slots need per-thread cgroups)"
    )


def slots_available() -> bool:
    parent = process._cgroup_parent()
    return parent is not None and (parent / "tasks").exists()


def pooled(*argv: str, **kw: Any) -> ProcessSpec:
    return ProcessSpec(
        argv=argv, env=dict(ENV), reaper=False, pdeathsig=False, cgroup_pool=True, **kw
    )


@pytest.mark.anyio
async def test_pooled_run_enforces_pids_and_kills_the_tree() -> None:
    need_privileged(
        slots_available(), "no cgroup v1 pids hierarchy (slots need per-thread cgroups)"
    )
    result = await run_process(pooled(PY, "-c", forker(64), pids_max=8), timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.pids_limited
    ok, failed = map(int, result.stdout.split())
    assert failed > 0 and ok <= 7  # the job itself is one of the 8
    # The sleeping children were killed with the job (the no-leak fixture also checks).


def pids_cgroup_of(result: ProcessResult) -> str:
    """The job's pids cgroup, as it printed /proc/self/cgroup."""
    line = next(ln for ln in result.stdout.decode().splitlines() if ":pids:" in ln)
    return line.split(":", 2)[2]


CGROUP_OF_SELF = "print(open('/proc/self/cgroup').read())"


@pytest.mark.anyio
async def test_slots_are_reused_once_empty_and_keep_only_their_thread() -> None:
    need_privileged(
        slots_available(), "no cgroup v1 pids hierarchy (slots need per-thread cgroups)"
    )
    first = await run_process(pooled(PY, "-c", CGROUP_OF_SELF, pids_max=4), timeout=10)
    made = process._slots._made
    for _ in range(3):
        again = await run_process(pooled(PY, "-c", CGROUP_OF_SELF, pids_max=4), timeout=10)
        assert "-slot-" in pids_cgroup_of(again)
    assert "-slot-" in pids_cgroup_of(first)
    assert process._slots._made == made, "sequential runs reuse a free slot"
    for slot in process._slots._free:
        assert slot.cgroup.pids() == []  # nothing of a finished run is left
        tasks = (slot.cgroup.path / "tasks").read_text().split()
        assert len(tasks) == 1 and int(tasks[0]) != os.getpid()  # its thread, not main


@pytest.mark.anyio
async def test_concurrent_runs_get_distinct_slots() -> None:
    need_privileged(
        slots_available(), "no cgroup v1 pids hierarchy (slots need per-thread cgroups)"
    )
    code = CGROUP_OF_SELF + "; import time; time.sleep(0.3)"
    results: list[ProcessResult] = []

    async def one() -> None:
        results.append(await run_process(pooled(PY, "-c", code, pids_max=4), timeout=10))

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(one)
    assert len({pids_cgroup_of(r) for r in results}) == 3


@pytest.mark.anyio
async def test_the_worker_is_never_signalled_by_the_slot_tree_kill() -> None:
    need_privileged(
        slots_available(), "no cgroup v1 pids hierarchy (slots need per-thread cgroups)"
    )
    # A job that outlives its budget: TERM then KILL go to everything in the slot's cgroup,
    # which lists the worker's pid too (its spawner thread sits there).
    hits: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda *_: hits.append(1))
    try:
        result = await run_process(pooled("sleep", "30", pids_max=4), timeout=0.3, grace=0.2)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert result.timed_out
    assert hits == []


@pytest.mark.anyio
async def test_unreaped_zombies_do_not_eat_the_next_runs_budget(tmp_path: Path) -> None:
    need_privileged(
        slots_available(), "no cgroup v1 pids hierarchy (slots need per-thread cgroups)"
    )
    # The job leaves a background child that the tree kill turns into a zombie re-parented
    # to pytest (a subreaper), still charged to the slot's cgroup until pytest reaps it.
    pidfile = tmp_path / "bg.pid"
    await run_process(pooled("sh", "-c", f"sleep 30 & echo $! > {pidfile}", pids_max=4), timeout=10)
    bg = int(pidfile.read_text())
    try:
        slot = process._slots._free[-1]
        with anyio.fail_after(5):
            while slot.cgroup.zombies() == 0:  # noqa: ASYNC110 - the kernel sends no event
                await anyio.sleep(0.01)  # the SIGKILLed child becomes a zombie a moment later
        zombies = slot.cgroup.zombies()
        slot.cgroup.set_max(4)
        assert int((slot.cgroup.path / "pids.max").read_text()) == 4 + 1 + zombies
    finally:
        reap(bg)


def reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


# --- the bwrap arm's spawn path -----------------------------------------------------


def test_prlimit_prefix_is_exact_and_in_order() -> None:
    rl = derive_rlimits(
        ResourceLimits(memory_bytes=123457, file_size_bytes=1001, open_files=17, cpu_time_s=3)
    )
    assert prlimit_prefix(rl, "/usr/bin/prlimit") == (
        "/usr/bin/prlimit",
        "--as=123457:123457",
        "--fsize=1001:1001",
        "--nofile=17:17",
        "--cpu=3:4",
        "--core=0:0",
        "--",
    )
    assert prlimit_prefix((), "/usr/bin/prlimit") == ()
    inf = resource.RLIM_INFINITY
    assert prlimit_prefix(((resource.RLIMIT_AS, inf, inf),), "p")[1] == "--as=unlimited:unlimited"


def test_limits_above_the_workers_hard_limits_stay_with_the_process_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    need(bwrap_mod._guest_prlimit() is not None, "prlimit(1) not installed")
    rl = ((resource.RLIMIT_NOFILE, 100, 100),)
    monkeypatch.setattr(resource, "getrlimit", lambda res: (50, 50))
    # The guest holds no capability and could not raise its hard limit: no prefix.
    assert bwrap_mod._limits_in_guest(rl) == ()
    monkeypatch.setattr(resource, "getrlimit", lambda res: (1000, 1000))
    prefix = bwrap_mod._limits_in_guest(rl)
    assert "--nofile=100:100" in prefix or "ulimit -n 100" in " ".join(prefix)


def test_shell_limits_prefix_only_when_exact() -> None:
    rl = derive_rlimits(
        ResourceLimits(memory_bytes=8 << 20, file_size_bytes=1 << 20, open_files=17, cpu_time_s=3)
    )
    assert shell_limits_prefix(rl, "/bin/dash") == (
        "/bin/dash",
        "-c",
        "ulimit -v 8192 && ulimit -f 2048 && ulimit -n 17 && ulimit -S -t 3 && "
        'ulimit -H -t 4 && ulimit -c 0 && exec "$@"',
        "sh",
    )
    # Not a whole number of 512-byte blocks: prlimit(1) must do it, exactly.
    assert shell_limits_prefix(((resource.RLIMIT_FSIZE, 1001, 1001),), "/bin/dash") is None
    # A resource the shells spell differently.
    assert shell_limits_prefix(((resource.RLIMIT_NPROC, 5, 5),), "/bin/dash") is None
    assert shell_limits_prefix((), "/bin/dash") == ()


@pytest.mark.anyio
async def test_bwrap_arm_spawns_without_pre_exec_work_and_limits_still_bind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    need(bwrap_mod.bwrap_probe().working, "bubblewrap unusable here")
    need(bwrap_mod._guest_prlimit() is not None, "prlimit(1) not installed")
    specs: list[ProcessSpec] = []
    real = run_process

    async def spy(spec: ProcessSpec, **kw: Any) -> ProcessResult:
        specs.append(spec)
        return await real(spec, **kw)

    monkeypatch.setattr(bwrap_mod, "run_process", spy)
    code = (
        "import resource as r; "
        "print(*(v for x in ('AS', 'FSIZE', 'NOFILE', 'CPU', 'CORE') "
        "for v in r.getrlimit(getattr(r, 'RLIMIT_' + x))))"
    )
    for file_size in (5 << 20, (5 << 20) + 1):  # via sh's ulimit, and via prlimit(1)
        specs.clear()
        job = SandboxJob(
            argv=(guest_python(), "-I", "-S", "-c", code),
            limits=ResourceLimits(
                memory_bytes=512 << 20, file_size_bytes=file_size, open_files=64, cpu_time_s=7
            ),
        )
        outcome = await bwrap_mod.BwrapSandbox().run(job)
        assert outcome.exit == Success(), outcome.stderr
        expected = [512 << 20, 512 << 20, file_size, file_size, 64, 64, 7, 8, 0, 0]
        assert [int(v) for v in outcome.stdout.split()] == expected
        (spec,) = specs
        # Nothing between fork and exec: CPython can vfork.
        assert spec.rlimits == () and spec.pdeathsig is False and spec.cgroup_pool
        assert "--die-with-parent" in spec.argv


@pytest.mark.anyio
async def test_bwrap_arm_reaps_its_orphaned_init_when_it_is_ours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    need(bwrap_mod.bwrap_probe().working, "bubblewrap unusable here")
    # pytest is a subreaper, so bubblewrap's init is re-parented to this process.
    inits: list[int] = []
    real = bwrap_mod._reap_orphaned_init

    async def spy(pid: object) -> None:
        assert isinstance(pid, int)
        inits.append(pid)
        await real(pid)

    monkeypatch.setattr(bwrap_mod, "_reap_orphaned_init", spy)
    outcome = await bwrap_mod.BwrapSandbox().run(SandboxJob(argv=("/bin/true",)))
    assert outcome.exit == Success()
    (init,) = inits
    # Reaped: no such process any more (not even a zombie of ours).
    assert gone(init)


@pytest.mark.anyio
async def test_a_subreaper_keeps_every_slots_process_budget_exact() -> None:
    """bubblewrap's init outlives its monitor, an orphan each job. A subreaper (pytest
    here, the worker process in production) gets them back and the arm reaps each as its
    job ends: no zombie stays charged to a slot, so ``pids.max`` is the budget itself,
    not the budget plus zombies that a slow host init may reap in the middle of a run."""
    need(bwrap_mod.bwrap_probe().working, "bubblewrap unusable here")
    need_privileged(
        slots_available(), "no cgroup v1 pids hierarchy (slots need per-thread cgroups)"
    )
    arm = bwrap_mod.BwrapSandbox()
    job = SandboxJob(argv=("/bin/true",), limits=ResourceLimits(pids=16))

    async def runner() -> None:
        for _ in range(10):
            assert (await arm.run(job)).exit == Success()

    async with anyio.create_task_group() as tg:
        for _ in range(2):
            tg.start_soon(runner)
    slots = list(process._slots._free)
    assert len(slots) >= 2
    for slot in slots:
        assert slot.cgroup.zombies() == 0
        # What the next run of that budget will get: exactly budget + bubblewrap's two +
        # the slot thread, nothing for zombies.
        slot.cgroup.set_max(16 + bwrap_mod._BWRAP_PIDS)
        assert (slot.cgroup.path / "pids.max").read_text().strip() == str(
            16 + bwrap_mod._BWRAP_PIDS + 1
        )


# --- orphans a subreaper inherits -------------------------------------------------------


def zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):  # gone meanwhile
        return False
    return stat[stat.rfind(b")") + 2 :].split()[0] == b"Z"


ORPHANER = """
import os, sys
pid = os.fork()
if pid == 0:
    os.setsid()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # not holding the caller's pipe open
    os.read(os.open(sys.argv[1], os.O_RDONLY), 1)  # wait until told (a fifo)
    os._exit(0)
print(pid, flush=True)
"""


class Orphan:
    """A grandchild in a session of its own, re-parented to us (pytest is a subreaper)
    once its parent exits; it exits itself when `release`d."""

    def __init__(self, tmp_path: Path) -> None:
        import subprocess

        self.fifo = tmp_path / "go"
        os.mkfifo(self.fifo)
        out = subprocess.run(
            [PY, "-c", ORPHANER, str(self.fifo)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self.pid = int(out.stdout)

    def release(self) -> None:
        with open(self.fifo, "wb") as f:
            f.write(b"x")

    def release_and_wait_zombie(self) -> None:
        self.release()
        wait_zombie(self.pid)


def exists(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def plain_child(code: int) -> Any:
    """A plain ``subprocess`` child in our own session, like a library's."""
    import subprocess

    return subprocess.Popen(["sh", "-c", f"exit {code}"])


def wait_zombie(pid: int) -> None:
    import time

    deadline = time.monotonic() + 5
    while not zombie(pid):
        assert time.monotonic() < deadline
        time.sleep(0.01)  # polling with a deadline


def test_reap_orphans_takes_an_orphan_of_another_session(tmp_path: Path) -> None:
    orphan = Orphan(tmp_path)
    process.reap_orphans()  # (other tests' orphans may go now)
    assert os.path.exists(f"/proc/{orphan.pid}") and not zombie(orphan.pid)  # alive: kept
    orphan.release_and_wait_zombie()
    assert process.reap_orphans() >= 1
    assert not os.path.exists(f"/proc/{orphan.pid}")


def test_reap_orphans_leaves_a_plain_subprocess_to_its_owner() -> None:
    import subprocess

    child = subprocess.Popen(["sh", "-c", "exit 3"])  # our own session, like a library's
    wait_zombie(child.pid)
    process.reap_orphans()
    assert zombie(child.pid)  # left alone...
    assert child.wait(timeout=5) == 3  # ...for its owner: its real status, not a stolen one


@pytest.mark.anyio
async def test_reap_orphans_never_takes_a_run_process_child() -> None:
    """run_process children run in sessions of their own, like orphans: they are told
    apart by registration, held from fork on, so a sweep racing the runs steals none."""
    stop = anyio.Event()
    sweeps = 0

    async def sweeper() -> None:
        nonlocal sweeps
        while not stop.is_set():
            process.reap_orphans()
            sweeps += 1
            await anyio.lowlevel.checkpoint()

    async def runs() -> None:
        for _ in range(40):
            result = await run_process(
                ProcessSpec(argv=("sh", "-c", "exit 7"), env=dict(ENV), reaper=False),
                timeout=10,
            )
            assert result.returncode == 7

    async with anyio.create_task_group() as tg:
        tg.start_soon(sweeper)
        await runs()
        stop.set()
    assert sweeps > 40


def test_a_process_that_is_no_subreaper_reaps_nothing() -> None:
    import subprocess

    code = (
        "from metnos_exec import process as p\n"
        "print(p._is_subreaper(), p.reap_orphans())\n"
        "print(p.become_subreaper(), p._is_subreaper())\n"
    )
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "0", "True", "True"]


# --- the slot's memory cgroup ---------------------------------------------------------

MiB = 1 << 20


@pytest.mark.anyio
async def test_pooled_run_charges_the_tree_not_the_worker() -> None:
    need_privileged(
        slots_available(), "no cgroup v1 pids hierarchy (slots need per-thread cgroups)"
    )
    need_privileged(process.memory_cgroup_available(), "no writable cgroup v1 memory hierarchy")
    # The worker holds (and touches) 128 MiB while the job runs: were the worker charged
    # to the slot's cgroup (one of its threads sits there), the peak would show it.
    ballast = b"\x01" * (128 * MiB)
    code = "b = b'\\x01' * (40 << 20); print(len(b))"
    result = await run_process(pooled(PY, "-c", code, pids_max=4, memory_max=96 * MiB), timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.memory_limited and not result.oom_killed
    peak = result.memory_peak_bytes
    assert peak is not None and 40 * MiB <= peak < 96 * MiB, peak
    assert len(ballast) == 128 * MiB


@pytest.mark.anyio
async def test_pooled_run_over_its_memory_is_oom_killed_and_the_worker_lives() -> None:
    need_privileged(
        slots_available(), "no cgroup v1 pids hierarchy (slots need per-thread cgroups)"
    )
    need_privileged(process.memory_cgroup_available(), "no writable cgroup v1 memory hierarchy")
    code = "b = b'\\x01' * (200 << 20); print('survived')"
    result = await run_process(pooled(PY, "-c", code, pids_max=4, memory_max=64 * MiB), timeout=30)
    assert result.oom_killed and result.returncode == -signal.SIGKILL
    assert result.stdout == b""
    peak = result.memory_peak_bytes
    assert peak is not None and peak <= 64 * MiB
    # The slot is lent again with a new limit, and the counter starts from there.
    again = await run_process(pooled(PY, "-c", "pass", pids_max=4, memory_max=64 * MiB), timeout=30)
    assert again.returncode == 0 and not again.oom_killed and again.memory_limited


@pytest.mark.anyio
async def test_a_slot_left_charged_above_the_next_budget_still_bounds_the_next_run() -> None:
    """Memory an earlier run left charged to the slot (here: pages of a host tmpfs file it
    wrote, which stay charged while the file lives and, without swap, cannot be reclaimed)
    must not take the next run's memory wall down: lowering the limit under what is
    charged fails (EBUSY), and the run then went on with per-process limits only while the
    report said "no memory cgroup" (CI, tests/adversarial: memory_across_processes)."""
    need_slots()
    need_privileged(process.memory_cgroup_available(), "no writable cgroup v1 memory hierarchy")
    shm = Path("/dev/shm") / f"metnos-test-charge-{os.getpid()}"
    fill = f"f = open({str(shm)!r}, 'wb'); [f.write(b'x' * (1 << 20)) for _ in range(96)]"
    try:
        async with process.pooled_slot() as slot:
            assert slot is not None and slot.memory is not None
            first = await run_process(pooled(PY, "-c", fill, pids_max=4), timeout=60, slot=slot)
            assert first.returncode == 0, first.stderr
            charged = int(slot.memory._read("memory.usage_in_bytes"))
            second = await run_process(
                pooled(PY, "-c", "b = b'\\x01' * (200 << 20)", pids_max=4, memory_max=32 * MiB),
                timeout=60,
                slot=slot,
            )
        assert second.memory_limited, f"{charged >> 20} MiB left charged took the wall down"
        assert second.oom_killed and second.returncode == -signal.SIGKILL
        peak = second.memory_peak_bytes
        assert peak is not None and peak <= 32 * MiB
    finally:
        shm.unlink(missing_ok=True)


@pytest.mark.anyio
async def test_what_an_earlier_run_left_charged_does_not_eat_the_next_runs_budget() -> None:
    """Left charged under the next limit, it would still count against it: a run using
    50 of its 64 MiB was OOM-killed for the 40 MiB an earlier run's host tmpfs file held."""
    need_slots()
    need_privileged(process.memory_cgroup_available(), "no writable cgroup v1 memory hierarchy")
    shm = Path("/dev/shm") / f"metnos-test-charge-{os.getpid()}"
    fill = f"f = open({str(shm)!r}, 'wb'); [f.write(b'x' * (1 << 20)) for _ in range(40)]"
    use = "b = b'\\x01' * (50 << 20); print(len(b))"
    try:
        async with process.pooled_slot() as slot:
            assert slot is not None and slot.memory is not None
            first = await run_process(pooled(PY, "-c", fill, pids_max=4), timeout=60, slot=slot)
            assert first.returncode == 0, first.stderr
            second = await run_process(
                pooled(PY, "-c", use, pids_max=4, memory_max=64 * MiB), timeout=60, slot=slot
            )
        assert second.memory_limited
        assert second.returncode == 0 and not second.oom_killed, second
        assert second.stdout.strip() == str(50 * MiB).encode()
    finally:
        shm.unlink(missing_ok=True)


@pytest.mark.anyio
async def test_memory_unbounded_is_said_when_no_memory_cgroup_holds_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    need_privileged(
        slots_available(), "no cgroup v1 pids hierarchy (slots need per-thread cgroups)"
    )
    monkeypatch.setattr(process.cgroups, "memory_cgroup_available", lambda: False)
    result = await run_process(pooled(PY, "-c", "pass", memory_max=64 * MiB), timeout=30)
    assert result.returncode == 0
    assert not result.memory_limited and result.memory_peak_bytes is None
    # A per-run cgroup in v1's pids hierarchy has no memory controller either.
    monkeypatch.undo()
    per_run = ProcessSpec(argv=("true",), env=dict(ENV), reaper=False, pids_max=4, memory_max=MiB)
    result = await run_process(per_run, timeout=30)
    assert result.returncode == 0 and result.pids_limited
    assert not result.memory_limited


def test_v2_memory_files_are_written_and_read(tmp_path: Path) -> None:
    # A directory standing in for a cgroup v2 node (this host runs v1).
    cgroup = process._Cgroup(tmp_path)
    assert cgroup.limit_memory(64 * MiB)
    assert (tmp_path / "memory.max").read_text() == str(64 * MiB)
    assert (tmp_path / "memory.swap.max").read_text() == "0"
    (tmp_path / "memory.peak").write_text("123456\n")
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 2\n")
    assert cgroup.memory_report() == (123456, 2)
    assert not process._Cgroup(tmp_path / "missing").limit_memory(MiB)


def test_a_pid_reused_before_it_is_disowned_stays_owned() -> None:
    """`wait4` frees a pid; the next spawn may get it and register it before the first
    run unregisters it: the registry counts, so the new child stays protected."""
    pid = 4_000_000  # above any real pid: the registry is all this touches
    with process._spawn_lock:
        process._owned[pid] += 1  # the first run's child
        process._owned[pid] += 1  # reaped, and the number reused by a new spawn
    process._disown(pid)  # the first run unregisters late
    with process._spawn_lock:
        assert not process._nobodys(pid)
    process._disown(pid)
    assert pid not in process._owned


@pytest.mark.anyio
async def test_reap_orphan_waits_for_a_running_orphan_and_returns_its_rusage(
    tmp_path: Path,
) -> None:
    orphan = Orphan(tmp_path)
    got: list[Any] = []

    async def reap() -> None:
        got.append(await process.reap_orphan(orphan.pid, 10))

    async with anyio.create_task_group() as tg:
        tg.start_soon(reap)
        await anyio.wait_all_tasks_blocked()
        # Claimed while it runs: the sweep leaves it to the claimant.
        assert orphan.pid in process._owned
        assert process.reap_orphans() >= 0 and exists(orphan.pid)
        await anyio.to_thread.run_sync(orphan.release)
    (rusage,) = got
    assert rusage is not None and rusage.ru_maxrss > 0
    assert not exists(orphan.pid) and orphan.pid not in process._owned


@pytest.mark.anyio
async def test_reap_orphan_gives_up_at_its_timeout_and_leaves_it_to_the_sweep(
    tmp_path: Path,
) -> None:
    orphan = Orphan(tmp_path)
    assert await process.reap_orphan(orphan.pid, 0.1) is None
    assert orphan.pid not in process._owned  # unregistered: the sweep may take it
    await anyio.to_thread.run_sync(orphan.release_and_wait_zombie)
    assert process.reap_orphans() >= 1
    assert not exists(orphan.pid)


@pytest.mark.anyio
async def test_reap_orphan_takes_nothing_that_is_not_an_orphan_of_ours() -> None:
    # A plain subprocess of ours (our own session) is left to its owner.
    child = plain_child(4)
    await anyio.to_thread.run_sync(wait_zombie, child.pid)
    assert await process.reap_orphan(child.pid, 0.1) is None
    assert child.wait(timeout=5) == 4
    # Nor is a pid that is nobody's child here.
    assert await process.reap_orphan(1, 0.1) is None


# --- a root worker's slot uids (metnos_exec.identities) ------------------------------------

#: The child's uids and gids (real, effective, saved, fs), with tools any uid may run: the
#: test's interpreter may sit where a slot's uid cannot reach (pyenv under /root).
UIDS = ("/bin/sh", "-c", "grep -E '^(Uid|Gid):' /proc/self/status | cut -f2-")


def thread_uids() -> set[str]:
    """The ``Uid:`` line of every thread of this process."""
    lines = set()
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/status") as f:
            lines.add(next(line for line in f if line.startswith("Uid:")).strip())
    return lines


@pytest.mark.anyio
async def test_a_slot_switches_to_its_own_uid_for_the_fork_only() -> None:
    need_slots()
    need_privileged(os.geteuid() == 0, "slot uids are a root worker's")
    async with process.pooled_slot() as slot:
        assert slot is not None
        identity = await slot.identity()
        assert identity is not None, slot.identity_error
        as_slot = await run_process(pooled(*UIDS, as_slot_user=True), timeout=10, slot=slot)
        as_root = await run_process(pooled(*UIDS), timeout=10, slot=slot)
    u = identity.uid
    assert as_slot.uid == u and as_slot.stdout.split() == [str(u).encode()] * 8, as_slot
    # The same thread forks the next job as root again: the switch held for one fork.
    assert as_root.uid == 0 and as_root.stdout.split() == [b"0"] * 8, as_root
    # Every thread of the worker (the slot's included) is root again.
    assert thread_uids() == {"Uid:\t0\t0\t0\t0"}
