"""The spawner threads and the fork: every child of `run_process` is forked here.

PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process, so
every fork happens on a long-lived daemon thread (`_Spawner`): the shared one, or a slot's
(`metnos_exec.process.slots`). The async side hands it a request and waits for the result
(`_on_spawner`). `_spawn` creates the pipes and forks, registering the child as ours
(`metnos_exec.process.reap`) from the fork on.

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
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import marshal
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, NamedTuple

import anyio

from metnos_exec.errors import HostFault
from metnos_exec.process import _reaper, reap
from metnos_exec.process.cgroups import _Cgroup
from metnos_exec.process.reap import KEEPER_ENV, _disown, _own, _prctl
from metnos_exec.process.spec import ProcessSpec

PR_SET_PDEATHSIG: Final = 1

_REAPER_PATH: Final = str(Path(_reaper.__file__).resolve())


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


class _Command(NamedTuple):
    """How `_spawn` starts the child: the shim's command line, or the command itself."""

    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    pass_fds: list[int]
    preexec: Callable[[], None] | None


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
        if spec.reaper:
            command = _shim_command(spec, rlimits, cgroup, grace, fds, ours, theirs)
        else:
            command = _direct_command(spec, rlimits, cgroup)
        for fd in ours:
            os.set_blocking(fd, False)
        popen = _popen(spec, command, in_r, out_w, err_w)
        pidfd = _pidfd_of(popen)
        ours.clear()
        return _Child(popen, pidfd, fds)
    finally:
        for fd in ours + theirs:
            os.close(fd)


def _shim_command(
    spec: ProcessSpec,
    rlimits: tuple[tuple[int, int, int], ...],
    cgroup: _Cgroup | None,
    grace: float,
    fds: dict[str, int],
    ours: list[int],
    theirs: list[int],
) -> _Command:
    """The command line of the reaper shim around `spec`, with its status pipe (its read
    end added to `fds` and `ours`) and its configuration in a memfd (in `theirs`)."""
    pass_fds = list(spec.pass_fds)
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
    return _Command(argv, {}, None, pass_fds, None)


def _direct_command(
    spec: ProcessSpec, rlimits: tuple[tuple[int, int, int], ...], cgroup: _Cgroup | None
) -> _Command:
    """`spec`'s own command, forked directly (``reaper=False``)."""
    popen_env = spec.env
    if spec.keeper_mark and reap._keeper_token:
        popen_env = {**spec.env, KEEPER_ENV: reap._keeper_token}
    # preexec_fn costs ~3 ms a spawn (fork instead of vfork, Python in the child);
    # skip it when there is nothing to do between fork and exec.
    preexec = (
        _preexec(spec.pdeathsig, os.getpid(), rlimits, cgroup.procs if cgroup else None)
        if spec.pdeathsig or rlimits or cgroup
        else None
    )
    return _Command(list(spec.argv), popen_env, spec.cwd, list(spec.pass_fds), preexec)


def _popen(
    spec: ProcessSpec, command: _Command, stdin: int, stdout: int, stderr: int
) -> subprocess.Popen[bytes]:
    """Fork and exec `command` on the child's ends of the pipes; ours from the fork on."""
    try:
        # Under the lock from fork to registration: `reap_orphans` must never see this
        # child as nobody's (it may exit at once, a zombie before `Popen` returns).
        with reap._spawn_lock:
            popen = subprocess.Popen(
                command.argv,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                env=command.env,
                cwd=command.cwd,
                close_fds=True,
                pass_fds=command.pass_fds,
                start_new_session=True,
                preexec_fn=command.preexec,
            )
            _own(popen.pid)
    except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
        if spec.reaper:
            raise HostFault(f"cannot start the reaper shim ({sys.executable}): {exc}") from exc
        raise _ExecFailed(exc) from exc
    except (OSError, subprocess.SubprocessError) as exc:
        raise HostFault(f"cannot spawn {command.argv[0]}: {exc}") from exc
    return popen


def _pidfd_of(popen: subprocess.Popen[bytes]) -> int:
    """A pidfd on the child just forked; without one it is killed, reaped and disowned."""
    try:
        return os.pidfd_open(popen.pid)
    except OSError as exc:  # pragma: no cover - Linux >= 5.3 is a precondition
        popen.kill()
        popen.wait()
        _disown(popen.pid)
        raise HostFault(f"pidfd_open failed: {exc}") from exc


class _ExecFailed(Exception):
    """The user-level command could not be executed (``reaper=False`` path)."""

    def __init__(self, exc: OSError) -> None:
        super().__init__(str(exc))
        self.exc = exc
