"""Process lifecycle: spawn one job's process, feed it, drain it, time it out, reap it.

`run_process` is the single way metnos-exec starts a native process. It holds these
promises on both anyio backends (asyncio and trio):

* **Spawned from one long-lived thread.** PR_SET_PDEATHSIG fires when the *thread* that
  forked the child exits, not the process. trio spawns from cached worker threads that exit
  after 10 s idle, which SIGKILLed long jobs. Every fork here happens on a single daemon
  "spawner" thread that lives as long as the worker; the async side hands it a request and
  waits (on an eventfd, shielded: a spawned child is never abandoned) for the pid.
* **Waited on with a pidfd** (``os.pidfd_open`` + ``anyio.wait_readable``), reaped with
  ``os.wait4`` for its rusage. No SIGCHLD handler, no child watcher, no polling.
* **Bounded output.** stdout and stderr are read as they come into buffers that keep the
  first ``output_bytes`` and discard the rest while still draining, so a flood neither
  blocks the child on a full pipe nor grows the worker.
* **Whole-tree kill on timeout and cancellation:** SIGTERM, ``grace``, SIGKILL, reap. On
  the caller's cancellation the same sequence runs in a shielded scope and the
  cancellation is re-raised, never swallowed.
* **Die-with-parent.** A SIGKILLed worker leaves no job process alive.

Two ways to contain the tree, chosen by `ProcessSpec.reaper`:

``reaper=True`` (default; the direct arm)
    The target runs under `metnos_exec.process._reaper`, a stdlib-only Python shim (see its
    docstring) that is a child subreaper. A grandchild that double-forks and calls
    ``setsid`` leaves the process group but is re-parented to the shim, so the shim can
    find and kill it: on the target's exit (SIGKILL at once), on our SIGTERM (TERM, grace,
    KILL) and on the worker's death (its parent-death signal is SIGTERM, so it still gets
    to clean up). Cost: one interpreter start per job (~30 ms on a loaded 2-core box).
    ``peak_rss_bytes`` and ``cpu_s`` come from the shim's report of its reaped children
    (the job tree, not the shim). No ``preexec_fn``: the shim does the child set-up itself,
    single-threaded.
``reaper=False`` (the bwrap arm, whose pid namespace and ``--die-with-parent`` already hold
    the tree)
    The command is forked directly into a new session. The parent-death signal and the
    rlimits need code between fork and exec, so this path uses a minimal ``preexec_fn``
    (``prctl`` through a pre-resolved ctypes pointer, ``setrlimit``, the cgroup join with
    raw ``os.write``): nothing in it takes a lock another thread could hold. The tree
    kill is ``killpg`` of the session's group (plus the cgroup when there is one); a
    descendant that calls ``setsid`` escapes it, which is why the direct arm uses the shim.
    Cost: ``preexec_fn`` forces fork instead of vfork, ~3 ms a spawn here (0.2 ms without);
    with ``pdeathsig=False``, no rlimits and no cgroup to join it is skipped (the bwrap arm:
    bubblewrap's ``--die-with-parent``, limits applied inside the sandbox, pooled cgroups).

Process limits: with ``pids_max`` and a writable cgroup (v1 ``pids`` controller, or a v2
tree with ``pids`` delegable), each run gets ``metnos/<worker pid>-<uuid>`` with
``pids.max`` set; the child joins it before it can fork, every pid in it is killed at the
end, and the cgroup is removed (``pids_limited=True``; under the shim the limit is
``pids_max + 1`` because the shim counts). Otherwise the fallback is RLIMIT_NPROC, and
``pids_limited=False``: that limit counts every thread of the *user* (not of the job), so
it is set to what the uid runs now plus ``pids_max`` (a fork bomb still stops, an ordinary
job still forks on a desktop with hundreds of processes), and the kernel does not enforce
it at all for uid 0.

Pooled cgroups (``cgroup_pool=True``; the bwrap arm): joining a cgroup is the costly part of
a per-run cgroup (cgroup v1 task migration takes ``cgroup_threadgroup_rwsem`` for writing,
an RCU grace period: 1-15 ms a job here), and the join needs a ``preexec_fn``. Instead a
pool of *slots* — one per concurrent run, created on demand, kept for the worker's life —
each a spawner thread moved **once** into its own ``metnos/<worker pid>-slot-<n>`` cgroup:
cgroup v1 places single threads, and fork puts the child in the forking *thread's* cgroup,
so a run borrows a free slot, sets its ``pids.max`` (budget + 1: the thread counts) and
forks from its thread, with no migration. The tree kill signals every pid in the slot's
``cgroup.procs`` except the worker's own (its thread is listed there); a slot is lent again
only once nothing but its thread is left. Unreaped zombies of earlier runs (bubblewrap's
init is always orphaned; some hosts' init reaps late) still count in ``pids.current``, so
``pids.max`` is raised by their number (caveat: reaped during the run, they become headroom).
A slot thread lives as long as the worker, like the shared spawner, so a parent-death signal
tied to it never fires early. On cgroup v2 (no per-thread cgroups outside threaded mode,
where ``pids`` cannot be enabled) and without a writable v1 hierarchy, the per-run cgroup
above is used.

Memory (``memory_max``; pooled runs on cgroup v1): RLIMIT_AS binds each *process*, so a job
of N processes may hold N times its budget, and a tmpfs it writes to (the bwrap arm's
private ``/tmp``) is counted by no rlimit at all. A slot's thread therefore also sits, once,
in its own v1 memory cgroup, nested under the worker's own memory cgroup
(``<worker's memcg>/metnos/<worker pid>-slot-<n>``). A page is charged to the cgroup of its
``mm``'s owner, so what the job tree maps and writes (tmpfs pages are shmem, charged to the
writer) is charged there while the worker's own memory is not (see `_SlotMemory`). Per run:
``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes`` (swap is no way out) set to
``memory_max``, cache left by earlier runs dropped when above 16 MiB (``memory.force_empty``;
below that it may count in the peak), the peak reset; after it,
``memory.max_usage_in_bytes`` is the tree's peak (``memory_peak_bytes``) and a
move of ``oom_kill`` in ``memory.oom_control`` (Linux >= 4.13) means the kernel OOM-killed a
process of the tree at the limit (``oom_killed``). On cgroup v2 the per-run cgroup holds
it instead when the ``memory`` controller can be enabled: ``memory.max``,
``memory.swap.max`` 0, ``memory.peak`` and ``oom_kill`` in ``memory.events`` (written to
the kernel's documentation, untested here: this host runs cgroup v1). ``memory_limited``
says whether a cgroup held it; it is ``False`` without a writable memory hierarchy (a
non-root worker) and for non-pooled runs on cgroup v1, and then only the callers' rlimits
bound memory.
The slot memory cgroups are removed at exit (`_remove_slot_memory`).

Errors: `HostFault` only when the harness breaks (pipes, the spawner, the shim's
interpreter or set-up, ``wait4``). A user-level command that cannot be executed is an
ordinary result: exit 127 when not found, 126 otherwise (as a shell does), with the
reason in ``exec_error`` (stderr stays the job's own), in both modes.

Usage caveat: Linux counts the resident set of the image a child leaves at exec in its
``ru_maxrss``, so ``peak_rss_bytes`` never reads below the image that forked it: ~9 MB under
the shim; with ``reaper=False`` the worker's own *high-water* RSS, vforked or not (a
vforked child execs out of the worker's memory: measured, a worker that once held 300 MiB
saw 311 MiB for ``/bin/true``). Callers that need a job's peak there take it from
elsewhere (the bwrap arm: the memory cgroup, or the rusage of bubblewrap's init).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import ctypes
import errno
import marshal
import math
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.lowlevel
import msgspec

from metnos_exec import _libc
from metnos_exec.errors import BadConfig, HostFault
from metnos_exec.identities import SlotIdentity, allocate, slot_uids_unavailable, switched
from metnos_exec.process import _reaper

__all__ = (
    "ProcessResult",
    "ProcessSpec",
    "Slot",
    "Stopped",
    "become_subreaper",
    "pids_cgroup_available",
    "pooled_slot",
    "slots_available",
    "reap_orphans",
    "run_process",
)

PR_SET_PDEATHSIG: Final = 1
PR_SET_CHILD_SUBREAPER: Final = 36
PR_GET_CHILD_SUBREAPER: Final = 37

_READ_CHUNK: Final = 1 << 16
#: After the child exits, how long readers may still wait for EOF. Only a process that left
#: the tree (possible with ``reaper=False``) can hold a pipe open past its exit.
_DRAIN_S: Final = 1.0
#: Extra time the shim gets beyond ``grace`` to kill and reap the tree before we SIGKILL it.
_SHIM_MARGIN_S: Final = 2.0
#: Bound on waiting for a SIGKILLed child to exit; past it the kernel is not cooperating.
_KILL_WAIT_S: Final = 10.0

_REAPER_PATH: Final = str(Path(_reaper.__file__).resolve())
# Resolved now, in the parent: a dlsym inside preexec_fn could take the loader's lock.
# Typed (`metnos_exec._libc`): prctl is variadic, its arguments unsigned longs.
_ulong = ctypes.c_ulong
_prctl = _libc.function("prctl", ctypes.c_int, ctypes.c_int, _ulong, _ulong, _ulong, _ulong)
#: The same call for the options that write an int through their second argument.
_prctl_get = _libc.function(
    "prctl", ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int), _ulong, _ulong, _ulong
)


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
            the child into it; see "Pooled cgroups" in the module docstring.
        memory_max: memory limit in bytes for the whole tree, held by a memory cgroup
            when one is available (see "Memory" in the module docstring); ``None``: none.
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


# --- the spawner thread -----------------------------------------------------------------


class _Spawner:
    """One daemon thread that performs every fork of this process, for its whole life.

    Requests carry an eventfd that the thread signals when the request is done, so the
    async side can wait for it with `anyio.wait_readable` on either backend.
    """

    def __init__(self, name: str = "metnos-spawner") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue[
            tuple[Callable[[], Any], concurrent.futures.Future[Any], int]
        ] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], Any], done_fd: int) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()
        self._requests.put((fn, future, done_fd))
        return future

    def _serve(self) -> None:
        while True:
            fn, future, done_fd = self._requests.get()
            try:
                result = fn()
            except BaseException as exc:  # handed to the waiting task, re-raised there
                os.eventfd_write(done_fd, 1)
                future.set_exception(exc)
            else:
                # The eventfd first: once the future is done, the fd has been written and
                # the waiter may close it (see `_on_spawner`).
                os.eventfd_write(done_fd, 1)
                future.set_result(result)


_spawner = _Spawner()
# A forked copy of the worker has no spawner thread (and maybe a lock held mid-submit).
os.register_at_fork(after_in_child=lambda: _spawner.__init__())  # type: ignore[misc]


#: How long the event loop waits for a spawn *synchronously* (GIL released) before it
#: falls back to waiting on the eventfd like any other I/O.
_SYNC_SPAWN_WAIT_S: Final = 0.02


async def _on_spawner(fn: Callable[[], Any], spawner: _Spawner | None = None) -> Any:
    """Run `fn` on a spawner thread (default: the shared one) and return its result
    (shielded: see below)."""
    done_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
    future = (spawner or _spawner).submit(fn, done_fd)
    # A spawn takes well under a millisecond (vfork + exec) and holds the GIL for most of
    # it anyway, so the loop could run no Python meanwhile. Waiting here, blocked with the
    # GIL released, hands the GIL to the spawner thread at once; returning to the loop
    # instead lets other tasks keep the GIL for up to the interpreter's switch interval
    # (5 ms) first, and costs an eventfd round trip. A slow spawn (first use of a slot,
    # a fork with preexec_fn, a loaded box) is awaited on the eventfd like any I/O.
    try:
        future.exception(timeout=_SYNC_SPAWN_WAIT_S)
    except concurrent.futures.TimeoutError:
        # Shielded: once submitted, a child may exist; the caller must get its handle to
        # kill and reap it, so we never walk away from a spawn in progress.
        with anyio.CancelScope(shield=True):
            await anyio.wait_readable(done_fd)
    # Closed only once the spawner has written it (it writes before completing the
    # future): an fd number closed early could be reused and then receive that write.
    try:
        return future.result()  # done, or done within microseconds (see `_serve`)
    finally:
        os.close(done_fd)


# --- orphans ------------------------------------------------------------------------------

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


# --- cgroups ------------------------------------------------------------------------------


_V1_PIDS: Final = Path("/sys/fs/cgroup/pids")
_V2_ROOT: Final = Path("/sys/fs/cgroup")


_parent_cache: list[Path | None] = []


def _cgroup_parent() -> Path | None:
    """The writable ``metnos`` cgroup under which per-run cgroups go; probed once."""
    if not _parent_cache:
        parent = _find_cgroup_parent()
        if parent is not None:
            _sweep_stale(parent)
        _parent_cache.append(parent)
    return _parent_cache[0]


def pids_cgroup_available() -> bool:
    """Whether `run_process` can enforce ``pids_max`` with a cgroup here (probed once)."""
    return _cgroup_parent() is not None


def slots_available() -> bool:
    """Whether pooled slots (`pooled_slot`) can work here: a writable cgroup v1 pids
    hierarchy, where one thread can sit in a cgroup of its own."""
    parent = _cgroup_parent()
    return parent is not None and (parent / "tasks").exists()


def _sweep_stale(parent: Path) -> None:
    """Remove per-run cgroups whose worker died without cleaning up (SIGKILL, power loss).

    Per-run cgroups are named ``<worker pid>-<uuid>``, slot cgroups ``<worker pid>-slot-<n>``;
    only those whose worker pid no longer exists are touched, so a live worker's cgroups are
    never pulled from under it. What is still inside one is SIGKILLed first: a job whose
    bubblewrap was orphaned in the instant before it set its own parent-death signal (see
    "Pooled cgroups") dies here at the latest. Best effort: rmdir may still refuse while
    the killed tasks exit; the next sweep gets it.
    """
    for entry in parent.iterdir():
        owner, sep, _ = entry.name.partition("-")
        if not (sep and owner.isdigit() and entry.is_dir()):
            continue
        if not Path(f"/proc/{owner}").exists():
            with contextlib.suppress(OSError):
                for pid in (entry / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), signal.SIGKILL)
            with contextlib.suppress(OSError):
                entry.rmdir()


def _can_create_child(parent: Path) -> bool:
    """Whether this process may create (and remove) a cgroup under `parent`.

    ``mkdir(exist_ok=True)`` of the parent proves nothing when another user (root) made
    it: probed by doing it, so a limit is never claimed on a cgroup we cannot create.
    Named like a run's cgroup (``<pid>-...``): a probe left by a killed process is swept.
    """
    probe = parent / f"{os.getpid()}-probe"
    try:
        probe.mkdir()
    except FileExistsError:
        pass
    except OSError:
        return False
    with contextlib.suppress(OSError):
        probe.rmdir()
    return True


def _find_cgroup_parent() -> Path | None:
    try:
        if (_V1_PIDS / "cgroup.procs").exists():
            parent = _V1_PIDS / "metnos"
            parent.mkdir(exist_ok=True)
            return parent if _can_create_child(parent) else None
        controllers = _V2_ROOT / "cgroup.controllers"
        if controllers.exists() and "pids" in controllers.read_text().split():
            parent = _V2_ROOT / "metnos"
            parent.mkdir(exist_ok=True)
            if "pids" not in (_V2_ROOT / "cgroup.subtree_control").read_text().split():
                (_V2_ROOT / "cgroup.subtree_control").write_text("+pids")
            if "pids" not in (parent / "cgroup.subtree_control").read_text().split():
                (parent / "cgroup.subtree_control").write_text("+pids")
            if "memory" in controllers.read_text().split():
                # Best effort: per-run cgroups then also hold `ProcessSpec.memory_max`
                # (see `_Cgroup.limit_memory`); without it they report memory unlimited.
                with contextlib.suppress(OSError):
                    for node in (_V2_ROOT, parent):
                        if "memory" not in (node / "cgroup.subtree_control").read_text().split():
                            (node / "cgroup.subtree_control").write_text("+memory")
            return parent if _can_create_child(parent) else None
    except OSError:
        return None
    return None


class _Cgroup:
    """A per-run pids cgroup; `close` kills whatever is left in it and removes it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.procs = str(path / "cgroup.procs")

    @classmethod
    def create(cls, pids_max: int) -> _Cgroup | None:
        parent = _cgroup_parent()
        if parent is None:
            return None
        path = parent / f"{os.getpid()}-{uuid.uuid4().hex}"
        try:
            path.mkdir()
        except OSError:
            return None
        try:
            (path / "pids.max").write_text(str(pids_max))
        except OSError:
            path.rmdir()
            return None
        return cls(path)

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in Path(self.procs).read_text().split()]
        except OSError:
            return []

    def limit_memory(self, limit: int) -> bool:
        """cgroup v2 only: set ``memory.max`` (and ``memory.swap.max``) before the child
        joins; ``False`` when this cgroup has no memory controller (v1's pids hierarchy,
        or v2 without ``memory`` delegated). Untested here: this host runs cgroup v1."""
        try:
            (self.path / "memory.max").write_text(str(limit))
        except OSError:
            return False
        with contextlib.suppress(OSError):
            (self.path / "memory.swap.max").write_text("0")
        return True

    def memory_report(self) -> tuple[int | None, int]:
        """cgroup v2: (``memory.peak``, ``oom_kill`` from ``memory.events``); the peak is
        ``None`` before Linux 5.19, which has no ``memory.peak``."""
        peak = None
        with contextlib.suppress(OSError, ValueError):
            peak = int((self.path / "memory.peak").read_text())
        kills = 0
        with contextlib.suppress(OSError, ValueError):
            for line in (self.path / "memory.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    kills = int(value)
        return peak, kills

    def signal_all(self, sig: int) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    async def close(self) -> None:
        deadline = time.monotonic() + _KILL_WAIT_S
        while True:
            self.signal_all(signal.SIGKILL)
            try:
                self.path.rmdir()
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise HostFault(f"cannot remove cgroup {self.path}: {exc}") from exc
            # Killed tasks leave the cgroup a moment after SIGKILL; poll until they do.
            await anyio.sleep(0.01)


# --- pooled cgroups ---------------------------------------------------------------------


class _SlotCgroup(_Cgroup):
    """A slot's long-lived pids cgroup; its spawner thread sits in it (cgroup v1 only).

    The worker's own pid shows in ``cgroup.procs`` (one of its threads is here), so every
    listing leaves it out: the tree kill must never reach the worker.
    """

    _max: str | None = None

    def pids(self) -> list[int]:
        me = os.getpid()
        try:
            fd = os.open(self.procs, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return []
        try:
            data = b""
            while chunk := os.read(fd, _READ_CHUNK):
                data += chunk
        except OSError:
            return []
        finally:
            os.close(fd)
        return [pid for pid in map(int, data.split()) if pid != me]

    def join_current_thread(self) -> None:
        """Move the calling *thread* (not its process) here. cgroup v1 only."""
        (self.path / "tasks").write_text(str(threading.get_native_id()))

    def zombies(self) -> int:
        """Charges of dead tasks nobody has reaped yet (listed nowhere, still counted).

        bubblewrap's monitor exits as soon as its init reports the guest's exit status, so
        the init (pid 1 of the sandbox) always ends up an orphan, reaped by the host's
        init or the nearest subreaper: promptly under systemd, every ~2 s on some VMs'
        init. Until then its zombie stays charged to the cgroup it was forked in.
        """
        try:
            fd = os.open(self.path / "pids.current", os.O_RDONLY | os.O_CLOEXEC)
            try:
                current = int(os.read(fd, 64))
            finally:
                os.close(fd)
        except (OSError, ValueError):
            return 0
        # The common case needs no listing: only our thread is counted.
        return 0 if current <= 1 else max(0, current - 1 - len(self.pids()))

    def set_max(self, pids_max: int | None) -> None:
        # +1: the spawner thread itself counts in pids.current; and the zombies of earlier
        # runs (see `zombies`) must not eat this run's budget. Caveat: when they are
        # reaped during this run, the run may fork up to that many more processes.
        value = "max" if pids_max is None else str(pids_max + 1 + self.zombies())
        if value != self._max:
            (self.path / "pids.max").write_text(value)
            self._max = value

    async def drain(self) -> None:
        """Kill what is left of the last run and wait until only our thread remains."""
        seen: list[int] = []
        with anyio.move_on_after(_KILL_WAIT_S):
            while pids := self.pids():
                if pids == seen:
                    # Exited but still listed (a zombie not yet reaped by its parent, say):
                    # the pidfds are readable at once, so do not spin on them.
                    await anyio.sleep(0.001)
                seen = pids
                # Killed tasks leave the cgroup a moment after SIGKILL (usually bubblewrap's
                # init, still being torn down): wait for each to exit on a pidfd, no polling.
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        pidfd = os.pidfd_open(pid)
                    except ProcessLookupError:
                        continue
                    try:
                        await anyio.wait_readable(pidfd)
                    finally:
                        os.close(pidfd)
            return
        raise HostFault(f"cgroup {self.path} still holds {self.pids()} after SIGKILL")


_V1_MEMORY: Final = Path("/sys/fs/cgroup/memory")
#: Above this much charge left by earlier runs, a slot's memory cgroup is emptied before a
#: run (see `_SlotMemory.begin`): the slack a run's peak may include.
_STALE_CACHE_BYTES: Final = 16 << 20
_memory_parent_cache: list[Path | None] = []


def _memory_parent() -> Path | None:
    """The writable v1 ``metnos`` memory cgroup for slot memory cgroups; probed once.

    Nested under the worker's *own* memory cgroup, not the hierarchy's root: jobs then stay
    inside whatever memory budget the worker itself was given (a systemd ``MemoryMax``, a
    container limit), instead of escaping it.
    """
    if not _memory_parent_cache:
        parent = None
        with contextlib.suppress(OSError, StopIteration):
            own = next(
                line.split(":", 2)[2].strip()
                for line in Path("/proc/self/cgroup").read_text().splitlines()
                if line.split(":", 2)[1:2] == ["memory"]
            )
            candidate = _V1_MEMORY / own.lstrip("/") / "metnos"
            if (candidate.parent / "tasks").exists():
                candidate.mkdir(exist_ok=True)
                if (candidate / "memory.limit_in_bytes").exists() and _can_create_child(candidate):
                    _sweep_stale(candidate)
                    parent = candidate
        _memory_parent_cache.append(parent)
    return _memory_parent_cache[0]


def memory_cgroup_available() -> bool:
    """Whether pooled runs (`ProcessSpec.cgroup_pool`) can hold ``memory_max`` for the
    whole tree with a memory cgroup here (cgroup v1, writable; probed once)."""
    return _memory_parent() is not None


class _SlotMemory:
    """A slot's long-lived v1 memory cgroup; its spawner thread sits in it.

    Why a thread can sit here while the worker's memory is not charged: a memory cgroup
    charges a page to the cgroup of the ``mm``'s *owner* (the thread group leader), so the
    worker's pages stay with the worker's own cgroup; a child forked from the slot thread
    starts in this cgroup and owns its new ``mm`` from exec on, so everything the job tree
    maps, and the tmpfs pages it writes (shmem, charged to the writer), is charged here.
    The kernel's OOM killer, scanning this cgroup, visits thread group leaders only: never
    the worker. Only kernel objects the slot thread itself allocates (pipes, the fork's
    task structures) are charged here too, a few hundred KiB at most.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._memsw = (path / "memory.memsw.limit_in_bytes").exists()
        self._limit: int | None = -1  # unknown until first set

    def join_current_thread(self) -> None:
        (self.path / "tasks").write_text(str(threading.get_native_id()))

    def _write(self, name: str, value: str) -> None:
        fd = os.open(self.path / name, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)

    def _read(self, name: str) -> str:
        fd = os.open(self.path / name, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.read(fd, 4096).decode()
        finally:
            os.close(fd)

    def set_limit(self, limit: int | None) -> None:
        """Memory (and memory+swap, so swap is no way out) limit for the next run.

        Raises:
            OSError: the kernel refused (EBUSY: more is charged than `limit` and could not
                be reclaimed).
        """
        if limit == self._limit:
            return
        value = "-1" if limit is None else str(limit)
        # memsw.limit must stay >= limit: raise memsw first, lower it last.
        if self._memsw:
            try:
                self._write("memory.memsw.limit_in_bytes", value)
            except OSError:
                self._write("memory.limit_in_bytes", value)
                self._write("memory.memsw.limit_in_bytes", value)
            else:
                self._write("memory.limit_in_bytes", value)
        else:
            self._write("memory.limit_in_bytes", value)
        self._limit = limit

    def empty(self) -> None:
        """Reclaim what the cgroup holds and can give back (page cache); best effort."""
        with contextlib.suppress(OSError):
            self._write("memory.force_empty", "0")

    def begin(self) -> int | None:
        """Reset the peak and return the OOM-kill count before a run (``None``: the kernel
        keeps none, < 4.13).

        Raises:
            OSError: EBUSY when more than a few MiB stay charged that cannot be reclaimed.
        """
        # Page cache left by earlier runs on this slot counts in this run's peak (and in
        # its limit until reclaimed, which the kernel does before any OOM kill). Dropping
        # it costs ~1.7 ms a job, so only when more than a few MiB are left: a no-op job
        # leaves ~5 MiB, mostly the interpreter's files the next job reads again anyway.
        if int(self._read("memory.usage_in_bytes")) > _STALE_CACHE_BYTES:
            self.empty()
            left = int(self._read("memory.usage_in_bytes"))
            if left > _STALE_CACHE_BYTES:
                # Not reclaimable (a host tmpfs file an earlier run wrote, without swap):
                # it would eat into this run's budget. `_run_in_slot` starts a new cgroup.
                raise OSError(errno.EBUSY, f"{left} bytes left charged by earlier runs")
        self._write("memory.max_usage_in_bytes", "0")
        return self.oom_kills()

    def oom_kills(self) -> int | None:
        for line in self._read("memory.oom_control").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return None

    def peak(self) -> int:
        return int(self._read("memory.max_usage_in_bytes"))


class Slot:
    """One spawner thread, moved once into its own pids cgroup (and memory cgroup, when
    there is one), borrowed by one run at a time (`pooled_slot`, or `run_process` for a
    ``cgroup_pool`` run). For a root worker, also the slot's own host uid (`identity`).
    """

    def __init__(self, index: int, cgroup: _SlotCgroup, memory: _SlotMemory | None = None) -> None:
        self.index = index
        self.spawner = _Spawner(f"metnos-spawner-{index}")
        self.cgroup = cgroup
        self.memory = memory
        #: How many times `memory` was replaced by an empty one (`_renew_slot_memory`).
        self.memory_generation = 0
        #: A drain failed: never lent again (see `_run_in_slot`).
        self.retired = False
        self._identity: SlotIdentity | None = None
        #: Why this slot has no identity, once `identity` was asked and could not give one.
        self.identity_error: str | None = None

    async def identity(self) -> SlotIdentity | None:
        """This slot's dedicated host uid (`metnos_exec.identities`), taken on first use;
        ``None`` when the worker is not root, slot uids are off or unavailable (the
        reason is then in `identity_error`)."""
        if self._identity is not None or self.identity_error is not None:
            return self._identity
        try:
            reason = slot_uids_unavailable()
        except BadConfig as exc:
            reason = str(exc)
        if reason is None:
            try:
                # On the slot's own thread: a one-off helper process and a lock, once.
                self._identity = await _on_spawner(allocate, self.spawner)
            except OSError as exc:
                reason = f"no slot uid: {exc}"
        self.identity_error = reason
        return self._identity

    async def run_as(self, fn: Callable[[], None]) -> None:
        """Call `fn` on this slot's thread switched to its identity: for what the kernel
        allows only to the same uid (prlimit(2) of the slot's processes by a root worker
        without CAP_SYS_RESOURCE).

        Raises:
            RuntimeError: the slot has no identity.
        """
        identity = self._identity
        if identity is None:
            raise RuntimeError("this slot has no identity")

        def call() -> None:
            with switched(identity):
                fn()

        await _on_spawner(call, self.spawner)


class _SlotPool:
    """Slots for `ProcessSpec.cgroup_pool` runs: as many as the most runs ever at once.

    A slot's thread lives as long as the worker (like the shared spawner), so the parent-
    death signal of what it forks never fires early.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[Slot] = []
        self._made = 0
        self._usable: bool | None = None

    async def acquire(self) -> Slot | None:
        """A free slot, a new one, or ``None`` when slots cannot work here."""
        with self._lock:
            if self._free:
                # Least recently used first: its zombies (see `_SlotCgroup.zombies`) had
                # the longest time to be reaped.
                return self._free.pop(0)
            if self._usable is False:
                return None
            index = self._made
            self._made += 1
        parent = _cgroup_parent()
        # Only cgroup v1 lets one thread sit in a cgroup of its own (v2 would need threaded
        # mode, where the pids controller cannot be enabled).
        if parent is None or not (parent / "tasks").exists():
            self._usable = False
            return None
        path = parent / f"{os.getpid()}-slot-{index}"
        try:
            path.mkdir(exist_ok=True)
        except OSError:
            self._usable = False
            return None
        slot = Slot(index, _SlotCgroup(path), _slot_memory(index))
        try:
            # The one migration this thread ever makes (the costly part of cgroup joins).
            await _on_spawner(slot.cgroup.join_current_thread, slot.spawner)
        except OSError:
            self._usable = False
            with contextlib.suppress(OSError):
                path.rmdir()
            return None
        if slot.memory is not None:
            try:
                await _on_spawner(slot.memory.join_current_thread, slot.spawner)
            except OSError:
                # The slot still holds the pids wall; its runs report memory unbounded.
                with contextlib.suppress(OSError):
                    slot.memory.path.rmdir()
                slot.memory = None
        self._usable = True
        return slot

    def release(self, slot: Slot) -> None:
        if slot.retired:
            return
        with self._lock:
            self._free.append(slot)


def _slot_memory(index: int, generation: int = 0) -> _SlotMemory | None:
    """Slot `index`'s memory cgroup, created, or ``None`` when there can be none here.

    `generation` > 0 names a replacement (`_renew_slot_memory`): ``<pid>-slot-<i>.<g>``,
    still swept by the worker pid before the first ``-``.
    """
    parent = _memory_parent()
    if parent is None:
        return None
    suffix = f".{generation}" if generation else ""
    path = parent / f"{os.getpid()}-slot-{index}{suffix}"
    try:
        # parents: another worker sharing our memory cgroup may have removed an empty
        # `metnos` on its way out (see `_remove_slot_memory`).
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return _SlotMemory(path)


async def _renew_slot_memory(slot: Slot) -> _SlotMemory | None:
    """Move `slot`'s thread into a new, empty memory cgroup and remove the old one.

    For a slot whose memory cgroup still holds more than the next run's limit once what
    can be reclaimed was (`_SlotMemory.set_limit` fails with EBUSY): pages an earlier run
    left that outlive it and cannot be reclaimed without swap, such as a host tmpfs file
    it wrote. Lowering the limit is then impossible, and a run that went on without it
    would have no memory wall at all. The old cgroup's charges pass to the ``metnos``
    parent when it is removed, so they still count against the worker's own budget.

    Returns:
        The new memory cgroup (also set as ``slot.memory``), or ``None`` when none could
        be made or joined (the run then says its memory was not bounded as a whole).
    """
    old = slot.memory
    slot.memory_generation += 1
    new = _slot_memory(slot.index, slot.memory_generation)
    if new is not None:
        try:
            await _on_spawner(new.join_current_thread, slot.spawner)
        except OSError:
            with contextlib.suppress(OSError):
                new.path.rmdir()
            new = None
    if new is None and old is not None:
        # The thread is still in `old`: keep it (a later run with a larger limit may fit).
        return None
    if old is not None:
        with contextlib.suppress(OSError):
            old.path.rmdir()
    slot.memory = new
    return new


_slots = _SlotPool()
os.register_at_fork(after_in_child=lambda: _slots.__init__())  # type: ignore[misc]


@contextlib.asynccontextmanager
async def pooled_slot() -> AsyncIterator[Slot | None]:
    """Borrow a slot for one run (``None`` when slots cannot work here), to learn its
    `Slot.identity` before the run; pass it to `run_process` (``slot=``), which drains it.
    Lent again on exit."""
    slot = await _slots.acquire()
    try:
        yield slot
    finally:
        if slot is not None:
            _slots.release(slot)


def _remove_slot_memory() -> None:
    """At exit, take each idle slot thread back to the worker's memory cgroup and remove
    the slot memory cgroups (and ``metnos``, when no other worker uses it).

    Why here and not only by the next worker's sweep: they live under the worker's *own*
    memory cgroup, which the next worker may not share (a new service instance, a new
    container), and a cgroup with children cannot be removed by whoever manages the
    worker's. A SIGKILLed worker still leaves them; a later worker in the same cgroup
    sweeps them.
    """
    parent = _memory_parent_cache[0] if _memory_parent_cache else None
    if parent is None:
        return
    home = str(parent.parent / "tasks")

    def go_home() -> None:
        Path(home).write_text(str(threading.get_native_id()))

    for slot in list(_slots._free):
        if slot.memory is None:
            continue
        done_fd = os.eventfd(0, os.EFD_CLOEXEC)
        try:
            slot.spawner.submit(go_home, done_fd).result(timeout=1.0)
            slot.memory.path.rmdir()
        except (OSError, concurrent.futures.TimeoutError):
            continue
        finally:
            os.close(done_fd)
    with contextlib.suppress(OSError):
        parent.rmdir()


atexit.register(_remove_slot_memory)


# --- spawning -------------------------------------------------------------------------


class _Child:
    """Parent-side handles of one spawned child. Owned by `run_process`."""

    def __init__(self, popen: subprocess.Popen[bytes], pidfd: int, fds: dict[str, int]) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.pidfd = pidfd
        self.fds = fds  # "stdin", "stdout", "stderr", "status" (shim only)
        self.t0 = time.monotonic()
        self.exited = False
        self.term_sent = False
        self.kill_sent = False
        self.exec_error: str | None = None
        #: The tree's usage read just before it was killed (`_tree_usage`).
        self.killed_usage: tuple[float, int] | None = None

    def close_fd(self, name: str) -> None:
        fd = self.fds.pop(name, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for name in list(self.fds):
            self.close_fd(name)
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def _preexec(
    pdeathsig: bool,
    parent: int,
    rlimits: tuple[tuple[int, int, int], ...],
    cgroup_procs: str | None,
) -> Callable[[], None]:
    """The minimal between-fork-and-exec set-up for ``reaper=False`` (see module doc)."""

    def setup() -> None:
        if cgroup_procs is not None:
            fd = os.open(cgroup_procs, os.O_WRONLY)
            os.write(fd, b"0")  # "0" is the writer itself
            os.close(fd)
        if pdeathsig:
            if _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
            if os.getppid() != parent:
                os._exit(125)  # the worker died before the prctl: nobody wants this job
        for res, soft, hard in rlimits:
            resource.setrlimit(res, (soft, hard))

    return setup


def _spawn(
    spec: ProcessSpec,
    rlimits: tuple[tuple[int, int, int], ...],
    cgroup: _Cgroup | None,
    grace: float,
) -> _Child:
    """Runs on a spawner thread. Creates the pipes and forks; never leaks an fd.

    `cgroup` is the per-run cgroup the child must *join* (``None`` when there is none, or
    when the forking thread already sits in the run's slot cgroup).
    """
    ours: list[int] = []  # parent ends, closed on failure
    theirs: list[int] = []  # child ends, always closed here once the child has them
    try:
        try:
            in_r, in_w = os.pipe2(os.O_CLOEXEC)
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
        except OSError as exc:
            raise HostFault(f"cannot create pipes for a job: {exc}") from exc
        ours += [in_w, out_r, err_r]
        theirs += [in_r, out_w, err_w]
        fds = {"stdin": in_w, "stdout": out_r, "stderr": err_r}
        pass_fds = list(spec.pass_fds)
        if spec.reaper:
            status_r, status_w = os.pipe2(os.O_CLOEXEC)
            ours.append(status_r)
            theirs.append(status_w)
            fds["status"] = status_r
            config = {
                "status_fd": status_w,
                "env": spec.env,
                "grace": grace,
                "pdeathsig": spec.pdeathsig,
                "parent": os.getpid(),
                "cgroup_procs": cgroup.procs if cgroup else None,
                "rlimits": [list(r) for r in rlimits],
                "cwd": spec.cwd,
            }
            # The job's environment can be large; a memfd has no argv size limit.
            config_fd = os.memfd_create("metnos-reaper-config", os.MFD_CLOEXEC)
            theirs.append(config_fd)
            os.write(config_fd, marshal.dumps(config))
            os.lseek(config_fd, 0, os.SEEK_SET)
            pass_fds += [status_w, config_fd]
            argv: list[str] = [sys.executable, "-I", "-S", _REAPER_PATH, str(config_fd), "--"]
            argv += spec.argv
            popen_env: dict[str, str] = {}
            cwd = None
            preexec = None
        else:
            argv = list(spec.argv)
            popen_env = spec.env
            if spec.keeper_mark and _keeper_token:
                popen_env = {**spec.env, KEEPER_ENV: _keeper_token}
            cwd = spec.cwd
            # preexec_fn costs ~3 ms a spawn (fork instead of vfork, Python in the child);
            # skip it when there is nothing to do between fork and exec.
            preexec = (
                _preexec(spec.pdeathsig, os.getpid(), rlimits, cgroup.procs if cgroup else None)
                if spec.pdeathsig or rlimits or cgroup
                else None
            )
        for fd in ours:
            os.set_blocking(fd, False)
        try:
            # Under the lock from fork to registration: `reap_orphans` must never see this
            # child as nobody's (it may exit at once, a zombie before `Popen` returns).
            with _spawn_lock:
                popen = subprocess.Popen(
                    argv,
                    stdin=in_r,
                    stdout=out_w,
                    stderr=err_w,
                    env=popen_env,
                    cwd=cwd,
                    close_fds=True,
                    pass_fds=pass_fds,
                    start_new_session=True,
                    preexec_fn=preexec,
                )
                _own(popen.pid)
        except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
            if spec.reaper:
                raise HostFault(f"cannot start the reaper shim ({sys.executable}): {exc}") from exc
            raise _ExecFailed(exc) from exc
        except (OSError, subprocess.SubprocessError) as exc:
            raise HostFault(f"cannot spawn {argv[0]}: {exc}") from exc
        try:
            pidfd = os.pidfd_open(popen.pid)
        except OSError as exc:  # pragma: no cover - Linux >= 5.3 is a precondition
            popen.kill()
            popen.wait()
            _disown(popen.pid)
            raise HostFault(f"pidfd_open failed: {exc}") from exc
        ours.clear()
        return _Child(popen, pidfd, fds)
    finally:
        for fd in ours + theirs:
            os.close(fd)


class _ExecFailed(Exception):
    """The user-level command could not be executed (``reaper=False`` path)."""

    def __init__(self, exc: OSError) -> None:
        super().__init__(str(exc))
        self.exc = exc


# --- the async side --------------------------------------------------------------------


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


def _threads_of_uid(uid: int) -> int:
    """Threads the uid runs now: what RLIMIT_NPROC counts (real uid, approximated by owner)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        total += int(stat[stat.rfind(b")") + 2 :].split()[17])  # field 20: num_threads
    return total


def _validate(spec: ProcessSpec, timeout: float, grace: float) -> None:
    if not spec.argv:
        raise ValueError("ProcessSpec.argv must not be empty")
    if spec.on_spawn is not None and spec.reaper:
        raise ValueError("ProcessSpec.on_spawn needs reaper=False (it would see the shim)")
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

    Returns:
        The result; ``timed_out`` tells a deadline kill from an ordinary exit.

    Raises:
        HostFault: the harness broke (pipes, spawner, shim, wait4).
        ValueError: `spec` is malformed.
    """
    _validate(spec, timeout, grace)
    if slot is not None:
        return await _run_in_slot(spec, slot, timeout, grace, stopped)
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
    spec: ProcessSpec, slot: Slot, budget_s: float, grace: float, stopped: Stopped | None
) -> ProcessResult:
    """`run_process` forking from `slot`'s thread: the child starts in the slot's cgroup."""
    budget = spec.pids_max + (1 if spec.reaper else 0) if spec.pids_max else None
    try:
        slot.cgroup.set_max(budget)
    except OSError as exc:
        raise HostFault(f"cannot set pids.max of {slot.cgroup.path}: {exc}") from exc
    memory = slot.memory if memory_cgroup_available() else None
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
        # worker is gone.
        slot.retired = True
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
    rlimits = spec.rlimits
    cgroup: _Cgroup | None
    if slot is not None:
        cgroup = slot.cgroup
        join = None  # the forking thread is in it already: the child starts there
    else:
        cgroup = (
            _Cgroup.create(spec.pids_max + (1 if spec.reaper else 0)) if spec.pids_max else None
        )
        join = cgroup
    pids_limited = spec.pids_max is not None and cgroup is not None
    # cgroup v2 per-run cgroup with the memory controller: it holds memory_max too.
    memory_limited = (
        join is not None and spec.memory_max is not None and join.limit_memory(spec.memory_max)
    )
    members = cgroup.pids if cgroup is not None else None
    identity = (
        await slot.identity()
        if slot is not None and (spec.as_slot_user or spec.drops_to_slot_user)
        else None
    )
    uid = os.geteuid() if identity is None else identity.uid
    switch = identity if spec.as_slot_user else None
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
        if spec.on_spawn is not None:
            try:
                await spec.on_spawn(child.pid, members)
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
        try:
            result = await _supervise(child, spec, budget_s, grace, cgroup, pids_limited, stopped)
        except BaseException:
            if stopped is not None and stopped.result is not None:
                stopped.result = msgspec.structs.replace(stopped.result, uid=uid)
                if memory_limited and join is not None:
                    with contextlib.suppress(OSError):
                        peak, _ = join.memory_report()
                        stopped.result = msgspec.structs.replace(
                            stopped.result, memory_limited=True, memory_peak_bytes=peak
                        )
            raise
        finally:
            child.close()
        result = msgspec.structs.replace(result, uid=uid)
        if memory_limited and join is not None:
            peak, kills = join.memory_report()
            result = msgspec.structs.replace(
                result, memory_limited=True, memory_peak_bytes=peak, oom_killed=kills > 0
            )
        return result
    finally:
        if join is not None:
            with anyio.CancelScope(shield=True):
                await join.close()


async def _supervise(
    child: _Child,
    spec: ProcessSpec,
    budget_s: float,
    grace: float,
    cgroup: _Cgroup | None,
    pids_limited: bool,
    stopped: Stopped | None = None,
) -> ProcessResult:
    out, err = _Capped(spec.output_bytes), _Capped(spec.output_bytes)
    timed_out = False
    reaped: tuple[int, int, Any] | None = None
    try:
        async with anyio.create_task_group() as tg:
            out_done, err_done = anyio.Event(), anyio.Event()
            tg.start_soon(_pump, child.fds["stdout"], out, out_done)
            tg.start_soon(_pump, child.fds["stderr"], err, err_done)
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
                stopped.result = ProcessResult(
                    returncode=os.waitstatus_to_exitcode(status),
                    stdout=out.value(),
                    stderr=err.value(),
                    stdout_truncated=out.truncated,
                    stderr_truncated=err.truncated,
                    timed_out=False,
                    wall_s=time.monotonic() - child.t0,
                    cpu_s=rusage.ru_utime + rusage.ru_stime,
                    peak_rss_bytes=rusage.ru_maxrss * 1024,
                    pids_limited=pids_limited,
                    killed_cpu_s=None if child.killed_usage is None else child.killed_usage[0],
                    killed_peak_rss_bytes=(
                        None if child.killed_usage is None else child.killed_usage[1]
                    ),
                )
    _, status, rusage = reaped
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
    return ProcessResult(
        returncode=os.waitstatus_to_exitcode(status),
        stdout=out.value(),
        stderr=err.value(),
        stdout_truncated=out.truncated,
        stderr_truncated=err.truncated,
        timed_out=timed_out,
        wall_s=wall,
        cpu_s=cpu_s,
        peak_rss_bytes=maxrss_kib * 1024,
        pids_limited=pids_limited,
        exec_error=exec_error,
        killed_cpu_s=None if child.killed_usage is None else child.killed_usage[0],
        killed_peak_rss_bytes=None if child.killed_usage is None else child.killed_usage[1],
    )


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
