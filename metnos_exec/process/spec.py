"""What a run is asked (`ProcessSpec`) and what it answers (`ProcessResult`, `Stopped`),
and the bounds every step of the process layer shares.

The lowest module of `metnos_exec.process`: plain data, imported by the spawner
(`metnos_exec.process.spawn`), the cgroups (`metnos_exec.process.cgroups`) and the run
itself (`metnos_exec.process.run`), importing none of them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final

import msgspec

#: How much one read of a pipe or of a cgroup's task list takes at most.
_READ_CHUNK: Final = 1 << 16
#: Bound on waiting for a SIGKILLed child to exit; past it the kernel is not cooperating.
_KILL_WAIT_S: Final = 10.0


class ProcessSpec(msgspec.Struct, frozen=True):
    """What to run and how to hold it.

    Attributes:
        argv: the command; ``argv[0]`` is looked up in ``env["PATH"]``.
        env: the whole environment; nothing is inherited from the worker.
        stdin: bytes written to the child's stdin, which is then closed.
        cwd: working directory of the child (``None``: the worker's).
        rlimits: ``(resource.RLIMIT_*, soft, hard)`` applied in the child before exec.
        pass_fds: extra fds the child inherits (e.g. one bwrap reads).
        pdeathsig: the child dies when the worker dies (PR_SET_PDEATHSIG).
        output_bytes: cap on the stdout kept, and separately on the stderr kept.
        pids_max: process limit for the whole tree (cgroup when possible).
        reaper: run under the subreaper shim, which kills escaped descendants too.
        cgroup_pool: fork from a pooled spawner thread that sits in its own long-lived
            pids cgroup (cgroup v1), instead of creating a cgroup per run and migrating
            the child into it; see "Pooled cgroups" in `metnos_exec.process.slots`.
        memory_max: memory limit in bytes for the whole tree, held by a memory cgroup
            when one is available (see "Memory" in `metnos_exec.process.cgroups`); ``None``: none.
        on_spawn: ``reaper=False`` only: awaited on the event loop right after the
            spawn, before anything is fed to the child, with the child's pid and a function
            listing the pids of the run's cgroup (``None`` without one). If it raises
            (cancellation included), the child is killed and reaped and the exception
            propagates (the hook kills whatever else it started). On the loop, not on the
            spawner thread: a hook that waits on its child (the bwrap gate waits ~1.5 ms
            for bubblewrap's set-up) would otherwise hold the spawner, and the loop that
            waits for it, for that long on every job.
        as_slot_user: fork the child as the slot's own host uid (a root worker's slot with
            an `Slot.identity`; `metnos_exec.identities`): the slot's thread switches to
            it around the fork. Without an identity the child runs as the worker's uid;
            `ProcessResult.uid` says which.
        drops_to_slot_user: the command itself drops to the slot's own host uid, after
            something only root may do (``nsenter --setuid --setgid`` into the staging
            namespace: `metnos_exec.undo.staging`): the child is forked as the worker, and
            `ProcessResult.uid` is the slot's. The caller builds that command from the
            same `Slot.identity`; nsenter runs nothing when it cannot drop.
        beside: a task run beside the child (a progress reader,
            `metnos_exec.sandbox.progress`): started with the output pumps, cancelled
            once the child has exited and its output is drained. It must not raise.
        release: a *held* run (``reaper=False``; a warm sandbox, issue 22): once spawned
            and past `on_spawn`, the run waits for ``release()``, which returns the stdin
            to feed (`stdin` is then unused). The run's clock (its timeout and
            ``wall_s``) starts when it returns. If it raises (cancellation included), the
            child is killed and reaped, as for `on_spawn`.
    """

    argv: tuple[str, ...]
    env: dict[str, str]
    stdin: bytes = b""
    cwd: str | None = None
    rlimits: tuple[tuple[int, int, int], ...] = ()
    pass_fds: tuple[int, ...] = ()
    pdeathsig: bool = True
    output_bytes: int = 1 << 20
    pids_max: int | None = None
    reaper: bool = True
    cgroup_pool: bool = False
    #: Mark the process for the keeper (`start_keeper`): its environment names this
    #: worker's keeper, so the keeper finds it (and the clones it makes) even if the
    #: worker dies before it has registered the child. Only for a command that passes no
    #: environment on (bubblewrap: ``--clearenv``).
    keeper_mark: bool = False
    memory_max: int | None = None
    on_spawn: Callable[[int, Callable[[], list[int]] | None], Awaitable[None]] | None = None
    as_slot_user: bool = False
    drops_to_slot_user: bool = False
    beside: Callable[[], Coroutine[Any, Any, None]] | None = None
    release: Callable[[], Awaitable[bytes]] | None = None


class ProcessResult(msgspec.Struct, frozen=True):
    """How the process ended.

    Attributes:
        returncode: exit status; negative means killed by signal ``-returncode``.
        stdout: the first ``output_bytes`` of stdout.
        stderr: the first ``output_bytes`` of stderr.
        stdout_truncated: more stdout was produced (and discarded).
        stderr_truncated: more stderr was produced (and discarded).
        timed_out: the deadline passed and the tree was killed.
        wall_s: from spawn to reap.
        cpu_s: user + system CPU of the job tree.
        peak_rss_bytes: largest resident set of any process of the tree.
        pids_limited: whether ``pids_max`` was really enforced.
        exec_error: why the command could not be executed (exit 127/126), else ``None``.
        memory_limited: whether ``memory_max`` was really enforced for the whole tree (a
            memory cgroup held it).
        memory_peak_bytes: the tree's peak memory charge as the memory cgroup counted it
            (its processes, the tmpfs pages they wrote, the page cache they touched);
            ``None`` without a memory cgroup.
        oom_killed: the kernel OOM-killed a process of the tree at the memory limit.
        uid: the host uid the child ran as (a slot's own, or the worker's).
        killed_cpu_s: for a tree that was killed (a timeout, the caller's stop): the CPU
            time of its processes alive just before the kill, their reaped children's
            included (``None``: it was not killed). What dies of the kill leaves no
            rusage to anyone here; a lower bound, with `cpu_s`, of what the tree used.
        killed_peak_rss_bytes: the same moment's largest resident high-water mark.
    """

    returncode: int
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    wall_s: float
    cpu_s: float
    peak_rss_bytes: int
    pids_limited: bool
    exec_error: str | None = None
    memory_limited: bool = False
    memory_peak_bytes: int | None = None
    oom_killed: bool = False
    uid: int | None = None
    killed_cpu_s: float | None = None
    killed_peak_rss_bytes: int | None = None


class Stopped:
    """What was measured of a run its caller stopped (a cancelled scope, an exception)
    after the child was spawned: `run_process` kills and reaps the tree, fills `result`
    (``timed_out`` false; its output so far) and lets the exception go on. ``None`` when
    nothing was spawned, or the run had ended already."""

    __slots__ = ("result",)

    def __init__(self) -> None:
        self.result: ProcessResult | None = None
