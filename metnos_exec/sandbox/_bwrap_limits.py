"""How the job's rlimits reach the bwrap arm's guest before its first instruction, with
nothing run between fork and exec in the worker (see `metnos_exec.sandbox.bwrap`).

When the worker may set every limit on bubblewrap's tree (`_can_gate`), the gate
(`_LimitGate`) does so while bubblewrap waits on ``--block-fd``, reads them back, and only
then releases it; the same gate lets the network wall attach before the guest exists.
Otherwise the guest's command runs behind a prefix that sets them and ``exec``s it
(`_limits_in_guest`: ``sh -c 'ulimit ...'`` when exact, else prlimit(1)), or, when neither
can express them, the process layer sets them before bubblewrap's exec.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import resource
import shutil
import signal
import time
from collections.abc import Awaitable, Callable

import anyio
import anyio.to_thread

from ..errors import HostFault
from .flags import SYSTEM_PATHS, prlimit_prefix, shell_limits_prefix

#: How long bubblewrap may take to reach its block fd, at least, whatever the job's
#: budget: a budget shorter than bubblewrap's own set-up (``--timeout 0.001``) is the
#: job's timeout (the gate does not release a guest whose budget is spent,
#: `_BudgetSpent`), not a host fault that would be retried to the same end on every
#: attempt.
_GATE_MIN_WAIT_S = 10.0


class _BudgetSpent(Exception):
    """The job's whole budget went by before bubblewrap reached its block fd: the gate
    killed the blocked tree instead of releasing the guest (the run is a ``Timeout``)."""


@functools.cache
def _guest_prlimit() -> str | None:
    """util-linux's prlimit, when it lives in a system tree the guest sees read-only."""
    found = shutil.which("prlimit", path="/usr/bin:/bin:/usr/sbin:/sbin")
    if found is None:
        return None
    real = os.path.realpath(found)
    if not any(real.startswith(root.rstrip("/") + "/") for root in SYSTEM_PATHS):
        return None
    return real


#: Shells whose ``ulimit`` units `shell_limits_prefix` knows (POSIX mode when run as sh).
_KNOWN_SHELLS = frozenset({"dash", "bash", "busybox"})


@functools.cache
def _guest_sh() -> str | None:
    """``/bin/sh`` resolved, when it is a shell we know and lives in a system tree."""
    real = os.path.realpath("/bin/sh")
    if os.path.basename(real) not in _KNOWN_SHELLS or not os.access(real, os.X_OK):
        return None
    if not any(real.startswith(root.rstrip("/") + "/") for root in SYSTEM_PATHS):
        return None
    return real


def _limits_in_guest(rlimits: tuple[tuple[int, int, int], ...]) -> tuple[str, ...]:
    """The command prefix that applies `rlimits` inside the sandbox (``sh``'s ``ulimit``
    when exact, else prlimit(1)), or ``()`` when the process layer must apply them before
    exec instead.

    Inside the sandbox the guest holds no capability, so it can only *lower* limits: a
    hard limit above the worker's own needs the old path (set by the worker, as root).
    """
    for res, _soft, hard in rlimits:
        ours = resource.getrlimit(res)[1]
        if ours != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > ours):
            return ()
    sh = _guest_sh()
    if sh is not None:
        prefix = shell_limits_prefix(rlimits, sh)
        if prefix is not None:
            return prefix
    prlimit = _guest_prlimit()
    return () if prlimit is None else prlimit_prefix(rlimits, prlimit)


#: CAP_SYS_RESOURCE's bit in ``CapEff``: lets us raise a hard limit above our own.
_CAP_SYS_RESOURCE = 24


@functools.cache
def _have_cap_sys_resource() -> bool:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_RESOURCE & 1)
    except (OSError, ValueError):
        pass
    return False


def _can_gate(rlimits: tuple[tuple[int, int, int], ...]) -> bool:
    """Whether the worker may set `rlimits` on the blocked sandbox with prlimit(2).

    Raising a hard limit above the one the sandbox inherited (ours) needs
    CAP_SYS_RESOURCE; without it the in-guest prefix (or the preexec path) stays.
    """
    if not rlimits:
        return False
    if _have_cap_sys_resource():
        return True
    for res, _soft, hard in rlimits:
        ours = resource.getrlimit(res)[1]
        if ours != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > ours):
            return False
    return True


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rfind(b")") + 2 :].split()[1])


def _descendants(root: int) -> set[int]:
    """`root` and its descendants, by scanning ``/proc`` (no cgroup to list them)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (ppid := _ppid(int(entry))) is not None:
            parents[int(entry)] = ppid
    tree = {root}
    grown = True
    while grown:
        grown = False
        for pid, ppid in parents.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grown = True
    return tree


class _LimitGate:
    """Applies the rlimits to bubblewrap while it waits on ``--block-fd``, then releases it.

    bubblewrap's sandbox process (pid 1 of the namespace, ``child-pid`` in the status)
    reads one byte from the block fd after pivot_root and dropping privileges, *before*
    it forks the guest. Meanwhile, on the event loop (`ProcessSpec.on_spawn`), we wait for
    ``child-pid`` on the status pipe, prlimit(2) every process of bubblewrap's tree (its
    monitor and that sandbox process), read the limits back, check the tree did not
    change, and only then write the byte: the guest is forked after, so it inherits the
    limits before its first instruction. No ``sh``/``prlimit`` exec in the guest (~0.5 ms a
    job) and still no preexec_fn. ``child-pid`` comes ~1.5 ms before the sandbox reaches
    the block fd (its mounts are built meanwhile), so the gate normally costs it no wait.

    Fail safe: anything unexpected (cancellation included) kills the whole blocked tree
    before the block fd is closed (closing it unwritten would also release the guest,
    unlimited).

    The gate owns the worker's copy of the status pipe's write end (`status_w`) and closes
    it as soon as bubblewrap has its own: end-of-file on the read end then means that
    bubblewrap exited during its set-up.

    A job run as its slot's own uid (a root worker's): prlimit(2) of another uid's process
    needs CAP_SYS_RESOURCE, which some root workers lack (a container's bounding set); the
    kernel also allows it to a caller whose *real* ids are the target's, so the calls are
    made on the slot's thread while it is that uid (`as_user`, `process.Slot.run_as`).
    """

    def __init__(
        self,
        rlimits: tuple[tuple[int, int, int], ...],
        status_r: int,
        status_w: int,
        wait_s: float,
        as_user: Callable[[Callable[[], None]], Awaitable[None]] | None = None,
        budget_s: float | None = None,
        before_release: Callable[[int], Awaitable[None]] | None = None,
    ):
        self._before_release = before_release
        self._as_user = as_user
        self._budget_s = budget_s
        self._rlimits = rlimits
        self._status_r = status_r
        self.status_w = status_w
        self._wait_s = wait_s
        #: Status bytes consumed while waiting for ``child-pid``; the rest comes later.
        self.status_head = b""
        self.block_r, self.block_w = os.pipe2(os.O_CLOEXEC)

    def close(self) -> None:
        for fd in (self.block_r, self.block_w, self.status_w):
            if fd >= 0:
                os.close(fd)
        self.block_r = self.block_w = self.status_w = -1

    async def _child_pid(self) -> int | None:
        """bubblewrap's ``child-pid``, or ``None`` when bubblewrap exited without one."""
        os.close(self.status_w)  # bubblewrap holds its own copy now
        self.status_w = -1
        os.set_blocking(self._status_r, False)
        decoder = json.JSONDecoder()
        with anyio.move_on_after(self._wait_s):
            while True:
                try:
                    chunk = os.read(self._status_r, 4096)
                except BlockingIOError:
                    await anyio.wait_readable(self._status_r)
                    continue
                if not chunk:
                    return None  # exited during set-up: the arm reports why
                self.status_head += chunk
                text = self.status_head.decode("utf-8", errors="replace").lstrip()
                with contextlib.suppress(ValueError):
                    doc, _ = decoder.raw_decode(text)
                    child = doc.get("child-pid") if isinstance(doc, dict) else None
                    if not isinstance(child, int) or child <= 0:
                        raise HostFault(f"unexpected bubblewrap status {text!r}")
                    return child
        raise HostFault("bubblewrap did not reach its block fd in time")

    def _apply(self, child: int, pid: int) -> None:
        for proc in (child, pid):
            for res, soft, hard in self._rlimits:
                resource.prlimit(proc, res, (soft, hard))
        for proc in (child, pid):
            for res, soft, hard in self._rlimits:
                if resource.prlimit(proc, res) != (soft, hard):
                    raise HostFault(f"rlimit {res} did not hold on pid {proc}")

    async def _tree(self, pid: int, members: Callable[[], list[int]] | None) -> set[int]:
        if members is not None:
            return set(members())  # one small cgroup file
        # No cgroup to list them: a scan of /proc, off the loop.
        return await anyio.to_thread.run_sync(_descendants, pid)

    async def __call__(self, pid: int, members: Callable[[], list[int]] | None) -> None:
        doomed: set[int] = {pid}  # killed if anything goes wrong
        # Called right after the spawn: the budget runs from here, as `process.run`'s.
        deadline = None if self._budget_s is None else time.monotonic() + self._budget_s
        try:
            child = await self._child_pid()
            if child is None:
                return
            doomed.add(child)
            tree = await self._tree(pid, members)
            doomed |= tree
            # Exactly bubblewrap's monitor and its sandbox process: nothing else may exist
            # (the guest is not forked yet), nothing may have left.
            if tree != {pid, child}:
                raise HostFault(f"unexpected bubblewrap tree {sorted(tree)} (want {pid}, {child})")
            try:
                if not self._rlimits:
                    pass  # a gate for the network wall only (the limits go another way)
                elif self._as_user is None:
                    self._apply(child, pid)
                else:
                    await self._as_user(functools.partial(self._apply, child, pid))
            except OSError as exc:
                raise HostFault(f"cannot set the job's rlimits on bubblewrap: {exc}") from exc
            if self._before_release is not None:
                # The network wall's listeners, in the sandbox's namespaces, before the
                # guest exists (`egress.wall.Wall.attach`).
                await self._before_release(child)
            if await self._tree(pid, members) != tree:
                raise HostFault("bubblewrap's tree changed while blocked")
            if deadline is not None and time.monotonic() >= deadline:
                # Nothing of the budget is left: the guest would be killed as it starts.
                raise _BudgetSpent
            os.write(self.block_w, b"g")
        except BaseException:
            for proc in doomed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc, signal.SIGKILL)
            raise
