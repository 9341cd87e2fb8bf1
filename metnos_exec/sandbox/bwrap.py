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
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any, final

import anyio
import msgspec

from ..errors import HostFault
from ..process import ProcessResult, ProcessSpec, Stopped, pooled_slot, reap_orphan, run_process
from ..process.teardown import Later, current_later
from ._bwrap_command import _BWRAP_PIDS as _BWRAP_PIDS
from ._bwrap_command import _host_facts, _HostFacts, bwrap_argv, process_spec
from ._bwrap_exit import BwrapSetupFailed, _drain, _usage, map_exit, parse_json_status
from ._bwrap_limits import (
    _GATE_MIN_WAIT_S,
    _BudgetSpent,
    _can_gate,
    _LimitGate,
    _limits_in_guest,
)
from ._bwrap_limits import _guest_prlimit as _guest_prlimit
from ._bwrap_place import _open_sources, _Placement, _placement
from ._bwrap_probe import NEGATIVE_PROBE_TTL_S as NEGATIVE_PROBE_TTL_S
from ._bwrap_probe import BwrapProbe, bwrap_probe, find_bwrap
from ._bwrap_probe import forget_probes as forget_probes
from ._bwrap_report import DISK_REASON as DISK_REASON
from ._bwrap_report import MEMORY_PER_PROCESS_REASON as MEMORY_PER_PROCESS_REASON
from ._bwrap_report import MEMORY_UNSIZED_TMPFS_REASON as MEMORY_UNSIZED_TMPFS_REASON
from ._bwrap_report import NO_BIND_FD_REASON as NO_BIND_FD_REASON
from ._bwrap_report import ROOT_QUOTAS_REASON as ROOT_QUOTAS_REASON
from ._bwrap_report import ROOT_UNKNOWN_REASON as ROOT_UNKNOWN_REASON
from ._bwrap_report import ROOT_WORKER_REASON as ROOT_WORKER_REASON
from ._bwrap_report import SLOT_QUOTAS_NOTE as SLOT_QUOTAS_NOTE
from ._bwrap_report import UNPRIVILEGED_QUOTAS_REASON as UNPRIVILEGED_QUOTAS_REASON
from ._bwrap_report import containment_report
from ._bwrap_report import root_worker_note as root_worker_note
from ._bwrap_report import worker_is_root as worker_is_root
from ._bwrap_warm import warm_pools
from ._types import (
    ContainmentReport,
    MemoryExceeded,
    SandboxJob,
    SandboxOutcome,
    record_stopped,
)
from .egress.policy import Resolver, system_resolver
from .egress.wall import Wall
from .flags import BwrapFeatures, derive_rlimits
from .hardening import Hardening, guest_job, host_hardening, seccomp_fd
from .progress import ProgressChannel, open_channel

__all__ = (
    "BwrapProbe",
    "BwrapSandbox",
    "BwrapSetupFailed",
    "bwrap_probe",
    "find_bwrap",
    "map_exit",
    "parse_json_status",
)
# The names imported ``as`` themselves above are re-exported: the doctor, other rooms' tests
# and the benches reach them through this module.

#: Bound on waiting for bubblewrap's orphaned init to finish exiting (normally microseconds).
_INIT_REAP_S = 2.0


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
        return containment_report(
            job, self._features, self._hardening, pids_enforced=None, memory_enforced=None
        )

    async def run(self, job: SandboxJob) -> SandboxOutcome:
        """Run `job` in bubblewrap until it exits or its wall time passes: in a warm
        sandbox of its template inside `warm_sandboxes` (`metnos_exec.sandbox._bwrap_warm`),
        else in one started for it.

        Raises:
            SandboxDenied: a mount would replace a private tree (``/proc``, ``/dev``, ``/``).
            BwrapSetupFailed: bubblewrap could not build the sandbox.
            HostFault: the harness broke (status unreadable).
        """
        pools = warm_pools()
        if pools is not None and job.argv:
            return await pools.run(self, job, self.why_cold(job))
        return await self._run_job(job)

    def why_cold(self, job: SandboxJob) -> str | None:
        """Why `job` cannot run in a warm sandbox (``None``: it can); see `_bwrap_warm`."""
        if job.stage is not None:
            return "staged (fs:write): its overlay and commit baseline are made per job"
        if job.network:
            return "network: the wall is attached to one job and records its egress"
        if self._hardening.landlock_abi is None or self._hardening.landlock_python is None:
            return "no in-guest landlock step here (the warm hold lives in it)"
        return None

    async def _run_job(
        self, job: SandboxJob, hold: Callable[[], Awaitable[bytes]] | None = None
    ) -> SandboxOutcome:
        """`run` in a sandbox started for `job`; with `hold` (a warm sandbox), held
        before the job's code until `hold` returns its stdin (`ProcessSpec.release`)."""
        if not job.argv:
            raise HostFault("the bwrap arm got a job without argv (a wasm job misrouted)")
        rlimits = derive_rlimits(job.limits)
        host = _host_facts
        host.refresh()
        wall = None if job.egress is None or not job.network else Wall(job.egress, self._resolver)
        if wall is not None:
            # The proxy variables point into the job's namespace, at the wall.
            job = msgspec.structs.replace(job, env={**job.env, **wall.env()})
        progress = open_channel()
        if progress is not None:
            # The guest inherits the pipe's write end (bubblewrap keeps an inherited fd
            # that is not close-on-exec, and so does everything it execs on the way).
            job = msgspec.structs.replace(job, env={**job.env, **progress.env()})
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
        try:
            sources = _open_sources(job, host.roots)
        except BaseException:
            if progress is not None:
                progress.finish()
            raise
        # A staged job's placement (its overlays) is closed before its commit, as before.
        later = current_later() if job.stage is None else None
        teardown = contextlib.AsyncExitStack()
        try:
            async with teardown:
                # Closed last: the job's sources, then its placement, then the slot lent
                # again (after the drain `run_process` leaves in `later`).
                teardown.callback(_close_all, sources)
                slot = await teardown.enter_async_context(pooled_slot())
                place = await _placement(slot, sources, stage=job.stage)
                teardown.callback(place.close)
                gated = _can_gate(rlimits)
                prefix = () if gated else _limits_in_guest(rlimits)
                try:
                    return await self._run(
                        job, guest, rlimits, gated, prefix, host, place, wall, progress, later, hold
                    )
                finally:
                    if later is not None:
                        # The result goes on now; its teardown after the drain.
                        later.add(teardown.pop_all().aclose)
        finally:
            if progress is not None:
                progress.finish()  # what the guest wrote last, before the outcome is used

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
        progress: ProgressChannel | None,
        later: Later | None = None,
        hold: Callable[[], Awaitable[bytes]] | None = None,
    ) -> SandboxOutcome:
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
            argv = bwrap_argv(
                guest,
                prefix,
                bwrap=self._bwrap,
                features=self._features,
                host=host,
                place=place,
                status_w=status_w,
                gate=gate,
                seccomp_r=seccomp_r,
                wall=wall,
            )
            in_guest = gated or bool(prefix)
            spec = process_spec(
                job,
                argv,
                rlimits,
                in_guest=in_guest,
                place=place,
                status_w=status_w,
                gate=gate,
                seccomp_r=seccomp_r,
                progress=progress,
            )
            if hold is not None:
                spec = msgspec.structs.replace(spec, release=hold)
            result, interrupted = await _launch(job, spec, place, wall, later)
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
        outcome = self._outcome(job, result, status, init, place, wall)
        if interrupted is not None:
            record_stopped(outcome)
            raise interrupted
        return outcome

    def _outcome(
        self,
        job: SandboxJob,
        result: ProcessResult,
        status: dict[str, Any],
        init: Any | None,
        place: _Placement,
        wall: Wall | None,
    ) -> SandboxOutcome:
        # The kernel told us: a process of the job was OOM-killed at the job's memory
        # limit (the memory cgroup's oom_kill counter moved). Never inferred from stderr.
        exit_ = MemoryExceeded() if result.oom_killed else map_exit(job, result, status)
        return SandboxOutcome(
            stdout=result.stdout,
            stderr=result.stderr,
            exit=exit_,
            usage=_usage(result, init),
            containment=containment_report(
                job,
                self._features,
                self._hardening,
                pids_enforced=result.pids_limited,
                memory_enforced=result.memory_limited,
                job_uid=result.uid,
                root_reason=place.root_reason,
            ),
            stdout_truncated=result.stdout_truncated,
            stderr_truncated=result.stderr_truncated,
            egress=() if wall is None else wall.records,
        )


async def _launch(
    job: SandboxJob,
    spec: ProcessSpec,
    place: _Placement,
    wall: Wall | None,
    later: Later | None = None,
) -> tuple[ProcessResult, BaseException | None]:
    """Run `spec` for the job's wall time, the network wall's listeners open meanwhile.

    Returns:
        The result, and what stopped the run from outside once it was launched (the
        caller re-raises it once the outcome is recorded), else ``None``.
    """
    spawned = time.monotonic()
    stopped = Stopped()
    interrupted: BaseException | None = None
    try:
        async with contextlib.AsyncExitStack() as stack:
            if wall is not None:
                # Its listeners and every relayed connection end with the run.
                await stack.enter_async_context(wall)
            result = await run_process(
                spec,
                timeout=job.limits.wall_time_s,
                slot=place.slot,
                stopped=stopped,
                later=later,
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
    return result, interrupted


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)


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
