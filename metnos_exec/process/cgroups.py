"""The cgroups of the process layer: a pids cgroup per run, the slots' long-lived pids and
memory cgroups (`metnos_exec.process.slots` lends them), and the probes that say which of
them this host allows.

Process limits: with ``pids_max`` and a writable cgroup (v1 ``pids`` controller, or a v2
tree with ``pids`` delegable), each run gets ``metnos/<worker pid>-<uuid>`` with
``pids.max`` set; the child joins it before it can fork, every pid in it is killed at the
end, and the cgroup is removed (``pids_limited=True``; under the shim the limit is
``pids_max + 1`` because the shim counts). Otherwise the fallback is RLIMIT_NPROC, and
``pids_limited=False``: that limit counts every thread of the *user* (not of the job), so
it is set to what the uid runs now plus ``pids_max`` (a fork bomb still stops, an ordinary
job still forks on a desktop with hundreds of processes), and the kernel does not enforce
it at all for uid 0.

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
The slot memory cgroups are removed at exit (`slots._remove_slot_memory`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Final

import anyio

from metnos_exec.errors import HostFault
from metnos_exec.process.spec import _KILL_WAIT_S, _READ_CHUNK

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
    "Pooled cgroups" in `metnos_exec.process.slots`) dies here at the latest. Best effort:
    rmdir may still refuse while the killed tasks exit; the next sweep gets it.
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
                # it would eat into this run's budget. `run._run_in_slot` starts a new cgroup.
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
