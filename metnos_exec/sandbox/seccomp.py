"""The bwrap arm's seccomp filter: one policy table, assembled here into classic BPF.

bubblewrap loads the program (``--seccomp FD``) as the very last step before it execs the
guest, so it binds every process of the job and cannot be removed (seccomp filters only
ever stack). The policy is a deny list on top of the namespaces: a call it does not name
is allowed, and the walls around it (mounts, namespaces, no capabilities) still apply.
A denied call fails with ``EPERM`` (``ENOSYS`` where libc needs it to fall back,
``EACCES`` where the kernel's own rule for it answers so), so a
guest gets a clean error rather than a kill; only a foreign ABI is killed, because its
numbers mean other calls and no row below would apply to it.

Policy. Rows 1-3 are checked first; every other row is about its own calls, and the first
of a call's rows that matches decides. "Low word": the 32 bits of an argument the kernel
reads, so garbage in the upper half changes nothing. Each row: calls, when, action, and
the threat it answers.

 1. any call, when the architecture is not the worker's (i386 ``int 0x80`` on x86_64,
    arm32 on aarch64): kill. Another ABI's numbers would slip past every row.
 2. any call, on x86_64, when it is an x32 call (``nr & 0x40000000``; not -1, which is no
    call): kill. x32 shares the x86_64 audit architecture; its numbers slip past every row.
 3. any call numbered above the newest this table knows: ENOSYS. Kernel interfaces nobody
    reviewed here; ENOSYS reads as "an older kernel", so libc falls back.
 4. ``socket``, unless ``AF_INET``/``AF_INET6``, or ``AF_NETLINK`` with ``NETLINK_ROUTE``:
    EPERM. ``AF_UNIX`` reaches host daemons through a socket inside a mounted folder (and,
    with the host network, abstract sockets); vsock reaches the hypervisor; packet, alg,
    bluetooth, rds and the other families are rarely used kernel code.
 5. ``socketpair``, unless ``AF_UNIX`` with ``SOCK_STREAM``/``SOCK_SEQPACKET``: EPERM. A
    datagram pair, once disconnected (``connect(AF_UNSPEC)``), can ``sendto`` any socket
    path.
 6. ``open``, ``openat``, with ``O_CREAT`` or ``O_TMPFILE`` and a mode holding ``S_ISUID``
    or ``S_ISGID``: EPERM. A setuid/setgid file planted in a writable folder runs with the
    worker's identity on the host.
 7. ``creat``, ``mkdir``, ``mkdirat``, ``mknod``, ``mknodat``, when the mode holds
    ``S_ISUID`` or ``S_ISGID``: EPERM. The same, through the other creating calls.
 8. ``chmod``, ``fchmod``, ``fchmodat``, ``fchmodat2``, when the mode holds ``S_ISUID`` or
    ``S_ISGID``: EPERM. The same, set after the fact (``chmod 6755``, ``cp -p``, ``tar -p``).
 9. ``openat2``: ENOSYS. Its flags and mode sit in a struct seccomp cannot read; libc falls
    back to ``openat`` (row 6).
10. ``clone``, when the flags hold a ``CLONE_NEW*`` namespace bit: EPERM. New namespaces are
    the first step of most kernel exploit chains.
11. ``unshare``, when the flags hold a ``CLONE_NEW*`` namespace bit: EPERM. The same, for
    the calling process.
12. ``clone3``: ENOSYS. Its flags sit in a struct seccomp cannot read; libc falls back to
    ``clone`` (row 10).
13. ``setns``: EPERM. Joining another namespace.
14. ``keyctl``, ``add_key``, ``request_key``: EPERM. Kernel keyrings belong to the worker's
    user: a job could read the worker's keys, or leave a key for the next job.
15. ``ptrace``, ``process_vm_readv``, ``process_vm_writev``, ``kcmp``, ``pidfd_getfd``,
    ``process_madvise``: EPERM. Reading or steering another process of the job (its
    memory, its fds); a common exploit primitive.
16. ``mount``, ``umount2``, ``pivot_root``, ``chroot``, ``fsopen``, ``fsconfig``,
    ``fsmount``, ``fspick``, ``move_mount``, ``open_tree``, ``open_tree_attr``,
    ``mount_setattr``: EPERM. Reshaping the filesystem view the walls are made of.
17. ``io_uring_setup``, ``io_uring_enter``, ``io_uring_register``: EPERM. A second system
    call interface seccomp cannot see into (it opens files, creates and connects sockets).
18. ``bpf``, ``perf_event_open``, ``userfaultfd``: EPERM. Large kernel attack surface (the
    BPF verifier, PMU drivers, a race-widening primitive).
19. ``open_by_handle_at``, ``name_to_handle_at``: EPERM. File handles open files by inode,
    around every path wall (the "shocker" container escape).
20. ``kexec_load``, ``kexec_file_load``, ``init_module``, ``finit_module``,
    ``delete_module``, ``reboot``, ``swapon``, ``swapoff``, ``acct``, ``quotactl``,
    ``quotactl_fd``, ``syslog``, ``settimeofday``, ``clock_settime``, ``vhangup``: EPERM.
    Host-global kernel state: kernel code, the clock, swap, accounting, the kernel log.
21. ``personality``, unless the persona is 0, ``UNAME26``, ``PER_LINUX32`` (or both), or
    the query ``0xffffffff``: EPERM. ``ADDR_NO_RANDOMIZE``, ``READ_IMPLIES_EXEC`` and the
    like weaken ASLR and W^X for what the job runs.
22. ``ioctl``, with request ``TIOCSTI`` or ``TIOCLINUX``: EPERM. Typing into a terminal or
    a console (keystroke injection).
23. ``iopl``, ``ioperm``, ``modify_ldt``, ``uselib``, ``ustat``, ``sysfs``,
    ``fanotify_init``, ``move_pages``, ``migrate_pages``: EPERM. Port I/O, segment tables,
    obsolete calls, other processes' memory placement: no use in a job, a history of
    kernel bugs.
24. ``memfd_create``, unless the flags hold ``MFD_NOEXEC_SEAL``: EACCES (what the kernel
    answers under ``vm.memfd_noexec = 2``, the same rule; that setting is per pid
    namespace and only a process holding ``CAP_SYS_ADMIN`` there could set it, which the
    guest never does). A memory file lives on an internal mount, which landlock does not
    judge: an executable one would let the job ``execve`` code it wrote (``fexecve``,
    ``/proc/self/fd/N``) where landlock refuses every file it wrote. Sealed, it has no
    execute bit and can never get one (``F_SEAL_EXEC``). Kernels before 6.3 do not know
    the flag (``EINVAL``): there a job has no memory files at all.

Not in the table, on purpose: ``setxattr`` and its kin (a file capability in
``security.capability`` needs ``CAP_SETFCAP``, which the guest never holds: tested), ``link``
and ``rename`` (a hard link or rename across mounts fails with ``EXDEV``, so a setuid
binary of the system trees cannot be linked into a writable folder), ``landlock_*`` (a job
may sandbox itself further).

Why our own assembler instead of libseccomp: the program is built once per worker from
this table (~300 instructions, ~2.5 KiB: a binary search over the call numbers, so the
kernel walks ~10 instructions per call) and handed to bubblewrap through a pipe, so the
only per-job cost is one pipe; the table stays the single source, readable next to
the code; there is no runtime dependency on a system library whose syscall tables lag the
kernel (libseccomp 2.5.4, in Debian 12, does not know ``mseal``, so the newest-call cut-off
of row 3 would need raw numbers anyway); and the output is deterministic, so the tests run
every row through a BPF interpreter (``tests/sandbox/bpf.py``), on both architectures,
besides attacking it on the real kernel. Codex (seccompiler), Firecracker and nsjail
(kafel) make the same choice. The price is the number tables (`._syscalls`), checked in
the tests against the kernel headers and libseccomp.
"""

from __future__ import annotations

import errno
import functools
import os
import struct
from collections.abc import Iterator
from typing import Final

import msgspec

from ._syscalls import AUDIT_ARCH, NEWEST, SYSCALLS, X32_SYSCALL_BIT

__all__ = (
    "ALLOW",
    "KILL",
    "POLICY",
    "SUPPORTED_ARCHES",
    "AllOf",
    "AnyOf",
    "Cond",
    "In",
    "Masked",
    "Not",
    "Rule",
    "compile_program",
    "errno_action",
    "native_arch",
    "seccomp_support",
)

# --- actions (linux/seccomp.h) ------------------------------------------------------

KILL: Final = 0x80000000  # SECCOMP_RET_KILL_PROCESS
ALLOW: Final = 0x7FFF0000  # SECCOMP_RET_ALLOW
_RET_ERRNO: Final = 0x00050000


def errno_action(err: int) -> int:
    """``SECCOMP_RET_ERRNO`` carrying `err`: the call fails with it, nothing runs."""
    return _RET_ERRNO | (err & 0xFFFF)


EPERM: Final = errno_action(errno.EPERM)
ENOSYS: Final = errno_action(errno.ENOSYS)
EACCES: Final = errno_action(errno.EACCES)

# --- conditions on the call's arguments ----------------------------------------------


class Masked(msgspec.Struct, frozen=True):
    """True when ``low_word(arg[index]) & mask`` is not zero."""

    index: int
    mask: int


class In(msgspec.Struct, frozen=True):
    """True when ``low_word(arg[index]) & mask`` is one of `values`."""

    index: int
    values: tuple[int, ...]
    mask: int = 0xFFFFFFFF


class AllOf(msgspec.Struct, frozen=True):
    """True when every condition is."""

    conds: tuple[Cond, ...]


class AnyOf(msgspec.Struct, frozen=True):
    """True when one condition is."""

    conds: tuple[Cond, ...]


class Not(msgspec.Struct, frozen=True):
    """True when `cond` is false."""

    cond: Cond


Cond = Masked | In | AllOf | AnyOf | Not


class Rule(msgspec.Struct, frozen=True):
    """One row of the policy.

    Attributes:
        syscalls: the calls it covers (names an architecture lacks are skipped there).
        action: what the filter answers (`EPERM`, `ENOSYS`, ...).
        threat: what the row answers, for people.
        when: a condition on the arguments; ``None`` means always.
    """

    syscalls: tuple[str, ...]
    action: int
    threat: str
    when: Cond | None = None


# --- constants the rows test (x86_64 and aarch64 agree on all of them) -----------------

AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
NETLINK_ROUTE = 0
SOCK_STREAM, SOCK_SEQPACKET = 1, 5
_SOCK_TYPE_MASK = 0xF  # the rest of `type` is SOCK_NONBLOCK / SOCK_CLOEXEC
O_CREAT, O_TMPFILE_BIT = 0o100, 0o20000000
S_ISUID_OR_GID = 0o6000
#: CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET.
CLONE_NEW_NAMESPACES = 0x7E020000
#: The same plus CLONE_NEWTIME (0x80), which only ``unshare`` takes (in ``clone`` the low
#: byte is the exit signal).
UNSHARE_NEW_NAMESPACES = CLONE_NEW_NAMESPACES | 0x80
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
#: Personas Docker and Flatpak allow too: plain Linux, ``UNAME26``, ``PER_LINUX32``, both,
#: and the query. Anything else (ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC, ...) is refused.
SAFE_PERSONAS = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
#: memfd_create's flag (Linux 6.3): the file is not executable and can never become so.
MFD_NOEXEC_SEAL = 0x8


def _mode_has_setid(index: int) -> Masked:
    return Masked(index, S_ISUID_OR_GID)


def _creates(flags: int, mode: int) -> AllOf:
    return AllOf((Masked(flags, O_CREAT | O_TMPFILE_BIT), _mode_has_setid(mode)))


#: The policy: the module docstring's table, rows 4-24 (rows 1-3 are the program's
#: prologue, see `compile_program`). Keep the two in step (a test checks the names).
POLICY: tuple[Rule, ...] = (
    Rule(
        ("openat",),
        EPERM,
        "a setuid/setgid file planted for the host",
        when=_creates(flags=2, mode=3),
    ),
    Rule(("open",), EPERM, "a setuid/setgid file planted for the host", when=_creates(1, 2)),
    Rule(
        ("ioctl",),
        EPERM,
        "keystroke injection into a terminal or a console",
        when=In(1, (TIOCSTI, TIOCLINUX)),
    ),
    Rule(
        ("clone",),
        EPERM,
        "new namespaces: the first step of most kernel exploit chains",
        when=Masked(0, CLONE_NEW_NAMESPACES),
    ),
    Rule(
        ("socket",),
        EPERM,
        "host Unix sockets, vsock, and rarely used socket families",
        when=Not(
            AnyOf(
                (
                    In(0, (AF_INET, AF_INET6)),
                    AllOf((In(0, (AF_NETLINK,)), In(2, (NETLINK_ROUTE,)))),
                )
            )
        ),
    ),
    Rule(
        ("socketpair",),
        EPERM,
        "a disconnectable datagram pair that can sendto any socket path",
        when=Not(
            AllOf(
                (
                    In(0, (AF_UNIX,)),
                    In(1, (SOCK_STREAM, SOCK_SEQPACKET), mask=_SOCK_TYPE_MASK),
                )
            )
        ),
    ),
    Rule(
        ("creat", "mkdir", "mknod"),
        EPERM,
        "a setuid/setgid file planted for the host",
        when=_mode_has_setid(1),
    ),
    Rule(
        ("mkdirat", "mknodat"),
        EPERM,
        "a setuid/setgid file planted for the host",
        when=_mode_has_setid(2),
    ),
    Rule(
        ("chmod", "fchmod"),
        EPERM,
        "a setuid/setgid bit set on a file the host sees",
        when=_mode_has_setid(1),
    ),
    Rule(
        ("fchmodat", "fchmodat2"),
        EPERM,
        "a setuid/setgid bit set on a file the host sees",
        when=_mode_has_setid(2),
    ),
    Rule(("openat2",), ENOSYS, "flags and mode in a struct seccomp cannot read"),
    Rule(
        ("unshare",),
        EPERM,
        "new namespaces: the first step of most kernel exploit chains",
        when=Masked(0, UNSHARE_NEW_NAMESPACES),
    ),
    Rule(("clone3",), ENOSYS, "flags in a struct seccomp cannot read"),
    Rule(("setns",), EPERM, "joining another namespace"),
    Rule(
        ("keyctl", "add_key", "request_key"),
        EPERM,
        "kernel keyrings shared with the worker's user and between jobs",
    ),
    Rule(
        (
            "ptrace",
            "process_vm_readv",
            "process_vm_writev",
            "kcmp",
            "pidfd_getfd",
            "process_madvise",
        ),
        EPERM,
        "reading or steering another process of the job",
    ),
    Rule(
        (
            "mount",
            "umount2",
            "pivot_root",
            "chroot",
            "fsopen",
            "fsconfig",
            "fsmount",
            "fspick",
            "move_mount",
            "open_tree",
            "open_tree_attr",
            "mount_setattr",
        ),
        EPERM,
        "reshaping the filesystem view the walls are made of",
    ),
    Rule(
        ("io_uring_setup", "io_uring_enter", "io_uring_register"),
        EPERM,
        "a system call interface seccomp cannot see into",
    ),
    Rule(
        ("bpf", "perf_event_open", "userfaultfd"),
        EPERM,
        "large kernel attack surface",
    ),
    Rule(
        ("open_by_handle_at", "name_to_handle_at"),
        EPERM,
        "opening files by inode, around the path walls",
    ),
    Rule(
        (
            "kexec_load",
            "kexec_file_load",
            "init_module",
            "finit_module",
            "delete_module",
            "reboot",
            "swapon",
            "swapoff",
            "acct",
            "quotactl",
            "quotactl_fd",
            "syslog",
            "settimeofday",
            "clock_settime",
            "vhangup",
        ),
        EPERM,
        "host-global kernel state",
    ),
    Rule(
        ("personality",),
        EPERM,
        "personas that weaken ASLR or W^X",
        when=Not(In(0, SAFE_PERSONAS)),
    ),
    Rule(
        (
            "iopl",
            "ioperm",
            "modify_ldt",
            "uselib",
            "ustat",
            "sysfs",
            "fanotify_init",
            "move_pages",
            "migrate_pages",
        ),
        EPERM,
        "interfaces with no use in a job and a history of kernel bugs",
    ),
    Rule(
        ("memfd_create",),
        EACCES,
        "an executable memory file: code the job wrote, run by execve where landlock does not look",
        when=Not(Masked(1, MFD_NOEXEC_SEAL)),
    ),
)

SUPPORTED_ARCHES: tuple[str, ...] = tuple(AUDIT_ARCH)

# --- classic BPF -----------------------------------------------------------------------

# linux/filter.h opcodes (only those the program uses; the test interpreter knows them all).
_LD_W_ABS: Final = 0x20  # BPF_LD | BPF_W | BPF_ABS: A = seccomp_data[k:k+4]
_ALU_AND_K: Final = 0x54  # BPF_ALU | BPF_AND | BPF_K: A &= k
_JMP_JA: Final = 0x05  # pc += k
_JMP_JEQ_K: Final = 0x15  # pc += (A == k) ? jt : jf
_JMP_JGT_K: Final = 0x25  # pc += (A > k) ? jt : jf
_JMP_JGE_K: Final = 0x35
_JMP_JSET_K: Final = 0x45  # pc += (A & k) ? jt : jf
_RET_K: Final = 0x06

# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6].
_NR, _ARCH = 0, 4


def _arg_low(index: int) -> int:
    # Little-endian only (x86_64, aarch64): the low word of args[i] comes first.
    return 16 + 8 * index


#: A program the kernel accepts has at most BPF_MAXINSNS instructions.
MAX_INSNS = 4096


class _Label:
    """A jump target inside the program, placed where it is emitted."""

    __slots__ = ()


_Target = int | _Label  # a conditional jump's branch: 0 = fall through, or a label


class _Op(msgspec.Struct):
    code: int
    k: int = 0
    jt: _Target = 0
    jf: _Target = 0


class _Assembler:
    """Instructions with forward labels, resolved into relative jumps at the end."""

    def __init__(self) -> None:
        self.items: list[_Op | _Label] = []

    def op(self, code: int, k: int = 0, jt: _Target = 0, jf: _Target = 0) -> None:
        self.items.append(_Op(code, k, jt, jf))

    def place(self, label: _Label) -> None:
        self.items.append(label)

    def cond(self, cond: Cond, true: _Label, false: _Label) -> None:
        """Jump to `true` or `false` according to `cond`; never falls through."""
        if isinstance(cond, Masked):
            self.op(_LD_W_ABS, _arg_low(cond.index))
            self.op(_JMP_JSET_K, cond.mask, true, false)
        elif isinstance(cond, In):
            self.op(_LD_W_ABS, _arg_low(cond.index))
            if cond.mask != 0xFFFFFFFF:
                self.op(_ALU_AND_K, cond.mask)
            for value in cond.values:
                self.op(_JMP_JEQ_K, value, true, 0)
            self.op(_JMP_JA, 0, false)
        elif isinstance(cond, Not):
            self.cond(cond.cond, false, true)
        elif isinstance(cond, AllOf):
            for part in cond.conds[:-1]:
                nxt = _Label()
                self.cond(part, nxt, false)
                self.place(nxt)
            self.cond(cond.conds[-1], true, false)
        else:
            for part in cond.conds[:-1]:
                nxt = _Label()
                self.cond(part, true, nxt)
                self.place(nxt)
            self.cond(cond.conds[-1], true, false)

    def assemble(self) -> bytes:
        where: dict[int, int] = {}
        pc = 0
        for item in self.items:
            if isinstance(item, _Label):
                where[id(item)] = pc
            else:
                pc += 1

        def rel(target: _Target, pc: int, wide: bool) -> int:
            if isinstance(target, int):
                return target
            off = where[id(target)] - pc - 1
            if off < 0 or (not wide and off > 255):
                raise ValueError(f"jump out of range: {off}")
            return off

        out = bytearray()
        pc = 0
        for item in self.items:
            if isinstance(item, _Label):
                continue
            if item.code == _JMP_JA:
                k, jt, jf = rel(item.jt, pc, wide=True), 0, 0
            else:
                k, jt, jf = item.k, rel(item.jt, pc, False), rel(item.jf, pc, False)
            out += struct.pack("=HBBI", item.code, jt, jf, k)
            pc += 1
        if pc > MAX_INSNS:
            raise ValueError(f"seccomp program too long: {pc} instructions")
        return bytes(out)


def _rows(arch: str) -> Iterator[tuple[int, list[Rule]]]:
    """(syscall number, its rules in policy order), in the order of first appearance."""
    numbers = SYSCALLS[arch]
    by_nr: dict[int, list[Rule]] = {}
    for rule in POLICY:
        for name in rule.syscalls:
            nr = numbers.get(name)
            if nr is not None:
                by_nr.setdefault(nr, []).append(rule)
    yield from by_nr.items()


@functools.cache
def compile_program(arch: str) -> bytes:
    """The policy as a classic BPF program for `arch`, ready for ``--seccomp FD``.

    Args:
        arch: one of `SUPPORTED_ARCHES` (``os.uname().machine`` spelling).

    Returns:
        The program: ``struct sock_filter`` records, native byte order.

    Raises:
        ValueError: an unsupported architecture, or a program the kernel would refuse.
    """
    if arch not in AUDIT_ARCH:
        raise ValueError(f"no seccomp policy for architecture {arch!r}")
    asm = _Assembler()
    # Row 1: a foreign ABI numbers calls differently: nothing below would mean anything.
    native = _Label()
    asm.op(_LD_W_ABS, _ARCH)
    asm.op(_JMP_JEQ_K, AUDIT_ARCH[arch], native, 0)
    asm.op(_RET_K, KILL)
    asm.place(native)
    asm.op(_LD_W_ABS, _NR)
    if arch == "x86_64":
        # Row 2: x32 calls share the audit arch and carry this bit. Number -1 is no call
        # (tracers use it to skip one): it goes on to row 3, ENOSYS, as the kernel says.
        not_x32 = _Label()
        asm.op(_JMP_JGE_K, X32_SYSCALL_BIT, 0, not_x32)
        asm.op(_JMP_JEQ_K, 0xFFFFFFFF, not_x32, 0)
        asm.op(_RET_K, KILL)
        asm.place(not_x32)
    # Row 3: newer than this table: unreviewed.
    known = _Label()
    asm.op(_JMP_JGT_K, NEWEST[arch], 0, known)
    asm.op(_RET_K, ENOSYS)
    asm.place(known)
    rows = dict(_rows(arch))
    blocks = {nr: _Label() for nr, rules in rows.items() if rules[0].when is not None}
    _dispatch(asm, sorted(rows), rows, blocks)
    # The blocks of the calls whose answer depends on their arguments: every one ends in
    # a return, so none falls into the next.
    for nr, block in blocks.items():
        asm.place(block)
        for rule in rows[nr]:
            if rule.when is None:
                asm.op(_RET_K, rule.action)
                break
            hit, miss = _Label(), _Label()
            asm.cond(rule.when, hit, miss)
            asm.place(hit)
            asm.op(_RET_K, rule.action)
            asm.place(miss)
        else:
            asm.op(_RET_K, ALLOW)
    return asm.assemble()


#: Calls per leaf of the dispatch tree, compared one by one.
_LEAF = 3


def _dispatch(
    asm: _Assembler, nrs: list[int], rows: dict[int, list[Rule]], blocks: dict[int, _Label]
) -> None:
    """A binary search over the named calls' numbers (A holds the number).

    Why not a chain of comparisons: the kernel runs the filter once per call number when
    it loads it (to cache the calls it always allows, which then skip the filter), and a
    chain walks ~200 instructions for each of them; the tree walks ~10. A call without a
    row ends at a leaf's ``ALLOW``; an unconditional row answers at its leaf; a row with
    conditions jumps to its block.
    """
    if len(nrs) <= _LEAF:
        for nr in nrs:
            asm.op(_JMP_JEQ_K, nr, 0, 1)
            block = blocks.get(nr)
            if block is None:
                asm.op(_RET_K, rows[nr][0].action)
            else:
                asm.op(_JMP_JA, 0, block)
        asm.op(_RET_K, ALLOW)
        return
    half = len(nrs) // 2
    upper = _Label()
    asm.op(_JMP_JGE_K, nrs[half], upper, 0)
    _dispatch(asm, nrs[:half], rows, blocks)
    asm.place(upper)
    _dispatch(asm, nrs[half:], rows, blocks)


def native_arch() -> str | None:
    """The architecture the worker's programs run as, when the policy covers it.

    ``None`` for an architecture without a table, or a 32-bit interpreter on a 64-bit
    kernel (its guests would make calls of the other ABI, which the filter kills).
    """
    machine = os.uname().machine
    if machine not in AUDIT_ARCH or struct.calcsize("P") != 8:
        return None
    return machine


#: The filter actions the program returns (``/proc/sys/kernel/seccomp/actions_avail``).
_NEEDED_ACTIONS = frozenset({"kill_process", "errno", "allow"})


@functools.cache
def seccomp_support() -> tuple[str | None, str]:
    """Whether the bwrap arm can load the filter here.

    Returns:
        ``(arch, why)``: the architecture whose program to load and a phrase for the
        report, or ``(None, why not)``.
    """
    arch = native_arch()
    if arch is None:
        return None, f"no seccomp policy for this architecture ({os.uname().machine})"
    try:
        with open("/proc/sys/kernel/seccomp/actions_avail", encoding="ascii") as f:
            actions = set(f.read().split())
    except OSError as exc:
        return None, f"the kernel offers no seccomp filters ({exc.strerror})"
    missing = _NEEDED_ACTIONS - actions
    if missing:
        return None, f"the kernel lacks seccomp actions {sorted(missing)}"
    return arch, f"seccomp filter ({arch}, {len(compile_program(arch)) // 8} instructions)"
