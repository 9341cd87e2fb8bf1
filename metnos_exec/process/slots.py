"""Slots: pooled spawner threads, each sitting once in its own cgroups, lent to one run at
a time.

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

A root worker's slot also has its own host uid (`Slot.identity`,
`metnos_exec.identities`), taken on first use. The cgroups themselves (`_SlotCgroup`,
`_SlotMemory`) are in `metnos_exec.process.cgroups`; what a run does in a slot is
`metnos_exec.process.run._run_in_slot`.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from metnos_exec.errors import BadConfig
from metnos_exec.identities import SlotIdentity, allocate, slot_uids_unavailable, switched
from metnos_exec.process.cgroups import (
    _cgroup_parent,
    _memory_parent,
    _memory_parent_cache,
    _SlotCgroup,
    _SlotMemory,
)
from metnos_exec.process.spawn import _on_spawner, _Spawner


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
            self._unusable()
            return None
        path = parent / f"{os.getpid()}-slot-{index}"
        try:
            path.mkdir(exist_ok=True)
        except OSError:
            self._unusable()
            return None
        slot = Slot(index, _SlotCgroup(path), _slot_memory(index))
        try:
            # The one migration this thread ever makes (the costly part of cgroup joins).
            await _on_spawner(slot.cgroup.join_current_thread, slot.spawner)
        except OSError:
            with contextlib.suppress(OSError):
                path.rmdir()
            self._unusable()
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

    def _unusable(self) -> None:
        """Slots cannot work here: none is made (the index this try took is given back,
        so `_made` counts the slots that exist, every one of them lent or free)."""
        with self._lock:
            self._usable = False
            self._made -= 1

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
