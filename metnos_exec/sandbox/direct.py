"""The direct arm (``sandbox: "none"``): a plain subprocess, the degraded fallback.

Used when the kernel wall is unavailable (bubblewrap missing, ``METNOS_SANDBOX=off``, no
user namespaces; see `metnos_exec.sandbox.select`). It runs ``job.argv`` with the job's
own environment, stdin and cwd through `metnos_exec.process.run_process`, under the
subreaper shim so the whole tree still dies on timeout and with the worker.

What it does *not* do, and says so in `containment`: mounts and ``network`` are ignored
(there is no namespace to apply them to), the job runs as the worker's own uid, and it can
see and signal the worker's other processes. Argument vetting (the first wall) still ran
before the job got here; this arm adds no second one.

Exit mapping: 0 → `Success`; N > 0 → `Failure(N)`; the deadline → `Timeout`; a signal →
`Killed(signal)`, naming the limit only when the kernel's own signal says it and that limit
was set (SIGXCPU → ``cpu_time``, SIGXFSZ → ``file_size``). An allocation refused by
RLIMIT_AS shows up as whatever the program does about ENOMEM (usually a `Failure`): the
kernel sends no signal for it, so this arm never claims `MemoryExceeded`.
"""

from __future__ import annotations

import os
import resource
import signal
from typing import final

from ..errors import HostFault
from ..process import (
    ProcessResult,
    ProcessSpec,
    Stopped,
    pids_cgroup_available,
    run_process,
)
from ._types import (
    AxisVerdict,
    ContainmentReport,
    Failure,
    Killed,
    ResourceLimits,
    SandboxExit,
    SandboxJob,
    SandboxOutcome,
    Success,
    Timeout,
    Usage,
    record_stopped,
)
from .progress import open_channel

__all__ = ("DirectSandbox", "direct_rlimits", "map_direct_exit")

_FILES = AxisVerdict(
    "not_kept", "no mount namespace: mounts are ignored, every file the worker's uid can reach is"
)
_NETWORK = AxisVerdict(
    "not_kept",
    "no network namespace: the host network is shared, and a manifest's hosts cannot be "
    "enforced (the network wall needs the bwrap arm)",
)
_TREE = AxisVerdict(
    "partial",
    "tree killed on timeout and with the worker (subreaper shim), but no pid namespace: "
    "the job sees and can signal the worker's other processes",
)


def direct_rlimits(limits: ResourceLimits) -> tuple[tuple[int, int, int], ...]:
    """Kernel resource limits for a direct job, in the form `ProcessSpec.rlimits` takes.

    - ``RLIMIT_AS`` = memory budget: a big allocation fails instead of swapping the host.
    - ``RLIMIT_FSIZE`` = file size budget: SIGXFSZ (EFBIG where the signal is ignored).
    - ``RLIMIT_NOFILE`` = open files.
    - ``RLIMIT_CPU``: soft at the budget (SIGXCPU, reported as ``cpu_time``), hard one
      second later (SIGKILL) for a job that ignores SIGXCPU. Equal soft and hard would make
      the kernel send SIGKILL first and hide which limit it was.
    - ``RLIMIT_CORE`` = 0: a SIGXCPU/SIGXFSZ death must not drop a core file in the cwd.

    The pids budget is not here: `run_process` enforces it with a cgroup (RLIMIT_NPROC
    counts the whole user's threads, see `metnos_exec.process`).
    """
    out: list[tuple[int, int, int]] = [(resource.RLIMIT_CORE, 0, 0)]
    if limits.memory_bytes is not None:
        out.append((resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes))
    if limits.file_size_bytes is not None:
        out.append((resource.RLIMIT_FSIZE, limits.file_size_bytes, limits.file_size_bytes))
    if limits.open_files is not None:
        out.append((resource.RLIMIT_NOFILE, limits.open_files, limits.open_files))
    if limits.cpu_time_s is not None:
        out.append((resource.RLIMIT_CPU, limits.cpu_time_s, limits.cpu_time_s + 1))
    return tuple(out)


def map_direct_exit(job: SandboxJob, result: ProcessResult) -> SandboxExit:
    """Turn a process result into a `SandboxExit` (see the module docstring)."""
    if result.timed_out:
        return Timeout()
    code = result.returncode
    if code == 0:
        return Success()
    if code > 0:
        return Failure(code=code)
    sig = -code
    limit = None
    if sig == signal.SIGXCPU and job.limits.cpu_time_s is not None:
        limit = "cpu_time"
    elif sig == signal.SIGXFSZ and job.limits.file_size_bytes is not None:
        limit = "file_size"
    return Killed(signal=sig, limit=limit)


def _resources_verdict(limits: ResourceLimits) -> AxisVerdict:
    applied = [
        name
        for name, value in (
            ("address space", limits.memory_bytes),
            ("file size", limits.file_size_bytes),
            ("open files", limits.open_files),
            ("CPU seconds", limits.cpu_time_s),
        )
        if value is not None
    ]
    if limits.pids is not None:
        # RLIMIT_NPROC, the fallback, counts the user's threads, not the job's, and does
        # not bind root at all.
        if pids_cgroup_available():
            applied.append("pids (cgroup)")
        elif os.geteuid() == 0:
            applied.append("pids NOT enforced (RLIMIT_NPROC does not bind root)")
        else:
            applied.append("pids per user (RLIMIT_NPROC), not per job")
    if not applied:
        return AxisVerdict("not_kept", "no limit set; only the wall-clock timeout applies")
    return AxisVerdict(
        "partial",
        f"rlimits only ({', '.join(applied)}), per process; no memory cgroup isolates the job",
    )


@final
class DirectSandbox:
    """Runs native jobs as plain subprocesses of the worker; keeps (almost) nothing."""

    name = "none"

    def containment(self, job: SandboxJob) -> ContainmentReport:
        """Every wall is down, and each reason says which."""
        uid = os.getuid()
        who = "root" if uid == 0 else f"uid {uid}"
        return ContainmentReport(
            sandbox="none",
            files=_FILES,
            network=_NETWORK,
            process_tree=_TREE,
            user=AxisVerdict("not_kept", f"runs as the worker's own identity ({who})"),
            resources=_resources_verdict(job.limits),
        )

    async def run(self, job: SandboxJob) -> SandboxOutcome:
        """Run `job.argv` to an outcome.

        Raises:
            HostFault: the harness broke (the process layer could not spawn or reap), or
                the job is not a native one.
        """
        if not job.argv:
            raise HostFault("the direct arm got a job without argv (a wasm job misrouted)")
        limits = job.limits
        progress = open_channel()
        spec = ProcessSpec(
            argv=job.argv,
            env=dict(job.env) if progress is None else {**job.env, **progress.env()},
            stdin=job.stdin,
            cwd=job.cwd,
            rlimits=direct_rlimits(limits),
            pass_fds=() if progress is None else (progress.write_fd,),
            output_bytes=limits.output_bytes,
            pids_max=limits.pids,
            beside=None if progress is None else progress.pump,
        )
        stopped = Stopped()
        try:
            result = await run_process(spec, timeout=limits.wall_time_s, stopped=stopped)
        except BaseException:
            if stopped.result is not None:
                # Stopped from outside once launched: what it used, for the caller.
                record_stopped(self._outcome(job, stopped.result))
            raise
        finally:
            if progress is not None:
                progress.finish()
        return self._outcome(job, result)

    def _outcome(self, job: SandboxJob, result: ProcessResult) -> SandboxOutcome:
        # A killed tree's processes leave no rusage: what they had used was read before
        # the kill (`ProcessResult.killed_cpu_s`); the larger lower bound.
        cpu = max(result.cpu_s, result.killed_cpu_s or 0.0)
        peak = max(result.peak_rss_bytes, result.killed_peak_rss_bytes or 0)
        return SandboxOutcome(
            stdout=result.stdout,
            stderr=result.stderr,
            exit=map_direct_exit(job, result),
            usage=Usage(wall_s=result.wall_s, cpu_s=cpu, peak_memory_bytes=peak),
            containment=self.containment(job),
            stdout_truncated=result.stdout_truncated,
            stderr_truncated=result.stderr_truncated,
        )
