"""Approval gates: a staged job's changes kept in the worker's state folder until a person
(or an agent's user) approves or rejects them.

A gated job (``Job.commit = "approve"``, or its manifest's ``commit = "approve"``) runs
staged like any other; where a commit would apply its plan, `keep_gate` keeps the plan
instead: ``<state_dir>/gates/<job id>/record.json`` (the ordered ops, the host fingerprints
they expect, the originals they destroy, the change set, when the gate expires) and the
new contents as blobs in ``content/`` beside it. Files on disk, written before the
job's ``awaiting_approval`` result is stored: a worker killed while the gate waits, and a
new one started, commits exactly what was kept. The overlay itself (a tmpfs in the staging
helper's namespace) is dropped with the job's sandbox and slot.

`GateCommit.apply` commits a kept gate through the same journal and the same checks as a
commit (`metnos_exec.undo.journal.apply_ops`): the roots must be the very folders the job
ran over, and every path an op touches must still hold what the plan saw (inode, size,
times, mode). A host change to any of them since the run refuses the approval
(`CommitConflict`, every such path named) with nothing applied; a change the journal sees
half-way is rolled back. The journal names the gated job and the undo entry: once that
job's final result lists the entry the changes stand, else `Staging.recover` rolls them
back.

Rules, each against the threat it answers:

================================================  ==========================================
rule                                              threat
================================================  ==========================================
A gate is written (temp folder, rename) before    a worker killed between the two: a result
its result is stored; a gate whose job is not     awaiting a gate that was never kept, or a
awaiting approval is removed, never applied       gate committed twice
Every path is compared before the first op (all   approving changes on top of a file a
conflicts named), then again by each op           person edited since the run
Kept contents are read back by digest and size    a kept blob cut short or swapped becomes
(`BlobStore.open_checked`)                        the committed file
A gate past its expiry is discarded, never        an approval days later over a tree that
applied                                           moved on
================================================  ==========================================
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import msgspec

from ..changeset import ChangeSet
from ..errors import CommitConflict, HostFault
from ..messages import (
    Absent,
    FileState,
    Move,
    PathState,
    Put,
    UndoEntry,
    UndoOp,
    new_job_id,
    writes_content,
)
from ..private import private_dir
from .applier import BlobSource
from .blobs import BlobStore
from .change_report import change_set, host_reader, read_content
from .changes import CommitPlan, store_originals
from .folder_lock import FolderLock
from .host_tree import (
    Blocked,
    Conflict,
    Fingerprint,
    HostTree,
    conflict_message,
    same_state,
)
from .journal import JournalHandle, JournalRecord
from .order import reverse_ops
from .overlay_run import OverlayRun, StagingPieces, apply_journalled
from .rollback import rollback

__all__ = (
    "DEFAULT_APPROVAL_TTL_S",
    "GateCommit",
    "GateRecord",
    "GateStore",
    "keep_gate",
    "precheck",
)

#: How long a gate waits for an answer unless the worker is told otherwise (one day).
DEFAULT_APPROVAL_TTL_S: Final = 24 * 3600.0


class GateRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What a kept gate holds (``record.json``; see the module docstring).

    Attributes:
        job_id: the gated job.
        executor / device / queue: as the job's (the gate is settled on that device).
        group: the branch group (``Job.branch_of``, else the job's own id): approving one
            gate of a group discards the others.
        roots: the job's writable folders, with the ``(dev, ino)`` each was staged over.
        ops: the plan's ops, in apply order.
        expect: the host fingerprint of every path an op touches (``None``: absent).
        destroyed: host files the ops destroy: their fingerprint and digest.
        filtered: what the commit leaves out (as `Committed.filtered`).
        changes: the change set (``committed = False``).
        kept_at / expires_at: unix seconds.
    """

    v: int = 1
    job_id: str
    executor: str
    device: str
    queue: str = ""
    group: str
    roots: tuple[str, ...]
    found: tuple[tuple[str, int, int], ...]
    ops: tuple[UndoOp, ...]
    expect: dict[str, Fingerprint | None]
    destroyed: dict[str, tuple[Fingerprint, str]]
    filtered: tuple[tuple[str, str], ...] = ()
    changes: ChangeSet
    kept_at: float
    expires_at: float


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(GateRecord)


class GateStore:
    """The gates kept in ``<state_dir>/gates`` (one folder per gated job)."""

    def __init__(self, state_dir: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.root = Path(state_dir) / "gates"
        self.fsync = fsync
        private_dir(self.root)

    def folder(self, job_id: str) -> Path:
        if not job_id or "/" in job_id or job_id.startswith("."):
            raise ValueError(f"not a job id: {job_id!r}")
        return self.root / job_id

    def content(self, job_id: str) -> BlobStore:
        return BlobStore(self.folder(job_id) / "content", fsync=self.fsync)

    def write(self, record: GateRecord, plan: CommitPlan) -> None:
        """Keep `record` and the new contents its ops write (from `plan.source`)."""
        final = self.folder(record.job_id)
        tmp = self.root / f".{record.job_id}.{os.urandom(4).hex()}"
        private_dir(tmp)
        try:
            store = BlobStore(tmp / "content", fsync=self.fsync)
            for path, state in _written(record.ops):
                got = plan.source.fetch(path, state)
                if isinstance(got, bytes):
                    digest = store.put_bytes(got)
                else:
                    try:
                        digest, _ = store.put_fd(got)
                    finally:
                        os.close(got)
                if digest != state.sha256:
                    raise HostFault(f"the staged content of {path} changed while it was kept")
            body = tmp / "record.json"
            body.write_bytes(_encoder.encode(record))
            body.chmod(0o600)
            if self.fsync:
                with open(body, "rb") as f:
                    os.fsync(f.fileno())
            if final.exists():  # a redelivered run's gate replaces the earlier one
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def load(self, job_id: str) -> GateRecord | None:
        """The kept gate of `job_id` (``None``: none kept here)."""
        try:
            data = (self.folder(job_id) / "record.json").read_bytes()
        except (FileNotFoundError, NotADirectoryError, ValueError):
            return None
        return _decoder.decode(data)

    def remove(self, job_id: str) -> None:
        with contextlib.suppress(ValueError):
            shutil.rmtree(self.folder(job_id), ignore_errors=True)

    def records(self) -> list[GateRecord]:
        """Every gate kept here (unreadable ones are skipped; temp folders removed when
        older than a minute: a keep that died half-way)."""
        out: list[GateRecord] = []
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith("."):
                with contextlib.suppress(OSError):
                    if time.time() - entry.stat().st_mtime > 60:
                        shutil.rmtree(entry, ignore_errors=True)
                continue
            with contextlib.suppress(OSError, msgspec.DecodeError):
                out.append(_decoder.decode((entry / "record.json").read_bytes()))
        return out


def _written(ops: tuple[UndoOp, ...]) -> list[tuple[str, FileState]]:
    """``(path, FileState)`` for each new content the ops write (a move moves its file,
    a mode change keeps it: neither needs one)."""
    seen: dict[str, tuple[str, FileState]] = {}
    for op in ops:
        if isinstance(op, Put) and isinstance(op.after, FileState) and writes_content(op):
            seen.setdefault(op.after.sha256, (op.path, op.after))
    return list(seen.values())


def keep_gate(
    run: OverlayRun, gates: GateStore, *, queue: str, group: str, ttl_s: float, now: float
) -> GateRecord:
    """Plan `run`'s commit and keep it as a gate (blocking: run it in a thread).

    Raises:
        CommitConflict: the host changed a target while the job ran (as for a commit):
            nothing is kept.
    """
    if run.tmpfs_fd is None:
        raise HostFault(f"staged job {run.stage_id} was never staged, so never ran")
    tree = HostTree(run.roots)
    uppers: list[tuple[str, int]] = []
    plan: CommitPlan | None = None
    try:
        moved = run._moved_roots(tree)
        if moved:
            raise CommitConflict(conflict_message("not kept for approval", moved))
        plan = run._plan(tree, uppers)
        if plan.conflicts:
            raise CommitConflict(conflict_message("not kept for approval", plan.conflicts))
        changes = change_set(
            plan.ops,
            before=host_reader(tree),
            after=read_content(plan.source.fetch),
            committed=False,
        )
        record = GateRecord(
            job_id=run.job_id,
            executor=run.executor,
            device=run.device,
            queue=queue,
            group=group,
            roots=run.roots,
            found=run.found,
            ops=plan.ops,
            expect=dict(plan.expect),
            destroyed=dict(plan.destroyed),
            filtered=tuple(plan.filtered),
            changes=changes,
            kept_at=now,
            expires_at=now + ttl_s,
        )
        gates.write(record, plan)
        return record
    finally:
        tree.close()
        for _, fd in uppers:
            os.close(fd)
        if plan is not None:
            plan.source.close()


def _befores(ops: tuple[UndoOp, ...]) -> dict[str, PathState]:
    """What each path held when the plan was made (the first op touching it says)."""
    out: dict[str, PathState] = {}
    for op in ops:
        if isinstance(op, Move):
            out.setdefault(op.src, op.state)
            out.setdefault(op.dst, Absent())
        else:
            out.setdefault(op.path, op.before)
    return out


def precheck(
    tree: HostTree, record: GateRecord
) -> tuple[list[Conflict], dict[str, Fingerprint | None]]:
    """Every way the host moved on since the gate was kept (all of them, for the
    message), and the fingerprints the ops are then applied against.

    A root must be the very folder the job ran over. A path an op touches must hold what
    the plan saw: the same inode unchanged (fingerprint), or else the same kind, content
    (SHA-256), target and mode as planned (a roll-back of an approval cut short by a
    crash puts the originals back as new inodes); anything else is a conflict."""
    found: list[Conflict] = []
    for root, dev, ino in record.found:
        try:
            st = os.fstat(tree.dir_fd(root))
        except Blocked as exc:
            found.append(Conflict(root, str(exc)))
            continue
        if (st.st_dev, st.st_ino) != (dev, ino):
            found.append(Conflict(root, "replaced on the host since the job ran"))
    if found:
        return found, {}
    befores = _befores(record.ops)
    fresh: dict[str, Fingerprint | None] = {}
    for path, want in record.expect.items():
        tree.release()
        try:
            now = tree.lstat(path)
            got = None if now is None else Fingerprint.of(now)
            if got is not None and want is not None and stat.S_ISDIR(want.mode):
                same = (got.dev, got.ino, got.mode) == (want.dev, want.ino, want.mode)
            else:
                same = got == want
            if not same and now is not None and path in befores:
                same = same_state(tree.state_of(path, now), befores[path])
            elif not same and now is None:
                same = isinstance(befores.get(path), Absent)
        except (Blocked, OSError) as exc:
            found.append(Conflict(path, str(exc)))
            continue
        if not same:
            what = "appeared" if want is None else "was removed" if got is None else "changed"
            found.append(Conflict(path, f"{what} on the host since the job ran"))
        fresh[path] = got
    return found, fresh


@dataclass(eq=False)
class GateCommit:
    """A kept gate applied to the host, waiting for the gated job's final result to be
    stored (`settle`), as `OverlayRun` after its commit."""

    entry: UndoEntry
    record: GateRecord
    handle: JournalHandle
    tree: HostTree
    lock: FolderLock
    staging: StagingPieces

    @classmethod
    def apply(cls, staging: StagingPieces, gates: GateStore, record: GateRecord) -> GateCommit:
        """Commit `record` (blocking; the caller holds the staging's commit lock).

        Raises:
            CommitConflict: the host changed since the run (every path named); nothing
                applied.
            HostFault, OSError: the host or the state folder refused; nothing applied.
        """
        lock = FolderLock(record.roots)
        tree = HostTree(record.roots)
        try:
            conflicts, expect = precheck(tree, record)
            if conflicts:
                raise CommitConflict(conflict_message("not approved, nothing applied", conflicts))
            destroyed = {
                path: (fp, sha256)
                for path, (_, sha256) in record.destroyed.items()
                if (fp := expect.get(path)) is not None
            }
            plan = CommitPlan(ops=record.ops, expect=expect, destroyed=destroyed)
            try:
                store_originals(plan, tree, staging.store)
            except Blocked as exc:
                raise CommitConflict(f"not approved, nothing applied: {exc}") from None
            entry = staging.seal.seal(
                UndoEntry(
                    job_id=record.job_id,
                    device=record.device,
                    executor=record.executor,
                    method="staged",
                    roots=record.roots,
                    ops=reverse_ops(record.ops),
                )
            )
            handle = staging.journal.begin(
                JournalRecord(
                    id=new_job_id(),
                    job_id=record.job_id,
                    entry_id=entry.id,
                    roots=record.roots,
                    ops=record.ops,
                    device=record.device,
                )
            )
            apply_journalled(
                tree,
                record.ops,
                BlobSource(gates.content(record.job_id)),
                staging,
                plan.expect,
                handle,
                during="the approval",
            )
        except BaseException:
            tree.close()
            lock.release()
            raise
        return cls(entry, record, handle, tree, lock, staging)

    def settle(self, *, stored: bool) -> None:
        """Keep the commit (the final result is stored) or roll it back (blocking)."""
        try:
            if not stored:
                rollback(
                    self.tree, self.record.ops, store=self.staging.store, tag=self.handle.record.id
                )
        finally:
            self.handle.close()
            self.tree.close()
            self.lock.release()

    def abandon(self) -> None:
        """Whether the final result was stored is unknown: the journal stays for
        `Staging.recover`."""
        self.handle.close(remove=False)
        self.tree.close()
        self.lock.release()
