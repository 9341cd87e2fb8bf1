"""Escapes found by trying to break the bwrap arm (issue 8), each closed and tried again.

Every test here failed on the code before its fix. Jobs are small programs on real
bubblewrap that report what they managed to do as one JSON line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from metnos_exec.sandbox._types import Trap
from metnos_exec.sandbox.bwrap import BwrapSandbox, map_exit

from .test_bwrap import arm, py_job, report  # noqa: F401

pytestmark = [pytest.mark.bwrap, pytest.mark.anyio]


# --- defect 8: a guest forging bubblewrap's exit report -----------------------------------

FDS = """
import json, os
def fds(pid):
    out = {}
    for n in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[n] = os.readlink(f"/proc/{pid}/fd/{n}")
        except OSError:
            pass  # the listing's own fd, closed again by now
    return out
print(json.dumps({"self": fds("self"), "init": fds(1)}))
"""


async def test_the_guest_and_bubblewraps_init_hold_only_the_expected_fds(
    arm: BwrapSandbox,  # noqa: F811
    tmp_path: Path,
) -> None:
    # What reaches the sandbox's process tree: the guest has its stdio and nothing else
    # (no status pipe, no block pipe, no mount fd); bubblewrap's init (pid 1) keeps its
    # stdio and the eventfd it reports the guest's exit through (see the next test).
    got = report(await arm.run(py_job(tmp_path, FDS)))
    assert sorted(got["self"]) == ["0", "1", "2"], got
    assert all(t.startswith("pipe:") for t in got["self"].values()), got
    extra = {n: t for n, t in got["init"].items() if n not in ("0", "1", "2")}
    assert list(extra.values()) == ["anon_inode:[eventfd]"], got


FORGE = """
import ctypes, json, os, struct, sys, time
libc = ctypes.CDLL(None, use_errno=True)
SYS_pidfd_getfd = 438
init = os.pidfd_open(1)
event = next(int(n) for n in os.listdir("/proc/1/fd")
             if os.readlink(f"/proc/1/fd/{n}") == "anon_inode:[eventfd]")
fd = libc.syscall(SYS_pidfd_getfd, init, event, 0)
if fd < 0:
    print(json.dumps({"forged": False, "errno": ctypes.get_errno()}), flush=True)
    sys.exit(0)
print(json.dumps({"forged": True}), flush=True)
os.write(fd, struct.pack("Q", VALUE))
time.sleep(5)  # killed with the sandbox once the monitor believes the guest exited
"""


@pytest.mark.parametrize("value", [5000, 2**64 - 2])
async def test_a_guest_forging_its_exit_report_gets_a_failure_of_its_own(
    arm: BwrapSandbox,  # noqa: F811
    tmp_path: Path,
    value: int,
) -> None:
    # Writing N to the init's eventfd makes bubblewrap's monitor report exit code N - 1:
    # 4999, or -3 (the monitor casts to int). Before the fix that was a HostFault
    # (E_HOST_FAULT, retried, blamed on the worker); now it is the job's own failure.
    # When a seccomp filter denies pidfd_getfd, the forgery does not happen at all and
    # the job simply succeeds.
    outcome = await arm.run(py_job(tmp_path, FORGE.replace("VALUE", str(value))))
    first = outcome.stdout.splitlines()[0]
    if b'"forged": true' in first:
        assert isinstance(outcome.exit, Trap), outcome
        reported = "4999" if value == 5000 else "-3"
        assert "tampered" in outcome.exit.message and reported in outcome.exit.message
    else:
        assert outcome.exit.__class__.__name__ == "Success", outcome


def test_an_out_of_range_exit_code_is_the_jobs_trap_not_a_host_fault() -> None:
    from metnos_exec.process import ProcessResult
    from metnos_exec.sandbox._types import SandboxJob

    result = ProcessResult(
        returncode=135, stdout=b"", stderr=b"", stdout_truncated=False,
        stderr_truncated=False, timed_out=False, wall_s=0.0, cpu_s=0.0,
        peak_rss_bytes=0, pids_limited=True,
    )  # fmt: skip
    for code in (-1, 256, 4999, "0"):
        got = map_exit(SandboxJob(argv=("x",)), result, {"child-pid": 2, "exit-code": code})
        assert isinstance(got, Trap), code
