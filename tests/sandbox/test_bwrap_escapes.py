"""Escapes found by trying to break the bwrap arm (issue 8), each closed and tried again.

Every test here failed on the code before its fix. Jobs are small programs on real
bubblewrap that report what they managed to do as one JSON line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from metnos_exec.sandbox._types import MemoryExceeded, Mount, ResourceLimits, Trap
from metnos_exec.sandbox.bwrap import DISK_REASON, BwrapSandbox, map_exit

from ..conftest import need, need_privileged
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


@pytest.mark.parametrize("mechanisms", ["off", "on"])
async def test_the_guest_and_bubblewraps_init_hold_only_the_expected_fds(
    arm: BwrapSandbox,  # noqa: F811
    tmp_path: Path,
    mechanisms: str,
) -> None:
    # What reaches the sandbox's process tree: the guest has its stdio and nothing else
    # (no status pipe, no block pipe, no mount fd); bubblewrap's init (pid 1) keeps its
    # stdio and the eventfd it reports the guest's exit through (see the next test).
    from metnos_exec.sandbox.hardening import Hardening

    if mechanisms == "off":  # the control: nothing hides the init's fds from the guest
        arm = BwrapSandbox(hardening=Hardening(None, "off (control)", None, "off (control)"))
    got = report(await arm.run(py_job(tmp_path, FDS)))
    assert sorted(got["self"]) == ["0", "1", "2"], got
    if mechanisms == "off":
        assert got["init"], got
    assert all(t.startswith("pipe:") for t in got["self"].values()), got
    # (With landlock, which keeps the guest from inspecting processes outside its domain,
    # the init's fds are not even visible: then there is nothing to list.)
    extra = {n: t for n, t in got["init"].items() if n not in ("0", "1", "2")}
    assert list(extra.values()) in ([], ["anon_inode:[eventfd]"]), got
    assert not got["init"] or sorted(got["init"])[:3] == ["0", "1", "2"], got


FORGE = """
import ctypes, json, os, struct, sys, time
libc = ctypes.CDLL(None, use_errno=True)
SYS_pidfd_getfd = 438
try:
    init = os.pidfd_open(1)
    # The eventfd is the init's first fd past stdio (3 or 4, whether or not the guest
    # may list them: landlock keeps it from inspecting processes outside its domain).
    for event in (3, 4, 5):
        fd = libc.syscall(SYS_pidfd_getfd, init, event, 0)
        if fd >= 0 and os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]":
            break
    else:
        raise OSError(ctypes.get_errno(), "no eventfd reached")
except OSError as exc:
    print(json.dumps({"forged": False, "error": str(exc)}), flush=True)
    sys.exit(0)
print(json.dumps({"forged": True}), flush=True)
os.write(fd, struct.pack("Q", VALUE))
time.sleep(5)  # killed with the sandbox once the monitor believes the guest exited
"""


@pytest.mark.parametrize("mechanisms", ["off", "on"])
@pytest.mark.parametrize("value", [5000, 2**64 - 2])
async def test_a_guest_forging_its_exit_report_gets_a_failure_of_its_own(
    arm: BwrapSandbox,  # noqa: F811
    tmp_path: Path,
    value: int,
    mechanisms: str,
) -> None:
    # Writing N to the init's eventfd makes bubblewrap's monitor report exit code N - 1:
    # 4999, or -3 (the monitor casts to int). Before the fix that was a HostFault
    # (E_HOST_FAULT, retried, blamed on the worker); now it is the job's own failure.
    # Without the seccomp filter and landlock (the control) the forgery happens; with
    # them, pidfd_getfd of bubblewrap's init is refused and the job simply succeeds.
    from metnos_exec.sandbox.hardening import Hardening

    if mechanisms == "off":
        arm = BwrapSandbox(hardening=Hardening(None, "off (control)", None, "off (control)"))
    outcome = await arm.run(py_job(tmp_path, FORGE.replace("VALUE", str(value))))
    first = outcome.stdout.splitlines()[0]
    if mechanisms == "off":
        assert b'"forged": true' in first, outcome
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


#: Root-only (0400) host-global files of /proc: physical page flags and counts (which
#: help an exploit find and shape kernel memory), the buddy allocator's layout, the
#: kernel log. A job that runs as host root (a root worker without a slot uid) passes the
#: permission check on each.
ROOT_ONLY_PROC = ["/proc/kpageflags", "/proc/kpagecount", "/proc/kpagecgroup", "/proc/pagetypeinfo"]


@pytest.mark.parametrize("who", ["as root", "as the worker or its slot uid"])
async def test_root_only_proc_files_are_masked_even_for_a_job_run_as_root(
    arm: BwrapSandbox,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    who: str,
) -> None:
    import os

    from metnos_exec.identities import SLOT_UIDS_ENV

    if who == "as root":
        # The worst case: a root worker's job that runs as root (slot uids off). Before
        # the masks it read the host's page flags.
        need_privileged(os.geteuid() == 0, "a job runs as root only on a root worker")
        monkeypatch.setenv(SLOT_UIDS_ENV, "off")
    code = f"WRITE = []\nREAD = {ROOT_ONLY_PROC!r}\n" + KERNEL
    got = report(await arm.run(py_job(tmp_path, code)))
    for path, what in got["read"].items():
        assert what in (0, "ENOENT", "EACCES", "EPERM"), (path, what)


WRITABLE = """
import json, os
# A folder can be writable only on a mount that is not read-only (access(2) says EROFS on
# one that is, whatever the modes): every mount's tree is walked where it is writable, and
# every read-only mount's own folder is checked to refuse. (A walk of all of / read every
# folder of /usr and /opt: over 30 s on a fresh machine's cold cache.)
found, ro_but_writable, walked = [], [], set()
for line in open("/proc/self/mountinfo"):
    fields = line.split()
    point = fields[4].encode().decode("unicode_escape")
    sep = fields.index("-")
    ro = "ro" in fields[5].split(",") or "ro" in fields[sep + 3].split(",")
    if ro:  # (a device node stays writable on a read-only mount: /dev/null masks)
        if os.path.isdir(point) and os.access(point, os.W_OK):
            ro_but_writable.append(point)
        continue
    if point == "/proc" or point.startswith(("/proc/", "/sys")) or point in walked:
        continue
    walked.add(point)
    for top, dirs, _ in os.walk(point):
        if os.access(top, os.W_OK) and not top.startswith("/tmp/"):  # /tmp/**: the sized /tmp
            found.append(top)
st = os.statvfs("/dev/shm")
print(json.dumps({"writable": sorted(set(found)), "shm_bytes": st.f_blocks * st.f_frsize,
                  "ro_but_writable": ro_but_writable, "rw_mounts": sorted(walked)}))
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
    assert got["ro_but_writable"] == [], got
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


async def test_the_memory_reason_says_whether_tmp_and_dev_shm_are_sized(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without a memory cgroup the private tmpfs mounts are a memory wall only when they
    # are sized; bubblewrap < 0.8 gets no --size, and the reason used to say "each at the
    # budget" anyway.
    from metnos_exec import process
    from metnos_exec.sandbox import bwrap as bwrap_mod
    from metnos_exec.sandbox.flags import BwrapFeatures

    probe = bwrap_mod.bwrap_probe()
    need(probe.working, f"bubblewrap not usable here: {probe.error}")
    need(probe.features.tmpfs_size, "this bubblewrap cannot size a tmpfs (< 0.8)")
    monkeypatch.setattr(process.cgroups, "memory_cgroup_available", lambda: False)
    fill = FILL_SHM.replace("range(128)", "range(48)")
    limits = ResourceLimits(memory_bytes=32 * MiB, file_size_bytes=256 * MiB)
    sized = BwrapSandbox(probe.path, features=probe.features)
    outcome = await sized.run(py_job(tmp_path, fill, limits=limits))
    got = report(outcome)
    assert got["error"] == "ENOSPC" and got["written_mib"] <= 32, got
    reason = outcome.containment.resources.reason
    assert bwrap_mod.MEMORY_PER_PROCESS_REASON in reason, reason
    # The same job as bubblewrap 0.7 would run it: /dev/shm is not sized, and says so.
    old = BwrapSandbox(probe.path, features=BwrapFeatures((0, 7, 0), bind_fd=probe.bind_fd))
    outcome = await old.run(py_job(tmp_path, fill, limits=limits))
    got = report(outcome)
    assert got == {"written_mib": 48, "error": None}, got
    resources = outcome.containment.resources
    assert resources.state == "partial"
    assert bwrap_mod.MEMORY_UNSIZED_TMPFS_REASON in resources.reason, resources
    assert "each at the budget" not in resources.reason


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


# --- defect 2: a hint folder swapped for a symlink ----------------------------------------

SWAPPER = """
import json, os, shutil
inner = os.path.join(os.environ["HOME"], "X", "swap", "inner")
shutil.rmtree(inner)
os.symlink(os.environ["HOME"], inner)
print(json.dumps({"swapped": True}))
"""

VICTIM = """
import json, os
inner = os.path.join(os.environ["HOME"], "X", "swap", "inner")
seen = sorted(os.listdir(inner))
try:
    with open(os.path.join(inner, "planted"), "w") as f:
        f.write("x")
    wrote = True
except OSError:
    wrote = False
print(json.dumps({"seen": seen, "wrote": wrote}))
"""


def _executor(root: Path, name: str, hint: str, code: str) -> Any:
    from metnos_exec.manifest import Executor, load_manifest

    folder = root / "executors" / name
    folder.mkdir(parents=True)
    (folder / "manifest.toml").write_text(
        f'name = "{name}"\nversion = "1"\nruntime = "python"\nentry = "main.py"\n'
        f'[[capabilities]]\nname = "fs:write"\nhints = ["{hint}"]\n'
    )
    (folder / "main.py").write_text(code)
    return Executor(manifest=load_manifest(folder / "manifest.toml"), path=str(folder))


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def swap_home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    (home / "X" / "swap" / "inner").mkdir(parents=True)
    (home / "X" / "swap" / "inner" / "b-data").write_text("B's own file")
    (home / "secret").write_text("the worker's home")
    return home


async def test_a_hint_folder_swapped_for_a_symlink_is_refused_not_mounted(
    arm: BwrapSandbox,  # noqa: F811
    tmp_path: Path,
    swap_home: Path,
) -> None:
    from metnos_exec.errors import SymlinkedFolder
    from metnos_exec.plan import plan_invocation

    a = _executor(tmp_path, "a", "~/X/swap/**", SWAPPER)
    b = _executor(tmp_path, "b", "~/X/swap/inner/**", VICTIM)
    home = str(swap_home)
    planned_before = plan_invocation(b, {}, home=home)  # the folder is real at this point
    assert report(await arm.run(plan_invocation(a, {}, home=home).job)) == {"swapped": True}
    assert (swap_home / "X" / "swap" / "inner").is_symlink()
    # Planned after the swap: refused before anything runs, naming the link.
    with pytest.raises(SymlinkedFolder, match="inner") as ei:
        plan_invocation(b, {}, home=home)
    assert ei.value.code == "E_SYMLINKED_FOLDER"
    # Planned before it (a job already queued): refused by the arm, at mount time.
    with pytest.raises(SymlinkedFolder):
        await arm.run(planned_before.job)
    # Before the fix B's job listed and wrote the home: nothing was planted anywhere.
    assert _names(swap_home) == ["X", "secret"]


async def test_a_swap_between_the_check_and_the_mount_mounts_what_was_checked(
    arm: BwrapSandbox,  # noqa: F811
    tmp_path: Path,
    swap_home: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The race the fd closes: the folder is checked (opened), then swapped for a link to
    # the home before bubblewrap mounts it. Bound from the fd, the guest sees the folder
    # that was checked (moved away, but the same inode), never the home.
    from metnos_exec.plan import plan_invocation
    from metnos_exec.sandbox import _bwrap_place as bwrap_mod
    from metnos_exec.sandbox.bwrap import bwrap_probe

    need(bwrap_probe().bind_fd, "this bubblewrap has no --bind-fd")
    inner = swap_home / "X" / "swap" / "inner"
    real_open = bwrap_mod.open_source

    def open_then_swap(path: str) -> int:
        fd = real_open(path)
        if path == str(inner):
            inner.rename(inner.with_name("moved"))
            inner.symlink_to(swap_home)
        return fd

    monkeypatch.setattr(bwrap_mod, "open_source", open_then_swap)
    b = _executor(tmp_path, "b", "~/X/swap/inner/**", VICTIM)
    got = report(await arm.run(plan_invocation(b, {}, home=str(swap_home)).job))
    # The guest's path shows the checked folder's content (B's file), and its write
    # landed there, in the moved folder: not in the home.
    assert got == {"seen": ["b-data"], "wrote": True}, got
    assert (swap_home / "X" / "swap" / "moved" / "planted").exists()
    assert _names(swap_home) == ["X", "secret"]


def test_files_partial_with_a_bubblewrap_that_cannot_bind_from_an_fd(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from metnos_exec.sandbox import _bwrap_report as bwrap_mod
    from metnos_exec.sandbox._types import SandboxJob
    from metnos_exec.sandbox.flags import BwrapFeatures

    monkeypatch.setattr(bwrap_mod, "worker_is_root", lambda: False)
    job = SandboxJob(argv=("x",))
    old = BwrapSandbox("/usr/bin/bwrap", features=BwrapFeatures((0, 9, 0), bind_fd=False))
    files = old.containment(job).files
    assert files.state == "partial" and files.reason.startswith(bwrap_mod.NO_BIND_FD_REASON)
    new = BwrapSandbox("/usr/bin/bwrap", features=BwrapFeatures((0, 8, 0), bind_fd=True))
    assert new.containment(job).files.state == "kept"


# --- the sandbox's own pid 1: what a guest can do to bubblewrap's init ---------------------

INIT = """
import ctypes, errno, json, os
out = {}
for path in ("/proc/1/mem", "/proc/1/task/1/mem"):
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        out[path] = errno.errorcode.get(exc.errno, str(exc.errno))
    else:
        # Opened: the real memory, or the mask (the null device: reads nothing).
        st = os.fstat(fd)
        out[path] = "masked" if st.st_rdev == os.stat("/dev/null").st_rdev else "memory"
        os.close(fd)
libc = ctypes.CDLL(None, use_errno=True)
if libc.ptrace(16, 1, 0, 0) == 0:  # PTRACE_ATTACH: the init stops
    out["ptrace"] = "attached"
    os.waitpid(1, 0x40000000)  # __WALL: the init is stopped, ours to release
    libc.ptrace(17, 1, 0, 0)  # PTRACE_DETACH: let it go on, so the job can end
else:
    out["ptrace"] = errno.errorcode.get(ctypes.get_errno(), "?")
print(json.dumps(out))
"""


@pytest.mark.parametrize("mechanisms", ["on", "no landlock", "off"])
async def test_the_guest_cannot_write_bubblewraps_init_and_the_report_says_where_it_can(
    arm: BwrapSandbox,  # noqa: F811
    tmp_path: Path,
    mechanisms: str,
) -> None:
    # Before: without landlock the guest (the init's uid, the init dumpable) opened
    # /proc/1/mem read-write, and the report said process_tree `kept`. Now the init's
    # memory is masked in every case; ptrace is seccomp's, and without the filter (the
    # control) the guest attaches to the init: the report says `partial`, naming it.
    import msgspec

    from metnos_exec.sandbox.hardening import Hardening

    hard = arm._hardening
    if mechanisms == "no landlock":
        hard = msgspec.structs.replace(hard, landlock_abi=None, landlock="off (control)")
    elif mechanisms == "off":
        hard = Hardening(None, "off (control)", None, "off (control)")
    if mechanisms != "on":
        arm = BwrapSandbox(hardening=hard)
    job = py_job(tmp_path, INIT)
    got = report(await arm.run(job))
    for path in ("/proc/1/mem", "/proc/1/task/1/mem"):
        assert got[path] in ("masked", "EACCES", "EPERM", "EROFS"), got
    tree = arm.containment(job).process_tree
    if hard.seccomp_active:
        assert got["ptrace"] == "EPERM", got
        assert tree.state == "kept", tree
        assert "init's memory masked" in tree.reason
    else:
        assert got["ptrace"] == "attached", got
        assert tree.state == "partial", tree
        assert "ptrace bubblewrap's init" in tree.reason
