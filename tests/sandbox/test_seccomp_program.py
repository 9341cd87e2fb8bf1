"""The seccomp program, read instruction by instruction: every row of the policy on both
architectures, run through a BPF interpreter (`tests/sandbox/bpf.py`), plus the number
tables checked against the kernel headers and libseccomp. No bubblewrap needed; the real
kernel attacks are in ``test_seccomp.py``."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import re
import struct
from pathlib import Path

import pytest

from metnos_exec.sandbox import seccomp
from metnos_exec.sandbox._syscalls import AUDIT_ARCH, NEWEST, SYSCALLS, X32_SYSCALL_BIT
from metnos_exec.sandbox.seccomp import (
    ALLOW,
    KILL,
    POLICY,
    SUPPORTED_ARCHES,
    compile_program,
    errno_action,
)
from tests.conftest import need
from tests.sandbox import bpf

EPERM = errno_action(errno.EPERM)
EACCES = errno_action(errno.EACCES)
ENOSYS = errno_action(errno.ENOSYS)
HIGH = 0xDEADBEEF00000000  # garbage in an argument's upper half: the kernel ignores it

# Ordinary calls every program makes: never touched by the filter.
ORDINARY = {
    "x86_64": {"read": 0, "write": 1, "mmap": 9, "execve": 59, "exit_group": 231, "futex": 202},
    "aarch64": {"read": 63, "write": 64, "mmap": 222, "execve": 221, "exit_group": 94},
}


def act(arch: str, name: str, *args: int) -> int:
    nr = SYSCALLS[arch][name] if name in SYSCALLS[arch] else ORDINARY[arch][name]
    return bpf.run(compile_program(arch), bpf.seccomp_data(nr, AUDIT_ARCH[arch], args))


# Each case: (call, arguments, expected action). Arguments are the raw registers.
S_IFREG, S_IFIFO = 0o100000, 0o010000
O_WRONLY, O_CREAT, O_TMPFILE = 0o1, 0o100, 0o20200000
CASES: list[tuple[str, tuple[int, ...], int]] = [
    # row 4: socket families
    ("socket", (1, 1, 0), EPERM),  # AF_UNIX stream
    ("socket", (1, 2, 0), EPERM),  # AF_UNIX datagram
    ("socket", (HIGH | 1, 1, 0), EPERM),  # AF_UNIX behind upper-half garbage
    ("socket", (40, 1, 0), EPERM),  # AF_VSOCK
    ("socket", (17, 3, 0), EPERM),  # AF_PACKET
    ("socket", (38, 5, 0), EPERM),  # AF_ALG
    ("socket", (16, 3, 4), EPERM),  # AF_NETLINK, NETLINK_SOCK_DIAG
    ("socket", (16, 3, 12), EPERM),  # AF_NETLINK, NETLINK_NETFILTER
    ("socket", (2, 1, 0), ALLOW),  # AF_INET
    ("socket", (10, 2, 0), ALLOW),  # AF_INET6
    ("socket", (HIGH | 2, 1, 0), ALLOW),
    ("socket", (16, 3, 0), ALLOW),  # AF_NETLINK, NETLINK_ROUTE (getaddrinfo)
    # row 5: socketpair
    ("socketpair", (1, 2, 0, 0), EPERM),  # datagram
    ("socketpair", (1, 3, 0, 0), EPERM),  # SOCK_RAW (an alias of datagram for AF_UNIX)
    ("socketpair", (1, 0o2000002, 0, 0), EPERM),  # datagram | SOCK_CLOEXEC
    ("socketpair", (2, 1, 0, 0), EPERM),  # not AF_UNIX
    ("socketpair", (1, 1, 0, 0), ALLOW),  # stream: asyncio, multiprocessing
    ("socketpair", (1, 0o2004001, 0, 0), ALLOW),  # stream | CLOEXEC | NONBLOCK
    ("socketpair", (1, 5, 0, 0), ALLOW),  # seqpacket
    # rows 6-8: setuid/setgid
    ("openat", (-100, 0, O_CREAT | O_WRONLY, 0o4755), EPERM),
    ("openat", (-100, 0, O_CREAT | O_WRONLY, 0o2755), EPERM),
    ("openat", (-100, 0, O_TMPFILE | O_WRONLY, 0o6700), EPERM),
    ("openat", (-100, 0, O_CREAT | O_WRONLY, HIGH | 0o4000), EPERM),
    ("openat", (-100, 0, O_CREAT | O_WRONLY, 0o1777), ALLOW),  # sticky is harmless
    ("openat", (-100, 0, O_CREAT | O_WRONLY, 0o755), ALLOW),
    ("openat", (-100, 0, 0, 0o4755), ALLOW),  # no O_CREAT: the mode register is garbage
    ("open", (0, O_CREAT, 0o4755), EPERM),
    ("open", (0, 0, 0o4755), ALLOW),
    ("creat", (0, 0o6755), EPERM),
    ("creat", (0, 0o644), ALLOW),
    ("mkdir", (0, 0o2755), EPERM),
    ("mkdirat", (-100, 0, 0o4755), EPERM),
    ("mkdirat", (-100, 0, 0o755), ALLOW),
    ("mknod", (0, S_IFIFO | 0o4644, 0), EPERM),
    ("mknodat", (-100, 0, S_IFREG | 0o2755, 0), EPERM),
    ("mknodat", (-100, 0, S_IFIFO | 0o644, 0), ALLOW),
    ("chmod", (0, 0o4755), EPERM),
    ("chmod", (0, 0o755), ALLOW),
    ("fchmod", (3, 0o2711), EPERM),
    ("fchmod", (3, HIGH | 0o711), ALLOW),
    ("fchmodat", (-100, 0, 0o6755), EPERM),
    ("fchmodat", (-100, 0, 0o644), ALLOW),
    ("fchmodat2", (-100, 0, 0o4700, 0), EPERM),
    ("fchmodat2", (-100, 0, 0o700, 0x100), ALLOW),
    ("openat2", (-100, 0, 0, 24), ENOSYS),
    # rows 10-13: namespaces
    ("clone", (0x10000000 | 17, 0, 0, 0, 0), EPERM),  # CLONE_NEWUSER | SIGCHLD
    ("clone", (0x20000, 0, 0, 0, 0), EPERM),  # CLONE_NEWNS
    ("clone", (0x40000000, 0, 0, 0, 0), EPERM),  # CLONE_NEWNET
    ("clone", (0x01200011, 0, 0, 0, 0), ALLOW),  # fork(): CHILD_SETTID | CLEARTID | SIGCHLD
    ("clone", (0x003D0F00, 0, 0, 0, 0), ALLOW),  # pthread_create's flags
    ("clone", (0x4111, 0, 0, 0, 0), ALLOW),  # posix_spawn: VM | VFORK | SIGCHLD
    ("unshare", (0x10000000,), EPERM),
    ("unshare", (0x80,), EPERM),  # CLONE_NEWTIME
    ("unshare", (0x400,), ALLOW),  # CLONE_FILES
    ("clone3", (0, 88), ENOSYS),
    ("setns", (3, 0), EPERM),
    # rows 14-20: always
    ("keyctl", (0, 0), EPERM),
    ("add_key", (0, 0, 0, 0, 0), EPERM),
    ("request_key", (0, 0, 0, 0), EPERM),
    ("ptrace", (0, 0, 0, 0), EPERM),
    ("process_vm_readv", (1, 0, 0, 0, 0, 0), EPERM),
    ("pidfd_getfd", (3, 0, 0), EPERM),
    ("mount", (0, 0, 0, 0, 0), EPERM),
    ("umount2", (0, 0), EPERM),
    ("pivot_root", (0, 0), EPERM),
    ("open_tree", (-100, 0, 0), EPERM),
    ("open_tree_attr", (-100, 0, 0, 0, 0), EPERM),
    ("fsopen", (0, 0), EPERM),
    ("io_uring_setup", (1, 0), EPERM),
    ("io_uring_enter", (3, 1, 0, 0, 0, 0), EPERM),
    ("io_uring_register", (3, 0, 0, 0), EPERM),
    ("bpf", (0, 0, 0), EPERM),
    ("perf_event_open", (0, 0, -1, -1, 0), EPERM),
    ("userfaultfd", (1,), EPERM),
    ("open_by_handle_at", (3, 0, 0), EPERM),
    ("name_to_handle_at", (-100, 0, 0, 0, 0), EPERM),
    ("kexec_load", (0, 0, 0, 0), EPERM),
    ("kexec_file_load", (0, 0, 0, 0, 0), EPERM),
    ("init_module", (0, 0, 0), EPERM),
    ("finit_module", (3, 0, 0), EPERM),
    ("delete_module", (0, 0), EPERM),
    ("syslog", (0, 0, 0), EPERM),
    ("settimeofday", (0, 0), EPERM),
    # row 21: personality
    ("personality", (0x0040000,), EPERM),  # ADDR_NO_RANDOMIZE
    ("personality", (0x0400000,), EPERM),  # READ_IMPLIES_EXEC
    ("personality", (0xFFFFFFFF,), ALLOW),  # the query
    ("personality", (0,), ALLOW),
    ("personality", (0x20008,), ALLOW),
    ("personality", (HIGH | 0,), ALLOW),
    # row 22: ioctl
    ("ioctl", (0, 0x5412, 0), EPERM),  # TIOCSTI
    ("ioctl", (0, 0x541C, 0), EPERM),  # TIOCLINUX
    ("ioctl", (0, HIGH | 0x5412, 0), EPERM),
    ("ioctl", (0, 0x5413, 0), ALLOW),  # TIOCGWINSZ
    ("ioctl", (0, 0x5401, 0), ALLOW),  # TCGETS
    # row 23
    ("move_pages", (0, 0, 0, 0, 0, 0), EPERM),
    ("migrate_pages", (0, 0, 0, 0), EPERM),
    ("fanotify_init", (0, 0), EPERM),
    ("modify_ldt", (0, 0, 0), EPERM),
    # row 24: memfd_create, unless MFD_NOEXEC_SEAL (0x8)
    ("memfd_create", (0, 0), EACCES),
    ("memfd_create", (0, 0x1), EACCES),  # MFD_CLOEXEC: executable by default
    ("memfd_create", (0, 0x3), EACCES),  # MFD_CLOEXEC | MFD_ALLOW_SEALING
    ("memfd_create", (0, 0x10), EACCES),  # MFD_EXEC
    ("memfd_create", (0, 0x5), EACCES),  # MFD_HUGETLB | MFD_CLOEXEC
    ("memfd_create", (0, (0x8 << 32) | 0x1), EACCES),  # the seal only in the ignored half
    ("memfd_create", (0, HIGH | 0x9), ALLOW),  # garbage above a sealed request
    ("memfd_create", (0, 0x8), ALLOW),  # MFD_NOEXEC_SEAL
    ("memfd_create", (0, 0x9), ALLOW),  # MFD_NOEXEC_SEAL | MFD_CLOEXEC
    ("memfd_create", (0, 0xD), ALLOW),  # ... | MFD_HUGETLB
    # untouched
    ("read", (0, 0, 0), ALLOW),
    ("write", (1, 0, 0), ALLOW),
    ("execve", (0, 0, 0), ALLOW),
    ("exit_group", (0,), ALLOW),
]


@pytest.mark.parametrize(
    ("arch", "name", "args", "expected"),
    [
        (arch, *case)
        for arch in SUPPORTED_ARCHES
        for case in CASES
        # aarch64 has only the *at forms (no open, chmod, mkdir, mknod, creat, ...).
        if case[0] in SYSCALLS[arch] or case[0] in ORDINARY[arch]
    ],
    ids=str,
)
def test_each_row_decides_on_both_architectures(
    arch: str, name: str, args: tuple[int, ...], expected: int
) -> None:
    assert hex(act(arch, name, *args)) == hex(expected)


def test_every_case_runs_on_some_architecture() -> None:
    # A case whose call no table numbers would be left out of the run above, silently.
    unknown = sorted(
        {
            name
            for name, _, _ in CASES
            if not any(name in SYSCALLS[a] or name in ORDINARY[a] for a in SUPPORTED_ARCHES)
        }
    )
    assert unknown == []


@pytest.mark.parametrize("arch", SUPPORTED_ARCHES)
def test_the_program_is_one_the_kernel_loads(arch: str) -> None:
    insns = bpf.decode(compile_program(arch))
    assert 50 < len(insns) < 512
    # It starts by checking the architecture.
    assert insns[0] == (0x20, 0, 0, 4)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHES)
def test_a_foreign_abi_is_killed(arch: str) -> None:
    program = compile_program(arch)
    for other in (0x40000003, 0x40000028, *(v for a, v in AUDIT_ARCH.items() if a != arch)):
        # i386, arm32, and the other supported 64-bit architecture
        for nr in (0, 20, 39, 172):
            assert bpf.run(program, bpf.seccomp_data(nr, other)) == KILL


def test_the_x32_abi_is_killed_on_x86_64() -> None:
    program = compile_program("x86_64")
    for nr in (0, 39, 512, 547):  # read, getpid, x32's own rt_sigaction and pwritev2
        data = bpf.seccomp_data(X32_SYSCALL_BIT | nr, AUDIT_ARCH["x86_64"])
        assert bpf.run(program, data) == KILL


@pytest.mark.parametrize("arch", SUPPORTED_ARCHES)
def test_calls_newer_than_the_table_are_enosys(arch: str) -> None:
    program = compile_program(arch)
    native = AUDIT_ARCH[arch]
    assert bpf.run(program, bpf.seccomp_data(NEWEST[arch], native)) == ALLOW
    for nr in (NEWEST[arch] + 1, 470, 1000, 0x3FFFFFFF, -1):
        assert bpf.run(program, bpf.seccomp_data(nr, native)) == ENOSYS


@pytest.mark.parametrize("arch", SUPPORTED_ARCHES)
def test_every_call_the_policy_does_not_name_is_allowed(arch: str) -> None:
    program = compile_program(arch)
    named = {SYSCALLS[arch][n] for rule in POLICY for n in rule.syscalls if n in SYSCALLS[arch]}
    for nr in range(NEWEST[arch] + 1):
        if nr not in named:
            # With argument values that trip every condition of the policy.
            data = bpf.seccomp_data(nr, AUDIT_ARCH[arch], [0xFFFFFFFFFFFFFFFF] * 6)
            assert bpf.run(program, data) == ALLOW, nr


@pytest.mark.parametrize("arch", SUPPORTED_ARCHES)
def test_the_kernel_walks_a_short_path_for_every_call(arch: str) -> None:
    # When it loads the filter the kernel runs it once per call number (to cache the
    # calls always allowed); then it runs it for every call that depends on arguments. A
    # binary search keeps both short: a chain of ~70 comparisons would walk ~150.
    program = compile_program(arch)
    longest = max(
        bpf.trace(program, bpf.seccomp_data(nr, AUDIT_ARCH[arch], [0] * 6))[1]
        for nr in range(NEWEST[arch] + 2)
    )
    assert longest <= 20, longest


def test_the_interpreter_refuses_what_the_kernel_refuses() -> None:
    def insn(code: int, jt: int = 0, jf: int = 0, k: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    ret = insn(0x06, k=ALLOW)
    with pytest.raises(bpf.BadProgram, match="last instruction"):
        bpf.decode(insn(0x20, k=4))  # ld arch, no return
    with pytest.raises(bpf.BadProgram, match="out of the program"):
        bpf.decode(insn(0x15, jt=5) + ret)  # jeq beyond the end
    with pytest.raises(bpf.BadProgram, match="out-of-range load"):
        bpf.decode(insn(0x20, k=64) + ret)  # past seccomp_data
    with pytest.raises(bpf.BadProgram, match="refuses"):
        bpf.run(insn(0x28) + ret, bpf.seccomp_data(0, 0))  # a half-word load
    assert bpf.run(ret, bpf.seccomp_data(0, 0)) == ALLOW


def test_every_named_call_exists_somewhere_and_the_table_names_it() -> None:
    doc = seccomp.__doc__ or ""
    for rule in POLICY:
        for name in rule.syscalls:
            assert any(name in SYSCALLS[a] for a in SUPPORTED_ARCHES), name
            assert f"``{name}``" in doc, f"{name} missing from the module's policy table"


def test_unknown_architecture_is_refused() -> None:
    with pytest.raises(ValueError, match="no seccomp policy"):
        compile_program("riscv64")


# --- the number tables against the kernel headers and libseccomp ---------------------

HEADERS = {
    "x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
    "aarch64": Path("/usr/include/asm-generic/unistd.h"),
}


@pytest.mark.parametrize("arch", SUPPORTED_ARCHES)
def test_numbers_match_the_kernel_headers(arch: str) -> None:
    header = HEADERS[arch]
    need(header.exists(), f"kernel headers missing ({header}; install linux-libc-dev)")
    known = {
        m.group(1): int(m.group(2))
        for m in re.finditer(r"#define __NR(?:3264)?_(\w+)\s+(\d+)\b", header.read_text())
    }
    compared = 0
    for name, nr in SYSCALLS[arch].items():
        if name in known:  # headers older than a call do not name it
            assert known[name] == nr, name
            compared += 1
    assert compared > 40


# libseccomp's names for the architectures (SCMP_ARCH_*).
_SCMP_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}


@pytest.mark.parametrize("arch", SUPPORTED_ARCHES)
def test_numbers_match_libseccomp(arch: str) -> None:
    found = ctypes.util.find_library("seccomp")
    need(found is not None, "libseccomp not installed (libseccomp2)")
    assert found is not None
    lib = ctypes.CDLL(found)
    resolve = lib.seccomp_syscall_resolve_name_arch
    resolve.argtypes = [ctypes.c_uint32, ctypes.c_char_p]
    resolve.restype = ctypes.c_int
    compared = 0
    for name, nr in SYSCALLS[arch].items():
        theirs = resolve(_SCMP_ARCH[arch], name.encode())
        if theirs >= 0:  # libseccomp older than a call does not know it
            assert theirs == nr, name
            compared += 1
    assert compared > 40
