"""The bwrap arm's containment report: the verdict on each axis and the reasons it gives,
for a job before it runs (`BwrapSandbox.containment`) and once it ran.

The reasons are constants, so the doctor and the tests name them instead of parsing
them. What the job ran as decides the files, user and resources axes (a root worker's job
runs as its slot's own uid, or as root, and says why); the seccomp filter and landlock are
added on top by `metnos_exec.sandbox.hardening.annotate`.
"""

from __future__ import annotations

import os

from ..errors import MetnosError
from ..identities import SLOT_UIDS_ENV, slot_uids_unavailable
from ..process import slots_available
from ._types import AxisVerdict, ContainmentReport, SandboxJob
from .flags import BwrapFeatures
from .hardening import Hardening, annotate

__all__ = (
    "DISK_REASON",
    "MEMORY_PER_PROCESS_REASON",
    "MEMORY_UNSIZED_TMPFS_REASON",
    "NO_BIND_FD_REASON",
    "ROOT_QUOTAS_REASON",
    "ROOT_UNKNOWN_REASON",
    "ROOT_WORKER_REASON",
    "SLOT_QUOTAS_NOTE",
    "UNPRIVILEGED_QUOTAS_REASON",
    "containment_report",
    "root_worker_note",
    "worker_is_root",
)

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


def containment_report(
    job: SandboxJob,
    features: BwrapFeatures,
    hardening: Hardening,
    *,
    pids_enforced: bool | None,
    memory_enforced: bool | None,
    job_uid: int | None = None,
    root_reason: str | None = None,
) -> ContainmentReport:
    """The report on `job` run by a bubblewrap with `features`: before the run
    (`pids_enforced` and `memory_enforced` ``None``: not known yet), or once it ran, as the
    host uid it ran as (`job_uid`; `root_reason`: why a root worker's job ran as root), with
    what `hardening` adds (`annotate`)."""
    files, user = _identity_verdicts(features, job_uid, root_reason)
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
            features=features,
            ran_as_root=worker_is_root() and job_uid == 0,
        ),
    )
    return annotate(report, job, hardening)
