"""The direct arm: exits, caps, limits, timeouts, and a report that matches what it does.

Every axis the report calls ``not_kept`` is tried here and shown to be really open; every
half the report claims (``partial``) is shown to hold.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import anyio
import msgspec
import pytest

from metnos_exec.errors import HostFault
from metnos_exec.sandbox._types import (
    AXES,
    Failure,
    Killed,
    Mount,
    ResourceLimits,
    Sandbox,
    SandboxJob,
    Success,
    Timeout,
)
from metnos_exec.sandbox.direct import DirectSandbox, direct_rlimits
from tests.conftest import need_privileged

ENV = {"PATH": "/usr/bin:/bin"}
PY = sys.executable
TREE = str(Path(__file__).parent.parent / "helpers" / "tree.py")

pytestmark = pytest.mark.anyio


def job(*argv: str, **kw: object) -> SandboxJob:
    return SandboxJob(argv=argv, env=dict(ENV), **kw)  # type: ignore[arg-type]


def limits(**kw: object) -> ResourceLimits:
    return ResourceLimits(**kw)  # type: ignore[arg-type]


async def test_is_a_sandbox_named_none() -> None:
    arm = DirectSandbox()
    assert isinstance(arm, Sandbox)
    assert arm.name == "none"


async def test_success_with_stdin_stdout_stderr() -> None:
    outcome = await DirectSandbox().run(
        job("sh", "-c", "cat; echo out; echo err >&2", stdin=b'{"a": 1}')
    )
    assert outcome.exit == Success()
    assert outcome.stdout == b'{"a": 1}out\n'
    assert outcome.stderr == b"err\n"
    assert outcome.containment.sandbox == "none"
    assert outcome.usage.wall_s > 0 and outcome.usage.cpu_s is not None


async def test_failure_keeps_the_code() -> None:
    outcome = await DirectSandbox().run(job("sh", "-c", "exit 7"))
    assert outcome.exit == Failure(code=7)


async def test_missing_command_is_failure_127() -> None:
    outcome = await DirectSandbox().run(job("no-such-command-here"))
    assert outcome.exit == Failure(code=127)


async def test_env_and_cwd_are_the_jobs(tmp_path: Path) -> None:
    outcome = await DirectSandbox().run(
        SandboxJob(
            argv=("sh", "-c", "pwd; env"),
            env={"PATH": "/usr/bin:/bin", "K": "v"},
            cwd=str(tmp_path),
        )
    )
    lines = outcome.stdout.decode().splitlines()
    assert lines[0] == str(tmp_path)
    assert sorted(lines[1:]) == ["K=v", "PATH=/usr/bin:/bin", f"PWD={tmp_path}"]


async def test_signal_is_killed_without_a_named_limit() -> None:
    outcome = await DirectSandbox().run(job("sh", "-c", "kill -TERM $$"))
    assert outcome.exit == Killed(signal=signal.SIGTERM, limit=None)


async def test_output_is_capped() -> None:
    outcome = await DirectSandbox().run(
        job("sh", "-c", "head -c 5M /dev/zero; echo e >&2", limits=limits(output_bytes=1000))
    )
    assert outcome.exit == Success()
    assert len(outcome.stdout) == 1000 and outcome.stdout_truncated
    assert outcome.stderr == b"e\n" and not outcome.stderr_truncated


async def test_cpu_limit_is_killed_cpu_time() -> None:
    outcome = await DirectSandbox().run(
        job(PY, "-c", "while True: pass", limits=limits(cpu_time_s=1, wall_time_s=20))
    )
    assert outcome.exit == Killed(signal=signal.SIGXCPU, limit="cpu_time")
    # The kernel sampled at least most of the budget (rusage ticks lag RLIMIT_CPU a bit).
    assert outcome.usage.cpu_s is not None and outcome.usage.cpu_s >= 0.5


async def test_file_size_limit_is_killed_file_size(tmp_path: Path) -> None:
    # Through sh: CPython ignores SIGXFSZ, so a Python writer would only see EFBIG. `exec`
    # makes head the job itself; a shell parent would report 128+25, which is only a guess.
    outcome = await DirectSandbox().run(
        job(
            "sh",
            "-c",
            f"exec head -c 10M /dev/zero > {tmp_path / 'big'}",
            limits=limits(file_size_bytes=1 << 20),
        )
    )
    assert outcome.exit == Killed(signal=signal.SIGXFSZ, limit="file_size")
    assert (tmp_path / "big").stat().st_size == 1 << 20
    assert not (tmp_path / "core").exists()


async def test_memory_limit_makes_a_big_allocation_fail() -> None:
    code = "import sys\ntry:\n    b = bytearray(512 << 20)\nexcept MemoryError:\n    sys.exit(42)"
    outcome = await DirectSandbox().run(job(PY, "-c", code, limits=limits(memory_bytes=256 << 20)))
    # RLIMIT_AS refuses the allocation; the kernel sends no signal, so no MemoryExceeded.
    assert outcome.exit == Failure(code=42)


async def test_open_files_limit() -> None:
    outcome = await DirectSandbox().run(job("sh", "-c", "ulimit -n", limits=limits(open_files=50)))
    assert outcome.stdout.strip() == b"50"


async def test_timeout_kills_the_whole_tree(tmp_path: Path) -> None:
    t0 = time.monotonic()
    outcome = await DirectSandbox().run(
        job(PY, TREE, str(tmp_path), limits=limits(wall_time_s=1.0))
    )
    assert outcome.exit == Timeout()
    assert time.monotonic() - t0 < 1.0 + 2.0
    for name in ("job.pid", "grandchild.pid"):
        assert _gone(tmp_path / name)


def _gone(pidfile: Path) -> bool:
    """The process whose pid is in `pidfile` no longer runs (absent or a zombie)."""
    pid = int(pidfile.read_text())
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):  # gone meanwhile
        return True
    return stat[stat.rfind(b")") + 2 :].split()[0] == b"Z"


async def test_pids_limit_holds_with_a_cgroup() -> None:
    from metnos_exec.process import pids_cgroup_available

    need_privileged(pids_cgroup_available(), "no writable pids cgroup")
    forker = (
        "import os, time\n"
        "n = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30); os._exit(0)\n"
        "        n += 1\n"
        "    except BlockingIOError:\n"
        "        pass\n"
        "print(n)"
    )
    outcome = await DirectSandbox().run(job(PY, "-c", forker, limits=limits(pids=16)))
    assert outcome.exit == Success()
    assert int(outcome.stdout) <= 15
    assert "pids (cgroup)" in outcome.containment.resources.reason


async def test_wasm_job_is_a_host_fault() -> None:
    with pytest.raises(HostFault):
        await DirectSandbox().run(SandboxJob())


# --- the report against the facts ---------------------------------------------------------


def test_report_shape() -> None:
    report = DirectSandbox().containment(job("true"))
    assert report.sandbox == "none"
    assert {name: v.state for name, v in report.axes().items()} == {
        "files": "not_kept",
        "network": "not_kept",
        "process_tree": "partial",
        "user": "not_kept",
        "resources": "partial",
    }
    assert report.lost() == list(AXES)
    assert all(v.reason for v in report.axes().values())
    msgspec.json.encode(report)  # serialisable as it is logged and returned


def test_resources_not_kept_without_any_limit() -> None:
    bare = ResourceLimits(
        memory_bytes=None, pids=None, file_size_bytes=None, open_files=None, cpu_time_s=None
    )
    assert DirectSandbox().containment(job("true", limits=bare)).resources.state == "not_kept"
    assert direct_rlimits(bare) == ((__import__("resource").RLIMIT_CORE, 0, 0),)


async def test_files_not_kept_a_file_outside_every_mount_is_readable(tmp_path: Path) -> None:
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("not yours")
    granted = tmp_path / "granted"
    granted.mkdir()
    outcome = await DirectSandbox().run(
        job("cat", str(secret), mounts=(Mount(host=str(granted), guest=str(granted)),))
    )
    assert outcome.containment.files.state == "not_kept"
    assert outcome.exit == Success() and outcome.stdout == b"not yours"


async def test_network_not_kept_a_job_without_network_reaches_a_listener() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        code = f"import socket; socket.create_connection(('127.0.0.1', {port}), 5).close()"
        outcome = await DirectSandbox().run(job(PY, "-c", code, network=False))
        conn, _ = server.accept()
        conn.close()
    assert outcome.containment.network.state == "not_kept"
    assert outcome.exit == Success()


async def test_user_not_kept_the_job_has_the_workers_uid() -> None:
    outcome = await DirectSandbox().run(job("id", "-u"))
    assert outcome.containment.user.state == "not_kept"
    assert int(outcome.stdout) == os.getuid()


async def test_process_tree_partial_the_job_sees_and_can_signal_the_worker() -> None:
    # Signal 0 probes permission without delivering anything.
    outcome = await DirectSandbox().run(job("kill", "-0", str(os.getpid())))
    assert outcome.containment.process_tree.state == "partial"
    assert outcome.exit == Success()


async def test_two_runs_do_not_poison_each_other(tmp_path: Path) -> None:
    arm = DirectSandbox()
    first = await arm.run(job("sh", "-c", "echo one"))
    with anyio.fail_after(30):
        await arm.run(job("sh", "-c", "exit 3"))
    again = await arm.run(job("sh", "-c", "echo one"))
    assert first.stdout == again.stdout == b"one\n"
    assert first.exit == again.exit == Success()
