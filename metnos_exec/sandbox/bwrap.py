"""The bwrap arm: a native subprocess inside bubblewrap, walls derived from the job.

The flags come from `metnos_exec.sandbox.flags` (pure); the process lifecycle (long-lived
spawner threads so die-with-parent never fires early, tree kill on timeout, bounded output,
a pooled pids cgroup per concurrent run) from `metnos_exec.process.run_process`. This module
only glues them and reads back what happened, honestly:

* nothing runs between fork and exec, so the worker is vforked, not copied: bubblewrap is
  started with ``--block-fd`` and, while its sandbox process waits there (before it forks
  the guest), the worker prlimit(2)s bubblewrap's whole tree, reads the limits back and
  only then releases it (`_LimitGate`); anything unexpected kills the blocked tree, so the
  guest never runs unlimited. When the worker could not raise a hard limit the job needs
  (no CAP_SYS_RESOURCE), the limits are applied *inside* the sandbox by a prefix that
  ``exec``s the guest instead (``sh -c 'ulimit ...'`` when exact, else ``prlimit``; see
  `_limits_in_guest`). The parent-death signal is bubblewrap's own
  ``--die-with-parent``, armed late: by its monitor after it has cloned the sandbox, by
  the sandbox only at the end of its set-up. A worker SIGKILLed before then left a
  bubblewrap stuck forever (its monitor gone before releasing it) or a sandbox that ran
  its guest with nobody to stop it (with the gate: end-of-file on the block pipe releases
  it). The worker's keeper (`metnos_exec.process.start_keeper`) closes both: every
  bubblewrap carries its mark in its environment (``--clearenv`` keeps it from the
  guest), and when the worker dies, however, the keeper SIGKILLs every process carrying
  it (the monitor, the sandbox's init, and so the whole pid namespace) and every process
  group the worker had registered (``tests/test_die_with_worker.py``: a real worker
  SIGKILLed while jobs start, as root and unprivileged);

* bubblewrap writes JSON status documents to ``--json-status-fd``: ``child-pid`` once the
  namespaces exist and the guest is being set up, ``exit-code`` once the guest has exited.
  No ``exit-code`` and bubblewrap not killed by a signal means bubblewrap's own set-up
  failed (a namespace it could not create, a mount source that vanished): a `HostFault`
  (`BwrapSetupFailed`), never a ``Failure(1)`` blamed on the job.
* ``exit-code`` follows bubblewrap's rule (``propagate_exit_status`` in ``bwrap.c``): the
  guest's exit status, or ``128 + N`` when the guest was killed by signal N. bubblewrap
  gives us nothing else to tell the two apart, so, like a shell, we read 129..192 as
  "killed by signal N". The limit is named only when the kernel's signal says it
  (SIGXCPU → ``cpu_time``, SIGXFSZ → ``file_size``) and that limit was set for the job.
  Caveat, stated plainly: a guest calling ``exit(128 + N)`` itself is reported as killed.
* the job's memory is bounded as a whole by the slot's memory cgroup (`ProcessSpec.memory_max`:
  every process of the tree and the private ``/tmp`` pages count); `MemoryExceeded` when
  the kernel OOM-killed part of the tree at that limit (the cgroup's ``oom_kill`` counter
  moved), whatever the guest's exit status; RLIMIT_AS stays, so a single big allocation
  still fails gracefully first. Without the cgroup the resources axis says ``partial``
  (`MEMORY_PER_PROCESS_REASON`).
* two kernel mechanisms on top of the namespaces (`.hardening`, decided once per worker):
  the seccomp filter (`.seccomp`), handed to bubblewrap through a pipe (``--seccomp``),
  and landlock (`.landlock`), which the guest's first process applies to itself before the
  executor's code (the job's argv is wrapped). The report names what they hold, and says
  ``partial`` where one is missing.
* a root worker: bubblewrap maps the guest's uid 65534 to the uid that runs bubblewrap.
  For root that would be host uid 0, so file permission checks would treat the guest as
  the owner of root's files (it holds no capability: only *owner* matches): root-only
  files of the read-only system trees readable, root-owned kernel files writable. So each
  job runs as its slot's own host uid instead (`metnos_exec.identities`; `_placement`):
  the slot's thread forks bubblewrap as that uid, and the job's mount sources are
  idmapped clones showing root as that uid (`mount_sources.StagedSources`), so the job
  keeps its owner rights on its own folders and nothing else of root's. A staged job's
  bubblewrap starts inside the staging namespace, which only root may enter: it is forked
  as root, and ``nsenter`` drops to the slot's uid there before it execs bubblewrap; its
  overlays are built on idmapped lower layers for that uid (`staged`,
  `metnos_exec.undo.overlay`). A job that cannot run so runs as root: `MASKED_PATHS`
  and every private file of ``/etc`` found at the worker's first job (`private_files`)
  are masked, but not what other system trees hold, nor files created later, and the
  files and user axes say ``partial`` (`ROOT_WORKER_REASON`, with why), the resources
  axis too (`ROOT_QUOTAS_REASON`: root's per-user kernel quotas).
* every job mount source is opened without following a symlink and bound from that fd
  (`mount_sources`): a folder swapped for a link is refused, never mounted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import resource
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, final

import anyio
import msgspec

from ..errors import HostFault, MetnosError, SandboxDenied
from ..identities import SLOT_UIDS_ENV, slot_uids_unavailable
from ..process import (
    ProcessResult,
    ProcessSpec,
    Slot,
    Stopped,
    pooled_slot,
    reap_orphan,
    run_process,
    slots_available,
)
from ._types import (
    AxisVerdict,
    ContainmentReport,
    Failure,
    Killed,
    MemoryExceeded,
    SandboxExit,
    SandboxJob,
    SandboxOutcome,
    Success,
    Timeout,
    Trap,
    Usage,
    record_stopped,
)
from .egress.dns import guest_files
from .egress.policy import Resolver, system_resolver
from .egress.wall import Wall
from .flags import (
    MASKED_PATHS,
    SYSTEM_PATHS,
    BwrapFeatures,
    default_interpreter_roots,
    derive_bwrap_argv,
    derive_rlimits,
    private_files,
    prlimit_prefix,
    shell_limits_prefix,
)
from .hardening import Hardening, annotate, guest_job, host_hardening, seccomp_fd
from .mount_sources import StagedSources, open_source
from .staged import IdmapUnavailable, StagedPlacement, stager_for

__all__ = (
    "BwrapProbe",
    "BwrapSandbox",
    "BwrapSetupFailed",
    "bwrap_probe",
    "find_bwrap",
    "map_exit",
    "parse_json_status",
)

#: How long a failed namespace probe is trusted before bubblewrap is tried again: a fixed
#: sysctl or a repaired install is picked up without restarting the worker.
NEGATIVE_PROBE_TTL_S = 30.0

_SIGNAL_BASE = 128
#: Processes bubblewrap itself keeps in the job's cgroup: its monitor and the init.
_BWRAP_PIDS = 2
_MAX_SIGNAL = 64
#: Bound on waiting for bubblewrap's orphaned init to finish exiting (normally microseconds).
_INIT_REAP_S = 2.0
#: How long bubblewrap may take to reach its block fd, at least, whatever the job's
#: budget: a budget shorter than bubblewrap's own set-up (``--timeout 0.001``) is the
#: job's timeout (the gate does not release a guest whose budget is spent,
#: `_BudgetSpent`), not a host fault that would be retried to the same end on every
#: attempt.
_GATE_MIN_WAIT_S = 10.0


class _BudgetSpent(Exception):
    """The job's whole budget went by before bubblewrap reached its block fd: the gate
    killed the blocked tree instead of releasing the guest (the run is a ``Timeout``)."""


class BwrapSetupFailed(HostFault):
    """bubblewrap could not build the sandbox (namespaces, mounts): no verdict on the job."""


# --- probe ----------------------------------------------------------------------------


class BwrapProbe(msgspec.Struct, frozen=True):
    """What one probe of bubblewrap found.

    Attributes:
        path: the bubblewrap executable, or ``None`` when none was found.
        version: parsed ``bwrap --version``; ``()`` when unknown.
        working: a sandbox with our namespace flags could be created and ran ``true``.
        error: why not, in bubblewrap's words (for people; decisions never parse it).
        bind_fd: ``bwrap --help`` lists ``--bind-fd`` (see `BwrapFeatures.bind_fd`).
    """

    path: str | None
    version: tuple[int, ...] = ()
    working: bool = False
    error: str | None = None
    bind_fd: bool = False

    @property
    def features(self) -> BwrapFeatures:
        return BwrapFeatures(version=self.version, bind_fd=self.bind_fd)


#: How long a successful ``$PATH`` search for bubblewrap is reused (the supervisor probes
#: once per job; a ``$PATH`` walk is a dozen ``stat`` calls). A missing bubblewrap is
#: looked for again on every call.
FIND_TTL_S = 2.0

_found: dict[tuple[str, str], tuple[str, float]] = {}


def find_bwrap(env: Mapping[str, str] | None = None) -> str | None:
    """Locate bubblewrap: ``$METNOS_BWRAP`` (a path, or a name looked up on ``$PATH``),
    else ``bwrap`` on ``$PATH``. A hit is reused for `FIND_TTL_S` seconds, a miss never:
    installing bubblewrap later needs no restart."""
    environ: Mapping[str, str] = os.environ if env is None else env
    wanted = environ.get("METNOS_BWRAP") or "bwrap"
    if "/" in wanted:
        return wanted if os.access(wanted, os.X_OK) else None
    path = environ.get("PATH", os.defpath)
    now = time.monotonic()
    hit = _found.get((wanted, path))
    if hit is not None and now - hit[1] < FIND_TTL_S:
        return hit[0]
    found = shutil.which(wanted, path=path)
    if found is not None:
        if len(_found) > 64:
            _found.clear()
        _found[(wanted, path)] = (found, now)
    return found


def _parse_version(text: str) -> tuple[int, ...]:
    # "bubblewrap 0.8.0"
    for word in text.split():
        parts = word.split(".")
        if len(parts) >= 2 and all(p.isdigit() for p in parts):
            return tuple(int(p) for p in parts)
    return ()


def _probe_uncached(path: str) -> BwrapProbe:
    # A one-shot, synchronous probe: it outlives nothing, needs no die-with-parent and is
    # reaped (killed on timeout) by subprocess.run, so it does not go through run_process.
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, timeout=10, check=False, env={}
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return BwrapProbe(path=path, error=f"bwrap --version: {exc}")
    version = _parse_version(out.stdout.decode(errors="replace"))
    try:
        usage = subprocess.run(
            [path, "--help"], capture_output=True, timeout=10, check=False, env={}
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        usage = b""
    # Parsed from the usage text: distributions backport it to older versions.
    bind_fd = b"--bind-fd" in usage and b"--ro-bind-fd" in usage
    true = shutil.which("true", path="/usr/bin:/bin") or "/bin/true"
    # The very namespace set the arm uses (user, pid, ipc, uts, net, cgroup), so "working"
    # means "our sandbox can be built here", not merely "bwrap starts".
    argv = derive_bwrap_argv(
        SandboxJob(argv=(true,)), bwrap=path, features=BwrapFeatures(version=version)
    )
    try:
        run = subprocess.run(argv, capture_output=True, timeout=10, check=False, env={})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return BwrapProbe(path=path, version=version, error=f"bwrap probe: {exc}")
    if run.returncode != 0:
        err = run.stderr.decode(errors="replace").strip().splitlines()
        reason = err[-1] if err else f"exit status {run.returncode}"
        return BwrapProbe(path=path, version=version, error=reason, bind_fd=bind_fd)
    return BwrapProbe(path=path, version=version, working=True, bind_fd=bind_fd)


_cache_lock = threading.Lock()
# key (path, inode, size, mtime_ns) -> (probe, monotonic time it was taken)
_cache: dict[tuple[str, int, int, int], tuple[BwrapProbe, float]] = {}


def bwrap_probe(env: Mapping[str, str] | None = None, *, refresh: bool = False) -> BwrapProbe:
    """Find bubblewrap and probe that it can build our sandbox, cached.

    A positive probe is cached for as long as the same binary (path, inode, size, mtime)
    is installed; a negative one for `NEGATIVE_PROBE_TTL_S`; a missing binary is looked
    for again on every call.

    Args:
        env: where ``METNOS_BWRAP`` and ``PATH`` are read; default `os.environ`.
        refresh: ignore the cache.
    """
    path = find_bwrap(env)
    if path is None:
        return BwrapProbe(path=None, error="bubblewrap (bwrap) not found")
    try:
        st = os.stat(path)
    except OSError as exc:
        return BwrapProbe(path=path, error=f"cannot stat {path}: {exc}")
    key = (path, st.st_ino, st.st_size, st.st_mtime_ns)
    now = time.monotonic()
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None and not refresh:
            probe, taken = hit
            if probe.working or now - taken < NEGATIVE_PROBE_TTL_S:
                return probe
    probe = _probe_uncached(path)
    with _cache_lock:
        _cache[key] = (probe, now)
    return probe


def forget_probes() -> None:
    """Drop every cached probe (tests)."""
    with _cache_lock:
        _cache.clear()
    _found.clear()


# --- limits -------------------------------------------------------------------------


@functools.cache
def _guest_prlimit() -> str | None:
    """util-linux's prlimit, when it lives in a system tree the guest sees read-only."""
    found = shutil.which("prlimit", path="/usr/bin:/bin:/usr/sbin:/sbin")
    if found is None:
        return None
    real = os.path.realpath(found)
    if not any(real.startswith(root.rstrip("/") + "/") for root in SYSTEM_PATHS):
        return None
    return real


#: Shells whose ``ulimit`` units `shell_limits_prefix` knows (POSIX mode when run as sh).
_KNOWN_SHELLS = frozenset({"dash", "bash", "busybox"})


@functools.cache
def _guest_sh() -> str | None:
    """``/bin/sh`` resolved, when it is a shell we know and lives in a system tree."""
    real = os.path.realpath("/bin/sh")
    if os.path.basename(real) not in _KNOWN_SHELLS or not os.access(real, os.X_OK):
        return None
    if not any(real.startswith(root.rstrip("/") + "/") for root in SYSTEM_PATHS):
        return None
    return real


def _limits_in_guest(rlimits: tuple[tuple[int, int, int], ...]) -> tuple[str, ...]:
    """The command prefix that applies `rlimits` inside the sandbox (``sh``'s ``ulimit``
    when exact, else prlimit(1)), or ``()`` when the process layer must apply them before
    exec instead.

    Inside the sandbox the guest holds no capability, so it can only *lower* limits: a
    hard limit above the worker's own needs the old path (set by the worker, as root).
    """
    for res, _soft, hard in rlimits:
        ours = resource.getrlimit(res)[1]
        if ours != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > ours):
            return ()
    sh = _guest_sh()
    if sh is not None:
        prefix = shell_limits_prefix(rlimits, sh)
        if prefix is not None:
            return prefix
    prlimit = _guest_prlimit()
    return () if prlimit is None else prlimit_prefix(rlimits, prlimit)


#: CAP_SYS_RESOURCE's bit in ``CapEff``: lets us raise a hard limit above our own.
_CAP_SYS_RESOURCE = 24


@functools.cache
def _have_cap_sys_resource() -> bool:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_RESOURCE & 1)
    except (OSError, ValueError):
        pass
    return False


def _can_gate(rlimits: tuple[tuple[int, int, int], ...]) -> bool:
    """Whether the worker may set `rlimits` on the blocked sandbox with prlimit(2).

    Raising a hard limit above the one the sandbox inherited (ours) needs
    CAP_SYS_RESOURCE; without it the in-guest prefix (or the preexec path) stays.
    """
    if not rlimits:
        return False
    if _have_cap_sys_resource():
        return True
    for res, _soft, hard in rlimits:
        ours = resource.getrlimit(res)[1]
        if ours != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > ours):
            return False
    return True


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rfind(b")") + 2 :].split()[1])


def _descendants(root: int) -> set[int]:
    """`root` and its descendants, by scanning ``/proc`` (no cgroup to list them)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (ppid := _ppid(int(entry))) is not None:
            parents[int(entry)] = ppid
    tree = {root}
    grown = True
    while grown:
        grown = False
        for pid, ppid in parents.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grown = True
    return tree


class _LimitGate:
    """Applies the rlimits to bubblewrap while it waits on ``--block-fd``, then releases it.

    bubblewrap's sandbox process (pid 1 of the namespace, ``child-pid`` in the status)
    reads one byte from the block fd after pivot_root and dropping privileges, *before*
    it forks the guest. Meanwhile, on the event loop (`ProcessSpec.on_spawn`), we wait for
    ``child-pid`` on the status pipe, prlimit(2) every process of bubblewrap's tree (its
    monitor and that sandbox process), read the limits back, check the tree did not
    change, and only then write the byte: the guest is forked after, so it inherits the
    limits before its first instruction. No ``sh``/``prlimit`` exec in the guest (~0.5 ms a
    job) and still no preexec_fn. ``child-pid`` comes ~1.5 ms before the sandbox reaches
    the block fd (its mounts are built meanwhile), so the gate normally costs it no wait.

    Fail safe: anything unexpected (cancellation included) kills the whole blocked tree
    before the block fd is closed (closing it unwritten would also release the guest,
    unlimited).

    The gate owns the worker's copy of the status pipe's write end (`status_w`) and closes
    it as soon as bubblewrap has its own: end-of-file on the read end then means that
    bubblewrap exited during its set-up.

    A job run as its slot's own uid (a root worker's): prlimit(2) of another uid's process
    needs CAP_SYS_RESOURCE, which some root workers lack (a container's bounding set); the
    kernel also allows it to a caller whose *real* ids are the target's, so the calls are
    made on the slot's thread while it is that uid (`as_user`, `process.Slot.run_as`).
    """

    def __init__(
        self,
        rlimits: tuple[tuple[int, int, int], ...],
        status_r: int,
        status_w: int,
        wait_s: float,
        as_user: Callable[[Callable[[], None]], Awaitable[None]] | None = None,
        budget_s: float | None = None,
        before_release: Callable[[int], Awaitable[None]] | None = None,
    ):
        self._before_release = before_release
        self._as_user = as_user
        self._budget_s = budget_s
        self._rlimits = rlimits
        self._status_r = status_r
        self.status_w = status_w
        self._wait_s = wait_s
        #: Status bytes consumed while waiting for ``child-pid``; the rest comes later.
        self.status_head = b""
        self.block_r, self.block_w = os.pipe2(os.O_CLOEXEC)

    def close(self) -> None:
        for fd in (self.block_r, self.block_w, self.status_w):
            if fd >= 0:
                os.close(fd)
        self.block_r = self.block_w = self.status_w = -1

    async def _child_pid(self) -> int | None:
        """bubblewrap's ``child-pid``, or ``None`` when bubblewrap exited without one."""
        os.close(self.status_w)  # bubblewrap holds its own copy now
        self.status_w = -1
        os.set_blocking(self._status_r, False)
        decoder = json.JSONDecoder()
        with anyio.move_on_after(self._wait_s):
            while True:
                try:
                    chunk = os.read(self._status_r, 4096)
                except BlockingIOError:
                    await anyio.wait_readable(self._status_r)
                    continue
                if not chunk:
                    return None  # exited during set-up: the arm reports why
                self.status_head += chunk
                text = self.status_head.decode("utf-8", errors="replace").lstrip()
                with contextlib.suppress(ValueError):
                    doc, _ = decoder.raw_decode(text)
                    child = doc.get("child-pid") if isinstance(doc, dict) else None
                    if not isinstance(child, int) or child <= 0:
                        raise HostFault(f"unexpected bubblewrap status {text!r}")
                    return child
        raise HostFault("bubblewrap did not reach its block fd in time")

    def _apply(self, child: int, pid: int) -> None:
        for proc in (child, pid):
            for res, soft, hard in self._rlimits:
                resource.prlimit(proc, res, (soft, hard))
        for proc in (child, pid):
            for res, soft, hard in self._rlimits:
                if resource.prlimit(proc, res) != (soft, hard):
                    raise HostFault(f"rlimit {res} did not hold on pid {proc}")

    async def _tree(self, pid: int, members: Callable[[], list[int]] | None) -> set[int]:
        if members is not None:
            return set(members())  # one small cgroup file
        # No cgroup to list them: a scan of /proc, off the loop.
        return await anyio.to_thread.run_sync(_descendants, pid)

    async def __call__(self, pid: int, members: Callable[[], list[int]] | None) -> None:
        doomed: set[int] = {pid}  # killed if anything goes wrong
        # Called right after the spawn: the budget runs from here, as `process.run`'s.
        deadline = None if self._budget_s is None else time.monotonic() + self._budget_s
        try:
            child = await self._child_pid()
            if child is None:
                return
            doomed.add(child)
            tree = await self._tree(pid, members)
            doomed |= tree
            # Exactly bubblewrap's monitor and its sandbox process: nothing else may exist
            # (the guest is not forked yet), nothing may have left.
            if tree != {pid, child}:
                raise HostFault(f"unexpected bubblewrap tree {sorted(tree)} (want {pid}, {child})")
            try:
                if not self._rlimits:
                    pass  # a gate for the network wall only (the limits go another way)
                elif self._as_user is None:
                    self._apply(child, pid)
                else:
                    await self._as_user(functools.partial(self._apply, child, pid))
            except OSError as exc:
                raise HostFault(f"cannot set the job's rlimits on bubblewrap: {exc}") from exc
            if self._before_release is not None:
                # The network wall's listeners, in the sandbox's namespaces, before the
                # guest exists (`egress.wall.Wall.attach`).
                await self._before_release(child)
            if await self._tree(pid, members) != tree:
                raise HostFault("bubblewrap's tree changed while blocked")
            if deadline is not None and time.monotonic() >= deadline:
                # Nothing of the budget is left: the guest would be killed as it starts.
                raise _BudgetSpent
            os.write(self.block_w, b"g")
        except BaseException:
            for proc in doomed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc, signal.SIGKILL)
            raise


# --- host facts -----------------------------------------------------------------------

#: How long what the host's system trees look like (which of `SYSTEM_PATHS`,
#: `MASKED_PATHS` and the interpreter roots exist, which are symlinks) is reused between
#: jobs. These are ~40 ``stat`` calls a job otherwise; a job's own mounts are always
#: checked live.
HOST_FACTS_TTL_S = 2.0


@functools.cache
def _private_etc() -> tuple[str, ...]:
    # Once per worker (a ~50 ms walk of /etc): see `private_files` for what it misses.
    return private_files("/etc")


class _HostFacts:
    """`derive_bwrap_argv`'s filesystem callables, memoised for the fixed host paths only."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken = -HOST_FACTS_TTL_S
        self._roots: tuple[str, ...] = ()
        self._fixed: frozenset[str] = frozenset()
        self._exists: dict[str, bool] = {}
        self._isdir: dict[str, bool] = {}
        self._link: dict[str, str | None] = {}
        self._masked: tuple[str, ...] = MASKED_PATHS

    def refresh(self) -> None:
        now = time.monotonic()
        if now - self._taken < HOST_FACTS_TTL_S:
            return
        roots = default_interpreter_roots()
        masked = (*MASKED_PATHS, *_private_etc()) if worker_is_root() else MASKED_PATHS
        fixed = frozenset((*SYSTEM_PATHS, *masked, *roots))
        with self._lock:
            self._roots, self._fixed, self._taken = roots, fixed, now
            self._masked = masked
            self._exists, self._isdir, self._link = {}, {}, {}

    @property
    def roots(self) -> tuple[str, ...]:
        return self._roots

    @property
    def masked(self) -> tuple[str, ...]:
        """`MASKED_PATHS`, plus every private file of ``/etc`` for a root worker."""
        return self._masked

    def exists(self, path: str) -> bool:
        if path not in self._fixed:
            return os.path.exists(path)
        hit = self._exists.get(path)
        if hit is None:
            hit = self._exists[path] = os.path.exists(path)
        return hit

    def isdir(self, path: str) -> bool:
        if path not in self._fixed:
            return os.path.isdir(path)
        hit = self._isdir.get(path)
        if hit is None:
            hit = self._isdir[path] = os.path.isdir(path)
        return hit

    def readlink(self, path: str) -> str | None:
        if path not in self._fixed:
            return os.readlink(path) if os.path.islink(path) else None
        if path not in self._link:
            self._link[path] = os.readlink(path) if os.path.islink(path) else None
        return self._link[path]


# One for the process: the supervisor builds an arm per job (`sandbox.select.choose_arm`).
_host_facts = _HostFacts()


# --- exit mapping ---------------------------------------------------------------------


def parse_json_status(blob: bytes) -> dict[str, Any]:
    """Merge the JSON documents bubblewrap wrote to ``--json-status-fd``.

    Raises:
        HostFault: the status stream is not what bubblewrap writes.
    """
    text = blob.decode("utf-8", errors="strict")
    decoder = json.JSONDecoder()
    merged: dict[str, Any] = {}
    pos = 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            return merged
        try:
            doc, pos = decoder.raw_decode(text, pos)
        except ValueError as exc:
            raise HostFault(f"unreadable bubblewrap status {text!r}: {exc}") from exc
        if not isinstance(doc, dict):
            raise HostFault(f"unexpected bubblewrap status document {doc!r}")
        merged.update(doc)


def _limit_for(sig: int, job: SandboxJob) -> str | None:
    if sig == signal.SIGXCPU and job.limits.cpu_time_s is not None:
        return "cpu_time"
    if sig == signal.SIGXFSZ and job.limits.file_size_bytes is not None:
        return "file_size"
    return None


def map_exit(job: SandboxJob, result: ProcessResult, status: dict[str, Any]) -> SandboxExit:
    """Turn what bubblewrap and the process layer saw into a `SandboxExit`.

    Only bubblewrap's own failure before the guest started is a host fault: once the
    guest runs, whatever bubblewrap reports is a verdict on the job (see the ``Trap``
    below for the one report a guest can forge).

    Raises:
        BwrapSetupFailed: bubblewrap exited without reporting a guest exit.
    """
    if result.timed_out:
        return Timeout()
    code = status.get("exit-code")
    if code is None:
        if result.returncode < 0:
            # bubblewrap itself was killed (SIGKILL from outside, or a limit that also
            # binds it), and with it the guest (it is the pid namespace's init).
            sig = -result.returncode
            return Killed(signal=sig, limit=_limit_for(sig, job))
        stderr = result.stderr.decode(errors="replace").strip()
        raise BwrapSetupFailed(
            f"bubblewrap could not set up the sandbox (exit status {result.returncode}, "
            f"no guest exit reported): {stderr[-500:] or 'no message'}"
        )
    if not isinstance(code, int) or not 0 <= code <= 255:
        # bubblewrap writes "exit-code" only once the guest was exec'd, from a value its
        # init hands the monitor over an eventfd the init keeps open (bwrap.c,
        # do_init/monitor_child). The seccomp filter refuses pidfd_getfd and ptrace, so
        # a guest cannot reach that eventfd; without the filter it can (pidfd_getfd on
        # pid 1, its own uid) and write any number. No process exit produces one
        # outside 0..255, so such a code is the guest's doing, a failure of its own,
        # never a host fault (which would be retried and blamed on the worker).
        return Trap(
            f"bubblewrap reported exit code {code!r}, which no process exit produces: the "
            "job tampered with bubblewrap's exit-status channel"
        )
    if code == 0:
        return Success()
    if _SIGNAL_BASE < code <= _SIGNAL_BASE + _MAX_SIGNAL:
        sig = code - _SIGNAL_BASE
        return Killed(signal=sig, limit=_limit_for(sig, job))
    return Failure(code=code)


# --- containment ----------------------------------------------------------------------

_FILES_REASON = "only the declared mounts and read-only system trees are visible"
_FILES = AxisVerdict("kept", _FILES_REASON)
#: Why a job run as root cannot claim the files and user walls. bubblewrap maps the
#: guest's uid 65534 to the uid that started it; for root that is host uid 0, so
#: discretionary access checks treat the guest as root (it holds no capability, so it
#: cannot override a mode: 0600 root files are read by *owner* match). `MASKED_PATHS`
#: hides a fixed list. A root worker runs its jobs as slot uids instead
#: (`metnos_exec.identities`); this is the reason when one could not.
ROOT_WORKER_REASON = (
    "the job ran as host root for file permissions (no capabilities); root-only files in "
    "read-only system folders are readable"
)
#: A root worker's job, before it ran: which uid it gets is decided at the run.
ROOT_UNKNOWN_REASON = (
    "the worker runs as root: whether the job runs as its slot's own uid or as root is "
    "known once it runs"
)
#: Why the files wall is only ``partial`` with a bubblewrap that cannot bind from an fd.
NO_BIND_FD_REASON = (
    "this bubblewrap has no --bind-fd (0.10+): mount sources are checked for symlinks, "
    "but one swapped between that check and the mount would be mounted"
)


def worker_is_root() -> bool:
    """Whether the worker runs as root (the guest's uid then maps to host uid 0, unless
    the job runs as its slot's own uid)."""
    return os.geteuid() == 0


_NET_KEPT = AxisVerdict(
    "kept", "own network namespace, only its own loopback in it (--unshare-net)"
)
_NET_GRANTED = AxisVerdict("not_kept", "network capability granted: host network shared")
#: The network wall's verdict (`sandbox.egress`): tested from inside real jobs by
#: tests/sandbox/egress/test_wall_bwrap.py and the adversarial rows.
_NET_WALL_REASON = (
    "own network namespace; egress limited to {hosts} through the worker's wall (HTTP "
    "proxy, SOCKS5, allow-listed DNS, transparent capture; names resolved and checked by "
    "the worker)"
)


def _network_verdict(job: SandboxJob) -> AxisVerdict:
    if not job.network:
        return _NET_KEPT
    if job.egress is None:
        return _NET_GRANTED
    return AxisVerdict("kept", _NET_WALL_REASON.format(hosts=job.egress.summary()))


_TREE = AxisVerdict(
    "kept", "own pid namespace with bubblewrap as init; --die-with-parent; tree killed"
)
_USER_REASON = "uid 65534 without capabilities in its own user namespace"


def _identity_verdicts(
    features: BwrapFeatures, job_uid: int | None, root_reason: str | None
) -> tuple[AxisVerdict, AxisVerdict]:
    """The files and user axes, for the host uid the job ran as (`None`: not run yet).

    Args:
        job_uid: the job's host uid (`ProcessResult.uid`).
        root_reason: for a root worker's job that ran as root: why not as a slot uid.
    """
    if worker_is_root():
        if job_uid is None:
            why = _slot_uids_unavailable()
            reason = ROOT_UNKNOWN_REASON if why is None else f"{ROOT_WORKER_REASON} ({why})"
            return AxisVerdict("partial", reason), AxisVerdict("partial", reason)
        if job_uid == 0:
            reason = f"{ROOT_WORKER_REASON} ({root_reason or 'no slot uid'})"
            return AxisVerdict("partial", reason), AxisVerdict("partial", reason)
    whose = (
        f", host uid {job_uid} (this job slot's own: it owns nothing else on the host)"
        if worker_is_root()
        else ""
    )
    files = (
        AxisVerdict("partial", NO_BIND_FD_REASON)
        if not features.bind_fd
        else AxisVerdict("kept", _FILES_REASON + (f", to host uid {job_uid}" if whose else ""))
    )
    if features.disable_userns:
        user = AxisVerdict("kept", _USER_REASON + whose + "; nested user namespaces disabled")
    else:
        user = AxisVerdict(
            "partial", _USER_REASON + whose + "; nested user namespaces allowed (bubblewrap < 0.8)"
        )
    return files, user


def root_worker_note() -> str | None:
    """What a root worker's jobs run as, for `metnos-exec status` (``None``: not root)."""
    if not worker_is_root():
        return None
    why = _slot_uids_unavailable()
    if why is None and not slots_available():
        why = "no job slots here (they need a writable cgroup v1 pids hierarchy)"
    if why is None:
        return (
            "the worker runs as root: each job slot runs its jobs as a dedicated host uid "
            f"of its own ({SLOT_UIDS_ENV}), staged or not; a job whose folders cannot be "
            "idmapped for it runs as root, and its report says so"
        )
    return f"{ROOT_WORKER_REASON} ({why}); run the worker as an unprivileged user"


def _slot_uids_unavailable() -> str | None:
    try:
        return slot_uids_unavailable()
    except MetnosError as exc:
        return str(exc)


#: The memory wall without a memory cgroup: RLIMIT_AS binds each process and the bytes of
#: each private tmpfs, so N processes (plus /tmp, /dev/shm and SysV shared memory, whose
#: pages no rlimit counts) reach several times the budget together. A tmpfs's size counts
#: data pages only: its number of files is not bounded (bubblewrap's ``--size`` sets no
#: ``nr_inodes``), and each empty file holds about 1 KiB of kernel memory (inode, dentry)
#: that only a memory cgroup charges (tests/adversarial: resources.tmpfs_file_count).
MEMORY_PER_PROCESS_REASON = (
    "memory bounded per process (RLIMIT_AS) and per tmpfs in bytes (/tmp, /dev/shm: each "
    "at the budget; not their number of files, whose kernel memory nothing bounds), not "
    "for the job as a whole: no memory cgroup"
)
#: The same without ``--size`` (bubblewrap < 0.8, `BwrapFeatures.tmpfs_size`): /tmp and
#: /dev/shm are tmpfs mounts of the kernel's default size, half the host's RAM each, and
#: their pages are RAM that RLIMIT_AS does not count.
MEMORY_UNSIZED_TMPFS_REASON = (
    "memory bounded per process (RLIMIT_AS) only, not for the job as a whole: no memory "
    "cgroup, and /tmp and /dev/shm are not sized (bubblewrap < 0.8 has no --size; each "
    "may take up to half the host's RAM)"
)
#: Writes to a job's writable folders land on the host's disk as they happen: each file is
#: capped (RLIMIT_FSIZE), their total is not, until writes go through a size-limited
#: staging layer (issue 10).
DISK_REASON = (
    "disk not bounded in total: writes to the writable folders are capped per file "
    "(RLIMIT_FSIZE) only, no staging layer limits their sum"
)


#: A root worker's job run as root: the kernel's per-user quotas are root's. A job that
#: holds them all (128 inotify instances, say) refuses them to every root process of the
#: host until it ends (a slot's uid has quotas of its own).
ROOT_QUOTAS_REASON = (
    "per-user kernel quotas (inotify instances and watches, epoll watches, message "
    "queues, pipe buffers) are root's, shared with every root process of the host"
)
#: An unprivileged worker's job is the worker's uid on the host, and the kernel counts
#: these quotas per host uid: inotify instances and watches and message queue bytes per
#: user in every ancestor user namespace (the job's own namespace does not separate
#: them), pipe buffers and epoll watches per uid outright. A job that holds them all
#: refuses them to the worker and to its other jobs until it ends; no cgroup bounds a
#: count of instances or watches.
UNPRIVILEGED_QUOTAS_REASON = (
    "per-user kernel quotas (inotify instances and watches, epoll watches, message "
    "queues, pipe buffers) are the worker's uid's, shared with the worker and its other "
    "jobs"
)
#: A root worker's job as its slot's uid: the quotas are that uid's, and a slot runs one
#: job at a time, so they are the job's own.
SLOT_QUOTAS_NOTE = "per-user kernel quotas the slot uid's own"


def _pids_reason(job_uid: int | None) -> str:
    """Why the process count is not held per job (no pids cgroup), for whoever the job's
    processes belong to on the host."""
    if job_uid == 0:
        return (
            "no process limit: no pids cgroup, and RLIMIT_NPROC does not bind root "
            "(the job ran as root)"
        )
    if worker_is_root():
        return (
            "process limit held by RLIMIT_NPROC on the slot's own uid, not a pids cgroup: "
            "earlier jobs' processes of that uid not yet reaped count too"
        )
    return (
        "process limit counted per user, not per job: no pids cgroup, and RLIMIT_NPROC "
        "counts every process of the worker's uid"
    )


def _resources_verdict(
    job: SandboxJob,
    pids_enforced: bool | None,
    memory_enforced: bool | None,
    job_uid: int | None,
    *,
    features: BwrapFeatures,
    ran_as_root: bool = False,
) -> AxisVerdict:
    """The resources axis, for what held (`None`: not known before the run).

    Args:
        job_uid: the host uid the job's processes run as (``None``: not known yet).
        features: the bubblewrap that runs it (whether it sizes /tmp and /dev/shm).
        ran_as_root: a root worker's job ran as root (not as its slot's uid).
    """
    lim = job.limits
    missing: list[str] = []
    if lim.memory_bytes is None:
        missing.append("no memory limit")
    elif memory_enforced is False:
        missing.append(
            MEMORY_PER_PROCESS_REASON if features.tmpfs_size else MEMORY_UNSIZED_TMPFS_REASON
        )
    elif memory_enforced is None:
        missing.append("job memory limit enforcement unknown until run")
    if lim.pids is None:
        missing.append("no process limit")
    elif pids_enforced is False:
        missing.append(_pids_reason(job_uid))
    elif pids_enforced is None:
        missing.append("process limit enforcement unknown until run")
    if lim.file_size_bytes is None:
        missing.append("no file size limit")
    # A staged folder's writes are bounded by its staging tmpfs (the supervisor says so).
    if any(m.writable and not m.staged for m in job.mounts):
        missing.append(DISK_REASON)
    if ran_as_root:
        missing.append(ROOT_QUOTAS_REASON)
    elif not worker_is_root():
        missing.append(UNPRIVILEGED_QUOTAS_REASON)
    if missing:
        return AxisVerdict("partial", "; ".join(missing))
    cpu = f"{lim.cpu_time_s} s CPU" if lim.cpu_time_s is not None else "CPU bounded by wall time"
    return AxisVerdict(
        "kept",
        f"job memory (memory cgroup), process count, file size and {cpu} limits held; "
        + SLOT_QUOTAS_NOTE,
    )


# --- the arm --------------------------------------------------------------------------


@final
class BwrapSandbox:
    """Native jobs inside bubblewrap.

    Args:
        bwrap: the bubblewrap executable; default: `bwrap_probe()`'s.
        features: what that bubblewrap supports; default: from the probe.
        hardening: the seccomp filter and landlock to add; default: what this host
            offers (`host_hardening`).
        resolver: how the network wall resolves the names a job asks for (default:
            the worker's own ``getaddrinfo``; tests pass one they control).
    """

    name = "bwrap"
    #: A job's writes can be staged: bubblewrap is started in the staging namespace
    #: (`SandboxJob.stage`, `metnos_exec.sandbox.staged`) and binds the overlays marked
    #: `Mount.staged`.
    stages_writes = True

    def __init__(
        self,
        bwrap: str | None = None,
        *,
        features: BwrapFeatures | None = None,
        hardening: Hardening | None = None,
        resolver: Resolver = system_resolver,
    ) -> None:
        self._resolver = resolver
        if bwrap is None or features is None:
            probe = bwrap_probe()
            bwrap = bwrap or probe.path or "bwrap"
            features = features or probe.features
        self._bwrap = bwrap
        self._features = features
        self._hardening = host_hardening() if hardening is None else hardening

    def containment(self, job: SandboxJob) -> ContainmentReport:
        """The report before running: resources stay ``partial`` until the run shows
        whether the pids and memory cgroups really held (see `run`)."""
        return self._report(job, pids_enforced=None, memory_enforced=None)

    def _report(
        self,
        job: SandboxJob,
        *,
        pids_enforced: bool | None,
        memory_enforced: bool | None,
        job_uid: int | None = None,
        root_reason: str | None = None,
    ) -> ContainmentReport:
        files, user = _identity_verdicts(self._features, job_uid, root_reason)
        report = ContainmentReport(
            sandbox="bwrap",
            files=files,
            network=_network_verdict(job),
            process_tree=_TREE,
            user=user,
            resources=_resources_verdict(
                job,
                pids_enforced,
                memory_enforced,
                os.geteuid() if job_uid is None else job_uid,
                features=self._features,
                ran_as_root=worker_is_root() and job_uid == 0,
            ),
        )
        return annotate(report, job, self._hardening)

    async def run(self, job: SandboxJob) -> SandboxOutcome:
        """Run `job` in bubblewrap until it exits or its wall time passes.

        Raises:
            SandboxDenied: a mount would replace a private tree (``/proc``, ``/dev``, ``/``).
            BwrapSetupFailed: bubblewrap could not build the sandbox.
            HostFault: the harness broke (status unreadable).
        """
        if not job.argv:
            raise HostFault("the bwrap arm got a job without argv (a wasm job misrouted)")
        rlimits = derive_rlimits(job.limits)
        host = _host_facts
        host.refresh()
        wall = None if job.egress is None or not job.network else Wall(job.egress, self._resolver)
        if wall is not None:
            # The proxy variables point into the job's namespace, at the wall.
            job = msgspec.structs.replace(job, env={**job.env, **wall.env()})
        # Landlock is applied by the guest's first process (the in-guest step): the
        # command bubblewrap execs is the job's, behind it (and behind the limits prefix).
        guest = guest_job(
            job,
            self._hardening,
            interpreter_roots=host.roots,
            exists=host.exists,
            readlink=host.readlink,
            isdir=host.isdir,
        )
        # Every job mount and interpreter root opened without following a symlink (a
        # swapped hint folder refuses the job here), and bound from that fd.
        sources = _open_sources(job, host.roots)
        try:
            async with pooled_slot() as slot:
                place = await _placement(slot, sources, stage=job.stage)
                gated = _can_gate(rlimits)
                prefix = () if gated else _limits_in_guest(rlimits)
                try:
                    return await self._run(job, guest, rlimits, gated, prefix, host, place, wall)
                finally:
                    place.close()
        finally:
            for fd in sources.values():
                os.close(fd)

    async def _run(
        self,
        job: SandboxJob,
        guest: SandboxJob,
        rlimits: tuple[tuple[int, int, int], ...],
        gated: bool,
        prefix: tuple[str, ...],
        host: _HostFacts,
        place: _Placement,
        wall: Wall | None,
    ) -> SandboxOutcome:
        sources = place.sources
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        gate: _LimitGate | None = None
        seccomp_r: int | None = None
        try:
            seccomp_r = seccomp_fd(self._hardening)
            if gated or wall is not None:
                gate = _LimitGate(
                    rlimits if gated else (),
                    status_r,
                    status_w,
                    max(job.limits.wall_time_s, _GATE_MIN_WAIT_S),
                    as_user=place.slot.run_as if place.as_slot_user and place.slot else None,
                    budget_s=job.limits.wall_time_s,
                    before_release=None if wall is None else wall.attach,
                )
            try:
                argv = derive_bwrap_argv(
                    msgspec.structs.replace(guest, argv=prefix + guest.argv) if prefix else guest,
                    bwrap=self._bwrap,
                    features=self._features,
                    exists=host.exists,
                    isdir=host.isdir,
                    readlink=host.readlink,
                    interpreter_roots=host.roots,
                    json_status_fd=status_w,
                    # As a slot's own uid the guest cannot read root's private files:
                    # the scan of /etc only matters for a job run as root.
                    masked_paths=MASKED_PATHS if place.as_slot_user else host.masked,
                    block_fd=None if gate is None else gate.block_r,
                    source_fds=sources,
                    seccomp_fd=seccomp_r,
                    files=() if wall is None else guest_files(),
                )
            except ValueError as exc:
                raise SandboxDenied(f"the bwrap arm refuses this job: {exc}") from exc
            if place.enter:
                # Staging: bubblewrap starts inside the staging namespace (an exec'd
                # nsenter, same pid), where the job's overlays are (`metnos_exec.undo.staging`);
                # a slot's job drops to the slot's uid there, before bubblewrap runs.
                argv = [*place.enter, *argv]
            in_guest = gated or bool(prefix)
            spec = ProcessSpec(
                argv=tuple(argv),
                # bubblewrap needs no environment; the guest's comes from --setenv.
                env={},
                stdin=job.stdin,
                cwd=None,
                # With the gate (or the prefix), nothing runs between fork and exec: no
                # preexec_fn, so CPython vforks instead of copying the worker (ms a job).
                rlimits=() if in_guest else rlimits,
                pass_fds=(
                    (status_w,)
                    + (() if gate is None else (gate.block_r,))
                    + (() if seccomp_r is None else (seccomp_r,))
                    + _bound_fds(argv, sources)
                ),
                # --die-with-parent sets bubblewrap's own parent-death signal before the
                # guest may start (the monitor sets it, then releases the sandbox), so a
                # second one from us only costs the preexec_fn. Kept when the rlimits need
                # a preexec_fn anyway: it also closes the instant between our exec and
                # bubblewrap's prctl.
                pdeathsig=not in_guest,
                output_bytes=job.limits.output_bytes,
                # bubblewrap's monitor and its init (pid 1 of the namespace) live in the
                # cgroup too: the guest gets exactly its budget.
                pids_max=None if job.limits.pids is None else job.limits.pids + _BWRAP_PIDS,
                # The pid namespace and --die-with-parent already hold the tree: no shim.
                reaper=False,
                # --die-with-parent is armed late: the worker's keeper finds bubblewrap
                # by this mark if the worker dies first (`process.start_keeper`).
                keeper_mark=True,
                # Fork from a spawner thread that already sits in its own pids cgroup: no
                # per-job cgroup migration (the costly part, an RCU grace period).
                cgroup_pool=True,
                # The job's total: every process of the tree and the /tmp pages it writes,
                # held by the slot's memory cgroup (RLIMIT_AS only binds each process).
                memory_max=job.limits.memory_bytes,
                on_spawn=gate,
                # A root worker's job runs as its slot's own host uid (`identities`):
                # forked as it, or (staged) dropping to it inside the staging namespace.
                as_slot_user=place.as_slot_user and not place.enter,
                drops_to_slot_user=place.as_slot_user and bool(place.enter),
            )
            spawned = time.monotonic()
            stopped = Stopped()
            interrupted: BaseException | None = None
            try:
                async with contextlib.AsyncExitStack() as stack:
                    if wall is not None:
                        # Its listeners and every relayed connection end with the run.
                        await stack.enter_async_context(wall)
                    result = await run_process(
                        spec, timeout=job.limits.wall_time_s, slot=place.slot, stopped=stopped
                    )
            except _BudgetSpent:
                # The gate killed bubblewrap before the guest existed (`process.run` reaped
                # it): the job's timeout, with nothing run.
                result = ProcessResult(
                    returncode=-signal.SIGKILL,
                    stdout=b"",
                    stderr=b"",
                    stdout_truncated=False,
                    stderr_truncated=False,
                    timed_out=True,
                    wall_s=time.monotonic() - spawned,
                    cpu_s=0.0,
                    peak_rss_bytes=0,
                    pids_limited=False,
                )
            except BaseException as exc:
                if stopped.result is None:
                    raise  # nothing was launched, or nothing of it could be measured
                # Stopped from outside once launched (a cancel, a drain, a lost lease, the
                # caller's backstop): the tree is dead and reaped. Its outcome is measured
                # as for a run that ended, and left for the caller (`record_stopped`).
                result, interrupted = stopped.result, exc
            with anyio.CancelScope(shield=interrupted is not None):
                if gate is not None:
                    gate.close()  # our copy of status_w, if the gate did not run
                else:
                    os.close(status_w)
                status_w = -1
                head = b"" if gate is None else gate.status_head
                status = parse_json_status(head + _drain(status_r))
                init = await _reap_orphaned_init(status.get("child-pid"))
        finally:
            if gate is not None:
                gate.close()  # closes status_w too
            elif status_w >= 0:
                os.close(status_w)
            os.close(status_r)
            if seccomp_r is not None:
                os.close(seccomp_r)
        # The kernel told us: a process of the job was OOM-killed at the job's memory
        # limit (the memory cgroup's oom_kill counter moved). Never inferred from stderr.
        exit_ = MemoryExceeded() if result.oom_killed else map_exit(job, result, status)
        outcome = SandboxOutcome(
            stdout=result.stdout,
            stderr=result.stderr,
            exit=exit_,
            usage=_usage(result, init),
            containment=self._report(
                job,
                pids_enforced=result.pids_limited,
                memory_enforced=result.memory_limited,
                job_uid=result.uid,
                root_reason=place.root_reason,
            ),
            stdout_truncated=result.stdout_truncated,
            stderr_truncated=result.stderr_truncated,
            egress=() if wall is None else wall.records,
        )
        if interrupted is not None:
            record_stopped(outcome)
            raise interrupted
        return outcome


def _usage(result: ProcessResult, init: Any | None) -> Usage:
    """What the run used, from the process layer's result and the init's rusage."""
    # bubblewrap's monitor reaps nothing of the guest: the guest's CPU time is in the
    # rusage of the init, which reaped it. A killed tree's processes are reaped by nobody
    # who counts them: what they had used was read just before the kill (`killed_cpu_s`,
    # their reaped children's included); the larger of the two lower bounds. Without
    # either (the init was not ours to reap, the run ended by itself) the CPU time is not
    # known, and not guessed.
    cpu = None if init is None else result.cpu_s + init.ru_utime + init.ru_stime
    if result.killed_cpu_s is not None:
        cpu = max(cpu or 0.0, result.killed_cpu_s)
    # The tree's peak as the memory cgroup counted it, when there is one; else the largest
    # single process the init reaped, or that was alive at the kill (a lower bound for a
    # tree). Never the monitor's own ru_maxrss: it execs out of the worker's memory, so it
    # reads the *worker's* high-water mark.
    peak = result.memory_peak_bytes
    if peak is None:
        single = [
            n
            for n in (
                None if init is None else init.ru_maxrss * 1024,
                result.killed_peak_rss_bytes,
            )
            if n
        ]
        peak = max(single) if single else None
    return Usage(wall_s=result.wall_s, cpu_s=cpu, peak_memory_bytes=peak)


@dataclasses.dataclass
class _Placement:
    """Where and as whom one job runs: its mount sources (fds to bind from), its slot,
    for a root worker whether it runs as the slot's own uid (else why not), and for a
    staged job the prefix bubblewrap starts under (`metnos_exec.sandbox.staged`)."""

    sources: dict[str, int]
    slot: Slot | None = None
    #: The idmapped sources of an unstaged job run as the slot's uid.
    idmapped: StagedSources | None = None
    #: A staged job's overlays, placed for the uid it runs as.
    staged: StagedPlacement | None = None
    #: The slot's uid the job runs as (``None``: the worker's).
    uid: int | None = None
    root_reason: str | None = None

    @property
    def as_slot_user(self) -> bool:
        return self.uid is not None

    @property
    def enter(self) -> tuple[str, ...]:
        return () if self.staged is None else self.staged.enter

    def close(self) -> None:
        if self.idmapped is not None:
            self.idmapped.close()
        if self.staged is not None:
            self.staged.close()


async def _placement(
    slot: Slot | None, sources: dict[str, int], *, stage: str | None = None
) -> _Placement:
    """For a root worker: the slot's uid and the job's folders idmapped for it, or the
    reason the job runs as root (no slot here, slot uids off or unavailable, a folder
    whose filesystem refuses idmapped mounts). Anyone else: the sources as opened.

    A staged job (`stage`) has its overlays mounted now, for that uid
    (`metnos_exec.sandbox.staged`): bubblewrap then starts in the staging namespace,
    which only root may enter, so it is forked as root and drops to the slot's uid there
    (``nsenter --setuid --setgid``) before it runs.
    """
    stager = None if stage is None else stager_for(stage)
    if not worker_is_root():
        if stager is None:
            return _Placement(sources, slot)
        placed = await stager.place(None, sources)
        return _Placement(placed.sources, slot, staged=placed)
    why = _slot_uids_unavailable()  # read per job: METNOS_SLOT_UIDS=off takes effect at once
    identity = None
    if why is None and slot is None:
        why = "no job slot here (slots need a writable cgroup v1 pids hierarchy)"
    elif why is None and slot is not None:
        identity = await slot.identity()
        if identity is None:
            why = slot.identity_error
    if identity is not None and stager is None:
        try:
            idmapped = StagedSources(sources, identity.uid, identity.gid, identity.userns_fd)
        except OSError as exc:
            why = f"cannot mount as the slot uid: {exc}"
        else:
            return _Placement(idmapped.fds, slot, idmapped=idmapped, uid=identity.uid)
    elif identity is not None and stager is not None:
        try:
            placed = await stager.place(identity, sources)
        except IdmapUnavailable as exc:
            why = f"cannot mount as the slot uid: {exc}"
        else:
            return _Placement(placed.sources, slot, staged=placed, uid=identity.uid)
    if stager is None:
        return _Placement(sources, slot, root_reason=why)
    placed = await stager.place(None, sources)
    return _Placement(placed.sources, slot, staged=placed, root_reason=why)


def _bound_fds(argv: list[str], sources: dict[str, int]) -> tuple[int, ...]:
    """The source fds `argv` binds from: only those go to bubblewrap. bubblewrap closes
    an fd once it has mounted it; one it was handed but never used (a root below a system
    tree, a mount another one replaced) would reach the guest."""
    used = {
        int(argv[i + 1]) for i, arg in enumerate(argv[:-1]) if arg in ("--bind-fd", "--ro-bind-fd")
    }
    return tuple(fd for fd in sources.values() if fd in used)


def _open_sources(job: SandboxJob, roots: tuple[str, ...]) -> dict[str, int]:
    """Open each job mount's host folder and each interpreter root (see
    `mount_sources.open_source`); an absent one is left out (it is not mounted).

    Raises:
        SymlinkedFolder: one is reached through a symlink (nothing is left open).
        HostFault: the kernel refused to open one for another reason.
    """
    fds: dict[str, int] = {}
    try:
        # A staged mount lives in the staging namespace, not here (`Mount.staged`).
        for path in (*roots, *(m.host for m in job.mounts if not m.staged)):
            if path in fds:
                continue
            try:
                fds[path] = open_source(path)
            except (FileNotFoundError, NotADirectoryError, PermissionError):
                # Not mounted, as before: a hint naming a missing folder, or a folder the
                # worker's own uid cannot reach (the guest could not have either).
                continue
            except OSError as exc:
                raise HostFault(f"cannot open mount source {path}: {exc}") from exc
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


async def _reap_orphaned_init(pid: object) -> Any | None:
    """Reap bubblewrap's init (the sandbox's pid 1) when it became *our* child; return
    its rusage, which covers the whole guest tree it reaped (``None``: not ours).

    bubblewrap's monitor exits as soon as the init reports the guest's exit status, before
    the init itself has exited, so the init is always orphaned: re-parented to the nearest
    subreaper, else to the host's init. When that is the worker (a subreaper, as the
    worker process is, or pid 1 of a container), nobody else will ever reap it: its
    zombie would keep a pid (and a charge in the pids cgroup) for the worker's lifetime.
    Otherwise it is left to whoever it belongs to, and the job's CPU time is not known.
    """
    if not isinstance(pid, int) or pid <= 0:
        return None
    return await reap_orphan(pid, _INIT_REAP_S)


def _drain(fd: int) -> bytes:
    # bubblewrap has exited and our copy of the write end is closed, so normally this hits
    # EOF at once. Non-blocking anyway: should any process still hold the write end, we
    # take what was written instead of hanging the worker.
    os.set_blocking(fd, False)
    chunks: list[bytes] = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return b"".join(chunks)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
