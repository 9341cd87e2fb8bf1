"""The fallback without staging: back up a job's declared targets, restore or record them.

Used when a job's writes cannot be staged (see `metnos_exec.undo.staging`): the job writes
straight into the host folders. Before it runs, each *declared target* (a path argument
admitted by an ``fs:write`` hint) is read: a file's content goes into the blob store, a
link's target and a folder's mode are noted. After a success the targets' new states make
the undo entry (``method = "backup"``, with `BackupRun.lost` saying what it does not
cover); after a failure they are put back at once. Other files the job writes are neither
recorded nor put back: that, and an unbounded disk, is the degradation
(``sandbox.degraded``, reason ``no_staging``).

A ``fs:write`` hint naming one file is bound alone (bubblewrap binds that file, nothing
beside it), never staged: that file is a declared target whether or not an argument names
it (it is all the job can write there), and it is reached from its folder, which becomes
the entry's root (a root is walked as a folder; the entry's ops touch only the file).
"""

from __future__ import annotations

import functools
import os
import posixpath
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import anyio
import anyio.to_thread

from ..errors import BadArguments, CommitConflict, HostFault
from ..logs import get_logger
from ..messages import Absent, FileState, LinkState, PathState, Put, UndoEntry, UndoOp
from ..sandbox._types import SandboxJob
from ._types import Committed
from .blobs import BlobStore
from .changes import find_moves, unreadable
from .folder_lock import FolderLock, wait_settled
from .journal import (
    BlobSource,
    Blocked,
    Conflict,
    HostTree,
    OpConflict,
    apply_ops,
    conflict_message,
    file_state,
    fingerprints,
    order_ops,
    reverse_ops,
    same_state,
)
from .seal import UndoSeal

__all__ = ("BackupRun",)

_log = get_logger()


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
    #: What the job was given (a hint naming one file: that file; `roots` has its folder).
    given: tuple[str, ...] = ()
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
        files = [root for root in roots if _is_file_root(root)]
        folders = tuple(dict.fromkeys(posixpath.dirname(r) if r in files else r for r in roots))
        run = cls(store, job_id, executor, device, folders, job, why, given=tuple(roots))
        # Not over a half-applied commit (another job's, a predecessor's): its backups
        # would record, and its failure restore, a state that never stood.
        await anyio.to_thread.run_sync(
            functools.partial(wait_settled, run.roots), abandon_on_cancel=True
        )
        wanted = tuple(dict.fromkeys([*targets, *files]))
        run.targets = await anyio.to_thread.run_sync(run._back_up, wanted)
        return run

    @property
    def lost(self) -> str:
        return (
            f"no staging ({self.no_staging}): only the {len(self.targets)} declared target(s) "
            "were backed up (restored on failure and by undo); other writes under "
            f"{', '.join(self.given or self.roots)} are not recorded and stay after a failure, "
            "folders the job created around a target are not removed, a folder target is "
            "restored only "
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
                try:
                    after = _current(tree, path)
                except PermissionError as exc:
                    # The job left its target unreadable to the worker (chmod 0): its new
                    # state cannot be recorded, so the change could not be undone. The
                    # job's verdict, named (the targets are put back as for a failure).
                    raise CommitConflict(
                        conflict_message(
                            "not recorded, the declared targets are put back",
                            [
                                Conflict(
                                    path,
                                    unreadable(exc, "the job left it unreadable to the worker"),
                                )
                            ],
                        )
                    ) from None
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
            left: list[Conflict] = []
            for path, before in self.targets.items():
                try:
                    now = _current(tree, path)
                except PermissionError as exc:
                    left.append(Conflict(path, unreadable(exc, "cannot be read to put it back")))
                    continue
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
                return left + list(exc.conflicts)
            except (OSError, Blocked) as exc:
                return [*left, Conflict(", ".join(self.targets), str(exc))]
        return left


def _is_file_root(root: str) -> bool:
    """Whether a writable mount is one file (a hint naming it), not a folder."""
    try:
        return not stat.S_ISDIR(os.lstat(root).st_mode)
    except OSError:
        return False  # gone: the tree refuses it with the reason


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
        if st is not None and stat.S_ISREG(st.st_mode):
            fd = tree.open_file(path, st)
    except Blocked as exc:
        raise BadArguments(
            f"declared target {path} cannot be backed up, so the job may not write it: {exc}"
        ) from None
    except PermissionError as exc:
        # A root-owned 0600 file under an unprivileged worker: the job's own argument
        # names what cannot be kept for undo (it was a host fault, retried).
        raise BadArguments(
            f"declared target {path} cannot be read by the worker ({exc.strerror}), so it "
            "cannot be backed up and the job may not write it"
        ) from None
    if st is None:
        return Absent()
    if stat.S_ISREG(st.st_mode):
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
