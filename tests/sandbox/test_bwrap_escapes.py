"""Escapes found by trying to break the bwrap arm (issue 8), each closed and tried again.

Every test here failed on the code before its fix. Jobs are small programs on real
bubblewrap that report what they managed to do as one JSON line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from metnos_exec.sandbox._types import MemoryExceeded, Mount, ResourceLimits, Trap
from metnos_exec.sandbox.bwrap import DISK_REASON, BwrapSandbox, map_exit

from .test_bwrap import arm, py_job, report  # noqa: F401

pytestmark = [pytest.mark.bwrap, pytest.mark.anyio]

MiB = 1 << 20


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


# --- defect 1: host-global kernel interfaces --------------------------------------------

KERNEL = """
import errno, json, os
def open_for_write(path):
    # Opening is enough to prove the wall: nothing is ever written to the host's kernel.
    try:
        os.close(os.open(path, os.O_WRONLY))
        return "opened"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
def read(path):
    try:
        with open(path, "rb") as f:
            return len(f.read(4096))
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
print(json.dumps({
    "write": {p: open_for_write(p) for p in WRITE},
    "read": {p: read(p) for p in READ},
    "sys": os.path.exists("/sys"),
}))
"""
WRITE = [
    "/proc/sys/kernel/core_pattern",  # issue 8: host root code execution at the next crash
    "/proc/sys/kernel/modprobe",
    "/proc/sys/vm/drop_caches",
    "/proc/sys/fs/file-max",
    "/proc/sysrq-trigger",
]
READ = ["/proc/kcore", "/proc/keys", "/proc/kallsyms", "/proc/timer_list", "/proc/sched_debug"]


async def test_host_global_kernel_interfaces_are_read_only_or_masked(
    arm: BwrapSandbox,  # noqa: F811
    tmp_path: Path,
) -> None:
    code = f"WRITE = {WRITE!r}\nREAD = {READ!r}\n" + KERNEL
    got = report(await arm.run(py_job(tmp_path, code)))
    # As root the guest's uid was host uid 0 and these opened (the defect); now none does.
    for path, what in got["write"].items():
        assert what in ("EROFS", "EACCES", "EPERM", "ENOENT"), (path, what)
    # Masked: an empty file (or absent where this kernel has none). Nothing leaks.
    for path, what in got["read"].items():
        assert what in (0, "ENOENT", "EACCES", "EPERM"), (path, what)
    assert got["sys"] is False  # /sys stays out


WRITABLE = """
import json, os
found = []
for top, dirs, _ in os.walk("/"):
    if top in ("/proc", "/sys"):
        dirs[:] = []
        continue
    if os.access(top, os.W_OK) and not top.startswith("/tmp/"):  # /tmp/**: the sized /tmp
        found.append(top)
st = os.statvfs("/dev/shm")
print(json.dumps({"writable": sorted(found), "shm_bytes": st.f_blocks * st.f_frsize}))
"""


async def test_only_tmp_and_a_sized_dev_shm_are_writable(
    arm: BwrapSandbox,  # noqa: F811
    tmp_path: Path,
) -> None:
    # /dev was an unsized writable tmpfs, /dev/shm a folder in it, and every masked folder
    # of /etc an unsized writable tmpfs: each a way past the memory budget without a
    # memory cgroup (issue 8 wrote 1 GiB to /dev/shm against a 256 MiB budget).
    limits = ResourceLimits(memory_bytes=64 * MiB)
    got = report(await arm.run(py_job(tmp_path, WRITABLE, limits=limits)))
    assert got["writable"] == ["/dev/pts", "/dev/shm", "/tmp"], got
    assert got["shm_bytes"] == 64 * MiB, got


FILL_SHM = """
import errno, json
written = 0
try:
    with open("/dev/shm/fill", "wb") as f:
        for _ in range(128):
            f.write(b"\\x01" * (1 << 20)); f.flush(); written += 1
    error = None
except OSError as e:
    error = errno.errorcode.get(e.errno)
print(json.dumps({"written_mib": written, "error": error}))
"""


async def test_dev_shm_fills_up_at_the_memory_budget(
    arm: BwrapSandbox,  # noqa: F811
    tmp_path: Path,
) -> None:
    limits = ResourceLimits(memory_bytes=64 * MiB, file_size_bytes=256 * MiB)
    outcome = await arm.run(py_job(tmp_path, FILL_SHM, limits=limits))
    if isinstance(outcome.exit, MemoryExceeded):
        return  # a memory cgroup stopped it first: also within the budget
    got = report(outcome)
    assert got["error"] == "ENOSPC" and got["written_mib"] <= 64, got


# --- defect 6: disk is not bounded in total ---------------------------------------------


async def test_a_writable_mount_makes_the_resources_axis_partial_for_disk(
    arm: BwrapSandbox,  # noqa: F811
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    # Many files under the per-file limit: their sum is what nothing bounds yet.
    fill = f"""
import json
for i in range(8):
    with open("{out}/f%d" % i, "wb") as f:
        f.write(b"\\x01" * (1 << 20))
print(json.dumps({{"wrote_mib": 8}}))
"""
    limits = ResourceLimits(file_size_bytes=2 * MiB)
    job = py_job(tmp_path, fill, mounts=(Mount(str(out), str(out), writable=True),), limits=limits)
    outcome = await arm.run(job)
    assert report(outcome) == {"wrote_mib": 8}
    assert sum(p.stat().st_size for p in out.iterdir()) == 8 * MiB  # 4x the per-file cap
    resources = outcome.containment.resources
    assert resources.state == "partial" and DISK_REASON in resources.reason, resources
    # Without a writable mount the disk is not the job's to fill.
    ro = await arm.run(py_job(tmp_path, "print('{}')"))
    assert DISK_REASON not in ro.containment.resources.reason
