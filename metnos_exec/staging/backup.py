"""The fallback without staging: back up a job's declared targets, restore or record them.

Used when a job's writes cannot be staged (see `metnos_exec.staging`): the job writes
straight into the host folders. Before it runs, each *declared target* (a path argument
admitted by an ``fs:write`` hint) is read: a file's content goes into the blob store, a
link's target and a folder's mode are noted. After a success the targets' new states make
the undo entry (``method = "backup"``, with `BackupRun.lost` saying what it does not
cover); after a failure they are put back at once. Other files the job writes are neither
recorded nor put back: that, and an unbounded disk, is the degradation
(``sandbox.degraded``, reason ``no_staging``).
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import anyio
import anyio.to_thread
import structlog

from ..blobs import BlobStore
from ..errors import BadArguments, HostFault
from ..folder_lock import FolderLock, wait_settled
from ..journal import (
    BlobSource,
    Blocked,
    Conflict,
    HostTree,
    OpConflict,
    apply_ops,
    file_state,
    fingerprints,
    order_ops,
    reverse_ops,
    same_state,
)
from ..messages import Absent, FileState, LinkState, PathState, Put, UndoEntry, UndoOp
from ..sandbox._types import SandboxJob
from ..undo_seal import UndoSeal
from ._types import Committed
from .changes import find_moves

__all__ = ("BackupRun",)

_log = structlog.get_logger("metnos_exec")


@dataclass(eq=False)
class BackupRun:
    """A job writing straight into the host, with its declared targets backed up."""

    store: BlobStore
    job_id: str
    executor: str
    device: str
    roots: tuple[str, ...]
    job: SandboxJob
    no_staging: str | None
    targets: dict[str, PathState] = field(default_factory=dict)
    method: Literal["staged", "backup"] = "backup"
    _committed: bool = False

    @classmethod
    async def create(
        cls,
        store: BlobStore,
        job_id: str,
        executor: str,
        device: str,
        job: SandboxJob,
        roots: Sequence[str],
        targets: Sequence[str],
        why: str,
    ) -> BackupRun:
        run = cls(store, job_id, executor, device, tuple(roots), job, why)
        # Not over a half-applied commit (another job's, a predecessor's): its backups
        # would record, and its failure restore, a state that never stood.
        await anyio.to_thread.run_sync(
            functools.partial(wait_settled, run.roots), abandon_on_cancel=True
        )
        run.targets = await anyio.to_thread.run_sync(run._back_up, tuple(targets))
        return run

    @property
    def lost(self) -> str:
        return (
            f"no staging ({self.no_staging}): only the {len(self.targets)} declared target(s) "
            "were backed up (restored on failure and by undo); other writes under "
            f"{', '.join(self.roots)} are not recorded and stay after a failure, folders the "
            "job created around a target are not removed, a folder target is restored only "
            "as a folder (not its content), and the disk is not bounded"
        )

    def _back_up(self, targets: tuple[str, ...]) -> dict[str, PathState]:
        found: dict[str, PathState] = {}
        with HostTree(self.roots) as tree:
            for path in targets:
                found[path] = _backed_up_state(tree, path, self.store)
        return found

    def disk_exceeded(self) -> bool:
        return False

    async def commit(self) -> Committed:
        return await anyio.to_thread.run_sync(self._commit)

    def _commit(self) -> Committed:
        ops: list[UndoOp] = []
        deleted: dict[tuple[str, int], list[str]] = {}
        with HostTree(self.roots) as tree:
            for path, before in self.targets.items():
                after = _current(tree, path)
                if after is None or same_state(after, before):
                    continue
                ops.append(Put(path=path, before=before, after=after))
                if isinstance(after, Absent) and isinstance(before, FileState | LinkState):
                    deleted.setdefault(_key(before), []).append(path)
        self._committed = True
        if not ops:
            return Committed(None)
        forward = order_ops(find_moves(ops, deleted, dict(self.targets)))
        entry = UndoSeal.beside(self.store.root).seal(
            UndoEntry(
                job_id=self.job_id,
                device=self.device,
                executor=self.executor,
                method="backup",
                roots=self.roots,
                ops=reverse_ops(forward),
                lost=self.lost,
            )
        )
        return Committed(entry)

    async def settle(self, *, stored: bool) -> None:
        if not stored:
            await self._restore()

    async def abandon(self) -> None:
        # Nothing was applied by us (the job wrote in place): the entry, if stored, stands.
        return

    async def discard(self, *, restore: bool = True) -> None:
        """Put the declared targets back as they were (a failed, timed-out or cancelled
        job); what else it wrote stays (said in `lost`)."""
        if not self._committed:
            self._committed = True
            if restore:
                await self._restore()

    async def _restore(self) -> None:
        left = await anyio.to_thread.run_sync(self._restore_sync)
        if left:
            _log.warning(
                "undo.conflict",
                reason="backed-up targets not restored",
                paths=[str(c) for c in left[:20]],
            )

    def _restore_sync(self) -> list[Conflict]:
        # As a commit: the check and the replace one step for every committer.
        try:
            lock = FolderLock(self.roots)
        except HostFault as exc:
            return [Conflict(", ".join(self.targets), exc.message)]
        with lock, HostTree(self.roots) as tree:
            ops: list[UndoOp] = []
            for path, before in self.targets.items():
                now = _current(tree, path)
                if now is None:
                    continue
                if not same_state(now, before):
                    ops.append(Put(path=path, before=now, after=before))
            ordered = order_ops(ops)
            expect = fingerprints(tree, [op.path for op in ordered if isinstance(op, Put)])
            try:
                apply_ops(
                    tree,
                    ordered,
                    source=BlobSource(self.store),
                    store=self.store,
                    expect=expect,
                    tag=f"restore-{os.urandom(4).hex()}",
                )
            except OpConflict as exc:
                return list(exc.conflicts)
            except (OSError, Blocked) as exc:
                return [Conflict(", ".join(self.targets), str(exc))]
        return []


def _key(state: FileState | LinkState) -> tuple[str, int]:
    if isinstance(state, FileState):
        return state.sha256, state.mode
    return "link:" + state.target, -1


def _current(tree: HostTree, path: str) -> PathState | None:
    try:
        return tree.state(path)
    except Blocked:
        return None


def _backed_up_state(tree: HostTree, path: str, store: BlobStore) -> PathState:
    """The target's state, its content copied into the blob store when it is a file.

    Raises:
        BadArguments: the target cannot be backed up (below a file or a link, a FIFO, a
            socket or a device): the job's own argument, refused before it runs (it was
            a host fault, retried and dead-lettered).
    """
    try:
        st = tree.lstat(path)
    except Blocked as exc:
        raise BadArguments(
            f"declared target {path} cannot be backed up, so the job may not write it: {exc}"
        ) from None
    if st is None:
        return Absent()
    if stat.S_ISREG(st.st_mode):
        fd = tree.open_file(path, st)
        try:
            return file_state(st, *store.put_fd(fd))
        finally:
            os.close(fd)
    state = tree.state_of(path, st)
    if state is None:
        raise BadArguments(
            f"declared target {path} is a special file (a FIFO, socket or device): it cannot "
            "be backed up, so the job may not write it"
        )
    return state
