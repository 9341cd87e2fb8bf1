"""The reaper shim: a tiny stdlib-only parent for one job's whole process tree.

`metnos_exec.process` runs a target as ``python -I -S _reaper.py CONFIG_FD -- argv...``
when the caller asks for tree containment without a kernel wall of its own (the direct
arm). This file is executed by path, never imported by the shim run, so it may only use
the standard library; the worker imports it only for `descendants`.

What the shim does, in order:

1. Blocks SIGTERM/SIGINT/SIGHUP/SIGCHLD and waits for them with ``sigwaitinfo`` (no
   handlers, so no signal can interrupt it half-way through a step).
2. Asks for PR_SET_PDEATHSIG(SIGTERM) on itself, then checks that its parent is still the
   worker: if the worker died before the prctl, no signal would ever come.
3. Becomes a *child subreaper* (PR_SET_CHILD_SUBREAPER): a grandchild that double-forks
   and calls ``setsid`` escapes the process group, but not the ppid chain; it is re-parented
   to the shim and stays findable as a descendant.
4. Joins the run's cgroup, if one was made (before any fork, so no descendant escapes it).
5. Forks the target: in the child, signals unblocked and restored to their defaults
   (Python ignores SIGPIPE and SIGXFSZ, and ignored dispositions survive exec), rlimits
   applied, PR_SET_PDEATHSIG(SIGKILL) towards the shim, then ``execvpe`` with the job's
   own environment (the shim's may carry Python's locale coercion). Exec failures are
   reported on a close-on-exec pipe and become exit 127 (not found) or 126 (other).
6. Waits. When the target exits, every remaining descendant is SIGKILLed at once: nothing
   outlives the job. On SIGTERM (the worker's timeout, or the worker dying through the
   parent-death signal), every descendant gets SIGTERM, then SIGKILL after ``grace``.
7. Reports the tree's usage (``RUSAGE_CHILDREN``: the target and every orphan it reaped,
   not the shim itself) on the status fd and exits with the target's status. A target
   killed by signal N makes the shim die of signal N too, so the worker's ``wait4`` sees
   an honest status.

Status lines on the status fd (one per line, ASCII):
``X <errno> <text>`` the target could not be executed; ``H <text>`` the shim itself could
not set up (a host fault); ``U <utime_s> <stime_s> <maxrss_kib>`` the tree's usage.

Limits (stated plainly): a descendant that is SIGKILLed in the instant between our /proc
scan and our kill could have its pid reused by an unrelated process; the loop is bounded by
how fast the tree can fork, which a cgroup ``pids.max`` caps. If the shim itself is
SIGKILLed (never by us before it had its chance), the target still dies through its own
parent-death signal, but a grandchild that escaped with ``setsid`` would survive.
"""

from __future__ import annotations

import ctypes
import errno
import marshal
import os
import resource
import signal
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:  # the shim imports only what it runs (no typing, no collections)
    from collections.abc import Callable

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

#: Exit status when the shim could not set itself up; the status fd says why.
SETUP_FAILED = 125


def _prctl() -> Callable[..., int]:
    """libc's ``prctl``, its arguments typed (an undeclared int goes in as a C ``int``;
    prctl's are unsigned longs). This file is run by path: `metnos_exec._libc` is out of
    reach."""
    ulong = ctypes.c_ulong
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ulong, ulong, ulong, ulong, use_errno=True)
    return proto(("prctl", ctypes.CDLL(None, use_errno=True)))


_WATCHED = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD}
_TERMINATING = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


def descendants(root: int) -> list[int]:
    """Live (non-zombie) descendants of `root`, found by walking ppid links in /proc."""
    children: dict[int, list[int]] = {}
    zombies: set[int] = set()
    try:
        entries = os.listdir("/proc")
    except OSError:  # pragma: no cover - /proc is a precondition of the whole design
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited while we looked
        # The command name may contain spaces and parens; fields resume after the last ')'.
        fields = stat[stat.rfind(b")") + 2 :].split()
        pid = int(entry)
        if fields[0] == b"Z":
            zombies.add(pid)
        children.setdefault(int(fields[1]), []).append(pid)
    found: list[int] = []
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in zombies:
                found.append(child)
            stack.append(child)
    return found


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        # Not contextlib.suppress: importing contextlib costs the shim's start-up.
        try:  # noqa: SIM105
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _reap_all(target: int, status: list[int]) -> None:
    """Reap every exited child without blocking; record the target's raw status."""
    while True:
        try:
            pid, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid == target:
            status.append(raw)


def _kill_tree(me: int, target: int, status: list[int]) -> None:
    """SIGKILL every descendant until none is left, reaping as we go."""
    while True:
        left = descendants(me)
        if not left:
            break
        _signal_all(left, signal.SIGKILL)
        _reap_all(target, status)
        # Killed processes need a moment to become zombies; wait for one to do so.
        if descendants(me):
            signal.sigtimedwait({signal.SIGCHLD}, 0.01)
    _reap_all(target, status)


def _exec_target(
    argv: list[str],
    env: dict[str, str],
    cfg: dict[str, object],
    report: int,
    prctl: Callable[..., int],
) -> None:
    """Child side of the fork: never returns."""
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        rlimits = cfg.get("rlimits")
        assert isinstance(rlimits, list)
        for res, soft, hard in rlimits:
            resource.setrlimit(res, (soft, hard))
        cwd = cfg.get("cwd")
        if isinstance(cwd, str):
            try:
                os.chdir(cwd)
            except OSError as exc:
                os.write(
                    report,
                    f"X {exc.errno} cannot change directory to {cwd}: {exc.strerror}".encode(),
                )
                os._exit(127 if exc.errno == errno.ENOENT else 126)
        try:
            os.execvpe(argv[0], argv, env)
        except OSError as exc:
            os.write(report, f"X {exc.errno} cannot execute {argv[0]}: {exc.strerror}".encode())
            os._exit(127 if exc.errno == errno.ENOENT else 126)
    except BaseException as exc:  # the child must never return into the shim's loop
        try:
            os.write(report, f"H child set-up failed: {exc!r}".encode())
        finally:
            os._exit(SETUP_FAILED)


def _die_like(raw: int) -> None:
    """Exit with the target's raw wait status, re-raising its fatal signal if it had one."""
    if os.WIFSIGNALED(raw):
        sig = os.WTERMSIG(raw)
        # A core dump of the shim would say nothing and litter the cwd.
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those cannot be (re)set
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # only reached for a signal whose default is not fatal
    os._exit(os.waitstatus_to_exitcode(raw) if os.WIFEXITED(raw) else SETUP_FAILED)


def main(argv: list[str]) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, _WATCHED)
    with os.fdopen(int(argv[1]), "rb") as f:
        # marshal, not json: builtin, so the shim starts ~10 ms faster; the worker that
        # wrote it runs this very interpreter, so the format always matches.
        cfg = marshal.loads(f.read())
    status_fd = int(cfg["status_fd"])
    os.set_inheritable(status_fd, False)
    target_argv = argv[3:]  # argv[2] is "--"
    env = cfg["env"]
    grace = float(cfg["grace"])

    def fault(text: str) -> None:
        os.write(status_fd, f"H {text}\n".encode())
        os._exit(SETUP_FAILED)

    prctl = _prctl()
    if cfg["pdeathsig"]:
        if prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            fault(f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
        if os.getppid() != cfg["parent"]:
            os._exit(SETUP_FAILED)  # the worker is already gone: nobody wants this job
    if prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        fault(f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(ctypes.get_errno())}")
    cgroup_procs = cfg.get("cgroup_procs")
    if cgroup_procs:
        try:
            fd = os.open(cgroup_procs, os.O_WRONLY)
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)
        except OSError as exc:
            fault(f"cannot join cgroup {cgroup_procs}: {exc}")

    report_r, report_w = os.pipe()  # both close-on-exec (PEP 446)
    try:
        target = os.fork()
    except OSError as exc:
        fault(f"fork failed: {exc}")
        raise  # unreachable; keeps type checkers calm
    if target == 0:
        os.close(report_r)
        _exec_target(target_argv, env, cfg, report_w, prctl)
    os.close(report_w)
    with os.fdopen(report_r, "rb") as f:
        exec_report = f.read()  # EOF as soon as exec succeeds (or the child exits)
    if exec_report:
        os.write(status_fd, exec_report + b"\n")

    me = os.getpid()
    status: list[int] = []
    term_deadline: float | None = None
    while True:
        info: signal.struct_siginfo | None
        if term_deadline is None:
            info = signal.sigwaitinfo(_WATCHED)
        else:
            left = term_deadline - time.monotonic()
            info = signal.sigtimedwait(_WATCHED, left) if left > 0 else None
        if info is None:
            break  # grace is over
        if info.si_signo == signal.SIGCHLD:
            _reap_all(target, status)
            if term_deadline is None:
                if status:
                    break  # the target is done; its leftovers die without grace
            elif not descendants(me):
                break
        elif term_deadline is None:
            _signal_all(descendants(me), signal.SIGTERM)
            term_deadline = time.monotonic() + grace
    _kill_tree(me, target, status)

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    os.write(status_fd, f"U {usage.ru_utime} {usage.ru_stime} {usage.ru_maxrss}\n".encode())
    _die_like(status[0] if status else signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv)
