"""One run: `run_process` spawns the child, feeds its stdin, pumps its output into bounded
buffers, times it out, and has its tree killed and its child reaped
(`metnos_exec.process.kill`). The caller's cancellation runs the same kill in a shielded
scope, then goes on.

A ``cgroup_pool`` run, or one given a slot, forks from the slot's thread
(`_run_in_slot`): the slot's pids limit and memory cgroup are set for it, and the slot is
drained (nothing left in its cgroup) before it is lent again.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import resource
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import anyio
import anyio.lowlevel
import msgspec

from metnos_exec.errors import HostFault
from metnos_exec.identities import switched
from metnos_exec.process import cgroups
from metnos_exec.process.cgroups import _Cgroup, _SlotMemory, _threads_of_uid
from metnos_exec.process.kill import _kill_leftovers, _reap, _terminate, _wait_exit
from metnos_exec.process.slots import Slot, _renew_slot_memory, pooled_slot
from metnos_exec.process.spawn import _Child, _ExecFailed, _on_spawner, _spawn
from metnos_exec.process.spec import (
    _KILL_WAIT_S,
    _READ_CHUNK,
    ProcessResult,
    ProcessSpec,
    Stopped,
)
from metnos_exec.process.teardown import Later

#: After the child exits, how long readers may still wait for EOF. Only a process that left
#: the tree (possible with ``reaper=False``) can hold a pipe open past its exit.
_DRAIN_S: Final = 1.0


class _Capped:
    """Keeps the first `cap` bytes; counts (and drops) the rest."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.parts: list[bytes] = []
        self.kept = 0
        self.truncated = False

    def add(self, chunk: bytes) -> None:
        room = self.cap - self.kept
        if room <= 0:
            self.truncated = True
            return
        if len(chunk) > room:
            chunk = chunk[:room]
            self.truncated = True
        self.parts.append(chunk)
        self.kept += len(chunk)

    def value(self) -> bytes:
        return b"".join(self.parts)


async def _pump(fd: int, sink: _Capped, done: anyio.Event) -> None:
    try:
        while True:
            try:
                chunk = os.read(fd, _READ_CHUNK)
            except BlockingIOError:
                await anyio.wait_readable(fd)
                continue
            if not chunk:
                return
            sink.add(chunk)
            # A child that floods the pipe would otherwise starve the event loop.
            await anyio.lowlevel.checkpoint()
    finally:
        done.set()


def _feed_now(child: _Child, data: bytes) -> memoryview | None:
    """Write as much of `data` to the child's stdin as the pipe takes now, without
    waiting; close stdin and return ``None`` when nothing is left to write (the usual
    case: a job's arguments fit the pipe's 64 KiB), else the rest, for `_feed`."""
    fd = child.fds["stdin"]
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view[:_READ_CHUNK]) :]
    except BlockingIOError:
        return view
    except BrokenPipeError:
        pass  # the child closed its stdin: what it did not read, it did not want
    child.close_fd("stdin")
    return None


async def _feed(child: _Child, view: memoryview) -> None:
    fd = child.fds["stdin"]
    try:
        while view:
            try:
                n = os.write(fd, view[:_READ_CHUNK])
            except BlockingIOError:
                await anyio.wait_writable(fd)
                continue
            except BrokenPipeError:
                return  # the child closed its stdin: what it did not read, it did not want
            view = view[n:]
    finally:
        child.close_fd("stdin")


def _read_status(child: _Child) -> tuple[str | None, str | None, tuple[float, int] | None]:
    """Parse the shim's status lines: (exec error, host fault, (cpu_s, maxrss_kib))."""
    fd = child.fds.get("status")
    if fd is None:
        return None, None, None
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, _READ_CHUNK):
            data += chunk
    exec_error = fault = None
    usage = None
    for line in data.decode(errors="replace").splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "X":
            exec_error = rest.partition(" ")[2]
        elif kind == "H":
            fault = rest
        elif kind == "U":
            utime, stime, maxrss = rest.split()
            usage = (float(utime) + float(stime), int(maxrss))
    return exec_error, fault, usage


def _validate(spec: ProcessSpec, timeout: float, grace: float) -> None:
    if not spec.argv:
        raise ValueError("ProcessSpec.argv must not be empty")
    if (spec.on_spawn is not None or spec.release is not None) and spec.reaper:
        raise ValueError("ProcessSpec.on_spawn and release need reaper=False (the shim)")
    if not (timeout > 0 and grace >= 0) or math.isnan(timeout):
        raise ValueError(f"need timeout > 0 and grace >= 0, got {timeout}, {grace}")
    if spec.output_bytes < 0:
        raise ValueError("ProcessSpec.output_bytes must be >= 0")
    if spec.pids_max is not None and spec.pids_max < 1:
        raise ValueError("ProcessSpec.pids_max must be >= 1")
    inf = resource.RLIM_INFINITY
    for res, soft, hard in spec.rlimits:
        if (soft < 0 and soft != inf) or (hard < 0 and hard != inf):
            raise ValueError(f"rlimit {res}: negative limit ({soft}, {hard})")
        if hard != inf and (soft == inf or soft > hard):
            raise ValueError(f"rlimit {res}: soft {soft} above hard {hard}")


# The timeout is the job's budget, enforced by a TERM/grace/KILL sequence a cancel scope around
# the call could not express (it would give no grace and no `timed_out` verdict).
async def run_process(
    spec: ProcessSpec,
    *,
    timeout: float,  # noqa: ASYNC109
    grace: float = 0.5,
    slot: Slot | None = None,
    stopped: Stopped | None = None,
    later: Later | None = None,
) -> ProcessResult:
    """Run `spec` to completion, or kill its whole tree at `timeout` seconds.

    Args:
        spec: what to run.
        timeout: wall-clock budget in seconds, from spawn.
        grace: seconds between SIGTERM and SIGKILL when the tree is killed.
        slot: a slot borrowed with `pooled_slot` (its borrower lends it again); else a
            ``cgroup_pool`` run borrows one itself.
        stopped: filled with what the run measured when the caller stops it (see
            `Stopped`), so that a cancelled run can still say what it used and what held.
        later: with `slot`, the drain of the slot's cgroup is left there
            (`metnos_exec.process.teardown`) instead of awaited: the result comes back
            once the child is reaped; the slot stays retired until the drain has run, so
            its borrower must release it after that step too.

    Returns:
        The result; ``timed_out`` tells a deadline kill from an ordinary exit.

    Raises:
        HostFault: the harness broke (pipes, spawner, shim, wait4).
        ValueError: `spec` is malformed.
    """
    _validate(spec, timeout, grace)
    if slot is not None:
        return await _run_in_slot(spec, slot, timeout, grace, stopped, later)
    if spec.cgroup_pool:
        async with pooled_slot() as borrowed:
            if borrowed is not None:
                return await _run_in_slot(spec, borrowed, timeout, grace, stopped)
    return await _run(spec, timeout, grace, stopped=stopped)


def _limit_for_run(memory: _SlotMemory, limit: int | None) -> int | None:
    """Set `memory`'s limit for the next run and begin it (`_SlotMemory.begin`); once
    more after emptying the cgroup of what can be reclaimed when the kernel refuses.

    Raises:
        OSError: the limit cannot be set even then (EBUSY: what is left charged cannot be
            reclaimed).
    """
    try:
        memory.set_limit(limit)
    except OSError:
        memory.empty()
        memory.set_limit(limit)
    return memory.begin()


async def _run_in_slot(
    spec: ProcessSpec,
    slot: Slot,
    budget_s: float,
    grace: float,
    stopped: Stopped | None,
    later: Later | None = None,
) -> ProcessResult:
    """`run_process` forking from `slot`'s thread: the child starts in the slot's cgroup."""
    budget = spec.pids_max + (1 if spec.reaper else 0) if spec.pids_max else None
    try:
        slot.cgroup.set_max(budget)
    except OSError as exc:
        raise HostFault(f"cannot set pids.max of {slot.cgroup.path}: {exc}") from exc
    memory = slot.memory if cgroups.memory_cgroup_available() else None
    oom_before: int | None = None
    if memory is not None:
        try:
            oom_before = _limit_for_run(memory, spec.memory_max)
        except OSError:
            # EBUSY: earlier runs left more charged than this limit, or than a few MiB of
            # it, and it cannot be reclaimed. A new, empty cgroup holds the run
            # (`_renew_slot_memory`); only when none can be made does it go on with its
            # per-process limits, and say so (memory_limited=False).
            memory = await _renew_slot_memory(slot)
            if memory is not None:
                try:
                    oom_before = _limit_for_run(memory, spec.memory_max)
                except OSError:
                    memory = None
    try:
        try:
            result = await _run(spec, budget_s, grace, slot=slot, stopped=stopped)
        except BaseException:
            # Stopped: what the memory cgroup counted, before the slot is drained.
            if memory is not None and stopped is not None and stopped.result is not None:
                with contextlib.suppress(OSError):
                    stopped.result = msgspec.structs.replace(
                        stopped.result,
                        memory_limited=spec.memory_max is not None,
                        memory_peak_bytes=memory.peak(),
                    )
            raise
        if memory is None:
            return result
        try:
            oom_after = memory.oom_kills()
            peak = memory.peak()
        except OSError as exc:
            raise HostFault(f"cannot read memory cgroup {memory.path}: {exc}") from exc
        return msgspec.structs.replace(
            result,
            memory_limited=spec.memory_max is not None,
            memory_peak_bytes=peak,
            oom_killed=oom_before is not None and oom_after is not None and oom_after > oom_before,
        )
    finally:
        # Lent again (by its borrower) only once empty: a slot that could not be emptied
        # (drain raised) is retired, its thread idles and its cgroup is swept after the
        # worker is gone. With `later`, the drain runs after the result is handed on.
        slot.retired = True
        if later is None:
            await _drain_slot(slot)
        else:
            later.add(lambda: _drain_slot(slot))


async def _drain_slot(slot: Slot) -> None:
    """Empty `slot`'s cgroup (shielded) and let it be lent again; a slot whose drain
    raised stays retired."""
    with anyio.CancelScope(shield=True):
        await slot.cgroup.drain()
    slot.retired = False


async def _run(
    spec: ProcessSpec,
    budget_s: float,
    grace: float,
    *,
    slot: Slot | None = None,
    stopped: Stopped | None = None,
) -> ProcessResult:
    """One run off `slot`'s thread, or off the shared spawner: its cgroup, its uid, the
    spawn, the ``on_spawn`` hook, `_supervise`; a per-run cgroup is removed at the end."""
    cgroup, join = _run_cgroup(spec, slot)
    pids_limited = spec.pids_max is not None and cgroup is not None
    # cgroup v2 per-run cgroup with the memory controller: it holds memory_max too.
    memory_limited = (
        join is not None and spec.memory_max is not None and join.limit_memory(spec.memory_max)
    )
    memory = join if memory_limited else None
    members = cgroup.pids if cgroup is not None else None
    identity = (
        await slot.identity()
        if slot is not None and (spec.as_slot_user or spec.drops_to_slot_user)
        else None
    )
    uid = os.geteuid() if identity is None else identity.uid
    switch = identity if spec.as_slot_user else None
    rlimits = spec.rlimits
    if spec.pids_max is not None and cgroup is None:
        nproc = _threads_of_uid(uid) + spec.pids_max
        rlimits = (*rlimits, (resource.RLIMIT_NPROC, nproc, nproc))

    def spawn() -> _Child:
        if switch is None:
            return _spawn(spec, rlimits, join, grace)
        # This thread alone becomes the slot's uid for the fork: the child keeps it.
        with switched(switch):
            return _spawn(spec, rlimits, join, grace)

    try:
        try:
            child: _Child = await _on_spawner(spawn, slot.spawner if slot else None)
        except _ExecFailed as failed:
            return _exec_failed(failed, pids_limited, uid)
        if spec.on_spawn is not None:
            await _call_on_spawn(child, spec.on_spawn, members)
        if spec.release is not None:
            spec = await _released(child, spec, spec.release)
        try:
            result = await _supervise(child, spec, budget_s, grace, cgroup, pids_limited, stopped)
        except BaseException:
            _note_stopped(stopped, uid, memory)
            raise
        finally:
            child.close()
        result = msgspec.structs.replace(result, uid=uid)
        if memory is not None:
            peak, kills = memory.memory_report()
            result = msgspec.structs.replace(
                result, memory_limited=True, memory_peak_bytes=peak, oom_killed=kills > 0
            )
        return result
    finally:
        if join is not None:
            with anyio.CancelScope(shield=True):
                await join.close()


def _run_cgroup(spec: ProcessSpec, slot: Slot | None) -> tuple[_Cgroup | None, _Cgroup | None]:
    """The run's cgroup (the slot's, a new per-run one, or ``None``), and the one its child
    must join (the per-run one: a slot's thread is in its cgroup already, and the child
    starts there)."""
    if slot is not None:
        return slot.cgroup, None
    cgroup = _Cgroup.create(spec.pids_max + (1 if spec.reaper else 0)) if spec.pids_max else None
    return cgroup, cgroup


def _exec_failed(failed: _ExecFailed, pids_limited: bool, uid: int) -> ProcessResult:
    """The result of a command that could not be executed: 127 when not found, else 126."""
    code = 127 if failed.exc.errno == errno.ENOENT else 126
    return ProcessResult(
        returncode=code,
        stdout=b"",
        stderr=b"",
        stdout_truncated=False,
        stderr_truncated=False,
        timed_out=False,
        wall_s=0.0,
        cpu_s=0.0,
        peak_rss_bytes=0,
        pids_limited=pids_limited,
        exec_error=f"cannot execute {failed.exc.filename}: {failed.exc.strerror}",
        uid=uid,
    )


async def _call_on_spawn(
    child: _Child,
    hook: Callable[[int, Callable[[], list[int]] | None], Awaitable[None]],
    members: Callable[[], list[int]] | None,
) -> None:
    """Await `ProcessSpec.on_spawn`; if it raises (cancellation included), the child is
    SIGKILLed and reaped, shielded, and its handles closed before the exception goes on."""
    try:
        await hook(child.pid, members)
    except BaseException:
        try:
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGKILL)
                with anyio.move_on_after(_KILL_WAIT_S):
                    await _wait_exit(child)
                if not child.exited:
                    raise HostFault(
                        f"process {child.pid} did not exit {_KILL_WAIT_S} s after SIGKILL"
                    )
                _reap(child, None)
        finally:
            child.close()
        raise


async def _released(
    child: _Child, spec: ProcessSpec, release: Callable[[], Awaitable[bytes]]
) -> ProcessSpec:
    """Wait for a held run's release (`ProcessSpec.release`): `spec` with the stdin it
    returned, the child's clock restarted; the child killed and reaped if it raises."""
    fed: list[bytes] = []

    async def wait(_pid: int, _members: object) -> None:
        fed.append(await release())

    await _call_on_spawn(child, wait, None)
    child.t0 = time.monotonic()
    return msgspec.structs.replace(spec, stdin=fed[0], release=None)


def _note_stopped(stopped: Stopped | None, uid: int, memory: _Cgroup | None) -> None:
    """Add to what a stopped run measured (`Stopped`) its uid and, when a per-run cgroup
    held its memory, the peak that cgroup counted."""
    if stopped is not None and stopped.result is not None:
        stopped.result = msgspec.structs.replace(stopped.result, uid=uid)
        if memory is not None:
            with contextlib.suppress(OSError):
                peak, _ = memory.memory_report()
                stopped.result = msgspec.structs.replace(
                    stopped.result, memory_limited=True, memory_peak_bytes=peak
                )


async def _supervise(
    child: _Child,
    spec: ProcessSpec,
    budget_s: float,
    grace: float,
    cgroup: _Cgroup | None,
    pids_limited: bool,
    stopped: Stopped | None = None,
) -> ProcessResult:
    """Watch the spawned child to its end (`_watch`), reap it and say how it ended."""
    out, err = _Capped(spec.output_bytes), _Capped(spec.output_bytes)
    reaped: tuple[int, int, Any] | None = None
    try:
        timed_out = await _watch(child, spec, budget_s, grace, cgroup, out, err)
        reaped = _reap(child, cgroup)
    finally:
        if reaped is None:
            # Cancelled from outside, or something broke: the tree still dies and is
            # reaped before the exception (cancellation included) goes on, and what the
            # run used is left for the caller (`Stopped`).
            with anyio.CancelScope(shield=True):
                await _terminate(child, grace, cgroup, spec.reaper)
                _, status, rusage = _reap(child, cgroup)
            if stopped is not None:
                stopped.result = _result(
                    child,
                    out,
                    err,
                    status,
                    timed_out=False,
                    wall_s=time.monotonic() - child.t0,
                    cpu_s=rusage.ru_utime + rusage.ru_stime,
                    maxrss_kib=rusage.ru_maxrss,
                    pids_limited=pids_limited,
                )
    _, status, rusage = reaped
    return _ended(child, spec, out, err, status, rusage, timed_out, pids_limited)


async def _watch(
    child: _Child,
    spec: ProcessSpec,
    budget_s: float,
    grace: float,
    cgroup: _Cgroup | None,
    out: _Capped,
    err: _Capped,
) -> bool:
    """Pump the child's output and feed its stdin until it exits, or kill its tree at the
    deadline; then kill what is left and let the readers drain. ``True``: it timed out."""
    timed_out = False
    async with anyio.create_task_group() as tg:
        out_done, err_done = anyio.Event(), anyio.Event()
        tg.start_soon(_pump, child.fds["stdout"], out, out_done)
        tg.start_soon(_pump, child.fds["stderr"], err, err_done)
        if spec.beside is not None:
            tg.start_soon(spec.beside)
        # No task for stdin unless it does not fit the pipe at once.
        rest = _feed_now(child, spec.stdin)
        if rest is not None:
            tg.start_soon(_feed, child, rest)
        with anyio.move_on_after(budget_s - (time.monotonic() - child.t0)):
            await _wait_exit(child)
        if not child.exited:
            timed_out = True
            # Readers keep draining while the tree dies, so it never blocks on a pipe.
            await _terminate(child, grace, cgroup, spec.reaper)
        _kill_leftovers(child, cgroup)
        with anyio.move_on_after(_DRAIN_S):
            await out_done.wait()
            await err_done.wait()
        tg.cancel_scope.cancel()
    return timed_out


def _ended(
    child: _Child,
    spec: ProcessSpec,
    out: _Capped,
    err: _Capped,
    status: int,
    rusage: Any,
    timed_out: bool,
    pids_limited: bool,
) -> ProcessResult:
    """How a reaped run ended, with the shim's report of the tree's usage when it ran
    under the shim.

    Raises:
        HostFault: the shim could not set up, or exited without its report.
    """
    wall = time.monotonic() - child.t0
    exec_error, fault, usage = _read_status(child)
    if fault is not None:
        raise HostFault(f"the reaper shim could not set up: {fault}")
    # A shim that died of a signal was killed (by us, by the job itself, by the OOM
    # killer): the status says so honestly. One that *exited* without its report broke.
    if spec.reaper and usage is None and not child.kill_sent and not os.WIFSIGNALED(status):
        raise HostFault(
            f"the reaper shim exited without a report (status {status}); stderr: "
            f"{err.value()[-500:]!r}"
        )
    if usage is not None:
        cpu_s, maxrss_kib = usage
    else:
        cpu_s, maxrss_kib = rusage.ru_utime + rusage.ru_stime, rusage.ru_maxrss
    return _result(
        child,
        out,
        err,
        status,
        timed_out=timed_out,
        wall_s=wall,
        cpu_s=cpu_s,
        maxrss_kib=maxrss_kib,
        pids_limited=pids_limited,
        exec_error=exec_error,
    )


def _result(
    child: _Child,
    out: _Capped,
    err: _Capped,
    status: int,
    *,
    timed_out: bool,
    wall_s: float,
    cpu_s: float,
    maxrss_kib: int,
    pids_limited: bool,
    exec_error: str | None = None,
) -> ProcessResult:
    """A reaped run's result: its wait status, what was kept of its output, its usage, and
    the tree's usage read before a kill (`_Child.killed_usage`)."""
    return ProcessResult(
        returncode=os.waitstatus_to_exitcode(status),
        stdout=out.value(),
        stderr=err.value(),
        stdout_truncated=out.truncated,
        stderr_truncated=err.truncated,
        timed_out=timed_out,
        wall_s=wall_s,
        cpu_s=cpu_s,
        peak_rss_bytes=maxrss_kib * 1024,
        pids_limited=pids_limited,
        exec_error=exec_error,
        killed_cpu_s=None if child.killed_usage is None else child.killed_usage[0],
        killed_peak_rss_bytes=None if child.killed_usage is None else child.killed_usage[1],
    )
