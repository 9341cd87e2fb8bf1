"""Unit tests for the pure bwrap flag derivation (no bubblewrap needed)."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest

from metnos_exec.sandbox._types import Mount, ResourceLimits, SandboxJob
from metnos_exec.sandbox.flags import (
    BwrapFeatures,
    derive_bwrap_argv,
    derive_rlimits,
    expand_hint,
    expand_hints,
)

HOME = "/home/u"


@pytest.mark.parametrize(
    ("hint", "root"),
    [
        ("~/notes/**", "/home/u/notes"),
        ("/tmp/*", "/tmp"),
        ("~/Pictures", "/home/u/Pictures"),
        ("~", "/home/u"),
        ("~/", "/home/u"),
        ("/data/x/*.md", "/data/x"),
        ("/data/a?c/d", "/data"),
        ("/data/[ab]/d", "/data"),
        ("/data//x/./y/", "/data/x/y"),
        ("/data/x/../y/**", "/data/y"),
    ],
)
def test_expand_hint_cuts_at_first_glob_segment_and_expands_home(hint: str, root: str) -> None:
    assert expand_hint(hint, HOME) == root


@pytest.mark.parametrize("hint", ["", "notes/**", "~bob/notes", "/*", "/**", "*"])
def test_expand_hint_refuses_relative_other_users_and_root(hint: str) -> None:
    with pytest.raises(ValueError):
        expand_hint(hint, HOME)


def test_expand_hints_dedupes_keeping_first_order() -> None:
    got = expand_hints(["~/notes/**", "/tmp/*", "~/notes/*.md", "/tmp"], HOME)
    assert got == ("/home/u/notes", "/tmp")


# --- derive_bwrap_argv ---------------------------------------------------------------


EXE = "/srv/executors/write_note"


def fake_fs(
    paths: set[str], links: dict[str, str] | None = None, dirs: set[str] | None = None
) -> dict[str, object]:
    """Injected filesystem: only `paths` exist; `links` are symlinks; `dirs` directories."""
    links = links or {}
    dirs = dirs or set()
    return {
        "exists": lambda p: p in paths or p in links,
        "readlink": lambda p: links.get(p),
        "isdir": lambda p: p in dirs,
    }


BASE_FS = {"/usr", "/etc", "/lib64", EXE}


def derive(job: SandboxJob, paths: set[str] | None = None, **kw: object) -> list[str]:
    fs = fake_fs(BASE_FS if paths is None else paths)
    kw.setdefault("interpreter_roots", ())
    kw.setdefault("features", BwrapFeatures(version=(0, 8, 0)))
    return derive_bwrap_argv(job, **fs, **kw)  # type: ignore[arg-type]


def job_with(**kw: object) -> SandboxJob:
    kw.setdefault("argv", ("/usr/bin/python3", f"{EXE}/main.py"))
    kw.setdefault("mounts", (Mount(EXE, EXE, writable=False),))
    return SandboxJob(**kw)  # type: ignore[arg-type]


def triples(argv: list[str], flag: str) -> list[tuple[str, str]]:
    """(src, dest) for every two-operand `flag` in argv."""
    return [(argv[i + 1], argv[i + 2]) for i, a in enumerate(argv) if a == flag]


def index_of(argv: list[str], *seq: str) -> int:
    for i in range(len(argv) - len(seq) + 1):
        if tuple(argv[i : i + len(seq)]) == seq:
            return i
    raise AssertionError(f"{seq} not in {argv}")


def test_rule1_system_paths_read_only_only_those_that_exist() -> None:
    argv = derive(job_with())
    ro = triples(argv, "--ro-bind")
    assert ("/usr", "/usr") in ro and ("/etc", "/etc") in ro and ("/lib64", "/lib64") in ro
    for missing in ("/lib32", "/opt", "/var/lib/python3", "/sbin"):
        assert all(missing not in pair for pair in ro)
    assert all(dest not in {"/usr", "/etc"} for _, dest in triples(argv, "--bind"))


def test_rule1_merged_usr_symlinks_recreated_not_bound() -> None:
    fs = fake_fs({"/usr", EXE}, links={"/bin": "usr/bin", "/lib": "usr/lib"})
    argv = derive_bwrap_argv(job_with(), interpreter_roots=(), **fs)  # type: ignore[arg-type]
    assert ("usr/bin", "/bin") in triples(argv, "--symlink")
    assert ("usr/lib", "/lib") in triples(argv, "--symlink")


def test_rule1_interpreter_prefix_outside_system_paths_is_mounted_read_only() -> None:
    prefix = "/root/.pyenv/versions/3.11.7"
    argv = derive(job_with(), paths=BASE_FS | {prefix}, interpreter_roots=(prefix, "/usr/local"))
    ro = triples(argv, "--ro-bind")
    assert (prefix, prefix) in ro
    # Already covered by /usr: no second mount.
    assert ("/usr/local", "/usr/local") not in ro


def test_rule2_private_proc_dev_tmp() -> None:
    argv = derive(job_with())
    index_of(argv, "--proc", "/proc")
    index_of(argv, "--dev", "/dev")
    index_of(argv, "--tmpfs", "/tmp")


def test_rule2_tmpfs_tmp_comes_before_any_bind_below_tmp() -> None:
    under_tmp = "/tmp/pytest-1/executor"
    notes = "/tmp/pytest-1/notes"
    job = job_with(mounts=(Mount(under_tmp, under_tmp), Mount(notes, notes, writable=True)))
    argv = derive(job, paths=BASE_FS | {under_tmp, notes})
    tmpfs = index_of(argv, "--tmpfs", "/tmp")
    assert tmpfs < index_of(argv, "--ro-bind", under_tmp, under_tmp)
    assert tmpfs < index_of(argv, "--bind", notes, notes)


def test_rule2_tmpfs_sized_by_memory_budget() -> None:
    job = job_with(limits=ResourceLimits(memory_bytes=123456789))
    argv = derive(job)
    index_of(argv, "--size", "123456789", "--tmpfs", "/tmp")
    # /dev/shm like /tmp, over a /dev made read-only first (its tmpfs has no size).
    shm = index_of(argv, "--size", "123456789", "--tmpfs", "/dev/shm")
    assert index_of(argv, "--dev", "/dev", "--remount-ro", "/dev") < shm
    old = derive(job, features=BwrapFeatures(version=(0, 6, 1)))
    assert "--size" not in old


def test_host_global_proc_files_read_only_and_masked_after_proc() -> None:
    from metnos_exec.sandbox.flags import PROC_MASKED_PATHS, PROC_READ_ONLY_PATHS

    assert {"/proc/sys", "/proc/sysrq-trigger"} <= set(PROC_READ_ONLY_PATHS)
    assert {"/proc/kcore", "/proc/keys", "/proc/kallsyms"} <= set(PROC_MASKED_PATHS)
    paths = BASE_FS | {"/proc/sys", "/proc/sysrq-trigger", "/proc/kcore", "/proc/acpi"}
    fs = fake_fs(paths, dirs={"/proc/sys", "/proc/acpi"})
    argv = derive_bwrap_argv(job_with(), interpreter_roots=(), **fs)  # type: ignore[arg-type]
    proc = index_of(argv, "--proc", "/proc")
    assert proc < index_of(argv, "--ro-bind", "/proc/sys", "/proc/sys")
    assert proc < index_of(argv, "--ro-bind", "/proc/sysrq-trigger", "/proc/sysrq-trigger")
    assert proc < index_of(argv, "--ro-bind", "/dev/null", "/proc/kcore")
    assert proc < index_of(argv, "--tmpfs", "/proc/acpi", "--remount-ro", "/proc/acpi")
    assert "/proc/keys" not in argv  # absent on this fake kernel: never created
    assert "/sys" not in argv


def test_root_only_host_global_proc_files_are_masked() -> None:
    # Root-only (0400) files a job running as host root could read: physical page flags,
    # counts and memcg owners, the buddy allocator's layout, the kernel log. runc and
    # podman mask most host-global files; these are root's alone, and a root worker's job
    # may run as root.
    from metnos_exec.sandbox.flags import PROC_MASKED_PATHS

    root_only = {
        "/proc/kpageflags",
        "/proc/kpagecount",
        "/proc/kpagecgroup",
        "/proc/pagetypeinfo",
        "/proc/kmsg",
    }
    assert root_only <= set(PROC_MASKED_PATHS)
    # Every root-only file of this kernel's /proc top level is masked (or unreadable
    # without a capability no job holds: none today).
    here = {
        f"/proc/{name}"
        for name in os.listdir("/proc")
        if not name.isdigit()
        and os.path.isfile(f"/proc/{name}")
        and not os.path.islink(f"/proc/{name}")
        and not os.stat(f"/proc/{name}").st_mode & 0o044
    }
    assert here <= set(PROC_MASKED_PATHS), here - set(PROC_MASKED_PATHS)
    fs = fake_fs(BASE_FS | root_only)
    argv = derive_bwrap_argv(job_with(), interpreter_roots=(), **fs)  # type: ignore[arg-type]
    for path in root_only:
        assert index_of(argv, "--proc", "/proc") < index_of(argv, "--ro-bind", "/dev/null", path)


def test_mounts_nested_after_their_parents() -> None:
    job = job_with(
        mounts=(
            Mount("/data/a/b/c", "/data/a/b/c"),
            Mount("/data/a", "/data/a", writable=True),
            Mount(EXE, EXE),
        )
    )
    argv = derive(job, paths=BASE_FS | {"/data/a", "/data/a/b/c"})
    assert index_of(argv, "--bind", "/data/a", "/data/a") < index_of(
        argv, "--ro-bind", "/data/a/b/c", "/data/a/b/c"
    )


def test_rule3_executor_folder_read_only() -> None:
    argv = derive(job_with())
    assert (EXE, EXE) in triples(argv, "--ro-bind")
    assert (EXE, EXE) not in triples(argv, "--bind")


def test_rule3_exact_duplicate_read_only_wins() -> None:
    job = job_with(mounts=(Mount(EXE, EXE, writable=True), Mount(EXE, EXE)))
    argv = derive(job)
    assert (EXE, EXE) in triples(argv, "--ro-bind")
    assert (EXE, EXE) not in triples(argv, "--bind")


def test_rule4_read_hints_ro_bind_write_hints_bind_missing_skipped() -> None:
    job = job_with(
        mounts=(
            Mount(EXE, EXE),
            Mount("/home/u/notes", "/home/u/notes", writable=False),
            Mount("/home/u/out", "/home/u/out", writable=True),
            Mount("/home/u/not-yet", "/home/u/not-yet", writable=True),
        )
    )
    argv = derive(job, paths=BASE_FS | {"/home/u/notes", "/home/u/out"})
    assert ("/home/u/notes", "/home/u/notes") in triples(argv, "--ro-bind")
    assert ("/home/u/out", "/home/u/out") in triples(argv, "--bind")
    assert "/home/u/not-yet" not in argv


def test_rule5_hint_expansion_feeds_mount_roots() -> None:
    # plan.py builds mounts from expand_hints; the flags then mount the cut roots.
    roots = expand_hints(["~/notes/**", "~/notes/*.md"], HOME)
    job = job_with(mounts=(Mount(EXE, EXE), *(Mount(r, r, writable=True) for r in roots)))
    argv = derive(job, paths=BASE_FS | {"/home/u/notes"})
    assert triples(argv, "--bind") == [("/home/u/notes", "/home/u/notes")]


def test_rule6_network_unshared_unless_granted() -> None:
    assert "--unshare-net" in derive(job_with(network=False))
    assert "--unshare-net" not in derive(job_with(network=True))


def test_rule7_always_namespaces_and_die_with_parent() -> None:
    for network in (False, True):
        argv = derive(job_with(network=network))
        for flag in (
            "--unshare-user",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-pid",
            "--die-with-parent",
        ):
            assert flag in argv, flag


def test_beyond_unprivileged_uid_new_session_hostname_cgroup() -> None:
    argv = derive(job_with())
    index_of(argv, "--uid", "65534")
    index_of(argv, "--gid", "65534")
    index_of(argv, "--hostname", "sandbox")
    assert "--new-session" in argv
    assert "--unshare-cgroup-try" in argv
    index_of(argv, "--cap-drop", "ALL")


def test_beyond_clearenv_then_only_job_env() -> None:
    argv = derive(job_with(env={"LANG": "C.UTF-8", "PATH": "/usr/bin"}))
    clear = argv.index("--clearenv")
    sets = [(argv[i + 1], argv[i + 2]) for i, a in enumerate(argv) if a == "--setenv"]
    assert sets == [("LANG", "C.UTF-8"), ("PATH", "/usr/bin")]
    assert all(i > clear for i, a in enumerate(argv) if a == "--setenv")


def test_beyond_disable_userns_only_when_supported() -> None:
    assert "--disable-userns" in derive(job_with(), features=BwrapFeatures(version=(0, 8, 0)))
    assert "--disable-userns" not in derive(job_with(), features=BwrapFeatures(version=(0, 7, 0)))
    assert "--disable-userns" not in derive(job_with(), features=BwrapFeatures())


def test_beyond_secrets_masked_after_etc_bind() -> None:
    paths = BASE_FS | {"/etc/shadow", "/etc/ssh"}
    fs = fake_fs(paths, dirs={"/etc/ssh"})
    argv = derive_bwrap_argv(job_with(), interpreter_roots=(), **fs)  # type: ignore[arg-type]
    etc = index_of(argv, "--ro-bind", "/etc", "/etc")
    assert etc < index_of(argv, "--ro-bind", "/dev/null", "/etc/shadow")
    # A masking tmpfs is read-only: a writable one would be an unsized tmpfs to fill.
    assert etc < index_of(argv, "--tmpfs", "/etc/ssh", "--remount-ro", "/etc/ssh")
    assert "/etc/gshadow" not in argv  # absent on this fake host


def test_beyond_root_read_only_chdir_and_command_last() -> None:
    argv = derive(job_with(cwd="/home/u/notes"), json_status_fd=7, seccomp_fd=9)
    index_of(argv, "--remount-ro", "/")
    index_of(argv, "--chdir", "/home/u/notes")
    index_of(argv, "--json-status-fd", "7")
    index_of(argv, "--seccomp", "9")
    sep = argv.index("--")
    assert argv[sep + 1 :] == ["/usr/bin/python3", f"{EXE}/main.py"]
    assert argv[0] == "bwrap"
    assert "--chdir" in derive(job_with()) and index_of(derive(job_with()), "--chdir", "/tmp")


def test_wasm_job_refused() -> None:
    with pytest.raises(ValueError):
        derive(SandboxJob())


def test_rlimits_from_limits() -> None:
    lim = ResourceLimits(
        memory_bytes=1 << 28, pids=64, file_size_bytes=1 << 20, open_files=99, cpu_time_s=5
    )
    got = {r: (s, h) for r, s, h in derive_rlimits(lim)}
    assert got == {
        resource.RLIMIT_AS: (1 << 28, 1 << 28),
        resource.RLIMIT_FSIZE: (1 << 20, 1 << 20),
        resource.RLIMIT_NOFILE: (99, 99),
        resource.RLIMIT_CPU: (5, 6),
        resource.RLIMIT_CORE: (0, 0),
    }
    # The pids wall is the process layer's (cgroup, or its own NPROC fallback).
    assert resource.RLIMIT_NPROC not in got
    none = ResourceLimits(memory_bytes=None, pids=None, file_size_bytes=None, open_files=None)
    assert derive_rlimits(none) == ((resource.RLIMIT_CORE, 0, 0),)


@pytest.mark.parametrize("guest", ["/", "/proc", "/proc/1", "/dev", "/dev/shm", "relative"])
def test_mounts_over_private_trees_are_refused(guest: str) -> None:
    job = job_with(mounts=(Mount(EXE, EXE), Mount("/data", guest)))
    with pytest.raises(ValueError):
        derive(job, paths=BASE_FS | {"/data"})


def test_hint_on_tmp_itself_replaces_private_tmp_as_asked() -> None:
    # The spec's own example: `/tmp/*` → `/tmp`; the bind comes after the tmpfs, so wins.
    job = job_with(mounts=(Mount(EXE, EXE), Mount("/tmp", "/tmp", writable=True)))
    argv = derive(job, paths=BASE_FS | {"/tmp"})
    assert index_of(argv, "--tmpfs", "/tmp") < index_of(argv, "--bind", "/tmp", "/tmp")


def test_root_only_files_a_kernel_adds_are_masked_though_no_list_names_them(
    tmp_path: Path,
) -> None:
    # A new kernel adds root-only files to /proc's top level (this product met
    # /proc/program_cpu on a 6.18 kernel, named in no list): the list is completed from
    # the running kernel, so such a file is masked too.
    from metnos_exec.sandbox.flags import _root_only_proc_files

    for name, mode in (
        ("newthing", 0o400),
        ("rw_root", 0o600),
        ("public", 0o444),
        ("group", 0o440),
        ("123", 0o400),
    ):
        (tmp_path / name).write_text("x")
        (tmp_path / name).chmod(mode)
    (tmp_path / "folder").mkdir(mode=0o500)
    found = _root_only_proc_files(str(tmp_path))
    assert found == (f"{tmp_path}/newthing", f"{tmp_path}/rw_root")
    assert _root_only_proc_files(str(tmp_path / "absent")) == ()
