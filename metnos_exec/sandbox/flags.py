"""Manifest-derived walls → bubblewrap argv, as a pure function.

Everything here is a mechanical translation of a `SandboxJob` into flags; nothing runs,
and the filesystem is only consulted through injected callables, so every rule is
unit-testable on a machine without bubblewrap. The policy (which mounts, network or not)
is decided upstream by `metnos_exec.plan`; this module only decides *how* bubblewrap
expresses it.

The command line is three tables of rows, each row with the threat it answers (as
`metnos_exec.sandbox.seccomp`'s `POLICY`): `FLAGS` (namespaces, identity, environment,
the fds bubblewrap is handed), `MOUNTS` (the guest's filesystem, built in table order
and then ordered parents first) and `LAST_FLAGS`; `derive_bwrap_argv` applies them in
that order and appends ``-- job.argv``. Read with bubblewrap's own warning in mind: it is
"not a complete, ready-made sandbox"; the seccomp filter comes in through ``seccomp_fd``
(`metnos_exec.sandbox.seccomp`), and landlock through the job's argv
(`metnos_exec.sandbox.landlock`). The job's kernel resource limits are
`metnos_exec.sandbox.rlimits`' (re-exported here).
"""

from __future__ import annotations

import os
import posixpath
import stat
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import msgspec

from ._types import Mount, SandboxJob
from .rlimits import derive_rlimits, prlimit_prefix, shell_limits_prefix

__all__ = (
    "GUEST_GID",
    "GUEST_UID",
    "MASKED_PATHS",
    "PROC_INIT_MASKED_PATHS",
    "PROC_MASKED_PATHS",
    "PROC_READ_ONLY_PATHS",
    "RESERVED_GUEST_PATHS",
    "SYSTEM_PATHS",
    "FLAGS",
    "LAST_FLAGS",
    "MOUNTS",
    "BwrapFeatures",
    "Flags",
    "Mounts",
    "default_interpreter_roots",
    "derive_bwrap_argv",
    "derive_rlimits",
    "prlimit_prefix",
    "shell_limits_prefix",
    "expand_hint",
    "expand_hints",
    "guest_python",
    "private_files",
)

_GLOB_CHARS = frozenset("*?[")


def expand_hint(hint: str, home: str) -> str:
    """Turn an ``fs:*`` hint into the host root bubblewrap should mount.

    bubblewrap mounts whole directory trees, so a glob hint is cut at its first segment
    holding a glob character; the fine grain stays with argument vetting (the first wall).
    ``~`` and ``~/...`` expand against `home` (never ``~user``: a manifest must not name
    other users' homes through us).

    Examples: ``~/notes/**`` → ``/home/u/notes``; ``/tmp/*`` → ``/tmp``;
    ``~/Pictures`` → ``/home/u/Pictures``.

    Args:
        hint: the hint as written in the manifest.
        home: the home directory ``~`` stands for.

    Returns:
        An absolute, normalised host path (no trailing slash, no ``..``).

    Raises:
        ValueError: the hint is empty, relative, uses ``~user``, or starts with a glob
            (which would mount ``/``).
    """
    if not hint:
        raise ValueError("empty fs hint")
    if hint == "~" or hint.startswith("~/"):
        path = home.rstrip("/") + hint[1:]
    elif hint.startswith("~"):
        raise ValueError(f"fs hint {hint!r}: only '~' and '~/' are expanded, not '~user'")
    else:
        path = hint
    if not posixpath.isabs(path):
        raise ValueError(f"fs hint {hint!r} is not absolute after '~' expansion")
    kept: list[str] = []
    for segment in path.split("/")[1:]:
        if _GLOB_CHARS.intersection(segment):
            break
        kept.append(segment)
    root = posixpath.normpath("/" + "/".join(kept))
    if root == "/":
        # Cutting "/*" or "/**" leaves the host root: refusing is the only honest answer,
        # mounting / would turn the files wall into decoration.
        raise ValueError(f"fs hint {hint!r} expands to the host root '/'")
    # normpath keeps a leading "//" (POSIX allows it to mean something else); fold it.
    return "/" + root.lstrip("/")


def expand_hints(hints: tuple[str, ...] | list[str], home: str | None = None) -> tuple[str, ...]:
    """`expand_hint` over several hints, de-duplicated, first occurrence order kept.

    Args:
        hints: hints as written in the manifest.
        home: the home ``~`` stands for; defaults to ``os.path.expanduser("~")``.

    Raises:
        ValueError: as `expand_hint`.
    """
    home = os.path.expanduser("~") if home is None else home
    seen: dict[str, None] = {}
    for hint in hints:
        seen.setdefault(expand_hint(hint, home), None)
    return tuple(seen)


# --- derivation ---------------------------------------------------------------------

#: Rule 1: host system trees the guest needs to run an interpreter, read-only, each only
#: if it exists (a missing ``/lib32`` is not an error). Read-only so a guest can never
#: plant a trojan in a shared library or a config the host later trusts.
SYSTEM_PATHS: tuple[str, ...] = (
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib64",
    "/lib32",
    "/etc",
    "/opt",
    "/var/lib/python3",
)

#: Private trees no job mount may replace or enter (see `derive_bwrap_argv`).
RESERVED_GUEST_PATHS: tuple[str, ...] = ("/proc", "/dev")

#: Secrets inside the system trees above, hidden behind an empty file / directory.
#: Why: the worker usually runs as root, and bubblewrap maps the guest's uid to the
#: worker's uid, so root-only files (``/etc/shadow``, ssh host keys) would be readable by
#: the guest through the read-only ``/etc`` bind. Masking answers that disclosure for
#: this fixed list only (a host's ``/etc/wireguard``, ``krb5.keytab``, TLS keys are not
#: in it), which is why the bwrap arm reports files and user ``partial`` for a root
#: worker; running the worker as an unprivileged user answers it properly.
MASKED_PATHS: tuple[str, ...] = (
    "/etc/shadow",
    "/etc/shadow-",
    "/etc/gshadow",
    "/etc/gshadow-",
    "/etc/security/opasswd",
    "/etc/sudoers",
    "/etc/sudoers.d",
    "/etc/ssh",
    "/etc/ssl/private",
)


#: Host-global kernel interfaces inside the private ``/proc``, made read-only (moby and
#: runc's ``readonlyPaths``). Why: ``/proc`` shows this pid namespace's processes only, but
#: these files act on the whole host. ``/proc/sys`` holds the sysctls: a guest whose uid
#: maps to host root (a root worker) could write ``kernel.core_pattern`` and have the
#: kernel run a program of its choosing as host root, in the host's namespaces, at the
#: next crash (issue 8). ``/proc/sysrq-trigger`` reboots or crashes the host; ``/proc/irq``,
#: ``/proc/bus`` and ``/proc/fs`` reconfigure devices and file servers. bubblewrap covers
#: some of them itself, but only when it finds the *folder* writable, which misses the
#: root-owned files of a read-only-looking folder (exactly ``/proc/sys``). Bound from the
#: host's ``/proc`` (the same kernel tables: sysctl files resolve per the *reader's*
#: namespaces, whichever proc mount they are reached through).
PROC_READ_ONLY_PATHS: tuple[str, ...] = (
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
)

#: Kernel state inside the private ``/proc`` hidden behind ``/dev/null`` (files) or an
#: empty read-only tmpfs (folders): moby and runc's ``maskedPaths`` (kernel memory, timers,
#: the scheduler's debug dump, the keys of the reader's keyrings, hardware lists; podman's
#: ``/proc`` entries are the same), plus the kernel's symbol table and allocator maps
#: (addresses that help an exploit), and every root-only (0400) file of ``/proc``'s top
#: level: physical page flags, counts and memory cgroup owners (``kpage*``: where kernel
#: objects sit in physical memory, the first step of Rowhammer-style and page-reuse
#: exploits), the buddy allocator's layout (``pagetypeinfo``) and the kernel log
#: (``kmsg``). Those need only the permission check, which a job that runs as host root (a
#: root worker's job without a slot uid) passes. Most of the others need a capability no
#: guest holds; masked anyway, as the runtimes do, so no kernel configuration is needed
#: for the guest to learn nothing from them. A list can only name the files known when it
#: was written: `_root_only_proc_files` adds the root-only files of the running kernel's
#: ``/proc`` top level that it does not name (``/proc/program_cpu`` on one 6.18 kernel).
_PROC_MASKED_KNOWN: tuple[str, ...] = (
    "/proc/acpi",
    "/proc/asound",
    "/proc/interrupts",
    "/proc/kallsyms",
    "/proc/kcore",
    "/proc/keys",
    "/proc/key-users",
    "/proc/kmsg",
    "/proc/kpagecgroup",
    "/proc/kpagecount",
    "/proc/kpageflags",
    "/proc/latency_stats",
    "/proc/pagetypeinfo",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/slabinfo",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/vmallocinfo",
)


def _root_only_proc_files(proc: str = "/proc") -> tuple[str, ...]:
    """The regular files at `proc`'s top level that neither group nor others may read
    (0400, 0600: root's alone), sorted; none when `proc` cannot be listed. Read once, at
    import: the top level of ``/proc`` is the kernel's, fixed while it runs."""
    try:
        names = os.listdir(proc)
    except OSError:
        return ()
    found = []
    for name in names:
        path = f"{proc}/{name}"
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not name.isdigit() and stat.S_ISREG(st.st_mode) and not st.st_mode & 0o044:
            found.append(path)
    return tuple(sorted(found))


PROC_MASKED_PATHS: tuple[str, ...] = _PROC_MASKED_KNOWN + tuple(
    p for p in _root_only_proc_files() if p not in _PROC_MASKED_KNOWN
)


#: The memory of bubblewrap's init (the sandbox's pid 1) behind ``/dev/null``. The guest
#: runs as the init's uid and the init is dumpable, so without landlock (which scopes
#: ptrace access to the guest's own domain) a guest opened ``/proc/1/mem`` read-write and
#: could rewrite the init: stop reaping, keep the tree alive, forge what it reports. The
#: other ways in (``ptrace``, ``process_vm_writev``) are seccomp's; an arm without the
#: filter says ``partial`` for the process tree (`hardening.annotate`).
PROC_INIT_MASKED_PATHS: tuple[str, ...] = ("/proc/1/mem", "/proc/1/task/1/mem")


def private_files(root: str = "/etc", *, skip: Sequence[str] = MASKED_PATHS) -> tuple[str, ...]:
    """Files and folders under `root` that only their owner or group may read.

    Regular files that are not world-readable, and folders that are not world-searchable
    (not descended into): what an unprivileged guest could not read, but a guest of a root
    worker (host uid 0 for permission checks) could. Symlinks are not followed. Entries at
    or under `skip` (already masked) are left out.

    Why: `MASKED_PATHS` names the usual secrets only; a host keeps others there too
    (``/etc/wireguard``, ``krb5.keytab``, TLS keys). The bwrap arm masks these as well when
    the worker is root (scanned once per worker: a file created later is not masked, which
    is one reason its files axis stays ``partial`` for a root worker).

    Args:
        root: the tree to scan.
        skip: paths already masked.

    Returns:
        Absolute paths, in walk order; ``()`` when `root` cannot be read.
    """
    found: list[str] = []
    for top, dirs, files in os.walk(root, onerror=lambda _exc: None):
        keep = []
        for name in dirs:
            path = posixpath.join(top, name)
            if any(_under(path, masked) for masked in skip):
                continue
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not st.st_mode & 0o001:
                found.append(path)
            else:
                keep.append(name)
        dirs[:] = keep
        for name in files:
            path = posixpath.join(top, name)
            if any(_under(path, masked) for masked in skip):
                continue
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and not st.st_mode & 0o004:
                found.append(path)
    return tuple(found)


#: The guest's uid/gid inside its user namespace: ``nobody``. Why: a guest that believes
#: it is root tries root things (and some tools relax checks for uid 0); as 65534 inside
#: a fresh user namespace it holds no capability at all.
GUEST_UID = 65534
GUEST_GID = 65534


class BwrapFeatures(msgspec.Struct, frozen=True):
    """What the installed bubblewrap supports (from ``bwrap --version`` and ``--help``).

    Attributes:
        version: parsed version, e.g. ``(0, 8, 0)``; ``()`` when unknown.
        bind_fd: ``--bind-fd`` / ``--ro-bind-fd`` exist (0.10.0, and distributions'
            backports to older releases: Debian's 0.8.0-2+deb12u1), with the check that
            the mounted inode is the fd's. Read from ``--help``, not the version.
    """

    version: tuple[int, ...] = ()
    bind_fd: bool = False

    @property
    def disable_userns(self) -> bool:
        """``--disable-userns`` exists since bubblewrap 0.8.0."""
        return self.version >= (0, 8, 0)

    @property
    def tmpfs_size(self) -> bool:
        """``--size`` before ``--tmpfs``: we only rely on it from 0.8.0 (conservative)."""
        return self.version >= (0, 8, 0)


#: How a ``python`` executor's interpreter runs: ``-I`` (isolated) minus ``-P``. ``-E`` ignores
#: every ``PYTHON*`` variable, ``-s`` the user's site-packages, ``-S`` the ``site`` module
#: (and with it the venv's and the system's site-packages), so ``sys.path`` is the
#: script's own folder (its sibling modules import) and the standard library, nothing
#: else. ``-I`` would also drop the script's folder (``-P``): a ``main.py`` importing a
#: ``helper.py`` next to it failed in the sandbox while it worked in a shell.
PYTHON_FLAGS: tuple[str, ...] = ("-E", "-s", "-S")


def guest_python() -> str:
    """The interpreter a native Python job should run, as a real path.

    A venv's ``bin/python`` is a symlink into the base installation; inside the sandbox only
    the base prefix is mounted, so the job must name the resolved base interpreter.
    """
    base = getattr(sys, "_base_executable", None) or sys.executable
    return os.path.realpath(base)


def default_interpreter_roots() -> tuple[str, ...]:
    """Prefixes of the running interpreter that the guest needs to start Python.

    `sys.base_prefix` and the prefix of the resolved executable (they differ under pyenv
    shims or relocated builds). Both resolved, so a symlinked prefix is mounted where the
    kernel will actually look.
    """
    roots: dict[str, None] = {}
    roots.setdefault(os.path.realpath(sys.base_prefix), None)
    exe_prefix = posixpath.dirname(posixpath.dirname(guest_python()))
    roots.setdefault(exe_prefix, None)
    return tuple(roots)


def _default_readlink(path: str) -> str | None:
    return os.readlink(path) if os.path.islink(path) else None


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _depth(path: str) -> int:
    return len([p for p in path.split("/") if p])


class _Op(msgspec.Struct, frozen=True):
    dest: str
    args: tuple[str, ...]


def _mask(path: str, is_dir: bool) -> tuple[str, ...]:
    """Hide `path`: a file behind ``/dev/null``, a folder behind an empty tmpfs made
    read-only (a writable one would be an unsized tmpfs the job could fill)."""
    if is_dir:
        return ("--tmpfs", path, "--remount-ro", path)
    return ("--ro-bind", "/dev/null", path)


@dataclass(frozen=True, slots=True)
class _Inputs:
    """What one derivation reads: the job, what its bubblewrap supports, the host (only
    through the callables), and the fds and files the caller hands over (the arguments of
    `derive_bwrap_argv`, defaults resolved)."""

    job: SandboxJob
    features: BwrapFeatures
    exists: Callable[[str], bool]
    isdir: Callable[[str], bool]
    readlink: Callable[[str], str | None]
    roots: Sequence[str]
    json_status_fd: int | None
    seccomp_fd: int | None
    masked_paths: Sequence[str]
    block_fd: int | None
    source_fds: Mapping[str, int] | None
    files: Sequence[tuple[str, str]]

    def present(self, host: str) -> bool:
        return self.exists(host) if self.source_fds is None else host in self.source_fds

    def bind(self, host: str, guest: str, writable: bool) -> tuple[str, ...]:
        # A staged mount (not opened on the worker's side) is bound by path.
        fds = self.source_fds
        fd = None if fds is None or not self.features.bind_fd else fds.get(host)
        if fd is None:
            return ("--bind" if writable else "--ro-bind", host, guest)
        # From the fd opened without symlinks: what is mounted is what was checked
        # (bubblewrap compares the mounted inode with the fd's and dies on a mismatch).
        return ("--bind-fd" if writable else "--ro-bind-fd", str(fd), guest)


class Flags(msgspec.Struct, frozen=True):
    """One row of `FLAGS` or `LAST_FLAGS`: flags bubblewrap gets, and the threat they answer.

    Attributes:
        args: the flags, fixed or computed from the derivation's inputs.
        threat: what the row answers, for people.
        when: the row applies only when this holds; ``None`` means always.
    """

    args: tuple[str, ...] | Callable[[_Inputs], Sequence[str]]
    threat: str
    when: Callable[[_Inputs], bool] | None = None

    def apply(self, inputs: _Inputs) -> Sequence[str]:
        if self.when is not None and not self.when(inputs):
            return ()
        return self.args if isinstance(self.args, tuple) else self.args(inputs)


class Mounts(msgspec.Struct, frozen=True):
    """One row of `MOUNTS`: mounts bubblewrap builds, and the threat they answer.

    Attributes:
        ops: the mounts, each with its destination in the guest, from the inputs.
        threat: what the row answers, for people.
    """

    ops: Callable[[_Inputs], Iterable[_Op]]
    threat: str


def _system_trees(d: _Inputs) -> Iterator[_Op]:
    # A top-level symlink (merged /usr: /bin -> usr/bin) is recreated as the same symlink
    # rather than bound, so paths resolve as on the host.
    for path in SYSTEM_PATHS:
        if not d.exists(path):
            continue
        target = d.readlink(path)
        if target is not None and _depth(path) == 1:
            yield _Op(path, ("--symlink", target, path))
        else:
            yield _Op(path, ("--ro-bind", path, path))


def _interpreter_roots(d: _Inputs) -> Iterator[_Op]:
    for root in d.roots:
        if any(_under(root, sys_path) for sys_path in SYSTEM_PATHS if d.exists(sys_path)):
            continue
        if d.present(root):
            yield _Op(root, d.bind(root, root, False))


def _proc_read_only(d: _Inputs) -> Iterator[_Op]:
    for path in PROC_READ_ONLY_PATHS:
        if d.exists(path):
            yield _Op(path, ("--ro-bind", path, path))


def _masks(paths: Iterable[str], d: _Inputs) -> Iterator[_Op]:
    for path in paths:
        if d.exists(path):
            yield _Op(path, _mask(path, d.isdir(path)))


def _tmpfs(dest: str) -> Callable[[_Inputs], Iterator[_Op]]:
    """A private tmpfs at `dest`, sized with the memory budget: tmpfs pages are RAM, and
    RLIMIT_AS does not count them (a memory cgroup, when there is one, does)."""

    def ops(d: _Inputs) -> Iterator[_Op]:
        size: tuple[str, ...] = ()
        if d.features.tmpfs_size and d.job.limits.memory_bytes is not None:
            size = ("--size", str(d.job.limits.memory_bytes))
        yield _Op(dest, (*size, "--tmpfs", dest))

    return ops


def _job_mounts(d: _Inputs) -> Iterator[_Op]:
    """The executor folder (read-only) and the fs hints, as plan.py resolved them. Only
    existing host paths; on an exact duplicate the read-only one wins (fail closed: an
    executor never gets to modify its own folder by accident)."""
    chosen: dict[str, Mount] = {}
    for mount in d.job.mounts:
        guest = posixpath.normpath(mount.guest)
        if not posixpath.isabs(guest) or guest in ("/", "//"):
            raise ValueError(f"mount target {mount.guest!r} must be an absolute path below /")
        if any(_under(guest, reserved) for reserved in RESERVED_GUEST_PATHS):
            # A host /proc over ours would show (and let the guest signal) host processes;
            # a host /dev would share /dev/shm and the ptys. Refused, never reordered.
            raise ValueError(f"mount target {mount.guest!r} would replace the private {guest}")
        # A staged mount lives in the staging namespace bubblewrap is started in, not on
        # the worker's side: it is checked there (by bubblewrap) instead.
        if not mount.staged and not d.present(mount.host):
            continue
        prev = chosen.get(mount.guest)
        if prev is None or (prev.writable and not mount.writable):
            chosen[mount.guest] = mount
    for mount in chosen.values():
        yield _Op(mount.guest, d.bind(mount.host, mount.guest, mount.writable))


def _fd_flag(flag: str, fd: Callable[[_Inputs], int | None]) -> Callable[[_Inputs], Sequence[str]]:
    """``flag FD`` when the caller hands bubblewrap that fd, nothing otherwise."""

    def args(d: _Inputs) -> Sequence[str]:
        value = fd(d)
        return () if value is None else (flag, str(value))

    return args


def _environment(d: _Inputs) -> Sequence[str]:
    out = ["--clearenv"]
    for key in sorted(d.job.env):
        out += ["--setenv", key, d.job.env[key]]
    return out


def _own_network(d: _Inputs) -> bool:
    return not d.job.network or d.job.egress is not None


#: Rules 7 and beyond: the flags before the mounts, in this order, each against one threat.
FLAGS: tuple[Flags, ...] = (
    Flags(
        ("--unshare-user",),
        "the guest's capabilities meaning something on the host: a fresh user namespace",
    ),
    Flags(("--unshare-ipc",), "System V IPC / POSIX message queues shared with host processes"),
    Flags(("--unshare-uts",), "the guest renaming the host: its own hostname"),
    Flags(
        ("--unshare-pid",),
        "the guest seeing or signalling host processes: its own pid namespace, with "
        "bubblewrap as its init, so the whole tree dies when bubblewrap does",
    ),
    Flags(
        ("--unshare-cgroup-try",),
        "the host's cgroup layout leaking: its own cgroup view (where the kernel supports it)",
    ),
    Flags(
        ("--die-with-parent",),
        "orphaned guests: the sandbox is SIGKILLed when the worker dies, even by SIGKILL",
    ),
    Flags(("--new-session",), "TIOCSTI keystroke injection into the caller's terminal: setsid()"),
    Flags(
        ("--uid", str(GUEST_UID), "--gid", str(GUEST_GID)),
        "a guest that believes it is root (some tools relax checks for uid 0): an "
        "unprivileged identity inside the namespace (`GUEST_UID`)",
    ),
    Flags(("--hostname", "sandbox"), "the host's name shown to the guest"),
    Flags(
        ("--cap-drop", "ALL"),
        "a capability surviving to exec when bubblewrap runs as root (belt and braces)",
    ),
    Flags(
        ("--disable-userns",),
        "a nested user namespace, the usual first step of a kernel exploit chain (it hands "
        "out a fresh set of capabilities over new namespaces)",
        when=lambda d: d.features.disable_userns,
    ),
    # Rule 6: no network capability → a network namespace of its own, with only its own
    # loopback (bubblewrap brings `lo` up, 127.0.0.1 inside the sandbox alone): no host
    # listener on 127.0.0.1, no abstract Unix sockets, no internet. A network capability
    # with its hosts (`job.egress`) too: the worker's wall puts its listeners in that
    # namespace, the only way out (`sandbox.egress`).
    Flags(
        ("--unshare-net",),
        "the host network, its loopback listeners and abstract Unix sockets",
        when=_own_network,
    ),
    Flags(
        _environment,
        "worker secrets (tokens, broker URLs) in the guest's environment: only the "
        "environment the job was given",
    ),
    Flags(
        _fd_flag("--json-status-fd", lambda d: d.json_status_fd),
        "the job blamed for bubblewrap's own set-up failure: bubblewrap reports the "
        "guest's pid and exit",
    ),
    Flags(
        _fd_flag("--seccomp", lambda d: d.seccomp_fd),
        "the system calls no namespace stops (`seccomp.POLICY`)",
    ),
    Flags(
        _fd_flag("--block-fd", lambda d: d.block_fd),
        "a guest started before its limits hold: bubblewrap waits on the fd",
    ),
)

#: Rules 1-4 and the masks: the mounts, each with its destination in the guest. They are
#: built in this order, then ordered parents first (see `derive_bwrap_argv`).
MOUNTS: tuple[Mounts, ...] = (
    # Rule 1: system trees read-only (see SYSTEM_PATHS), then the interpreter's prefixes
    # outside them.
    Mounts(_system_trees, "a trojan planted in a shared library or config the host trusts"),
    Mounts(_interpreter_roots, "the same, in the interpreter's own prefix"),
    # Rule 2: private /proc (only this pid namespace's processes), a minimal /dev (null,
    # zero, random, tty...; no disks), and a private /tmp. ``/sys`` is never mounted: it
    # is the host's device tree, and the guest has no use for it.
    Mounts(
        lambda d: (_Op("/proc", ("--proc", "/proc")),),
        "host processes seen or signalled through the host's /proc",
    ),
    Mounts(_proc_read_only, "host-global kernel interfaces written (`PROC_READ_ONLY_PATHS`)"),
    Mounts(
        lambda d: _masks(PROC_MASKED_PATHS, d),
        "kernel state that helps an exploit (`PROC_MASKED_PATHS`)",
    ),
    Mounts(
        # The sandbox's own pid 1: always there.
        lambda d: (_Op(path, _mask(path, False)) for path in PROC_INIT_MASKED_PATHS),
        "the guest rewriting bubblewrap's init through its memory (`PROC_INIT_MASKED_PATHS`)",
    ),
    # bubblewrap's /dev is a writable, unsized tmpfs: read-only, so its only writable
    # place is /dev/shm (below), sized like /tmp.
    Mounts(
        lambda d: (_Op("/dev", ("--dev", "/dev", "--remount-ro", "/dev")),),
        "host disks and devices; an unsized writable /dev the job could fill",
    ),
    Mounts(_tmpfs("/tmp"), "the host's /tmp shared; RAM filled through an unsized tmpfs"),
    Mounts(_tmpfs("/dev/shm"), "the same, for shared memory"),
    # Rules 3-4: the executor folder and the fs hints.
    Mounts(
        _job_mounts,
        "folders the manifest did not name; a mount over the private /proc, /dev or /",
    ),
    Mounts(
        lambda d: (_Op(guest, ("--ro-bind", host, guest)) for host, guest in d.files),
        "the host's resolver files behind the network wall (its own resolv.conf, hosts)",
    ),
    # Secrets the system binds would otherwise expose (see MASKED_PATHS).
    Mounts(
        lambda d: _masks(dict.fromkeys(d.masked_paths), d),
        "root-only secrets of the system trees read by a root worker's guest",
    ),
)

#: The flags after the mounts.
LAST_FLAGS: tuple[Flags, ...] = (
    # The root of the sandbox is bubblewrap's tmpfs; read-only, so the guest cannot stash
    # files outside /tmp and the mounts it was given.
    Flags(("--remount-ro", "/"), "files stashed outside /tmp and the job's mounts"),
    Flags(
        lambda d: ("--chdir", d.job.cwd or "/tmp"),
        "a guest started in the worker's own folder (bubblewrap's default when it exists "
        "inside): the job's cwd, else the private /tmp",
    ),
)


def derive_bwrap_argv(
    job: SandboxJob,
    *,
    bwrap: str = "bwrap",
    features: BwrapFeatures | None = None,
    exists: Callable[[str], bool] = os.path.exists,
    isdir: Callable[[str], bool] = os.path.isdir,
    readlink: Callable[[str], str | None] = _default_readlink,
    interpreter_roots: Sequence[str] | None = None,
    json_status_fd: int | None = None,
    seccomp_fd: int | None = None,
    masked_paths: Sequence[str] = MASKED_PATHS,
    block_fd: int | None = None,
    source_fds: Mapping[str, int] | None = None,
    files: Sequence[tuple[str, str]] = (),
) -> list[str]:
    """The full bubblewrap command line for `job`: ``[bwrap, *flags, "--", *job.argv]``.

    Pure: the filesystem is consulted only through `exists`, `isdir` and `readlink`, so
    tests pass fakes and run without bubblewrap and without the paths.

    Args:
        job: what to run; `job.mounts` already holds the executor folder (read-only) and
            the expanded ``fs:*`` hints (see `metnos_exec.plan`).
        bwrap: the bubblewrap executable.
        features: what this bubblewrap supports; ``None`` means "assume 0.8.0".
        exists: host path existence check.
        isdir: host directory check (to mask a directory with a tmpfs, a file with
            ``/dev/null``).
        readlink: host symlink target, or ``None`` when the path is not a symlink.
        interpreter_roots: extra read-only roots for the interpreter; defaults to
            `default_interpreter_roots()`.
        json_status_fd: fd (in the bwrap process) that receives bubblewrap's JSON status:
            the child pid once the namespaces exist, the exit code once it exits. Lets the
            caller tell bubblewrap's own set-up failure from the job's failure.
        block_fd: fd (in the bwrap process) the sandbox reads one byte from before it
            starts the guest (``--block-fd``): the caller sets the rlimits meanwhile.
        seccomp_fd: fd (in the bwrap process) holding a seccomp BPF program, which
            bubblewrap loads just before it execs the guest (`seccomp.compile_program`).
        masked_paths: host paths hidden behind an empty file or folder; default
            `MASKED_PATHS` (the bwrap arm adds `private_files` for a root worker).
        source_fds: host path → an fd (in the bwrap process) opened on it without
            following symlinks (`sandbox.mount_sources.open_source`), for every job mount
            and interpreter root that exists; with it, those are mounted from their fd
            (``--bind-fd`` / ``--ro-bind-fd`` when `features` has them), and a path
            missing from it counts as absent. ``None``: consult `exists` and bind by path.
        files: ``(host file, guest path)`` pairs bound read-only over the system trees
            (the network wall's ``/etc/resolv.conf`` and ``/etc/hosts``).

    Returns:
        The argv, ready for `ProcessSpec`.

    Raises:
        ValueError: `job` has no argv (a wasm job cannot run in this arm), or a mount
            targets ``/`` or lies at or below a private tree (`RESERVED_GUEST_PATHS`).
    """
    if not job.argv:
        raise ValueError("the bwrap arm runs native jobs only: job.argv is empty")
    inputs = _Inputs(
        job,
        BwrapFeatures(version=(0, 8, 0)) if features is None else features,
        exists,
        isdir,
        readlink,
        default_interpreter_roots() if interpreter_roots is None else interpreter_roots,
        json_status_fd,
        seccomp_fd,
        masked_paths,
        block_fd,
        source_fds,
        files,
    )
    ops = [op for row in MOUNTS for op in row.ops(inputs)]
    # Order: a mount hides whatever an earlier one put below its destination, so parents
    # go first (sort by depth; stable, so at equal depth system < private < job < mask).
    # This is what keeps `--tmpfs /tmp` from hiding an executor folder under /tmp.
    ops.sort(key=lambda op: _depth(op.dest))
    argv: list[str] = [bwrap]
    for row in FLAGS:
        argv += row.apply(inputs)
    for op in ops:
        argv += op.args
    for row in LAST_FLAGS:
        argv += row.apply(inputs)
    argv.append("--")
    argv += job.argv
    return argv
