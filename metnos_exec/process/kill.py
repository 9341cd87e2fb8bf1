"""The kill sequence: how one run's tree dies, and how its child is reaped.

`_terminate`: the tree's usage is read first (`_tree_usage`: what dies of the kill leaves
no rusage), then SIGTERM (to the shim, which relays it, or to the session's group, and to
every pid of the run's cgroup), ``grace`` seconds (plus a margin for the shim to kill and
reap its own tree), SIGKILL, and a bounded wait for the child's exit. Once it has exited,
what is left of its group and its cgroup is SIGKILLed (`_kill_leftovers`), again just
before it is reaped (`_reap`), while its pgid cannot be reused.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any, Final

import anyio

from metnos_exec.errors import HostFault
from metnos_exec.process.cgroups import _Cgroup
from metnos_exec.process.reap import _disown
from metnos_exec.process.spawn import _Child
from metnos_exec.process.spec import _KILL_WAIT_S

#: Extra time the shim gets beyond ``grace`` to kill and reap the tree before we SIGKILL it.
_SHIM_MARGIN_S: Final = 2.0


async def _wait_exit(child: _Child) -> None:
    if not child.exited:
        await anyio.wait_readable(child.pidfd)
        child.exited = True


def _signal_tree(child: _Child, sig: int, cgroup: _Cgroup | None, *, shim: bool) -> None:
    """Signal the child's tree: the shim itself (it relays), or the session's group."""
    if shim and sig != signal.SIGKILL:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, sig)
    else:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, sig)
    if cgroup is not None:
        cgroup.signal_all(sig)


def _tree_usage(child: _Child, cgroup: _Cgroup | None) -> tuple[float, int]:
    """CPU seconds and the largest resident high-water mark of the tree's live processes.

    Read just before the tree is killed: what the processes that die of it used is lost
    with them otherwise (a killed sandbox's init reaps nothing, so no rusage carries
    them). Each process counts its own CPU and that of the children it reaped; the peak is
    the largest single process (``VmHWM``), as ``ru_maxrss`` would say. The tree is the
    cgroup's members, else the child and its descendants.
    """
    pids = cgroup.pids() if cgroup is not None else _descendants_of(child.pid)
    tick = os.sysconf("SC_CLK_TCK")
    cpu, peak = 0.0, 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
            with open(f"/proc/{pid}/status", "rb") as f:
                status = f.read()
        except OSError:
            continue  # gone meanwhile: reaped by its parent, which counts it
        # utime, stime, cutime, cstime: fields 14-17 of stat(5), 12-15 after the name.
        cpu += sum(int(x) for x in fields[11:15]) / tick
        for line in status.splitlines():
            if line.startswith(b"VmHWM:"):
                peak = max(peak, int(line.split()[1]) * 1024)
                break
    return cpu, peak


def _descendants_of(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rpartition(b")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


async def _terminate(child: _Child, grace: float, cgroup: _Cgroup | None, shim: bool) -> None:
    """SIGTERM the tree, wait `grace`, SIGKILL it, wait for the child to exit."""
    if child.exited:
        return
    if child.killed_usage is None:
        child.killed_usage = _tree_usage(child, cgroup)
    if not child.term_sent:
        child.term_sent = True
        _signal_tree(child, signal.SIGTERM, cgroup, shim=shim)
        # The shim runs its own grace and kills the tree itself; give it time to.
        with anyio.move_on_after(grace + (_SHIM_MARGIN_S if shim else 0.0)):
            await _wait_exit(child)
        if child.exited:
            return
    child.kill_sent = True
    _signal_tree(child, signal.SIGKILL, cgroup, shim=shim)
    with anyio.move_on_after(_KILL_WAIT_S):
        await _wait_exit(child)
    if not child.exited:
        raise HostFault(f"process {child.pid} did not exit {_KILL_WAIT_S} s after SIGKILL")


def _kill_leftovers(child: _Child, cgroup: _Cgroup | None) -> None:
    """Once the child has exited, nothing of its job may outlive it.

    Under the shim this normally finds nothing (the shim killed its tree before exiting);
    it matters when the shim itself was killed. Without the shim, it is the tree kill.
    What is left of the session's group, and of the cgroup, is SIGKILLed. While the leader
    is an unreaped zombie its pgid cannot be reused, so this reaches this job's own
    processes only.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    if cgroup is not None:
        cgroup.signal_all(signal.SIGKILL)


def _reap(child: _Child, cgroup: _Cgroup | None) -> tuple[int, int, Any]:
    """Reap the exited child with its rusage, after killing its leftovers.

    Only the session's group is signalled here: that must happen while the leader is an
    unreaped zombie (its pgid cannot be reused until then). The cgroup is emptied by its
    own clean-up (`_Cgroup.close`, `_SlotCgroup.drain`), which kills until it is empty.
    """
    _kill_leftovers(child, None)
    try:
        pid, status, rusage = os.wait4(child.pid, 0)
    except ChildProcessError as exc:
        raise HostFault(f"wait4({child.pid}) failed: somebody else reaped our child") from exc
    finally:
        _disown(child.pid)
    # Popen would warn that the process is "still running" when collected.
    child.popen.returncode = os.waitstatus_to_exitcode(status)
    return pid, status, rusage
