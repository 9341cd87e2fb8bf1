"""The bwrap arm on real bubblewrap: every axis reported ``kept`` is attacked here.

Jobs are small Python programs run by the base interpreter inside the sandbox; each prints
one JSON line describing what it managed to do, so assertions read behaviour, not stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from metnos_exec.sandbox._types import (
    Failure,
    Killed,
    MemoryExceeded,
    Mount,
    ResourceLimits,
    SandboxJob,
    SandboxOutcome,
    Success,
    Timeout,
)
from metnos_exec.sandbox.bwrap import (
    BwrapSandbox,
    BwrapSetupFailed,
    bwrap_probe,
    map_exit,
    parse_json_status,
)
from metnos_exec.sandbox.flags import guest_python
from tests.conftest import need, need_privileged
from tests.helpers.kernel import inotify_refused
from tests.process.test_process import _reset_peak_rss, _vm_kib

pytestmark = [pytest.mark.bwrap, pytest.mark.anyio]

MiB = 1 << 20
HAS_SHADOW = os.path.exists("/etc/shadow")
AS_ROOT = os.geteuid() == 0


def need_bwrap() -> None:
    need(
        shutil.which("bwrap") is not None and bwrap_probe().working,
        "bubblewrap missing or unable to create namespaces here",
    )


@pytest.fixture
def arm() -> BwrapSandbox:
    need_bwrap()
    return BwrapSandbox()


@pytest.fixture
def root_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A root worker's jobs run as root, as before slot uids (``METNOS_SLOT_UIDS=off``):
    for the tests of that mode."""
    from metnos_exec.identities import SLOT_UIDS_ENV

    monkeypatch.setenv(SLOT_UIDS_ENV, "off")


@pytest.fixture(params=["default", "slot uids off"])
def uid_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a root worker runs a job (as its slot's uid, as root); for an
    unprivileged worker the second is the first again, so it is skipped."""
    from metnos_exec.identities import SLOT_UIDS_ENV

    if request.param != "default":
        if not AS_ROOT:
            pytest.skip("only a root worker runs jobs as root")
        monkeypatch.setenv(SLOT_UIDS_ENV, "off")
    return str(request.param)


def ran_as_slot_uid(outcome: SandboxOutcome) -> bool:
    """A root worker's job ran as its slot's own uid (the report names it)."""
    return AS_ROOT and "host uid" in outcome.containment.user.reason


def py_job(tmp_path: Path, code: str, *, mounts: tuple[Mount, ...] = (), **kw: Any) -> SandboxJob:
    """A native Python job whose executor folder lives under the test's tmp dir (so under
    /tmp: it also proves the executor bind is not hidden by the private /tmp)."""
    exe = tmp_path / "executor"
    exe.mkdir(exist_ok=True)
    main = exe / f"main_{len(list(exe.iterdir()))}.py"
    main.write_text(textwrap.dedent(code))
    return SandboxJob(
        argv=(guest_python(), "-I", "-S", str(main)),
        mounts=(Mount(str(exe), str(exe)), *mounts),
        **kw,
    )


def report(outcome: SandboxOutcome) -> dict[str, Any]:
    assert outcome.exit == Success(), (outcome.exit, outcome.stderr[-2000:])
    result: dict[str, Any] = json.loads(outcome.stdout)
    return result


# --- acceptance 2: files ----------------------------------------------------------------


async def test_host_file_outside_mounts_is_not_visible(arm: BwrapSandbox, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    job = py_job(
        tmp_path,
        f"""
        import json
        try:
            open({str(secret)!r}).read(); print(json.dumps({{"read": True}}))
        except OSError as e:
            print(json.dumps({{"read": False, "errno": e.errno}}))
        """,
    )
    got = report(await arm.run(job))
    assert got == {"read": False, "errno": 2}  # ENOENT: not mounted at all
    # As root, root-only files in the system trees stay readable: see the root tests.
    assert arm.containment(job).files.state == ("partial" if AS_ROOT else "kept")


async def test_root_only_host_secrets_are_masked(arm: BwrapSandbox, tmp_path: Path) -> None:
    # The worker is root and the guest's uid maps to it: without the mask the read-only
    # /etc bind would hand out /etc/shadow.
    need(HAS_SHADOW, "/etc/shadow absent on this host")
    job = py_job(
        tmp_path,
        """
        import json
        try:
            data = open("/etc/shadow").read(); print(json.dumps({"read": len(data)}))
        except OSError as e:
            print(json.dumps({"read": None, "errno": e.errno}))
        """,
    )
    got = report(await arm.run(job))
    assert not got["read"], got


async def test_write_into_read_only_mount_fails(arm: BwrapSandbox, tmp_path: Path) -> None:
    data = tmp_path / "notes"
    data.mkdir()
    (data / "a.md").write_text("original")
    job = py_job(
        tmp_path,
        f"""
        import json, os
        out = {{}}
        for name, fn in [("overwrite", lambda: open({str(data / "a.md")!r}, "w").write("x")),
                         ("create", lambda: open({str(data / "b.md")!r}, "w").write("x")),
                         ("unlink", lambda: os.unlink({str(data / "a.md")!r}))]:
            try:
                fn(); out[name] = "ok"
            except OSError as e:
                out[name] = e.errno
        print(json.dumps(out))
        """,
        mounts=(Mount(str(data), str(data), writable=False),),
    )
    got = report(await arm.run(job))
    assert got == {"overwrite": 30, "create": 30, "unlink": 30}  # EROFS
    assert (data / "a.md").read_text() == "original"
    assert not (data / "b.md").exists()


async def test_writable_mount_is_writable(arm: BwrapSandbox, tmp_path: Path) -> None:
    # The control for the test above: the denial is the mount mode, not a broken job.
    data = tmp_path / "out"
    data.mkdir()
    job = py_job(
        tmp_path,
        f"""
        import json
        open({str(data / "new.md")!r}, "w").write("written inside")
        print(json.dumps({{"ok": True}}))
        """,
        mounts=(Mount(str(data), str(data), writable=True),),
    )
    assert report(await arm.run(job)) == {"ok": True}
    assert (data / "new.md").read_text() == "written inside"


async def test_executor_cannot_modify_itself(arm: BwrapSandbox, tmp_path: Path) -> None:
    job = py_job(
        tmp_path,
        """
        import json
        try:
            open(__file__, "a").write("# evil"); print(json.dumps({"errno": 0}))
        except OSError as e:
            print(json.dumps({"errno": e.errno}))
        """,
    )
    assert report(await arm.run(job)) == {"errno": 30}


# --- acceptance 2: network and sockets ----------------------------------------------------

_CONNECT_TCP = """
import json, socket
s = socket.socket()
s.settimeout(5)
try:
    s.connect(("127.0.0.1", {port})); print(json.dumps({{"connected": True}}))
except OSError as e:
    print(json.dumps({{"connected": False, "errno": e.errno}}))
"""


@pytest.fixture
def tcp_listener() -> Any:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    yield srv
    srv.close()


async def test_no_network_cannot_reach_host_listener(
    arm: BwrapSandbox, tmp_path: Path, tcp_listener: socket.socket
) -> None:
    port = tcp_listener.getsockname()[1]
    job = py_job(tmp_path, _CONNECT_TCP.format(port=port), network=False)
    got = report(await arm.run(job))
    assert got["connected"] is False, got
    assert arm.containment(job).network.state == "kept"


async def test_granted_network_reaches_host_listener(
    arm: BwrapSandbox, tmp_path: Path, tcp_listener: socket.socket
) -> None:
    port = tcp_listener.getsockname()[1]
    job = py_job(tmp_path, _CONNECT_TCP.format(port=port), network=True)
    outcome = await arm.run(job)
    assert report(outcome) == {"connected": True}
    assert outcome.containment.network.state == "not_kept"
    assert "granted" in outcome.containment.network.reason


_CONNECT_UNIX = """
import json, socket
try:
    s = socket.socket(socket.AF_UNIX)
    s.connect({addr!r}); print(json.dumps({{"connected": True}}))
except OSError as e:
    print(json.dumps({{"connected": False, "errno": e.errno}}))
"""


def mounts_only(arm: BwrapSandbox) -> BwrapSandbox:
    """The same arm without its seccomp filter: what the namespaces and mounts hold alone."""
    hard = msgspec.structs.replace(arm._hardening, seccomp_arch=None, seccomp="off for this test")
    return BwrapSandbox(hardening=hard)


async def test_host_unix_socket_not_reachable(arm: BwrapSandbox, tmp_path: Path) -> None:
    sockdir = tmp_path / "run"
    sockdir.mkdir()
    path = str(sockdir / "host.sock")
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(path)
        srv.listen(1)
        job = py_job(tmp_path, _CONNECT_UNIX.format(addr=path))
        got = report(await arm.run(job))
        walls = report(await mounts_only(arm).run(job))
    assert got == {"connected": False, "errno": 1}  # EPERM: the seccomp filter
    assert walls == {"connected": False, "errno": 2}  # ENOENT: the path is not there either


async def test_host_abstract_unix_socket_not_reachable(arm: BwrapSandbox, tmp_path: Path) -> None:
    # Abstract sockets have no path to hide; they belong to the network namespace.
    addr = f"\0metnos-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(addr)
        srv.listen(1)
        job = py_job(tmp_path, _CONNECT_UNIX.format(addr=addr))
        got = report(await arm.run(job))
        walls = report(await mounts_only(arm).run(job))
    assert got == {"connected": False, "errno": 1}
    assert walls["connected"] is False, walls  # --unshare-net alone holds it too


async def test_unix_socket_inside_a_mounted_folder_is_refused(
    arm: BwrapSandbox, tmp_path: Path
) -> None:
    """A filesystem socket travels with its folder: an fs:read or fs:write hint on a
    folder holding a socket would grant connecting to it, even without network (path
    sockets ignore network namespaces). The seccomp filter is the wall that closes it
    (the mounts alone do not: the control run)."""
    sockdir = tmp_path / "shared"
    sockdir.mkdir()
    path = str(sockdir / "host.sock")
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(path)
        srv.listen(2)
        job = py_job(
            tmp_path,
            _CONNECT_UNIX.format(addr=path),
            mounts=(Mount(str(sockdir), str(sockdir), writable=False),),
        )
        outcome = await arm.run(job)
        walls = report(await mounts_only(arm).run(job))
    assert report(outcome) == {"connected": False, "errno": 1}
    assert outcome.containment.network.state == "kept"
    assert walls == {"connected": True}


# --- acceptance 3: resources ----------------------------------------------------------------


async def test_fork_bomb_stops_at_pids_limit(arm: BwrapSandbox, tmp_path: Path) -> None:
    job = py_job(
        tmp_path,
        """
        import json, os, time
        ok = failed = 0
        for _ in range(200):
            try:
                pid = os.fork()
            except OSError:
                failed += 1
                continue
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            ok += 1
        print(json.dumps({"ok": ok, "failed": failed}))
        """,
        limits=ResourceLimits(pids=16),
    )
    outcome = await arm.run(job)
    got = report(outcome)
    # The guest itself is one of the 16; the children sleeping in the namespace die with
    # it when it exits (bubblewrap's init goes, the kernel kills the namespace).
    assert got["ok"] <= 15 and got["failed"] >= 185, got
    if os.geteuid() == 0:
        assert outcome.containment.resources.state == "kept", outcome.containment.resources


async def test_big_allocation_fails_under_memory_limit(arm: BwrapSandbox, tmp_path: Path) -> None:
    job = py_job(
        tmp_path,
        """
        import json
        try:
            b = bytearray(2 << 30); print(json.dumps({"allocated": True}))
        except MemoryError:
            print(json.dumps({"allocated": False}))
        """,
        limits=ResourceLimits(memory_bytes=256 * MiB),
    )
    assert report(await arm.run(job)) == {"allocated": False}


async def test_big_file_cut_off_python_gets_efbig(arm: BwrapSandbox, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    target = out / "big.bin"
    job = py_job(
        tmp_path,
        f"""
        import json
        try:
            with open({str(target)!r}, "wb") as f:
                for _ in range(100):
                    f.write(b"\\0" * {MiB})
            print(json.dumps({{"errno": 0}}))
        except OSError as e:
            print(json.dumps({{"errno": e.errno}}))
        """,
        mounts=(Mount(str(out), str(out), writable=True),),
        limits=ResourceLimits(file_size_bytes=2 * MiB),
    )
    # CPython ignores SIGXFSZ, so the kernel answers EFBIG (27).
    assert report(await arm.run(job)) == {"errno": 27}
    assert target.stat().st_size <= 2 * MiB


async def test_big_file_from_shell_is_killed_by_sigxfsz(arm: BwrapSandbox, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    target = out / "big.bin"
    job = SandboxJob(
        argv=("/bin/sh", "-c", f"head -c {100 * MiB} /dev/zero > {target}"),
        mounts=(Mount(str(out), str(out), writable=True),),
        limits=ResourceLimits(file_size_bytes=MiB),
    )
    outcome = await arm.run(job)
    assert outcome.exit == Killed(signal=signal.SIGXFSZ, limit="file_size"), outcome
    assert target.stat().st_size == MiB


async def test_cpu_limit_is_named_by_sigxcpu(arm: BwrapSandbox) -> None:
    job = SandboxJob(
        argv=("/bin/sh", "-c", "while :; do :; done"),
        limits=ResourceLimits(cpu_time_s=1, wall_time_s=20),
    )
    outcome = await arm.run(job)
    assert outcome.exit == Killed(signal=signal.SIGXCPU, limit="cpu_time"), outcome


# --- acceptance 4 and 7: lifecycle and output ------------------------------------------------


async def test_double_fork_setsid_dies_at_timeout(arm: BwrapSandbox, tmp_path: Path) -> None:
    # Inside bwrap pids are namespaced, so the grandchild is found from the host by a
    # unique token in its argv (/proc/PID/cmdline), not by a pid the job could report.
    token = f"metnos-dfs-{os.getpid()}-{time.monotonic_ns()}"
    job = py_job(
        tmp_path,
        f"""
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c",
                         "import time; time.sleep(120)", {token!r}])
            os._exit(0)
        time.sleep(120)
        """,
        limits=ResourceLimits(wall_time_s=1.5),
    )
    seen: list[int] = []
    outcome: SandboxOutcome | None = None

    async def run() -> None:
        nonlocal outcome
        outcome = await arm.run(job)

    t0 = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        while not seen and outcome is None:
            seen = _pids_with(token)
            await anyio.sleep(0.02)  # polling for the grandchild to appear
    elapsed = time.monotonic() - t0
    assert seen, "the setsid grandchild never showed up: the test would prove nothing"
    assert outcome is not None and outcome.exit == Timeout(), outcome
    assert elapsed < 1.5 + 2.0, elapsed
    # Gone when run() returns (not merely by the time the leak fixture gives up).
    for _ in range(50):  # polling with a 0.5 s deadline: the kernel reaps asynchronously
        left = _pids_with(token)
        if not left:
            break
        await anyio.sleep(0.01)
    assert left == [], f"setsid grandchild outlived run(): {left}"


async def test_stdout_flood_is_capped(arm: BwrapSandbox) -> None:
    # ru_maxrss is a lifetime high-water mark (an earlier test may have set it): reset the
    # peak (VmHWM) so the growth measured is this run's only.
    _reset_peak_rss()
    before = _vm_kib("VmRSS")
    job = SandboxJob(
        argv=("/bin/sh", "-c", f"head -c {100 * MiB} /dev/zero"),
        limits=ResourceLimits(output_bytes=MiB, wall_time_s=30),
    )
    outcome = await arm.run(job)
    assert outcome.exit == Success()
    assert outcome.stdout_truncated and len(outcome.stdout) == MiB
    grown_kib = _vm_kib("VmHWM") - before
    assert grown_kib < 50 * 1024, f"worker grew by {grown_kib / 1024:.1f} MiB"


# --- acceptance 9: process tree and user --------------------------------------------------


async def test_guest_sees_only_its_own_pid_namespace(arm: BwrapSandbox, tmp_path: Path) -> None:
    me = os.getpid()
    job = py_job(
        tmp_path,
        f"""
        import json, os, signal
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        try:
            os.kill({me}, signal.SIGKILL); killed = True
        except ProcessLookupError:
            killed = False
        print(json.dumps({{"pids": pids, "killed": killed, "me": os.getpid()}}))
        """,
    )
    got = report(await arm.run(job))
    assert got["killed"] is False
    assert max(got["pids"]) < 10 and me not in got["pids"], got
    assert got["me"] == 2  # bubblewrap's init is 1
    assert arm.containment(job).process_tree.state == "kept"


async def test_guest_is_unprivileged_without_nested_userns(
    arm: BwrapSandbox, tmp_path: Path
) -> None:
    job = py_job(
        tmp_path,
        """
        import ctypes, json, os, socket
        libc = ctypes.CDLL(None, use_errno=True)
        CLONE_NEWUSER = 0x10000000
        rc = libc.unshare(CLONE_NEWUSER)
        caps = [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")]
        print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "unshare": rc,
                          "caps": caps[0], "host": socket.gethostname(),
                          "env": sorted(os.environ)}))
        """,
        env={"METNOS_VISIBLE": "1"},
    )
    outcome = await arm.run(job)
    got = report(outcome)
    assert (got["uid"], got["gid"]) == (65534, 65534)
    assert got["unshare"] == -1  # --disable-userns
    assert int(got["caps"], 16) == 0
    assert got["host"] == "sandbox"
    # Only what the job was given (bubblewrap adds PWD; CPython's C-locale coercion adds
    # LC_CTYPE in its own process): nothing of the worker's environment.
    assert set(got["env"]) <= {"METNOS_VISIBLE", "PWD", "LC_CTYPE"}, got["env"]
    assert "METNOS_VISIBLE" in got["env"]
    # A root worker's job as root is host root for permissions: only partial.
    as_root = AS_ROOT and not ran_as_slot_uid(outcome)
    assert outcome.containment.user.state == ("partial" if as_root else "kept")


# --- exits, isolation between runs, set-up faults -----------------------------------------


async def test_exit_codes_and_signals_map(arm: BwrapSandbox, tmp_path: Path) -> None:
    fail = await arm.run(py_job(tmp_path, "import sys; sys.exit(3)"))
    assert fail.exit == Failure(code=3)
    killed = await arm.run(
        py_job(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    )
    assert killed.exit == Killed(signal=9, limit=None)
    assert fail.containment.sandbox == "bwrap"


async def test_two_runs_do_not_poison_each_other(arm: BwrapSandbox, tmp_path: Path) -> None:
    code = """
        import json, os
        seen = os.path.exists("/tmp/left-behind")
        open("/tmp/left-behind", "w").write("x")
        print(json.dumps({"seen": seen}))
        """
    first = report(await arm.run(py_job(tmp_path, code)))
    second = report(await arm.run(py_job(tmp_path, code)))
    assert first == second == {"seen": False}


async def test_setup_failure_is_a_host_fault_not_a_job_failure(arm: BwrapSandbox) -> None:
    job = SandboxJob(argv=("/bin/true",), cwd="/does/not/exist")
    with pytest.raises(BwrapSetupFailed):
        await arm.run(job)


def test_map_exit_without_guest_exit_raises_and_reads_128_plus_n() -> None:
    from metnos_exec.process import ProcessResult

    def res(rc: int, timed_out: bool = False) -> ProcessResult:
        return ProcessResult(
            returncode=rc, stdout=b"", stderr=b"bwrap: oops", stdout_truncated=False,
            stderr_truncated=False, timed_out=timed_out, wall_s=0.0, cpu_s=0.0,
            peak_rss_bytes=0, pids_limited=True,
        )  # fmt: skip

    job = SandboxJob(argv=("x",), limits=ResourceLimits(cpu_time_s=1))
    with pytest.raises(BwrapSetupFailed):
        map_exit(job, res(1), {"child-pid": 5})
    assert map_exit(job, res(152), {"exit-code": 152}) == Killed(24, "cpu_time")
    nolimit = SandboxJob(argv=("x",), limits=ResourceLimits(file_size_bytes=None))
    assert map_exit(nolimit, res(153), {"exit-code": 153}) == Killed(25, None)
    assert map_exit(job, res(-9), {"child-pid": 5}) == Killed(9, None)
    assert map_exit(job, res(-15, True), {}) == Timeout()
    assert map_exit(job, res(2), {"exit-code": 2}) == Failure(2)
    doc = parse_json_status(b'{ "child-pid": 7 }\n{ "exit-code": 0 }\n')
    assert doc == {"child-pid": 7, "exit-code": 0}


# --- acceptance 5 and 6: die-with-parent, and never too early ------------------------------

_WORKER = """
import anyio, sys
from metnos_exec.sandbox.bwrap import BwrapSandbox
from metnos_exec.sandbox._types import Mount, SandboxJob, ResourceLimits
marker, token, backend = sys.argv[1], sys.argv[2], sys.argv[3]
d = marker.rsplit("/", 1)[0]
job = SandboxJob(
    argv=("/bin/sh", "-c", f"touch {marker}; sleep 600; : {token}"),
    mounts=(Mount(d, d, writable=True),),
    limits=ResourceLimits(wall_time_s=600),
)
anyio.run(BwrapSandbox().run, job, backend=backend)
"""


def _pids_with(token: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sigkill_of_worker_leaves_no_sandboxed_process(tmp_path: Path, backend: str) -> None:
    need_bwrap()
    marker = tmp_path / "started"
    token = f"metnos-dwp-{os.getpid()}-{time.monotonic_ns()}"
    worker = subprocess.Popen([sys.executable, "-c", _WORKER, str(marker), token, backend])
    try:
        deadline = time.monotonic() + 20
        while not marker.exists():  # polling with a deadline for the job to start
            assert worker.poll() is None, "worker died before the job started"
            assert time.monotonic() < deadline, "job never started"
            time.sleep(0.02)
        assert _pids_with(token), "the sandboxed job is not running"
    finally:
        worker.kill()
        worker.wait()
    deadline = time.monotonic() + 5
    while _pids_with(token) and time.monotonic() < deadline:
        time.sleep(0.02)  # SIGKILL delivery and reaping take a moment
    assert _pids_with(token) == []


_LONG_JOB = """
import sys, anyio
from metnos_exec.sandbox.bwrap import BwrapSandbox
from metnos_exec.sandbox._types import ResourceLimits, SandboxJob
job = SandboxJob(
    argv=("/bin/sh", "-c", f"sleep {sys.argv[2]}; echo done"),
    limits=ResourceLimits(wall_time_s=120),
)
outcome = anyio.run(BwrapSandbox().run, job, backend=sys.argv[1])
print(repr(outcome.exit), outcome.stdout.decode().strip(), outcome.usage.wall_s)
"""


@pytest.mark.slow
def test_30_s_job_completes_on_both_backends() -> None:
    # Acceptance 6: die-with-parent must never fire while the worker lives. trio spawns
    # from worker threads whose idle cache expires after 10 s, and PR_SET_PDEATHSIG follows
    # the spawning *thread*: a job outliving that thread would be SIGKILLed. One worker
    # process per backend, run side by side (about 31 s of wall time for both).
    need_bwrap()
    seconds = 30
    t0 = time.monotonic()
    workers = {
        backend: subprocess.Popen(
            [sys.executable, "-c", _LONG_JOB, backend, str(seconds)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for backend in ("asyncio", "trio")
    }
    outputs: dict[str, tuple[int, str, str]] = {}
    try:
        for backend, proc in workers.items():
            raw_out, raw_err = proc.communicate(timeout=seconds + 30)
            outputs[backend] = (proc.returncode, raw_out.decode(), raw_err.decode()[-2000:])
    finally:
        for proc in workers.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    elapsed = time.monotonic() - t0
    for backend, (rc, out, err) in outputs.items():
        assert rc == 0, (backend, err)
        exit_repr, said, wall = out.split()
        assert (exit_repr, said) == ("Success()", "done"), (backend, out, err)
        assert float(wall) >= seconds, (backend, wall)
    assert elapsed >= seconds


# --- the report follows what happened -------------------------------------------------


async def test_resources_partial_when_pids_not_enforced(
    arm: BwrapSandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As root without a pids cgroup, RLIMIT_NPROC is void: the process layer says so with
    # pids_limited=False, and the report must not claim the wall.
    import msgspec

    from metnos_exec.process import run_process as real
    from metnos_exec.sandbox import bwrap as bwrap_mod

    assert bwrap_mod.run_process is real  # type: ignore[attr-defined]  # what we replace

    async def no_cgroup(spec: Any, **kw: Any) -> Any:
        return msgspec.structs.replace(await real(spec, **kw), pids_limited=False)

    monkeypatch.setattr(bwrap_mod, "run_process", no_cgroup)
    outcome = await arm.run(py_job(tmp_path, "print('{}')"))
    assert outcome.containment.resources.state == "partial"
    # The reason fits the job's uid: RLIMIT_NPROC is void for root, per user otherwise
    # (a slot's own uid for a root worker's job).
    reason = outcome.containment.resources.reason
    if ran_as_slot_uid(outcome):
        assert "slot's own uid" in reason, reason
    elif AS_ROOT:
        assert "no process limit" in reason and "does not bind root" in reason, reason
    else:
        assert "counted per user, not per job" in reason and "root" not in reason, reason


async def test_resources_partial_without_limits(arm: BwrapSandbox, tmp_path: Path) -> None:
    job = py_job(tmp_path, "print('{}')", limits=ResourceLimits(memory_bytes=None))
    outcome = await arm.run(job)
    assert outcome.exit == Success()
    assert outcome.containment.resources.state == "partial"
    assert "no memory limit" in outcome.containment.resources.reason


async def test_mount_over_proc_is_denied_before_launch(arm: BwrapSandbox, tmp_path: Path) -> None:
    from metnos_exec.errors import SandboxDenied

    marker = tmp_path / "ran"
    job = SandboxJob(
        argv=("/bin/sh", "-c", f"touch {marker}"),
        mounts=(Mount("/proc", "/proc"), Mount(str(tmp_path), str(tmp_path), writable=True)),
    )
    with pytest.raises(SandboxDenied):
        await arm.run(job)
    assert not marker.exists()


def test_containment_before_run_is_honest_about_unknowns() -> None:
    need_bwrap()
    report_ = BwrapSandbox().containment(SandboxJob(argv=("x",), network=True))
    assert report_.sandbox == "bwrap"
    assert report_.files.state == ("partial" if AS_ROOT else "kept")
    assert report_.process_tree.state == "kept"
    assert report_.network.state == "not_kept"
    # Whether the pids cgroup holds is only known once run_process has tried.
    assert report_.resources.state == "partial"


def test_user_axis_partial_without_disable_userns(monkeypatch: pytest.MonkeyPatch) -> None:
    from metnos_exec.sandbox import _bwrap_report as bwrap_mod
    from metnos_exec.sandbox.flags import BwrapFeatures

    monkeypatch.setattr(bwrap_mod, "worker_is_root", lambda: False)
    old = BwrapSandbox("/usr/bin/bwrap", features=BwrapFeatures(version=(0, 7, 0)))
    assert old.containment(SandboxJob(argv=("x",))).user.state == "partial"
    new = BwrapSandbox("/usr/bin/bwrap", features=BwrapFeatures(version=(0, 8, 0)))
    assert new.containment(SandboxJob(argv=("x",))).user.state == "kept"


# --- the job's memory is bounded as a whole (memory cgroup), not per process -------------


# Each child fills 200 MiB (well under its own 256 MiB RLIMIT_AS) and holds it a moment,
# so that together they would reach 800 MiB: only a per-job limit stops that.
def children_filling(n: int, mib: int, hold_s: float) -> str:
    """A script whose `n` children each fill `mib` MiB, hold it `hold_s` s and exit; it
    prints their exit codes as JSON."""
    return (
        FILL_TEMPLATE.replace("N_KIDS", str(n))
        .replace("MIB", str(mib))
        .replace("HOLD_S", str(hold_s))
    )


FILL_TEMPLATE = """
import json, os, time
kids = []
for _ in range(N_KIDS):
    pid = os.fork()
    if pid == 0:
        block = b"\\x01" * (MIB << 20)
        time.sleep(HOLD_S)
        os._exit(0)
    kids.append(pid)
codes = [os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) for k in kids]
print(json.dumps({"codes": codes}))
"""
FOUR_CHILDREN = children_filling(4, 200, 2)


def need_memcg() -> None:
    from metnos_exec.process import memory_cgroup_available

    need_privileged(memory_cgroup_available(), "no writable cgroup v1 memory hierarchy")


async def test_a_tree_cannot_exceed_the_jobs_memory_limit(
    arm: BwrapSandbox, tmp_path: Path
) -> None:
    need_memcg()
    limit = 256 * MiB
    outcome = await arm.run(
        py_job(tmp_path, FOUR_CHILDREN, limits=ResourceLimits(memory_bytes=limit, pids=16))
    )
    # The kernel OOM-killed part of the tree at the job's limit and said so.
    assert outcome.exit == MemoryExceeded(), (outcome.exit, outcome.stdout, outcome.stderr)
    peak = outcome.usage.peak_memory_bytes
    assert peak is not None and 200 * MiB < peak <= limit + MiB, peak
    assert outcome.containment.resources.state == "kept", outcome.containment.resources


async def test_the_private_tmp_counts_in_the_jobs_memory(arm: BwrapSandbox, tmp_path: Path) -> None:
    need_memcg()
    limit = 256 * MiB
    # Files may be as big as /tmp: the file size limit must not be what stops the job.
    big_files = ResourceLimits(memory_bytes=limit, file_size_bytes=512 * MiB)
    fill = """
        import json, os
        written, error = 0, None
        try:
            with open("/tmp/fill", "wb") as f:
                for _ in range(400):
                    f.write(b"\\x01" * (1 << 20)); f.flush(); written += 1
        except OSError as e:
            error = e.errno
        print(json.dumps({"written_mib": written, "errno": error}))
        """
    outcome = await arm.run(py_job(tmp_path, fill, limits=big_files))
    if outcome.exit != MemoryExceeded():
        got = report(outcome)
        assert got["errno"] is not None and got["written_mib"] < 256, got
    # /tmp pages plus a heap, each under its own bound (tmpfs size, RLIMIT_AS), together
    # past the job's: without a memory cgroup this job would hold ~400 MiB and succeed.
    both = """
        import json
        with open("/tmp/fill", "wb") as f:
            for _ in range(200):
                f.write(b"\\x01" * (1 << 20))
        heap = b"\\x01" * (200 << 20)
        print(json.dumps({"held_mib": 400}))
        """
    outcome = await arm.run(py_job(tmp_path, both, limits=big_files))
    assert outcome.exit == MemoryExceeded(), (outcome.exit, outcome.stdout, outcome.stderr)
    peak = outcome.usage.peak_memory_bytes
    assert peak is not None and peak <= limit + MiB, peak


TWO_CHILDREN_60_MIB = children_filling(2, 60, 0.5)


async def test_a_job_within_its_limit_succeeds_after_an_oom_and_peak_is_the_trees(
    arm: BwrapSandbox, tmp_path: Path
) -> None:
    need_memcg()
    limits = ResourceLimits(memory_bytes=256 * MiB, pids=16)
    first = await arm.run(py_job(tmp_path, FOUR_CHILDREN, limits=limits))
    assert first.exit == MemoryExceeded()
    # The same slot is lent again (sequential runs): its limit and counters start afresh.
    outcome = await arm.run(py_job(tmp_path, TWO_CHILDREN_60_MIB, limits=limits))
    assert report(outcome) == {"codes": [0, 0]}
    peak = outcome.usage.peak_memory_bytes
    # Both children at once: more than either process alone could show.
    assert peak is not None and 120 * MiB <= peak <= 256 * MiB, peak
    assert outcome.containment.resources.state == "kept"


async def test_resources_partial_when_no_memory_cgroup_holds_the_job(
    arm: BwrapSandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from metnos_exec import process
    from metnos_exec.sandbox.bwrap import MEMORY_PER_PROCESS_REASON

    monkeypatch.setattr(process.cgroups, "memory_cgroup_available", lambda: False)
    # bubblewrap's monitor execs out of this process's memory, so its own ru_maxrss reads
    # this process's high-water mark: make that large. The peak must come from the guest
    # tree (the rusage of bubblewrap's init), not from us.
    ballast = bytearray(300 * MiB)
    ballast[::4096] = b"\x01" * len(ballast[::4096])
    del ballast
    outcome = await arm.run(
        py_job(tmp_path, TWO_CHILDREN_60_MIB, limits=ResourceLimits(memory_bytes=256 * MiB))
    )
    assert report(outcome) == {"codes": [0, 0]}
    assert outcome.containment.resources.state == "partial"
    assert MEMORY_PER_PROCESS_REASON in outcome.containment.resources.reason
    # Without the cgroup the peak is one process's (a lower bound for the tree).
    peak = outcome.usage.peak_memory_bytes
    assert peak is not None and peak < 120 * MiB
    assert peak >= 60 * MiB  # a child's fill: the guest's, really measured


INOTIFY_HOLDER = """
import ctypes, errno, json
libc = ctypes.CDLL(None, use_errno=True)
held, why = 0, None
while held < 1 << 20:
    if libc.inotify_init1(0) < 0:
        why = errno.errorcode.get(ctypes.get_errno())
        break
    held += 1
# Holding them all: open the gate for reading (the test sees a reader), wait for its close.
with open(GATE) as gate:
    gate.read()
print(json.dumps({"held": held, "error": why}))
"""


async def test_per_user_kernel_quotas_are_shared_with_the_worker_unless_a_slot_uid(
    arm: BwrapSandbox, tmp_path: Path
) -> None:
    # The kernel counts inotify instances per host uid, across user namespaces. An
    # unprivileged worker's job is the worker's uid: while it holds them all, the worker
    # (this process) and its other jobs get none, and the report must say so. A root
    # worker's job as its slot's uid spends the slot's own.
    import errno

    from metnos_exec.process import memory_cgroup_available
    from metnos_exec.sandbox.bwrap import (
        ROOT_QUOTAS_REASON,
        SLOT_QUOTAS_NOTE,
        UNPRIVILEGED_QUOTAS_REASON,
    )

    if AS_ROOT:
        need_slot_uids()
    with open("/proc/sys/fs/inotify/max_user_instances") as f:  # noqa: ASYNC230
        limit = int(f.read())
    gate_dir = tmp_path / "gate"
    gate_dir.mkdir()
    gate = gate_dir / "held"
    os.mkfifo(gate, 0o644)
    job = py_job(
        tmp_path,
        f"GATE = {str(gate)!r}\n" + INOTIFY_HOLDER,
        mounts=(Mount(str(gate_dir), str(gate_dir)),),
        limits=ResourceLimits(open_files=limit + 64),
    )
    outcomes: list[SandboxOutcome] = []
    refused: list[int] = []

    async def run() -> None:
        outcomes.append(await arm.run(job))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        deadline = time.monotonic() + 20
        while True:  # polling with a deadline: a reader appears once the job holds them
            try:
                writer = os.open(gate, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                break
            except OSError as exc:
                if exc.errno != errno.ENXIO or time.monotonic() > deadline or outcomes:
                    raise
            await anyio.sleep(0.01)
        try:
            refused.append(inotify_refused())
        finally:
            os.close(writer)
    outcome = outcomes[0]
    got = report(outcome)
    assert got["error"] == "EMFILE" and 0 < got["held"] <= limit, got
    resources = outcome.containment.resources
    if not AS_ROOT:
        assert refused == [errno.EMFILE], refused  # the worker's own quota, used up
        assert resources.state == "partial", resources
        assert UNPRIVILEGED_QUOTAS_REASON in resources.reason, resources
        return
    assert ran_as_slot_uid(outcome)
    assert refused == [0], refused  # root kept its own
    assert ROOT_QUOTAS_REASON not in resources.reason
    assert UNPRIVILEGED_QUOTAS_REASON not in resources.reason
    if memory_cgroup_available():
        assert resources.state == "kept" and SLOT_QUOTAS_NOTE in resources.reason, resources


async def test_cpu_time_is_the_guests_own(arm: BwrapSandbox, tmp_path: Path) -> None:
    """bubblewrap's monitor reaps nothing of the guest; its CPU time is taken from the init
    that reaped it (pytest is a subreaper, like the worker process)."""
    code = "import time\nx = 0\nfor i in range(3 * 10**6):\n    x += i\n"
    code += "print(time.process_time())\n"
    outcome = await arm.run(py_job(tmp_path, code))
    assert outcome.exit == Success(), outcome
    guest = float(outcome.stdout)
    assert outcome.usage.cpu_s is not None and outcome.usage.cpu_s >= guest > 0.05


async def test_usage_not_measured_is_not_guessed(
    arm: BwrapSandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When bubblewrap's init is not ours to reap (a worker that is no subreaper), the
    guest's CPU time and, without a memory cgroup, its peak are unknown: ``None``."""
    from metnos_exec import process
    from metnos_exec.sandbox import bwrap as bwrap_mod

    async def not_ours(pid: int, timeout: float) -> None:  # noqa: ASYNC109
        return None

    monkeypatch.setattr(bwrap_mod, "reap_orphan", not_ours)
    monkeypatch.setattr(process.cgroups, "memory_cgroup_available", lambda: False)
    outcome = await arm.run(SandboxJob(argv=("/bin/true",)))
    assert outcome.exit == Success()
    assert outcome.usage.cpu_s is None and outcome.usage.peak_memory_bytes is None
    process.reap_orphans()  # the init we did not reap (pytest is a subreaper)


# --- a root worker: the guest is host root for file permissions ---------------------------


def _root_only_file(parent: str) -> Any:
    """A world-traversable folder under `parent` holding a root-owned 0600 file, like
    /etc/wireguard/wg0.conf on a real host; removed afterwards."""
    need_privileged(AS_ROOT, "creating a root-owned file")
    need(os.path.isdir(parent), f"{parent} absent on this host")
    base = Path(tempfile.mkdtemp(prefix="metnos-rootonly-", dir=parent))
    try:
        base.chmod(0o755)
        secret = base / "key"
        secret.write_text("root secret")
        secret.chmod(0o600)
        yield secret
    finally:
        shutil.rmtree(base)


@pytest.fixture
def root_only_file() -> Any:
    """In /tmp: a folder an unprivileged worker can mount too."""
    yield from _root_only_file("/tmp")


def secret_job(secret: Path) -> SandboxJob:
    # cat(1) from /usr, not Python: an unprivileged worker may not reach the interpreter's
    # prefix (here under /root), and the claim is about file permissions only.
    return SandboxJob(
        argv=("/bin/cat", "--", str(secret)),
        mounts=(Mount(str(secret.parent), str(secret.parent)),),
        env={"LC_ALL": "C"},
    )


async def test_a_root_workers_job_as_root_reads_root_only_files_and_says_partial(
    arm: BwrapSandbox, root_only_file: Path, root_jobs: None
) -> None:
    from metnos_exec.sandbox.bwrap import ROOT_WORKER_REASON

    outcome = await arm.run(secret_job(root_only_file))
    # Mounted read-only, mode 0600, owner root: the guest (uid 65534 → host uid 0) reads it.
    assert outcome.exit == Success() and outcome.stdout == b"root secret", outcome
    assert outcome.containment.files.state == outcome.containment.user.state == "partial"
    assert outcome.containment.files.reason.startswith(ROOT_WORKER_REASON)
    assert outcome.containment.user.reason.startswith(ROOT_WORKER_REASON)
    assert "METNOS_SLOT_UIDS=off" in outcome.containment.files.reason


@pytest.fixture
def system_secret() -> Any:
    """In a *system* tree (``/opt``, mounted read-only for every job, with no idmap):
    what a root worker's job could read as root."""
    yield from _root_only_file("/opt")


def need_slot_uids() -> None:
    from metnos_exec import process
    from metnos_exec.identities import slot_uids_unavailable

    need_privileged(AS_ROOT, "slot uids are a root worker's")
    need_privileged(
        slot_uids_unavailable() is None, f"slot uids unavailable: {slot_uids_unavailable()}"
    )
    parent = process._cgroup_parent()
    need_privileged(
        parent is not None and (parent / "tasks").exists(), "no cgroup v1 job slots here"
    )


@pytest.mark.parametrize("mode", ["as root", "as a slot uid"])
async def test_a_root_workers_job_as_a_slot_uid_cannot_read_root_only_system_files(
    arm: BwrapSandbox, system_secret: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    # Issue 8, defect 1: as host root for permissions, the guest read any root-only file
    # of the read-only system trees (and wrote root-owned kernel files). As its slot's
    # own uid it is any local user there.
    need_slot_uids()
    if mode == "as root":
        from metnos_exec.identities import SLOT_UIDS_ENV

        monkeypatch.setenv(SLOT_UIDS_ENV, "off")
    outcome = await arm.run(SandboxJob(argv=("/bin/cat", str(system_secret)), env={"LC_ALL": "C"}))
    files, user = outcome.containment.files, outcome.containment.user
    if mode == "as root":
        assert outcome.stdout == b"root secret", outcome  # why it says partial
        assert files.state == user.state == "partial"
        return
    assert outcome.exit == Failure(code=1) and outcome.stdout == b"", outcome
    assert b"Permission denied" in outcome.stderr
    assert files.state == user.state == "kept", (files, user)
    assert ran_as_slot_uid(outcome)


async def test_a_slot_uid_keeps_owner_rights_on_its_own_folders_only(
    arm: BwrapSandbox, root_only_file: Path, tmp_path: Path
) -> None:
    # The job's folders are root's (the root worker's user): through an idmapped mount
    # the slot's uid is their owner, as the job was before, so a 0600 file of its mounted
    # folder is readable and what it writes is root's on disk.
    need_slot_uids()
    out = tmp_path / "out"
    out.mkdir()
    job = SandboxJob(
        argv=("/bin/sh", "-c", f"cat {root_only_file} && echo made > {out}/new"),
        mounts=(
            Mount(str(root_only_file.parent), str(root_only_file.parent)),
            Mount(str(out), str(out), writable=True),
        ),
    )
    outcome = await arm.run(job)
    assert outcome.exit == Success() and outcome.stdout == b"root secret", outcome
    assert ran_as_slot_uid(outcome)
    made = out / "new"
    assert made.read_text() == "made\n" and (made.stat().st_uid, made.stat().st_gid) == (0, 0)


SLEEPER = "import sys, time; print(sys.argv[1], flush=True); time.sleep(30)"


def _uids_of(token: str) -> dict[int, tuple[int, ...]]:
    """pid → host uids (real, effective, saved, fs) of the processes whose argv holds
    `token`."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if token.encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/status") as f:
                uid = next(line for line in f if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        found[int(entry)] = tuple(int(x) for x in uid.split()[1:])
    return found


async def test_each_slot_runs_its_jobs_as_its_own_unprivileged_host_uid(
    arm: BwrapSandbox, tmp_path: Path
) -> None:
    # Seen from the host, not from inside: two jobs at once, two slots, two uids, none 0.
    need_slot_uids()
    tokens = [f"metnos-slot-probe-{os.getpid()}-{i}" for i in range(2)]
    seen: dict[str, dict[int, tuple[int, ...]]] = {}
    outcomes: list[SandboxOutcome] = []

    async def one(token: str) -> None:
        job = py_job(tmp_path, SLEEPER, limits=ResourceLimits(wall_time_s=30))
        job = msgspec.structs.replace(job, argv=(*job.argv, token))
        outcomes.append(await arm.run(job))

    async with anyio.create_task_group() as tg:
        for token in tokens:
            tg.start_soon(one, token)
        deadline = time.monotonic() + 20
        # Polling with a deadline: the guests take a moment to start.
        while time.monotonic() < deadline and not all(seen.get(t) for t in tokens):
            for token in tokens:
                seen[token] = _uids_of(token)
            await anyio.sleep(0.05)
        for pids in seen.values():  # end the sleepers (whatever the assertions say)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    assert all(seen.get(t) for t in tokens), seen
    uids = {t: {u for ids in seen[t].values() for u in ids} for t in tokens}
    assert all(len(u) == 1 and 0 not in u for u in uids.values()), uids
    assert uids[tokens[0]] != uids[tokens[1]], uids  # one uid per slot
    assert all(ran_as_slot_uid(o) for o in outcomes)


async def test_a_folder_that_cannot_be_idmapped_runs_the_job_as_root_and_says_why(
    arm: BwrapSandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    need_slot_uids()
    from metnos_exec.sandbox import _bwrap_place as bwrap_mod

    def refuse(*_: Any, **__: Any) -> Any:
        raise OSError(95, "idmapped mount: Operation not supported")

    monkeypatch.setattr(bwrap_mod, "StagedSources", refuse)
    outcome = await arm.run(py_job(tmp_path, "print('{}')"))
    assert outcome.exit == Success(), outcome  # the job still runs...
    files = outcome.containment.files  # ... and the report says as whom
    assert files.state == "partial" and "cannot mount as the slot uid" in files.reason


UNPRIVILEGED_WORKER = """
import anyio, json, sys
import msgspec
from metnos_exec.sandbox.bwrap import BwrapSandbox
from metnos_exec.sandbox._types import Mount, SandboxJob
job = msgspec.json.decode(sys.argv[1].encode(), type=SandboxJob)
out = anyio.run(BwrapSandbox().run, job)
print(json.dumps({"exit": msgspec.to_builtins(out.exit), "stdout": out.stdout.decode(),
                  "stderr": out.stderr.decode()[-500:],
                  "files": out.containment.files.state, "user": out.containment.user.state}))
"""


def test_unprivileged_worker_cannot_read_root_only_files_and_keeps_the_axes(
    root_only_file: Path,
) -> None:
    import msgspec

    need_bwrap()
    setpriv = shutil.which("setpriv")
    need(setpriv is not None, "setpriv (util-linux) not installed")
    assert setpriv is not None
    job = secret_job(root_only_file)
    run = subprocess.run(
        [
            setpriv,
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--",
            sys.executable,
            "-c",
            UNPRIVILEGED_WORKER,
            msgspec.json.encode(job).decode(),
        ],
        capture_output=True,
        timeout=60,
        check=False,
        env={"PATH": "/usr/bin:/bin"},
        cwd="/",
    )
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    got = json.loads(run.stdout)
    assert got["exit"] == {"type": "failure", "code": 1}, got
    assert got["stdout"] == "" and "Permission denied" in got["stderr"], got
    assert (got["files"], got["user"]) == ("kept", "kept"), got


def test_private_files_finds_what_only_owner_or_group_may_read(tmp_path: Path) -> None:
    from metnos_exec.sandbox.flags import private_files

    (tmp_path / "public.conf").write_text("x")
    (tmp_path / "key").write_text("x")
    (tmp_path / "key").chmod(0o600)
    (tmp_path / "group-only").write_text("x")
    (tmp_path / "group-only").chmod(0o640)
    closed = tmp_path / "wireguard"
    closed.mkdir()
    (closed / "wg0.conf").write_text("x")
    closed.chmod(0o700)
    masked = tmp_path / "ssh"
    masked.mkdir()
    (masked / "host_key").write_text("x")
    (masked / "host_key").chmod(0o600)
    (tmp_path / "link").symlink_to(tmp_path / "key")
    found = private_files(str(tmp_path), skip=(str(masked),))
    assert sorted(found) == sorted(str(tmp_path / n) for n in ("key", "group-only", "wireguard"))


CACERTS = "/etc/default/cacerts"  # 0600 root on this host; not in MASKED_PATHS
CACERTS_PRIVATE = os.path.isfile(CACERTS) and not os.stat(CACERTS).st_mode & 0o004


@pytest.mark.parametrize("mode", ["as root", "as a slot uid"])
async def test_root_worker_hides_private_files_of_etc(
    arm: BwrapSandbox, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    target = CACERTS
    need_privileged(AS_ROOT, "only a root worker's jobs could read them")
    need(CACERTS_PRIVATE, f"{target} absent or world-readable here")
    if mode == "as root":
        from metnos_exec.identities import SLOT_UIDS_ENV

        monkeypatch.setenv(SLOT_UIDS_ENV, "off")
    outcome = await arm.run(SandboxJob(argv=("/bin/cat", target)))
    # As root: masked with the host's /dev/null, bound on a nodev mount: opening it fails
    # (EACCES). As a slot uid: a 0600 root file is simply not its to read. Either way,
    # nothing of what it holds reaches the guest.
    assert outcome.exit in (Success(), Failure(code=1)) and outcome.stdout == b"", outcome
    if mode == "as root":
        assert outcome.containment.files.state == "partial"  # files created later...
    else:
        need_privileged(ran_as_slot_uid(outcome), "no slot uid here (no cgroup v1 job slots)")
        assert outcome.containment.files.state == "kept"


# --- rlimits applied while bubblewrap waits on --block-fd --------------------------------


async def test_limits_hold_from_the_guests_first_instruction(
    arm: BwrapSandbox, monkeypatch: pytest.MonkeyPatch, uid_mode: str
) -> None:
    """The guest is ``cat /proc/self/limits`` itself (no shell, no prlimit exec before it):
    what it prints is what held when its first instruction ran."""
    import metnos_exec.sandbox.bwrap as bwrap_mod

    specs: list[Any] = []
    real = bwrap_mod.run_process

    async def spy(spec: Any, **kw: Any) -> Any:
        specs.append(spec)
        return await real(spec, **kw)

    monkeypatch.setattr(bwrap_mod, "run_process", spy)
    job = SandboxJob(
        argv=("/bin/cat", "/proc/self/limits"),
        limits=ResourceLimits(cpu_time_s=7, file_size_bytes=3 * MiB, memory_bytes=512 * MiB),
    )
    outcome = await arm.run(job)
    assert outcome.exit == Success(), outcome
    (spec,) = specs
    assert spec.on_spawn is not None and "--block-fd" in spec.argv
    assert spec.argv[-2:] == job.argv and spec.rlimits == ()  # no prefix, no preexec_fn
    rows = {
        line[:26].strip(): line[26:].split()[:2]
        for line in outcome.stdout.decode().splitlines()[1:]
    }
    # Soft 7 s (SIGXCPU, named cpu_time), hard one later (SIGKILL) as `derive_rlimits` says.
    assert rows["Max cpu time"] == ["7", "8"]
    assert rows["Max file size"] == [str(3 * MiB)] * 2
    assert rows["Max address space"] == [str(512 * MiB)] * 2


async def test_gate_failure_kills_the_blocked_sandbox_before_the_guest_runs(
    arm: BwrapSandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uid_mode: str
) -> None:
    import resource

    from metnos_exec.errors import HostFault

    out = tmp_path / "out"
    out.mkdir()
    real = resource.prlimit

    def refuse(pid: int, res: int, limits: Any = None) -> Any:
        if limits is not None:
            raise PermissionError(1, "refused by the test")
        return real(pid, res)

    monkeypatch.setattr(resource, "prlimit", refuse)
    job = SandboxJob(
        argv=("/bin/sh", "-c", f"echo ran > {out}/marker"),
        mounts=(Mount(str(out), str(out), writable=True),),
        limits=ResourceLimits(cpu_time_s=5),
    )
    with pytest.raises(HostFault, match="rlimits"):
        await arm.run(job)
    assert not (out / "marker").exists()


def _gated(argv: tuple[str, ...], wait_s: float) -> tuple[Any, Any, list[int]]:
    """A `_LimitGate` on a stand-in for bubblewrap (`argv`), which holds the status pipe's
    write end and never writes to it; the spec that runs it; and the pids it saw."""
    import resource

    import metnos_exec.sandbox.bwrap as bwrap_mod
    from metnos_exec.process import ProcessSpec

    status_r, status_w = os.pipe2(os.O_CLOEXEC)
    gate = bwrap_mod._LimitGate(((resource.RLIMIT_CPU, 5, 6),), status_r, status_w, wait_s=wait_s)
    seen: list[int] = []

    async def spy(pid: int, members: Any) -> None:
        seen.append(pid)
        await gate(pid, members)

    spec = ProcessSpec(
        argv=argv, env={}, reaper=False, pdeathsig=False, pass_fds=(status_w,), on_spawn=spy
    )

    class Closer:
        def close(self) -> None:
            gate.close()  # block pipe and, if still ours, the status write end
            os.close(status_r)

    return Closer(), spec, seen


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_a_run_cancelled_while_the_gate_waits_kills_and_reaps_the_child() -> None:
    from metnos_exec.process import run_process

    gate, spec, seen = _gated(("/bin/sleep", "30"), wait_s=30)
    try:
        t0 = time.monotonic()
        with anyio.move_on_after(0.3):
            await run_process(spec, timeout=30)
        assert time.monotonic() - t0 < 2.0
    finally:
        gate.close()
    (pid,) = seen
    assert _gone(pid)  # killed *and* reaped: not even a zombie is left


async def test_a_gate_that_never_sees_child_pid_is_a_host_fault_and_kills_the_child() -> None:
    from metnos_exec.errors import HostFault
    from metnos_exec.process import run_process

    gate, spec, seen = _gated(("/bin/sleep", "30"), wait_s=0.2)
    try:
        with pytest.raises(HostFault, match="block fd in time"):
            await run_process(spec, timeout=30)
    finally:
        gate.close()
    assert _gone(seen[0])


async def test_bubblewrap_exiting_during_set_up_releases_the_gate() -> None:
    """End of file on the status pipe (every write end closed: ours by the gate, the
    child's by its exit) means bubblewrap gave up before ``child-pid``: the gate steps
    aside and the run reports the exit as it is."""
    from metnos_exec.process import run_process

    gate, spec, _ = _gated(("/bin/sh", "-c", "exit 3"), wait_s=30)
    try:
        result = await run_process(spec, timeout=30)
    finally:
        gate.close()
    assert result.returncode == 3


def test_gate_needs_cap_sys_resource_to_raise_a_hard_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import resource

    import metnos_exec.sandbox._bwrap_limits as bwrap_mod

    monkeypatch.setattr(bwrap_mod, "_have_cap_sys_resource", lambda: False)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert bwrap_mod._can_gate(((resource.RLIMIT_NOFILE, soft, hard),))
    assert not bwrap_mod._can_gate(((resource.RLIMIT_NOFILE, hard + 1, hard + 1),))
    assert not bwrap_mod._can_gate(())
    monkeypatch.setattr(bwrap_mod, "_have_cap_sys_resource", lambda: True)
    assert bwrap_mod._can_gate(((resource.RLIMIT_NOFILE, hard + 1, hard + 1),))


@pytest.mark.parametrize("cgroup", ["per_run", "none"])
async def test_limits_hold_without_a_slot(
    arm: BwrapSandbox, monkeypatch: pytest.MonkeyPatch, cgroup: str
) -> None:
    """No pooled slot: the gate runs off the shared spawner, and finds bubblewrap's tree
    from a per-run cgroup, or by scanning /proc when there is no cgroup at all."""
    from metnos_exec import process

    async def no_slot() -> None:
        return None

    monkeypatch.setattr(process._slots, "acquire", no_slot)
    if cgroup == "none":
        monkeypatch.setattr(process._Cgroup, "create", classmethod(lambda cls, n: None))
    job = SandboxJob(
        argv=("/bin/cat", "/proc/self/limits"),
        limits=ResourceLimits(cpu_time_s=9, file_size_bytes=5 * MiB),
    )
    outcome = await arm.run(job)
    assert outcome.exit == Success(), outcome
    rows = {
        line[:26].strip(): line[26:].split()[:2]
        for line in outcome.stdout.decode().splitlines()[1:]
    }
    assert rows["Max cpu time"] == ["9", "10"]
    assert rows["Max file size"] == [str(5 * MiB)] * 2
