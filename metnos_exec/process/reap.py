"""Reaping: the children `run_process` owns, the orphans a subreaper inherits, and the
keeper that kills a dead worker's children.

Every pid `run_process` has spawned and not yet reaped is registered here (`_own`,
`_disown`, under `_spawn_lock`), so that `reap_orphans` never takes a child somebody waits
for, and so that the keeper (`start_keeper`, the stdlib-only script
`metnos_exec.process._keeper`, run by path) learns of each one: if the worker dies before
it has reaped a child, however it dies, the keeper SIGKILLs that child's process group.

A worker that is a child subreaper (`become_subreaper`) gets back the orphans of its job
trees (bubblewrap's init, above all): `reap_orphan` reaps one expected orphan with its
rusage, `reap_orphans` sweeps the zombies that are nobody's to wait for.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import subprocess
import sys
import threading
from typing import Any, Final

import anyio

from metnos_exec import _libc

PR_SET_CHILD_SUBREAPER: Final = 36
PR_GET_CHILD_SUBREAPER: Final = 37

# Resolved now, in the parent: a dlsym inside preexec_fn (`metnos_exec.process.spawn`)
# could take the loader's lock.
# Typed (`metnos_exec._libc`): prctl is variadic, its arguments unsigned longs.
_ulong = ctypes.c_ulong
_prctl = _libc.function("prctl", ctypes.c_int, ctypes.c_int, _ulong, _ulong, _ulong, _ulong)
#: The same call for the options that write an int through their second argument.
_prctl_get = _libc.function(
    "prctl", ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int), _ulong, _ulong, _ulong
)

#: pids `run_process` has spawned and not reaped yet: never `reap_orphans`' to take. Changed
#: and read under `_spawn_lock`, which each spawn also holds from fork to registration.
#: Counted, not a set: a pid freed by our `wait4` may be reused by the next spawn (and
#: registered) before the first run has unregistered it.
_owned: collections.Counter[int] = collections.Counter()
_spawn_lock = threading.Lock()


def _forget_owned() -> None:
    # A forked copy of the worker owns none of these children (and the lock may have been
    # held by another thread at the fork).
    global _spawn_lock, _keeper_w, _keeper_token
    _spawn_lock = threading.Lock()
    _owned.clear()
    _keeper_w = -1
    _keeper_token = ""


#: The write end of the keeper's pipe (`start_keeper`); -1: no keeper.
_keeper_w = -1
#: The variable that marks a process as this worker's (`ProcessSpec.keeper_mark`), and
#: its value: unique to this worker (its keeper kills what carries it, nothing else).
KEEPER_ENV = "METNOS_KEEPER"
_keeper_token = ""
_KEEPER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_keeper.py")


def start_keeper() -> int | None:
    """Start this process's keeper (`metnos_exec.process._keeper`): from now on every process
    group a `run_process` child leads is SIGKILLed if this process dies before it has
    reaped that child, however it dies. Once per process (the worker's, at start); the
    keeper's pid, or ``None`` when it could not start (said by the caller).

    Why: bubblewrap's ``--die-with-parent`` is armed late (see `metnos_exec.process._keeper`); a
    worker SIGKILLed while a job started left a bubblewrap, or its guest, running.
    """
    global _keeper_w, _keeper_token
    if _keeper_w >= 0:
        return None
    token = os.urandom(12).hex()
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", _KEEPER_PATH, str(r), f"{KEEPER_ENV}={token}"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            pass_fds=(r,),
            start_new_session=True,
        )
    except OSError:
        os.close(w)
        return None
    finally:
        os.close(r)
    with _spawn_lock:
        _keeper_w = w
        _keeper_token = token
        for pid in _owned:  # children started before the keeper
            _tell_keeper(b"+", pid)
    return proc.pid


def _tell_keeper(op: bytes, pid: int) -> None:
    """Under `_spawn_lock`: one record (5 bytes: written at once, PIPE_BUF)."""
    if _keeper_w >= 0:
        with contextlib.suppress(OSError):  # the keeper is gone: nothing to tell
            os.write(_keeper_w, op + pid.to_bytes(4, "little"))


def _own(pid: int) -> None:
    """Under `_spawn_lock`: `pid` is ours until `_disown`."""
    _owned[pid] += 1
    if _owned[pid] == 1:
        _tell_keeper(b"+", pid)


os.register_at_fork(after_in_child=_forget_owned)


def become_subreaper() -> bool:
    """Make this process a child subreaper (PR_SET_CHILD_SUBREAPER); ``False`` if refused.

    What for: bubblewrap's monitor exits before its init (pid 1 of the sandbox), so every
    bwrap job leaves an orphan. Re-parented to the host's init, it stays a zombie until
    that init reaps it: at once under systemd or a container's init, but every ~2 s on
    some hosts, and meanwhile its zombie still counts in the slot's pids cgroup, whose
    ``pids.max`` must then be raised by that many (measured here: a median of 79 and up
    to 126 zombies per slot at concurrency 2, so a job's process budget of 64 could reach
    ~190 when they were reaped mid-run). A subreaper worker gets the inits back and reaps
    each one as its job ends (the bwrap arm), so the budget stays exact.

    The worker process (`metnos_exec.worker.run_worker`) calls this. An application that
    embeds a `Supervisor` may too, if it does not mind that every orphan of its own
    descendants then comes to it: `reap_orphans` (called by the supervisor every
    ``cancel_poll_s``) reaps those that are nobody's to wait for.
    """
    return bool(_prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def _is_subreaper() -> bool:
    flag = ctypes.c_int(0)
    return (
        bool(_prctl_get(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0)
        and flag.value != 0
    )


def _zombie_children() -> list[int]:
    """This process's children that are zombies (a snapshot)."""
    pids: list[int] = []
    try:
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/children", "rb") as f:
                pids += map(int, f.read().split())
    except OSError:
        return []
    return [pid for pid in pids if (st := _state_and_session(pid)) is not None and st[0] == "Z"]


def _state_and_session(pid: int) -> tuple[str, int] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return fields[0].decode(), int(fields[3])  # fields 3 and 6: state, session


def _nobodys(pid: int) -> bool:
    """`pid` is no child `run_process` waits for, nor in our own session (where a plain
    ``subprocess`` child of any library would be). Call under `_spawn_lock`."""
    if pid in _owned:
        return False
    st = _state_and_session(pid)
    return st is not None and st[1] != os.getsid(0)


def _disown(pid: int) -> None:
    """`pid` was reaped: its number may now be reused by anyone's process."""
    with _spawn_lock:
        _owned[pid] -= 1
        if _owned[pid] <= 0:
            del _owned[pid]
            _tell_keeper(b"-", pid)


def _wait4_now(pid: int) -> Any | None:
    """``wait4(pid, WNOHANG)``: the rusage if it was reaped now, ``None`` if it still runs.

    Raises:
        ChildProcessError: not our child.
    """
    done, _, rusage = os.wait4(pid, os.WNOHANG)
    return rusage if done else None


async def reap_orphan(pid: int, timeout: float) -> Any | None:  # noqa: ASYNC109
    """Reap one expected orphan (bubblewrap's init) and return its rusage, or ``None``
    when it is not ours to reap (not our child, or one `run_process` or a plain
    ``subprocess`` waits for) or did not exit within `timeout` seconds.

    The rusage is the orphan's *and* that of the descendants it reaped: for bubblewrap's
    init, the guest's whole tree (its CPU time, and the largest resident set of any of
    its processes). While it is still running it is registered like a `run_process`
    child, so `reap_orphans` leaves it to us, and its pid cannot be reused under us; past
    the timeout it is unregistered and left to the next sweep. Shielded from
    cancellation: a child of ours is never abandoned half-claimed.
    """
    with _spawn_lock:
        if not _nobodys(pid):
            return None
        try:
            reaped = _wait4_now(pid)
        except ChildProcessError:
            return None  # not our child: the host's init or another subreaper reaps it
        if reaped is not None:
            return reaped
        _own(pid)
        pidfd = os.pidfd_open(pid)  # an unreaped child of ours: the pid is still it
    try:
        with anyio.CancelScope(shield=True), anyio.move_on_after(timeout):
            await anyio.wait_readable(pidfd)
        return _wait4_now(pid)  # still ours: registered above

    finally:
        os.close(pidfd)
        _disown(pid)


def reap_orphans() -> int:
    """Reap the zombie orphans a subreaper inherited; return how many. Never blocks.

    Only zombies nobody else will wait for: not a child `run_process` spawned (it reaps
    its own), and not one in this process's own session (a plain ``subprocess`` child of
    any library shares it, and its ``wait`` would otherwise find it gone). What remains
    are descendants re-parented to us: bubblewrap's inits (a bwrap ``--new-session``
    leader each; the arm reaps its job's own at once, this catches the rest, e.g. the
    probe's), and processes of a job tree whose direct child died first (each job runs
    in a session of its own). Does nothing unless this process is a subreaper.
    """
    if not _is_subreaper():
        return 0
    reaped = 0
    for pid in _zombie_children():  # read outside the lock: spawns need not wait for it
        with _spawn_lock:
            # Again under the lock: meanwhile it may have been reaped, its pid reused.
            if not _nobodys(pid):
                continue
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            reaped += done != 0
    return reaped
