"""Manifest-derived walls → bubblewrap argv, as a pure function.

Everything here is a mechanical translation of a `SandboxJob` into flags; nothing runs,
and the filesystem is only consulted through injected callables, so every rule is
unit-testable on a machine without bubblewrap. The policy (which mounts, network or not)
is decided upstream by `metnos_exec.plan`; this module only decides *how* bubblewrap
expresses it.

Each flag is documented next to the threat it answers (bubblewrap's ``bwrap.xml`` style).
Read with bubblewrap's own warning in mind: it is "not a complete, ready-made sandbox";
the seccomp filter comes in through ``seccomp_fd`` (`metnos_exec.sandbox.seccomp`), and
landlock through the job's argv (`metnos_exec.sandbox.landlock`).
"""

from __future__ import annotations

import os
import posixpath
import resource
import stat
import sys
from collections.abc import Callable, Mapping, Sequence

import msgspec

from ._types import Mount, ResourceLimits, SandboxJob

__all__ = (
    "GUEST_GID",
    "GUEST_UID",
    "MASKED_PATHS",
    "PROC_INIT_MASKED_PATHS",
    "PROC_MASKED_PATHS",
    "PROC_READ_ONLY_PATHS",
    "RESERVED_GUEST_PATHS",
    "SYSTEM_PATHS",
    "BwrapFeatures",
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
#: for the guest to learn nothing from them.
PROC_MASKED_PATHS: tuple[str, ...] = (
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
    features = BwrapFeatures(version=(0, 8, 0)) if features is None else features
    roots = default_interpreter_roots() if interpreter_roots is None else interpreter_roots

    ops: list[_Op] = []

    # Rule 1: system trees read-only. A top-level symlink (merged /usr: /bin -> usr/bin)
    # is recreated as the same symlink rather than bound, so paths resolve as on the host.
    for path in SYSTEM_PATHS:
        if not exists(path):
            continue
        target = readlink(path)
        if target is not None and _depth(path) == 1:
            ops.append(_Op(path, ("--symlink", target, path)))
        else:
            ops.append(_Op(path, ("--ro-bind", path, path)))

    def present(host: str) -> bool:
        return exists(host) if source_fds is None else host in source_fds

    def bind(host: str, guest: str, writable: bool) -> tuple[str, ...]:
        # A staged mount (not opened on the worker's side) is bound by path.
        fd = None if source_fds is None or not features.bind_fd else source_fds.get(host)
        if fd is None:
            return ("--bind" if writable else "--ro-bind", host, guest)
        # From the fd opened without symlinks: what is mounted is what was checked
        # (bubblewrap compares the mounted inode with the fd's and dies on a mismatch).
        return ("--bind-fd" if writable else "--ro-bind-fd", str(fd), guest)

    for root in roots:
        if any(_under(root, sys_path) for sys_path in SYSTEM_PATHS if exists(sys_path)):
            continue
        if present(root):
            ops.append(_Op(root, bind(root, root, False)))

    # Rule 2: private /proc (only this pid namespace's processes), a minimal /dev (null,
    # zero, random, tty...; no disks), and a private /tmp. ``/sys`` is never mounted: it
    # is the host's device tree, and the guest has no use for it.
    ops.append(_Op("/proc", ("--proc", "/proc")))
    for path in PROC_READ_ONLY_PATHS:
        if exists(path):
            ops.append(_Op(path, ("--ro-bind", path, path)))
    for path in PROC_MASKED_PATHS:
        if exists(path):
            ops.append(_Op(path, _mask(path, isdir(path))))
    for path in PROC_INIT_MASKED_PATHS:  # the sandbox's own pid 1: always there
        ops.append(_Op(path, _mask(path, False)))
    # bubblewrap's /dev is a writable, unsized tmpfs: read-only, so its only writable
    # place is /dev/shm (below), sized like /tmp.
    ops.append(_Op("/dev", ("--dev", "/dev", "--remount-ro", "/dev")))
    # The tmpfs mounts are sized with the memory budget: tmpfs pages are RAM, and
    # RLIMIT_AS does not count them (a memory cgroup, when there is one, does).
    size: tuple[str, ...] = ()
    if features.tmpfs_size and job.limits.memory_bytes is not None:
        size = ("--size", str(job.limits.memory_bytes))
    ops.append(_Op("/tmp", (*size, "--tmpfs", "/tmp")))
    ops.append(_Op("/dev/shm", (*size, "--tmpfs", "/dev/shm")))

    # Rules 3-4: the executor folder (read-only) and the fs hints, as plan.py resolved
    # them. Only existing host paths; on an exact duplicate the read-only one wins
    # (fail closed: an executor never gets to modify its own folder by accident).
    chosen: dict[str, Mount] = {}
    for mount in job.mounts:
        guest = posixpath.normpath(mount.guest)
        if not posixpath.isabs(guest) or guest in ("/", "//"):
            raise ValueError(f"mount target {mount.guest!r} must be an absolute path below /")
        if any(_under(guest, reserved) for reserved in RESERVED_GUEST_PATHS):
            # A host /proc over ours would show (and let the guest signal) host processes;
            # a host /dev would share /dev/shm and the ptys. Refused, never reordered.
            raise ValueError(f"mount target {mount.guest!r} would replace the private {guest}")
        # A staged mount lives in the staging namespace bubblewrap is started in, not on
        # the worker's side: it is checked there (by bubblewrap) instead.
        if not mount.staged and not present(mount.host):
            continue
        prev = chosen.get(mount.guest)
        if prev is None or (prev.writable and not mount.writable):
            chosen[mount.guest] = mount
    for mount in chosen.values():
        ops.append(_Op(mount.guest, bind(mount.host, mount.guest, mount.writable)))

    for host_file, guest_path in files:
        ops.append(_Op(guest_path, ("--ro-bind", host_file, guest_path)))

    # Secrets the system binds would otherwise expose (see MASKED_PATHS).
    for path in dict.fromkeys(masked_paths):
        if exists(path):
            ops.append(_Op(path, _mask(path, isdir(path))))

    # Order: a mount hides whatever an earlier one put below its destination, so parents
    # go first (sort by depth; stable, so at equal depth system < private < job < mask).
    # This is what keeps `--tmpfs /tmp` from hiding an executor folder under /tmp.
    ops.sort(key=lambda op: _depth(op.dest))

    argv: list[str] = [bwrap]
    # Rule 7 and beyond, each against one threat:
    argv += [
        # A fresh user namespace: the guest's capabilities mean nothing on the host.
        "--unshare-user",
        # No System V IPC / POSIX message queues shared with host processes.
        "--unshare-ipc",
        # Own hostname: the guest cannot rename the host.
        "--unshare-uts",
        # Own pid namespace: the guest cannot see or signal host processes, and bubblewrap
        # runs as its init, so the whole tree dies when bubblewrap does.
        "--unshare-pid",
        # Own cgroup view (where the kernel supports it): no host cgroup layout leaks.
        "--unshare-cgroup-try",
        # SIGKILL the sandbox when the worker dies, even by SIGKILL: no orphaned guests.
        "--die-with-parent",
        # setsid(): no TIOCSTI keystroke injection into the caller's terminal.
        "--new-session",
        # Unprivileged identity inside the namespace.
        "--uid",
        str(GUEST_UID),
        "--gid",
        str(GUEST_GID),
        "--hostname",
        "sandbox",
        # Belt and braces when bubblewrap runs as root: no capability survives to exec.
        "--cap-drop",
        "ALL",
    ]
    if features.disable_userns:
        # A nested user namespace is the usual first step of a kernel exploit chain
        # (it hands out a fresh set of capabilities over new namespaces).
        argv.append("--disable-userns")
    if not job.network or job.egress is not None:
        # Rule 6: no network capability → a network namespace of its own, with only its
        # own loopback (bubblewrap brings `lo` up, 127.0.0.1 inside the sandbox alone):
        # no host listener on 127.0.0.1, no abstract Unix sockets, no internet. A
        # network capability with its hosts (`job.egress`) too: the worker's wall puts
        # its listeners in that namespace, the only way out (`sandbox.egress`).
        argv.append("--unshare-net")
    # Only the environment the job was given: no worker secrets (tokens, broker URLs).
    argv.append("--clearenv")
    for key in sorted(job.env):
        argv += ["--setenv", key, job.env[key]]
    if json_status_fd is not None:
        argv += ["--json-status-fd", str(json_status_fd)]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    if block_fd is not None:
        argv += ["--block-fd", str(block_fd)]
    for op in ops:
        argv += op.args
    # The root of the sandbox is bubblewrap's tmpfs; read-only, so the guest cannot stash
    # files outside /tmp and the mounts it was given.
    argv += ["--remount-ro", "/"]
    argv += ["--chdir", job.cwd or "/tmp"]
    argv.append("--")
    argv += job.argv
    return argv


def derive_rlimits(limits: ResourceLimits) -> tuple[tuple[int, int, int], ...]:
    """Kernel resource limits for the guest.

    The bwrap arm applies them inside the sandbox with a prefix that ``exec``s the guest
    (`shell_limits_prefix`, else `prlimit_prefix`), so they bind from the guest's first
    instruction; or, when that cannot express them, before bubblewrap's exec (by the
    process layer), where they bind bubblewrap's own processes too.

    - ``RLIMIT_AS`` = memory budget: a big allocation fails (MemoryError / ENOMEM) instead
      of pushing the host into swap or the OOM killer.
    - No ``RLIMIT_NPROC`` here: the pids wall belongs to the process layer (a per-run pids
      cgroup, ``ProcessSpec.pids_max``; it falls back to RLIMIT_NPROC itself, computed
      above the uid's current count — a plain ``pids`` value would make bubblewrap's own
      fork fail for a non-root worker that already runs more processes than that).
    - ``RLIMIT_FSIZE`` = file size budget: the kernel sends SIGXFSZ (or EFBIG when the
      signal is ignored, as CPython does) — the disk cannot be filled by one file.
    - ``RLIMIT_NOFILE`` = open files: no fd exhaustion games.
    - ``RLIMIT_CPU``: soft at the budget (SIGXCPU, reported as ``cpu_time``), hard one
      second later (SIGKILL) for a guest that ignores SIGXCPU.
    - ``RLIMIT_CORE`` = 0: a SIGXCPU/SIGXFSZ death must not hand the guest's memory to the
      host's core handler (``core_pattern`` pipes run outside the sandbox).

    Returns:
        ``((resource, soft, hard), ...)`` in the form `ProcessSpec.rlimits` takes.
    """
    out: list[tuple[int, int, int]] = []
    if limits.memory_bytes is not None:
        out.append((resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes))
    if limits.file_size_bytes is not None:
        out.append((resource.RLIMIT_FSIZE, limits.file_size_bytes, limits.file_size_bytes))
    if limits.open_files is not None:
        out.append((resource.RLIMIT_NOFILE, limits.open_files, limits.open_files))
    if limits.cpu_time_s is not None:
        out.append((resource.RLIMIT_CPU, limits.cpu_time_s, limits.cpu_time_s + 1))
    out.append((resource.RLIMIT_CORE, 0, 0))
    return tuple(out)


# prlimit(1) option for each resource we set (util-linux names).
_PRLIMIT_OPTIONS: dict[int, str] = {
    resource.RLIMIT_AS: "--as",
    resource.RLIMIT_CORE: "--core",
    resource.RLIMIT_CPU: "--cpu",
    resource.RLIMIT_DATA: "--data",
    resource.RLIMIT_FSIZE: "--fsize",
    resource.RLIMIT_MEMLOCK: "--memlock",
    resource.RLIMIT_NOFILE: "--nofile",
    resource.RLIMIT_NPROC: "--nproc",
    resource.RLIMIT_STACK: "--stack",
}


def prlimit_prefix(rlimits: Sequence[tuple[int, int, int]], prlimit: str) -> tuple[str, ...]:
    """A command prefix that applies `rlimits` inside the sandbox, then execs the guest.

    ``prlimit --as=S:H ... -- <guest argv>``: util-linux's prlimit sets its own limits
    (exact byte values, soft and hard) and ``execvp``s the guest, so the limits bind from
    the guest's first instruction, as `derive_rlimits` promises. Why not set them before
    bubblewrap starts: that needs code between fork and exec in the worker, which makes
    CPython fork the whole worker instead of vfork-ing (milliseconds per job). What changes:
    bubblewrap's own two processes no longer carry the limits (they run none of the job's
    code). A command that cannot be executed exits 127 (not found) or 126, as in a shell.

    Args:
        rlimits: ``(resource, soft, hard)`` triples, as `derive_rlimits` returns them.
        prlimit: path of the prlimit executable *as the guest sees it* (a system path).

    Returns:
        ``(prlimit, "--as=...", ..., "--")``; ``()`` when `rlimits` is empty.

    Raises:
        ValueError: a resource prlimit(1) has no option for.
    """
    if not rlimits:
        return ()

    def value(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else str(v)

    out = [prlimit]
    for res, soft, hard in rlimits:
        option = _PRLIMIT_OPTIONS.get(res)
        if option is None:
            raise ValueError(f"no prlimit(1) option for resource {res}")
        out.append(f"{option}={value(soft)}:{value(hard)}")
    out.append("--")
    return tuple(out)


# POSIX-mode ``ulimit`` option and unit for each resource dash, bash (as sh) and busybox
# ash agree on. Others (RLIMIT_NPROC is -p in dash, -u in bash) go through prlimit(1).
_ULIMIT_OPTIONS: dict[int, tuple[str, int]] = {
    resource.RLIMIT_AS: ("-v", 1024),
    resource.RLIMIT_CORE: ("-c", 512),
    resource.RLIMIT_CPU: ("-t", 1),
    resource.RLIMIT_FSIZE: ("-f", 512),
    resource.RLIMIT_NOFILE: ("-n", 1),
}


def shell_limits_prefix(rlimits: Sequence[tuple[int, int, int]], sh: str) -> tuple[str, ...] | None:
    """Like `prlimit_prefix`, with the shell's ``ulimit`` builtin, then ``exec``.

    ``sh -c 'ulimit -v N && ... && exec "$@"' sh <guest argv>``: one exec of a shell that
    needs only libc (dash starts ~0.3 ms faster than prlimit(1), which also loads
    libsmartcols). ``ulimit`` counts in units (KiB, 512-byte blocks), so this is used only
    when every limit is an exact multiple of its unit; otherwise, or for a resource the
    shells name differently, the answer is ``None`` (use `prlimit_prefix`).

    Args:
        rlimits: ``(resource, soft, hard)`` triples, as `derive_rlimits` returns them.
        sh: path of a POSIX shell (dash, bash or busybox ash) *as the guest sees it*.

    Returns:
        The prefix; ``()`` when `rlimits` is empty; ``None`` when not exactly expressible.
    """
    if not rlimits:
        return ()
    inf = resource.RLIM_INFINITY
    steps: list[str] = []
    for res, soft, hard in rlimits:
        spec = _ULIMIT_OPTIONS.get(res)
        if spec is None:
            return None
        option, unit = spec
        values = []
        for v in (soft, hard):
            if v == inf:
                values.append("unlimited")
            elif v % unit:
                return None
            else:
                values.append(str(v // unit))
        if values[0] == values[1]:
            steps.append(f"ulimit {option} {values[0]}")  # soft and hard at once
        else:
            # Soft first (it must stay <= the current hard), then the hard one (>= soft).
            steps.append(f"ulimit -S {option} {values[0]} && ulimit -H {option} {values[1]}")
    # Values are integers we formatted: nothing of the job reaches the script text.
    script = " && ".join([*steps, 'exec "$@"'])
    return (sh, "-c", script, "sh")
