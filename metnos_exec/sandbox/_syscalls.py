"""System call numbers for the seccomp policy (`metnos_exec.sandbox.seccomp`), per architecture.

Only the calls the policy names, plus the newest call this table knows of (anything above
it is answered ``ENOSYS``, see the policy). Numbers come from the kernel's UAPI headers
(``asm/unistd_64.h`` for x86_64, ``asm-generic/unistd.h`` for aarch64); since Linux 5.1
(``pidfd_send_signal``, 424) every architecture shares one numbering for new calls, which
is why the two tables agree from there on. ``tests/sandbox/test_seccomp.py`` checks them
against the installed headers and against libseccomp where those know a name.

A name missing from an architecture's table does not exist there (aarch64 has no ``open``,
``chmod`` or ``mkdir``: only their ``*at`` forms); the policy skips it on that
architecture.
"""

from __future__ import annotations

__all__ = ("AUDIT_ARCH", "NEWEST", "SYSCALLS", "X32_SYSCALL_BIT")

#: ``seccomp_data.arch`` of each supported architecture (``AUDIT_ARCH_*`` in
#: ``linux/audit.h``: the ELF machine, 64-bit, little-endian).
AUDIT_ARCH: dict[str, int] = {
    "x86_64": 0xC000003E,
    "aarch64": 0xC00000B7,
}

#: x86_64's x32 ABI: the same audit architecture, numbers with this bit set.
X32_SYSCALL_BIT = 0x40000000

#: The newest call in the tables below (``file_setattr``, Linux 6.17).
NEWEST: dict[str, int] = {"x86_64": 469, "aarch64": 469}

_SHARED: dict[str, int] = {
    # Since Linux 5.1 all architectures number new calls alike.
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "clone3": 435,
    "openat2": 437,
    "pidfd_getfd": 438,
    "process_madvise": 440,
    "mount_setattr": 442,
    "quotactl_fd": 443,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "fchmodat2": 452,
    "open_tree_attr": 467,
    "file_setattr": 469,
}

SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {
        "open": 2,
        "ioctl": 16,
        "socket": 41,
        "socketpair": 53,
        "clone": 56,
        "creat": 85,
        "mkdir": 83,
        "chmod": 90,
        "fchmod": 91,
        "ptrace": 101,
        "syslog": 103,
        "mknod": 133,
        "uselib": 134,
        "personality": 135,
        "ustat": 136,
        "sysfs": 139,
        "vhangup": 153,
        "modify_ldt": 154,
        "pivot_root": 155,
        "chroot": 161,
        "acct": 163,
        "settimeofday": 164,
        "mount": 165,
        "umount2": 166,
        "swapon": 167,
        "swapoff": 168,
        "reboot": 169,
        "iopl": 172,
        "ioperm": 173,
        "init_module": 175,
        "delete_module": 176,
        "quotactl": 179,
        "clock_settime": 227,
        "kexec_load": 246,
        "add_key": 248,
        "request_key": 249,
        "keyctl": 250,
        "migrate_pages": 256,
        "openat": 257,
        "mkdirat": 258,
        "mknodat": 259,
        "fchmodat": 268,
        "unshare": 272,
        "move_pages": 279,
        "perf_event_open": 298,
        "fanotify_init": 300,
        "name_to_handle_at": 303,
        "open_by_handle_at": 304,
        "setns": 308,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "kcmp": 312,
        "finit_module": 313,
        "kexec_file_load": 320,
        "memfd_create": 319,
        "bpf": 321,
        "userfaultfd": 323,
        **_SHARED,
    },
    "aarch64": {
        "mknodat": 33,
        "mkdirat": 34,
        "umount2": 39,
        "mount": 40,
        "pivot_root": 41,
        "chroot": 51,
        "fchmod": 52,
        "fchmodat": 53,
        "openat": 56,
        "vhangup": 58,
        "quotactl": 60,
        "ioctl": 29,
        "acct": 89,
        "personality": 92,
        "unshare": 97,
        "kexec_load": 104,
        "init_module": 105,
        "delete_module": 106,
        "clock_settime": 112,
        "syslog": 116,
        "ptrace": 117,
        "reboot": 142,
        "settimeofday": 170,
        "socket": 198,
        "socketpair": 199,
        "add_key": 217,
        "request_key": 218,
        "keyctl": 219,
        "clone": 220,
        "swapon": 224,
        "swapoff": 225,
        "migrate_pages": 238,
        "move_pages": 239,
        "perf_event_open": 241,
        "fanotify_init": 262,
        "name_to_handle_at": 264,
        "open_by_handle_at": 265,
        "setns": 268,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "kcmp": 272,
        "finit_module": 273,
        "bpf": 280,
        "userfaultfd": 282,
        "memfd_create": 279,
        "kexec_file_load": 294,
        **_SHARED,
    },
}
