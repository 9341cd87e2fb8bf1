"""Process lifecycle: spawn, feed, drain, cap, time out, cancel, die with the worker.

Most behaviours are checked with the subreaper shim (``reaper=True``, the direct arm) and
without it (``reaper=False``, what the bwrap arm uses). Every async test runs on asyncio
and trio. The conftest makes pytest a child subreaper, so an orphan a test leaves behind
is re-parented to pytest and fails the test.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest

from metnos_exec import process
from metnos_exec.errors import HostFault
from metnos_exec.process import ProcessResult, ProcessSpec, run_process
from tests.conftest import need_privileged

ENV = {"PATH": "/usr/bin:/bin"}
PY = sys.executable
HELPERS = Path(__file__).parent.parent / "helpers"
TREE = str(HELPERS / "tree.py")
WORKER = str(HELPERS / "worker.py")

both_modes = pytest.mark.parametrize("reaper", [True, False], ids=["shim", "no-shim"])


def spec(*argv: str, reaper: bool = True, **kw: object) -> ProcessSpec:
    return ProcessSpec(argv=argv, env=dict(ENV), reaper=reaper, **kw)  # type: ignore[arg-type]


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (zombies of ours are reaped here)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):  # gone meanwhile
        return False
    if stat[stat.rfind(b")") + 2 :].split()[0] == b"Z":
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return False
    return True


def wait_gone(pids: list[int], within: float = 10.0) -> list[int]:
    """Poll (with a deadline) until none of `pids` is alive; return the survivors."""
    deadline = time.monotonic() + within
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = [p for p in left if alive(p)]
    return left


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


async def await_file(path: Path, within: float = 10.0) -> int:
    """Poll (with a deadline) for a pid file written by a job; return the pid."""
    with anyio.fail_after(within):
        # Another process writes the file: there is no event to wait on, so poll.
        while (pid := read_pid(path)) is None:  # noqa: ASYNC110
            await anyio.sleep(0.01)
    return pid


def cgroups_available() -> bool:
    return process._cgroup_parent() is not None


# --- basics --------------------------------------------------------------------------


@pytest.mark.anyio
@both_modes
async def test_exit_code_stdout_stderr_and_stdin(reaper: bool) -> None:
    result = await run_process(
        spec("sh", "-c", "cat; echo out; echo err >&2; exit 3", reaper=reaper, stdin=b"in:"),
        timeout=10,
    )
    assert result.returncode == 3
    assert result.stdout == b"in:out\n"
    assert result.stderr == b"err\n"
    assert not (result.timed_out or result.stdout_truncated or result.stderr_truncated)
    assert result.exec_error is None


@pytest.mark.anyio
@both_modes
async def test_environment_is_exactly_the_spec(reaper: bool) -> None:
    env = {"PATH": "/usr/bin:/bin", "ONLY": "this"}
    result = await run_process(ProcessSpec(argv=("env",), env=env, reaper=reaper), timeout=10)
    assert sorted(result.stdout.decode().splitlines()) == ["ONLY=this", "PATH=/usr/bin:/bin"]


@pytest.mark.anyio
@both_modes
async def test_cwd(reaper: bool, tmp_path: Path) -> None:
    result = await run_process(spec("pwd", reaper=reaper, cwd=str(tmp_path)), timeout=10)
    assert result.stdout.decode().strip() == str(tmp_path)


@pytest.mark.anyio
@both_modes
async def test_missing_command_is_an_ordinary_127(reaper: bool) -> None:
    result = await run_process(spec("no-such-command-here", reaper=reaper), timeout=10)
    assert result.returncode == 127
    assert result.exec_error is not None and "no-such-command-here" in result.exec_error


@pytest.mark.anyio
@both_modes
async def test_unexecutable_file_is_126(reaper: bool, tmp_path: Path) -> None:
    script = tmp_path / "script"
    script.write_text("#!/bin/sh\necho hi\n")  # not executable
    result = await run_process(spec(str(script), reaper=reaper), timeout=10)
    assert result.returncode == 126
    assert result.exec_error is not None


@pytest.mark.anyio
@both_modes
async def test_signal_death_is_a_negative_returncode(reaper: bool) -> None:
    result = await run_process(spec("sh", "-c", "kill -USR1 $$", reaper=reaper), timeout=10)
    assert result.returncode == -signal.SIGUSR1
    assert not result.timed_out


@pytest.mark.anyio
@both_modes
async def test_default_signal_dispositions_are_restored(reaper: bool) -> None:
    # Python ignores SIGPIPE and SIGXFSZ; an ignored disposition would survive exec.
    result = await run_process(
        spec("sh", "-c", "grep -E 'SigIgn' /proc/self/status", reaper=reaper), timeout=10
    )
    ignored = int(result.stdout.split()[1], 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1))
    assert not ignored & (1 << (signal.SIGXFSZ - 1))


@pytest.mark.anyio
@both_modes
async def test_stdin_a_child_never_reads_does_not_deadlock(reaper: bool) -> None:
    result = await run_process(spec("true", reaper=reaper, stdin=b"x" * (8 << 20)), timeout=10)
    assert result.returncode == 0 and not result.timed_out


@pytest.mark.anyio
@both_modes
@pytest.mark.parametrize("size", [0, 100, 64 << 10, (1 << 20) + 7])
async def test_stdin_reaches_the_child_whole(reaper: bool, size: int) -> None:
    """Small stdin is written at once, without a feeding task; what does not fit the pipe
    is fed as the child reads it. Either way the child gets every byte, then EOF."""
    data = bytes(i % 251 for i in range(size))
    result = await run_process(spec("sha256sum", reaper=reaper, stdin=data), timeout=10)
    assert result.returncode == 0
    assert result.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()


@pytest.mark.anyio
@both_modes
async def test_new_session_and_only_std_and_passed_fds(reaper: bool) -> None:
    stray_r, stray_w = os.pipe()
    passed_r, passed_w = os.pipe()
    os.set_inheritable(stray_w, True)  # an inheritable fd we do *not* pass must not leak
    try:
        code = (
            "import os,sys;"
            f"print(os.getsid(0) != {os.getsid(0)});"
            "print(sorted(int(f) for f in os.listdir('/proc/self/fd')"
            f" if int(f) in ({stray_w},{passed_w})))"
        )
        result = await run_process(
            spec(PY, "-c", code, reaper=reaper, pass_fds=(passed_w,)), timeout=10
        )
    finally:
        for fd in (stray_r, stray_w, passed_r, passed_w):
            os.close(fd)
    assert result.stdout.decode().split("\n")[:2] == ["True", f"[{passed_w}]"]


@pytest.mark.anyio
@both_modes
async def test_rlimits_are_applied_before_exec(reaper: bool) -> None:
    result = await run_process(
        spec("sh", "-c", "ulimit -n", reaper=reaper, rlimits=((resource.RLIMIT_NOFILE, 37, 37),)),
        timeout=10,
    )
    assert result.stdout.strip() == b"37"


GET_PDEATHSIG = (
    "import ctypes; libc = ctypes.CDLL(None); sig = ctypes.c_int(-1);"
    "libc.prctl(2, ctypes.byref(sig), 0, 0, 0); print(sig.value)"  # PR_GET_PDEATHSIG
)


@pytest.mark.anyio
@both_modes
@pytest.mark.parametrize("pdeathsig", [True, False])
async def test_parent_death_signal_is_set_as_asked(reaper: bool, pdeathsig: bool) -> None:
    result = await run_process(
        spec(PY, "-c", GET_PDEATHSIG, reaper=reaper, pdeathsig=pdeathsig), timeout=10
    )
    # Under the shim the target always dies with the shim; the shim's own parent-death
    # signal (towards the worker) is what `pdeathsig` controls.
    expected = signal.SIGKILL if (pdeathsig or reaper) else 0
    assert int(result.stdout) == expected


@pytest.mark.anyio
async def test_usage_is_measured() -> None:
    code = (
        "b = bytearray(120 << 20)\n"
        "for i in range(0, len(b), 4096): b[i] = 1\n"
        "x = 0\n"
        "while x < 3_000_000: x += 1"
    )
    result = await run_process(spec(PY, "-c", code), timeout=30)
    assert result.returncode == 0
    assert result.peak_rss_bytes >= 120 << 20
    assert result.cpu_s > 0.05
    assert result.wall_s >= result.cpu_s * 0.5


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="argv"):
        anyio.run(lambda: run_process(spec(), timeout=1))
    with pytest.raises(ValueError, match="soft"):
        anyio.run(
            lambda: run_process(spec("true", rlimits=((resource.RLIMIT_CPU, 5, 1),)), timeout=1)
        )


# --- bounded output --------------------------------------------------------------------


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


@pytest.mark.anyio
@both_modes
async def test_flood_is_capped_and_worker_memory_stays_bounded(reaper: bool) -> None:
    # Reset the peak RSS (VmHWM) so the measurement is about this run only.
    _reset_peak_rss()
    rss_before = _vm_kib("VmRSS")
    result = await run_process(
        spec(
            "sh",
            "-c",
            "head -c 100M /dev/zero; head -c 20M /dev/zero >&2; echo done >&2",
            reaper=reaper,
            output_bytes=1 << 20,
        ),
        timeout=60,
    )
    growth_mib = (_vm_kib("VmHWM") - rss_before) / 1024
    assert result.returncode == 0 and not result.timed_out
    assert len(result.stdout) == 1 << 20 and result.stdout_truncated
    assert len(result.stderr) == 1 << 20 and result.stderr_truncated
    assert growth_mib < 50, f"worker grew by {growth_mib:.1f} MiB"


@pytest.mark.anyio
async def test_output_exactly_at_the_cap_is_not_truncated() -> None:
    result = await run_process(
        spec("head", "-c", "4096", "/dev/zero", output_bytes=4096), timeout=10
    )
    assert len(result.stdout) == 4096 and not result.stdout_truncated


# --- timeouts, tree kill, cancellation ----------------------------------------------------


@pytest.mark.anyio
async def test_timeout_kills_a_double_forked_setsid_grandchild(tmp_path: Path) -> None:
    t0 = time.monotonic()
    result = await run_process(spec(PY, TREE, str(tmp_path)), timeout=1.0, grace=0.5)
    elapsed = time.monotonic() - t0
    job = int((tmp_path / "job.pid").read_text())
    grandchild = int((tmp_path / "grandchild.pid").read_text())
    assert result.timed_out
    assert elapsed < 1.0 + 2.0
    assert (tmp_path / "job.term").exists(), "SIGTERM comes before SIGKILL"
    assert wait_gone([job, grandchild], within=0.5) == []


@pytest.mark.anyio
async def test_without_the_shim_a_pids_cgroup_still_kills_escaped_descendants(
    tmp_path: Path,
) -> None:
    need_privileged(cgroups_available(), "no writable pids cgroup")
    result = await run_process(
        spec(PY, TREE, str(tmp_path), reaper=False, pids_max=64), timeout=1.0, grace=0.5
    )
    grandchild = int((tmp_path / "grandchild.pid").read_text())
    assert result.timed_out and result.pids_limited
    assert wait_gone([grandchild], within=0.5) == []


@pytest.mark.anyio
@both_modes
async def test_timeout_grace_then_sigkill_for_a_child_ignoring_sigterm(reaper: bool) -> None:
    t0 = time.monotonic()
    result = await run_process(
        spec("sh", "-c", "trap '' TERM; echo ready; sleep 30", reaper=reaper),
        timeout=0.5,
        grace=0.3,
    )
    assert result.timed_out
    assert result.returncode == -signal.SIGKILL
    assert result.stdout == b"ready\n"
    assert time.monotonic() - t0 >= 0.5 + 0.3


@pytest.mark.anyio
@both_modes
async def test_output_written_during_the_grace_is_kept(reaper: bool) -> None:
    result = await run_process(
        spec("sh", "-c", "trap 'echo bye; exit 0' TERM; sleep 30 & wait", reaper=reaper),
        timeout=0.5,
        grace=5,
    )
    assert result.timed_out
    assert result.stdout == b"bye\n"


@pytest.mark.anyio
async def test_cancellation_kills_the_tree_and_is_reraised(tmp_path: Path) -> None:
    finished: list[ProcessResult] = []

    async def job() -> None:
        finished.append(await run_process(spec(PY, TREE, str(tmp_path)), timeout=60))

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(job)
            pid = await await_file(tmp_path / "job.pid")
            grandchild = await await_file(tmp_path / "grandchild.pid")
            tg.cancel_scope.cancel()
    assert finished == [], "run_process must re-raise the cancellation, not return"
    assert (tmp_path / "job.term").exists(), "SIGTERM comes before SIGKILL"
    assert wait_gone([pid, grandchild], within=0.5) == []


@pytest.mark.anyio
async def test_cancellation_is_not_swallowed_when_the_child_exits_on_term() -> None:
    with anyio.CancelScope() as scope:
        scope.deadline = anyio.current_time() + 0.5
        await run_process(spec("sleep", "30"), timeout=60)
        raise AssertionError("unreachable: the cancellation must propagate")
    assert scope.cancelled_caught


@pytest.mark.anyio
async def test_cancelled_before_the_spawn_completes_still_kills_and_reraises() -> None:
    with anyio.CancelScope() as scope:
        scope.cancel()  # already cancelled when run_process starts: the spawn is shielded
        await run_process(spec("sleep", "30"), timeout=60)
    assert scope.cancelled_caught  # and the autouse fixture checks nothing was left


@pytest.mark.anyio
@both_modes
async def test_a_tiny_timeout_is_still_a_clean_timeout(reaper: bool) -> None:
    result = await run_process(spec("sleep", "30", reaper=reaper), timeout=0.001, grace=0.1)
    assert result.timed_out


@pytest.mark.anyio
async def test_descendants_left_behind_by_a_finished_job_are_killed() -> None:
    t0 = time.monotonic()
    result = await run_process(
        spec("sh", "-c", "(setsid sleep 100 > /dev/null 2>&1 &); echo started"), timeout=30
    )
    assert result.returncode == 0 and result.stdout == b"started\n"
    assert time.monotonic() - t0 < 5  # no wait for the orphan; the fixture sees none left


# --- pids ---------------------------------------------------------------------------------


def forker(n: int) -> str:
    """A script that tries `n` forks (each child sleeps) and prints "ok failed"."""
    return FORK_TEMPLATE.replace("N_FORKS", str(n))


FORK_TEMPLATE = """
import os, time
ok = failed = 0
for _ in range(N_FORKS):
    try:
        pid = os.fork()
    except BlockingIOError:
        failed += 1
        continue
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    ok += 1
print(ok, failed)
"""


@pytest.mark.anyio
@both_modes
async def test_pids_max_makes_forks_fail_and_leaves_nothing(
    reaper: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    need_privileged(cgroups_available(), "no writable pids cgroup")
    made: list[Path] = []
    create = process._Cgroup.create

    def spy(pids_max: int) -> process._Cgroup | None:
        cgroup = create(pids_max)
        if cgroup is not None:
            made.append(cgroup.path)
            assert (cgroup.path / "pids.max").read_text().strip() == str(pids_max)
        return cgroup

    monkeypatch.setattr(process._Cgroup, "create", spy)
    result = await run_process(spec(PY, "-c", forker(200), reaper=reaper, pids_max=32), timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.pids_limited
    ok, failed = map(int, result.stdout.split())
    assert failed > 0
    assert ok <= 31  # the job itself is one of the 32
    assert len(made) == 1 and not made[0].exists(), "the run's cgroup is removed"


@pytest.mark.anyio
async def test_without_a_cgroup_root_reports_pids_not_limited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(process.cgroups, "_cgroup_parent", lambda: None)
    code = "import resource; print(resource.getrlimit(resource.RLIMIT_NPROC)[0])"
    result = await run_process(spec(PY, "-c", code, pids_max=32), timeout=10)
    # RLIMIT_NPROC is still applied, above what this uid already runs ...
    assert 32 < int(result.stdout) < 32 + 100_000
    # ... but it counts the user's threads, not the job's (and uid 0 is exempt).
    assert result.pids_limited is False


# --- host faults ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_job_killing_its_shim_is_a_verdict_not_a_host_fault() -> None:
    result = await run_process(spec("sh", "-c", "kill -KILL $PPID; sleep 30"), timeout=10)
    assert result.returncode == -signal.SIGKILL
    assert not result.timed_out  # the job's own doing: the target died with its parent


@pytest.mark.anyio
async def test_a_missing_shim_interpreter_is_a_host_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/nonexistent/python3")  # the module process reads
    with pytest.raises(HostFault, match="reaper shim"):
        await run_process(spec("true"), timeout=10)


# --- spawning thread and die-with-parent --------------------------------------------


def test_pdeathsig_is_tied_to_the_forking_thread() -> None:
    """The hazard the spawner thread exists for: a child forked by a thread that then exits
    is SIGKILLed although the process lives on. This is why the tests below have teeth."""
    holder: list[process._Child] = []
    t = threading.Thread(
        target=lambda: holder.append(
            process._spawn(spec("sleep", "30", reaper=False), (), None, 0.5)
        )
    )
    t.start()
    t.join()
    child = holder[0]
    try:
        _, status, _ = os.wait4(child.pid, 0)
        assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL
        child.popen.returncode = -9
    finally:
        child.close()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@both_modes
def test_a_job_outlives_an_idle_worker_thread(backend: str, reaper: bool) -> None:
    """trio's worker threads exit after 10 s idle; the helper makes that 0.1 s and checks
    that a job outlives such a thread's exit. A fresh process, so that trio's process-wide
    thread cache holds no thread left over from earlier tests."""
    out = subprocess.run(
        [PY, str(HELPERS / "idle_thread.py"), backend, "2.5", *([] if reaper else ["--no-reaper"])],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
        capture_output=True,
        timeout=60,
        check=True,
    )
    report = json.loads(out.stdout)
    assert report["returncode"] == 0, report
    if backend == "trio":
        assert report["thread_exited"], "the worker thread must exit while the job runs"


# trio's real 10 s thread idle timeout is exercised end to end by
# tests/sandbox/test_bwrap.py::test_30_s_job_completes_on_both_backends (30 s jobs on both
# backends through run_process, side by side); the test above checks the mechanism fast.


def _run_worker(
    tmp_path: Path, backend: str, *options: str, job: list[str]
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [PY, WORKER, backend, *options, "--", *job],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize(
    "via", [(), ("--arm", "metnos_exec.sandbox.direct:DirectSandbox")], ids=["process", "direct"]
)
def test_sigkill_of_the_worker_kills_the_whole_job_tree(
    tmp_path: Path, backend: str, via: tuple[str, ...]
) -> None:
    worker = _run_worker(tmp_path, backend, *via, job=[PY, TREE, str(tmp_path)])
    try:
        deadline = time.monotonic() + 15
        while not ((tmp_path / "job.pid").exists() and (tmp_path / "grandchild.pid").exists()):
            assert time.monotonic() < deadline, "the job never started"
            assert worker.poll() is None, "the worker died early"
            time.sleep(0.02)
        job = int((tmp_path / "job.pid").read_text())
        grandchild = int((tmp_path / "grandchild.pid").read_text())
        assert alive(job) and alive(grandchild)
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    assert wait_gone([job, grandchild], within=5) == []


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sigkill_of_the_worker_kills_the_job_without_the_shim(tmp_path: Path, backend: str) -> None:
    pidfile = tmp_path / "job.pid"
    worker = _run_worker(
        tmp_path, backend, "--no-reaper", job=["sh", "-c", f"echo $$ > {pidfile}; exec sleep 100"]
    )
    try:
        deadline = time.monotonic() + 15
        while not pidfile.exists() or not pidfile.read_text().strip():
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.02)
        job = int(pidfile.read_text())
        assert alive(job)
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    assert wait_gone([job], within=5) == []
