"""The bwrap arm's command for one job: the host's fixed paths as `derive_bwrap_argv` reads
them (memoised, `_HostFacts`), the argv (`bwrap_argv`), and the `ProcessSpec` that starts
it (`process_spec`): which fds bubblewrap is handed, where the rlimits are set, the cgroup
budgets and the slot's identity.
"""

from __future__ import annotations

import functools
import os
import threading
import time

import msgspec

from ..errors import SandboxDenied
from ..process import ProcessSpec
from ._bwrap_limits import _LimitGate
from ._bwrap_place import _Placement
from ._bwrap_report import worker_is_root
from ._types import SandboxJob
from .egress.dns import guest_files
from .egress.wall import Wall
from .flags import (
    MASKED_PATHS,
    SYSTEM_PATHS,
    BwrapFeatures,
    default_interpreter_roots,
    derive_bwrap_argv,
    private_files,
)
from .progress import ProgressChannel

#: Processes bubblewrap itself keeps in the job's cgroup: its monitor and the init.
_BWRAP_PIDS = 2


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


def bwrap_argv(
    guest: SandboxJob,
    prefix: tuple[str, ...],
    *,
    bwrap: str,
    features: BwrapFeatures,
    host: _HostFacts,
    place: _Placement,
    status_w: int,
    gate: _LimitGate | None,
    seccomp_r: int | None,
    wall: Wall | None,
) -> list[str]:
    """bubblewrap's command line for `guest` (its argv behind the limits `prefix`), under
    the staging namespace's ``nsenter`` for a staged job.

    Raises:
        SandboxDenied: `derive_bwrap_argv` refused a mount of the job.
    """
    try:
        argv = derive_bwrap_argv(
            msgspec.structs.replace(guest, argv=prefix + guest.argv) if prefix else guest,
            bwrap=bwrap,
            features=features,
            exists=host.exists,
            isdir=host.isdir,
            readlink=host.readlink,
            interpreter_roots=host.roots,
            json_status_fd=status_w,
            # As a slot's own uid the guest cannot read root's private files:
            # the scan of /etc only matters for a job run as root.
            masked_paths=MASKED_PATHS if place.as_slot_user else host.masked,
            block_fd=None if gate is None else gate.block_r,
            source_fds=place.sources,
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
    return argv


def process_spec(
    job: SandboxJob,
    argv: list[str],
    rlimits: tuple[tuple[int, int, int], ...],
    *,
    in_guest: bool,
    place: _Placement,
    status_w: int,
    gate: _LimitGate | None,
    seccomp_r: int | None,
    progress: ProgressChannel | None = None,
) -> ProcessSpec:
    """How the process layer starts `argv` for `job`; `in_guest`: the gate or the prefix
    sets `rlimits`, not the process layer before exec; `progress`: the job's progress
    channel (its write end handed down to the guest, its reader beside the run)."""
    return ProcessSpec(
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
            + (() if progress is None else (progress.write_fd,))
            + _bound_fds(argv, place.sources)
        ),
        beside=None if progress is None else progress.pump,
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


def _bound_fds(argv: list[str], sources: dict[str, int]) -> tuple[int, ...]:
    """The source fds `argv` binds from: only those go to bubblewrap. bubblewrap closes
    an fd once it has mounted it; one it was handed but never used (a root below a system
    tree, a mount another one replaced) would reach the guest."""
    used = {
        int(argv[i + 1]) for i, arg in enumerate(argv[:-1]) if arg in ("--bind-fd", "--ro-bind-fd")
    }
    return tuple(fd for fd in sources.values() if fd in used)
