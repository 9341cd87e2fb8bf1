"""A job staged in overlays: its mounts, its commit, its settlement.

The staged half of `metnos_exec.undo.staging` (`OverlayRun`): the job writes into a
copy-on-write overlay over each writable folder, on a tmpfs as large as its disk budget.
`OverlayRun.place` mounts the overlays when the bwrap arm runs the job; `commit` plans the
change set (`metnos_exec.undo.changes.plan_commit`), stores the originals as blobs, seals
the undo entry (the reverse), writes the journal and applies the changes to the real
folders, the folders' lock held (`metnos_exec.undo.folder_lock`) from the first check until
`settle` keeps or rolls back the commit; `discard` drops the overlay.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, Protocol

import anyio
import anyio.to_thread
import msgspec

from ..changeset import ChangeSet
from ..errors import CommitConflict, HostFault
from ..identities import SlotIdentity
from ..messages import UndoEntry, UndoOp
from ..sandbox import staged
from ..sandbox._types import Mount, SandboxJob
from ..sandbox.mount_sources import idmapped_clone, open_source
from ..sandbox.staged import IdmapUnavailable, StagedPlacement
from ._types import Committed
from .applier import ContentSource
from .blobs import BlobStore
from .change_report import change_set, host_reader, read_content
from .changes import CommitPlan, change_stamp, plan_commit, store_originals, unreadable
from .folder_lock import FolderLock, wait_settled
from .host_tree import Blocked, Conflict, Fingerprint, HostTree, OpConflict, conflict_message
from .journal import Journal, JournalHandle, JournalRecord, apply_ops
from .order import reverse_ops
from .overlay import HelperGone, OverlayNamespace
from .rollback import rollback
from .seal import UndoSeal

__all__ = ("DEFAULT_DISK_BYTES", "OverlayRun", "StagingPieces", "apply_journalled")

#: The disk budget of a job whose limits set none (the manifest's default, 256 MiB).
DEFAULT_DISK_BYTES: Final = 256 * 1024 * 1024
#: Inodes a staging tmpfs allows per byte of budget (a 256 MiB budget: 65,536 files).
_BYTES_PER_INODE: Final = 4096
#: A full staging tmpfs: fewer bytes than this left (a write that did not fit failed).
_FULL_SLACK_BYTES: Final = 64 * 1024


class StagingPieces(Protocol):
    """What an `OverlayRun` uses of its worker's `metnos_exec.undo.staging.Staging`."""

    store: BlobStore
    journal: Journal
    seal: UndoSeal
    state_dir: Path
    fsync: bool
    commit_lock: anyio.Lock

    async def restart(self) -> str | None: ...


def _state_fault(state_dir: Path, exc: OSError) -> OSError | HostFault:
    """The worker's own folder refused a write before the commit touched anything: a full
    disk says which folder is full (the job's own folders may have room)."""
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        return exc
    return HostFault(
        f"the worker's state folder {state_dir} is full (the originals kept "
        f"for undo, the commit journal): {exc.strerror}; nothing was applied"
    )


@dataclass(eq=False)
class OverlayRun:
    """A job staged in overlays (see the module docstring).

    Its overlays are mounted when the bwrap arm runs it (`place`, the `Stager` of
    `metnos_exec.sandbox.staged`, registered under `stage_id` until `discard`): a root
    worker's job runs as its slot's own uid, known only then, and its overlays must show
    root's files as that uid's. A worker that is not root has no slot uids: its job is
    staged at once, so a job prepared ahead needs nothing more at its run.
    """

    staging: StagingPieces
    ns: OverlayNamespace
    stage_id: str
    job_id: str
    executor: str
    device: str
    roots: tuple[str, ...]
    job: SandboxJob
    found: tuple[tuple[str, int, int], ...]
    #: The job's tmpfs (``None``: not staged yet).
    tmpfs_fd: int | None = None
    since_ns: int = 0
    method: Literal["staged", "backup"] = "staged"
    no_staging: str | None = None
    _handle: JournalHandle | None = None
    _tree: HostTree | None = None
    #: Held from the commit's first check until it is settled (`metnos_exec.undo.folder_lock`).
    _held: FolderLock | None = None
    _ops: tuple[UndoOp, ...] = ()
    _closed: bool = False

    @classmethod
    async def create(
        cls,
        staging: StagingPieces,
        ns: OverlayNamespace,
        job_id: str,
        executor: str,
        device: str,
        job: SandboxJob,
        roots: Sequence[str],
    ) -> OverlayRun:
        found: list[tuple[str, int, int]] = []
        for root in roots:
            # No symlink anywhere on the way (the helper, which mounts it, checks the
            # same way and compares the folder's identity with this one).
            fd = open_source(root)
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
            if not stat.S_ISDIR(st.st_mode):
                raise HostFault(f"writable folder {root} is no longer a plain folder")
            found.append((root, st.st_dev, st.st_ino))
        stage_id = f"{job_id}.{os.urandom(3).hex()}"
        index = {root: i for i, root in enumerate(roots)}
        mounts = tuple(
            Mount(
                host=ns.overlay_path(stage_id, index[m.host]),
                guest=m.guest,
                writable=True,
                staged=True,
            )
            if m.writable and m.host in index
            else m
            for m in job.mounts
        )
        run = cls(
            staging=staging,
            ns=ns,
            stage_id=stage_id,
            job_id=job_id,
            executor=executor,
            device=device,
            roots=tuple(roots),
            job=msgspec.structs.replace(job, mounts=mounts, stage=stage_id),
            found=tuple(found),
        )
        if os.geteuid() != 0:
            await run._stage((), (), None)
        staged.register(stage_id, run)
        return run

    async def place(
        self, identity: SlotIdentity | None, sources: Mapping[str, int]
    ) -> StagedPlacement:
        """See `metnos_exec.sandbox.staged.Stager.place`."""
        if self._closed:
            raise HostFault(f"staged job {self.stage_id} was discarded before its run")
        if self.tmpfs_fd is not None:
            if identity is not None:  # pragma: no cover - only root workers have slot uids
                raise HostFault("a job staged for the worker cannot run as a slot uid")
            return StagedPlacement(self.ns.enter(), dict(sources))
        if identity is None:
            await self._stage_once((), (), None)
            return StagedPlacement(self.ns.enter(), dict(sources))
        opened: list[int] = []
        lowers: list[int] = []
        clones: list[int] = []
        try:
            for root, dev, ino in self.found:
                # As the arm opens every other source: no symlink on the way, and the very
                # folder checked when the job was prepared.
                try:
                    opened.append(open_source(root))
                except OSError as exc:
                    raise HostFault(f"cannot open writable folder {root}: {exc}") from exc
                st = os.fstat(opened[-1])
                if (st.st_dev, st.st_ino) != (dev, ino):
                    raise HostFault(f"writable folder {root} changed before the job ran")
            try:
                for (root, _, _), fd in zip(self.found, opened, strict=True):
                    # Only the folder's own mount: overlayfs shows no mounts below it.
                    lowers.append(
                        idmapped_clone(fd, identity.userns_fd, recursive=False, what=root)
                    )
                for path, fd in sources.items():
                    clones.append(idmapped_clone(fd, identity.userns_fd, what=path))
            except OSError as exc:
                raise IdmapUnavailable(exc.errno, str(exc)) from exc
            attached = await self._stage_once(lowers, clones, identity.gid)
        finally:
            # The helper holds what it attached; a clone not attached unmounts here.
            for fd in (*opened, *lowers, *clones):
                os.close(fd)
        return StagedPlacement(
            self.ns.enter(identity.uid, identity.gid),
            dict(zip(sources, attached, strict=True)),
            uid=identity.uid,
            owned=list(attached),
        )

    async def _stage_once(
        self, lowers: Sequence[int], sources: Sequence[int], gid: int | None
    ) -> list[int]:
        """`_stage`, with one new helper when the last one died since the job was
        prepared (its namespace, and bubblewrap's way in, are the new one's)."""
        try:
            return await self._stage(lowers, sources, gid)
        except HelperGone:
            why = await self.staging.restart()
            if why is not None:
                raise HostFault(f"the staging helper died and cannot be restarted: {why}") from None
            return await self._stage(lowers, sources, gid)

    async def _stage(
        self, lowers: Sequence[int], sources: Sequence[int], gid: int | None
    ) -> list[int]:
        # Never over a folder another commit (this worker's, another's, a redelivered
        # job's predecessor's) has half applied or may still roll back: the job would
        # start from, and commit on top of, a tree that is neither before nor after.
        await anyio.to_thread.run_sync(
            functools.partial(wait_settled, self.roots), abandon_on_cancel=True
        )
        size = self.job.limits.disk_bytes or DEFAULT_DISK_BYTES
        fd, attached = await self.ns.stage(
            self.stage_id,
            list(self.found),
            size=size,
            inodes=max(1024, size // _BYTES_PER_INODE),
            lowers=lowers,
            sources=sources,
            gid=gid,
        )
        try:
            self.since_ns = change_stamp(fd)
        except OSError:
            os.close(fd)
            for other in attached:
                os.close(other)
            self.ns.release(self.stage_id)
            raise
        self.tmpfs_fd = fd
        return attached

    def disk_exceeded(self) -> bool:
        if self.tmpfs_fd is None:
            return False  # never ran: it wrote nothing
        st = os.statvfs(f"/proc/self/fd/{self.tmpfs_fd}")
        return st.f_bavail * st.f_frsize < _FULL_SLACK_BYTES or st.f_favail == 0

    async def commit(self) -> Committed:
        """Apply the staged changes to the host (in a thread); see the module docstring.

        Raises:
            CommitConflict: the host changed a target while the job ran; nothing applied.
        """
        async with self.staging.commit_lock:
            return await anyio.to_thread.run_sync(self._commit)

    def _commit(self) -> Committed:
        if self.tmpfs_fd is None:
            raise HostFault(f"staged job {self.stage_id} was never staged, so never ran")
        # From the first check to the settlement: the check and the replace are one step
        # for every committer of these folders, in any process.
        lock = FolderLock(self.roots)
        try:
            committed = self._commit_locked()
        except BaseException:
            lock.release()
            raise
        if self._handle is None:
            lock.release()  # nothing applied: nothing to settle
        else:
            self._held = lock
        return committed

    def _commit_locked(self) -> Committed:
        assert self.tmpfs_fd is not None
        tree = HostTree(self.roots)
        uppers: list[tuple[str, int]] = []
        plan: CommitPlan | None = None
        try:
            moved = self._moved_roots(tree)
            if moved:
                raise CommitConflict(conflict_message("not committed, nothing applied", moved))
            plan = self._plan(tree, uppers)
            if plan.conflicts:
                raise CommitConflict(
                    conflict_message("not committed, nothing applied", plan.conflicts)
                )
            if not plan.ops:
                tree.close()
                return Committed(None, tuple(plan.filtered), ChangeSet())
            changes = change_set(
                plan.ops, before=host_reader(tree), after=read_content(plan.source.fetch)
            )
            entry = self._keep_originals(plan, tree)
            handle = self._begin_journal(entry, plan)
            apply_journalled(
                tree, plan.ops, plan.source, self.staging, plan.expect, handle, during="the commit"
            )
            self._handle, self._tree, self._ops = handle, tree, plan.ops
            return Committed(entry, tuple(plan.filtered), changes)
        except BaseException:
            if self._tree is None:
                tree.close()
            raise
        finally:
            for _, fd in uppers:
                os.close(fd)
            if plan is not None:
                plan.source.close()

    def _plan(self, tree: HostTree, uppers: list[tuple[str, int]]) -> CommitPlan:
        """Open each root's upper folder (into `uppers`, closed by the caller) and plan the
        commit from them."""
        assert self.tmpfs_fd is not None
        try:
            for i, root in enumerate(self.roots):
                uppers.append(
                    (
                        root,
                        os.open(
                            f"u{i}",
                            os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                            dir_fd=self.tmpfs_fd,
                        ),
                    )
                )
            return plan_commit(
                tree,
                uppers,
                since_ns=self.since_ns,
                xattr_prefix=self.ns.xattr_prefix,
                max_bytes=self.job.limits.disk_bytes or DEFAULT_DISK_BYTES,
            )
        except PermissionError as exc:
            # Planning reads only the job's folders and its staged layer: what the
            # worker may not read there is the job's doing (a root it closed), and the
            # planner names the paths it can; never retried as a host fault.
            where = self.roots[len(uppers)] if len(uppers) < len(self.roots) else None
            raise CommitConflict(
                conflict_message(
                    "not committed, nothing applied",
                    [
                        Conflict(
                            where or ", ".join(self.roots),
                            unreadable(exc, "the worker cannot read the job's changes here"),
                        )
                    ],
                )
            ) from None

    def _keep_originals(self, plan: CommitPlan, tree: HostTree) -> UndoEntry:
        """Store the originals the plan destroys; the sealed undo entry (the reverse)."""
        staging = self.staging
        try:
            store_originals(plan, tree, staging.store)
        except Blocked as exc:
            raise CommitConflict(str(exc)) from None
        except OSError as exc:
            raise _state_fault(staging.state_dir, exc) from None
        return staging.seal.seal(
            UndoEntry(
                job_id=self.job_id,
                device=self.device,
                executor=self.executor,
                method="staged",
                roots=self.roots,
                ops=reverse_ops(plan.ops),
            )
        )

    def _begin_journal(self, entry: UndoEntry, plan: CommitPlan) -> JournalHandle:
        try:
            return self.staging.journal.begin(
                JournalRecord(
                    job_id=self.job_id,
                    entry_id=entry.id,
                    roots=self.roots,
                    ops=plan.ops,
                    device=self.device,
                )
            )
        except OSError as exc:
            raise _state_fault(self.staging.state_dir, exc) from None

    def _moved_roots(self, tree: HostTree) -> list[Conflict]:
        """The roots that are no longer the folders the job was staged over: reached
        through a symlink now (a parent swapped by another job's commit), gone, or another
        folder. The commit would write there, outside what the job was given."""
        moved: list[Conflict] = []
        for root, dev, ino in self.found:
            try:
                st = os.fstat(tree.dir_fd(root))
            except Blocked as exc:
                moved.append(Conflict(root, str(exc)))
                continue
            if (st.st_dev, st.st_ino) != (dev, ino):
                moved.append(Conflict(root, "replaced on the host while the job ran"))
        return moved

    async def settle(self, *, stored: bool) -> None:
        """Keep the commit (its result is stored) or roll it back (it is not)."""
        handle, tree, ops, lock = self._handle, self._tree, self._ops, self._held
        self._handle, self._tree, self._held = None, None, None
        try:
            if handle is not None and not stored and tree is not None:
                await anyio.to_thread.run_sync(
                    lambda: rollback(tree, ops, store=self.staging.store, tag=handle.record.id)
                )
        finally:
            if handle is not None:
                handle.close()
            if tree is not None:
                tree.close()
            if lock is not None:
                lock.release()
            await self.discard()

    async def abandon(self) -> None:
        handle, tree, lock = self._handle, self._tree, self._held
        self._handle, self._tree, self._held = None, None, None
        if handle is not None:
            handle.close(remove=False)
        if tree is not None:
            tree.close()
        if lock is not None:
            lock.release()  # the journal's recovery (any worker's) takes it in turn
        await self.discard()

    async def discard(self, *, restore: bool = True) -> None:
        """Drop the staged writes (idempotent)."""
        if self._held is not None:  # committed, never settled: the journal decides
            self._held.release()
            self._held = None
        if self._closed:
            return
        self._closed = True
        staged.unregister(self.stage_id)
        if self.tmpfs_fd is not None:
            os.close(self.tmpfs_fd)
            self.tmpfs_fd = None
        # Also when never staged: a request the helper got but whose answer was lost.
        self.ns.release(self.stage_id)


def apply_journalled(
    tree: HostTree,
    ops: Sequence[UndoOp],
    source: ContentSource,
    staging: StagingPieces,
    expect: dict[str, Fingerprint | None],
    handle: JournalHandle,
    *,
    during: str,
) -> None:
    """Apply a commit's ops under its journal record (a job's commit, an approval's);
    on a failure the journal goes (nothing stays applied).

    Raises:
        CommitConflict: a target changed on the host meanwhile (`during` says when).
    """
    try:
        apply_ops(
            tree,
            ops,
            source=source,
            store=staging.store,
            expect=expect,
            tag=handle.record.id,
            fsync=staging.fsync,
        )
    except OpConflict as exc:
        handle.close()
        raise CommitConflict(
            conflict_message(f"changed on the host during {during}", exc.conflicts)
        ) from None
    except BaseException:
        handle.close()
        raise
