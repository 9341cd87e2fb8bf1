"""Undo: put a job's files back exactly as it found them, and be undoable in turn.

An undo is a job on the queue (``executor = "metnos:undo"``, ``args = {"job_id": X}``,
``device`` = the device that made X's changes, so it runs there and nowhere else). The
worker that leases it:

1. finds X's entries (`entries_to_undo`): X's result must be ``succeeded`` and list them
   in ``undo_ids``; each must be X's own (its ``job_id``), made on this device, and not
   undone already (an entry undone by an undo job Y stays undone while Y's own entry is
   not undone in turn: so "undo the undo" brings X's result back, and X can then be
   undone again). The broker's word on that (``undone_by``) can only refuse: before
   reading the disk, `apply_undo` checks each entry's seal and its job, and asks the
   device's own ledger (`metnos_exec.undo.seal.UndoLedger`), which a rewritten broker
   cannot reset;
2. checks every path against what X left there (`check_ops`): content by SHA-256, kind,
   link target, mode; a folder X created must hold nothing X did not put there; below a
   file or link that X made of a folder nothing is looked for (the undo makes the folder
   again first). Any difference refuses the undo with ``E_UNDO_CONFLICT`` naming the
   files, and nothing changes (an original missing from the blob store:
   ``E_UNDO_UNAVAILABLE``);
3. stores what the undo destroys (X's results) as blobs, writes the commit journal and
   applies the ops (`apply_undo`, with `metnos_exec.undo.journal`'s rules: a crash at any step
   is rolled back by the next start). What it replaces is recorded as found (mtime and
   owner too), so a roll-back of the undo, and the undo of the undo, put it back exactly;
4. records its own entry, the *redo* (the same ops reversed, ``reverses`` = X's entry),
   marks X's entries as undone by it (in the ledger before the first op, in the broker
   after), and acks its result; ``undo.applied`` is logged.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..brokers.base import Broker
from ..errors import UndoConflict, UndoUnavailable
from ..messages import (
    UNDO_EXECUTOR,
    Absent,
    DirState,
    FileState,
    Move,
    PathState,
    Put,
    UndoEntry,
    UndoOp,
    writes_content,
)
from .blobs import BlobStore
from .journal import (
    BlobSource,
    Blocked,
    Conflict,
    Fingerprint,
    HostTree,
    Journal,
    JournalHandle,
    JournalRecord,
    OpConflict,
    apply_ops,
    below_no_folder,
    conflict_message,
    order_ops,
    reverse_ops,
    same_state,
)
from .seal import UndoClaim, UndoLedger, UndoSeal

__all__ = (
    "AppliedUndo",
    "apply_undo",
    "check_ops",
    "entries_to_undo",
    "missing_blobs",
    "undo_job_args",
)

#: How deep an undo-of-an-undo chain is followed before giving up (a loop in the store).
_MAX_CHAIN = 64


def undo_job_args(job_id: str) -> dict[str, str]:
    """The arguments of the undo job for `job_id`."""
    return {"job_id": job_id}


async def _stands(broker: Broker, undo_job_id: str, depth: int = 0) -> bool:
    """Whether undo job `undo_job_id`'s effect stands: it succeeded, and its own entries
    were not undone (by an undo that stands) since."""
    if depth > _MAX_CHAIN:
        return True
    result = await broker.get_result(undo_job_id)
    if result is None or result.status != "succeeded":
        return False
    for record in await broker.get_undo(result.undo_ids):
        if record.undone_by is not None and await _stands(broker, record.undone_by, depth + 1):
            return False
    return True


async def entries_to_undo(broker: Broker, job_id: str, *, device: str) -> list[UndoEntry]:
    """The entries that undo `job_id` on `device` (see the module docstring).

    Raises:
        UndoUnavailable: nothing to undo here, with the reason.
    """
    result = await broker.get_result(job_id)
    if result is None:
        raise UndoUnavailable(f"job {job_id} has no result (unknown, not finished, or purged)")
    if result.status != "succeeded" or not result.undo_ids:
        raise UndoUnavailable(
            f"job {job_id} recorded no file changes (status {result.status}, no undo entry)"
        )
    records = await broker.get_undo(result.undo_ids)
    if len(records) != len(result.undo_ids):
        raise UndoUnavailable(f"the undo entries of job {job_id} are gone (purged)")
    for record in records:
        if record.entry.job_id != job_id:
            # Sealed, but another job's: a result pointed at it in the store.
            raise UndoUnavailable(
                f"undo entry {record.entry.id} listed by job {job_id}'s result belongs to job "
                f"{record.entry.job_id} (altered in the broker?); nothing was changed"
            )
        if record.entry.device != device:
            raise UndoUnavailable(
                f"job {job_id} changed files on device {record.entry.device!r}; its undo runs "
                f"there, not on {device!r}"
            )
        if record.undone_by is not None and await _stands(broker, record.undone_by):
            raise UndoUnavailable(
                f"job {job_id} was already undone by job {record.undone_by}; undo that job to "
                "bring its changes back"
            )
    return [record.entry for record in records]


def check_ops(
    tree: HostTree, ops: Sequence[UndoOp], found: dict[str, PathState] | None = None
) -> tuple[dict[str, Fingerprint | None], list[Conflict]]:
    """Compare the host with what `ops` expect to find (their ``before``).

    A path the ops find absent below one they find as a file or a symlink (a folder the
    job replaced, which the ops make again) is not looked at: nothing can be there.

    Args:
        found: filled with what each path checked holds (its mtime and owner too).

    Returns:
        The fingerprints to hold the host to while applying, and the conflicts.
    """
    expect: dict[str, Fingerprint | None] = {}
    conflicts: list[Conflict] = []
    removed = {op.path for op in ops if isinstance(op, Put) and isinstance(op.after, Absent)} | {
        op.src for op in ops if isinstance(op, Move)
    }
    first: dict[str, PathState] = {}
    for op in ops:
        for path, state in _wanted(op):
            first.setdefault(path, state)
    seen: set[str] = set()
    for op in ops:
        for path, state in _wanted(op):
            if path in seen:
                continue  # an earlier op takes it from here
            seen.add(path)
            if isinstance(state, Absent) and below_no_folder(path, first):
                continue
            try:
                st = tree.lstat(path)
                current = tree.state(path) if st is not None else Absent()
            except (Blocked, OSError) as exc:
                conflicts.append(Conflict(path, f"cannot be read: {exc}"))
                continue
            if not same_state(current, state):
                conflicts.append(Conflict(path, _difference(current, state)))
                continue
            if found is not None and current is not None:
                found[path] = current
            expect[path] = None if st is None else Fingerprint.of(st)
            if isinstance(state, DirState) and isinstance(op, Put) and isinstance(op.after, Absent):
                extra = sorted(
                    name
                    for name in os.listdir(tree.dir_fd(path))
                    if f"{path.rstrip('/')}/{name}" not in removed
                )
                if extra:
                    conflicts.append(
                        Conflict(path, f"folder holds entries made since: {', '.join(extra[:5])}")
                    )
    return expect, conflicts


def _wanted(op: UndoOp) -> list[tuple[str, PathState]]:
    """The paths `op` touches, with what it expects to find there."""
    if isinstance(op, Move):
        return [(op.src, op.state), (op.dst, Absent())]
    return [(op.path, op.before)]


def missing_blobs(ops: Sequence[UndoOp], store: BlobStore) -> list[Conflict]:
    """Paths whose original content `ops` restore from a blob this store lacks."""
    return [
        Conflict(
            op.path,
            f"its original (blob {op.after.sha256[:12]}) is not in {store.root}, or has the "
            "wrong size",
        )
        for op in ops
        if isinstance(op, Put)
        and isinstance(op.after, FileState)
        and writes_content(op)
        and not store.has(op.after.sha256, size=op.after.size)
    ]


def _difference(current: object, expected: object) -> str:
    def kind(state: object) -> str:
        return {
            "Absent": "nothing",
            "FileState": "a file",
            "LinkState": "a symlink",
            "DirState": "a folder",
        }.get(type(state).__name__, "a special file")

    if current is None:
        return "is now a special file"
    if type(current) is not type(expected):
        return f"is now {kind(current)}, was {kind(expected)}"
    if isinstance(current, FileState) and isinstance(expected, FileState):
        if current.sha256 != expected.sha256:
            return "content changed since"
        return f"mode changed since ({expected.mode:o} -> {current.mode:o})"
    return "changed since"


@dataclass
class AppliedUndo:
    """An undo applied on the host, waiting for its result to be stored (`settle`)."""

    redo: UndoEntry
    undone: tuple[UndoEntry, ...]
    handle: JournalHandle
    tree: HostTree
    ops: tuple[UndoOp, ...]
    store: BlobStore
    claim: UndoClaim

    def settle(self, *, stored: bool) -> list[Conflict]:
        """Keep (the result is stored) or roll back; returns paths a roll-back left."""
        from .journal import rollback

        left: list[Conflict] = []
        try:
            if not stored:
                left = rollback(self.tree, self.ops, store=self.store, tag=self.handle.record.id)
                self.claim.release()
            else:
                self.claim.keep()
        finally:
            self.handle.close()
            self.tree.close()
        return left


def apply_undo(
    entries: Sequence[UndoEntry],
    *,
    job_id: str,
    undo_job_id: str,
    device: str,
    store: BlobStore,
    journal: Journal,
    fsync: bool = False,
) -> AppliedUndo:
    """Check and apply `entries`, job `job_id`'s (blocking; run it in a thread).

    Raises:
        UndoConflict: the host changed since the job; nothing was changed.
        UndoUnavailable: an entry has no valid seal of this device (`undo_seal`), is not
            `job_id`'s or not this device's, is undone already (the device's ledger), or
            an original to restore is not in `store`; nothing was changed.
        HostFault: the device's undo key or ledger cannot be read.
    """
    seal = UndoSeal.beside(store.root)
    _refuse_forged(entries, seal, job_id=job_id, device=device, store=store)
    ledger = UndoLedger.beside(store.root)
    _refuse_undone(entries, ledger, job_id=job_id, undo_job_id=undo_job_id)
    ops = order_ops(op for entry in entries for op in entry.ops)
    roots = tuple(dict.fromkeys(root for entry in entries for root in entry.roots))
    missing = missing_blobs(ops, store)
    if missing:
        raise UndoUnavailable(
            conflict_message(
                "the originals are not in this worker's blob store (pruned, or kept by a "
                "worker on another machine: give the device's workers one blob folder)",
                missing,
            )
        )
    tree = HostTree(roots)
    try:
        found: dict[str, PathState] = {}
        expect, conflicts = check_ops(tree, ops, found)
        if conflicts:
            raise UndoConflict(_conflict_text(entries[0].job_id, conflicts))
        # What the undo replaces, as it is (its mtime and owner, which the entry may not
        # hold: a commit stamps its files as it writes them): a roll-back of the undo, and
        # the redo, put that back exactly.
        ops = tuple(_as_found(op, found) for op in ops)
        _keep_destroyed(tree, ops, store)
        redo = seal.seal(
            UndoEntry(
                job_id=undo_job_id,
                device=device,
                executor=UNDO_EXECUTOR,
                method=entries[0].method,
                roots=roots,
                ops=reverse_ops(ops),
                reverses=entries[0].id,
                lost=entries[0].lost,
            )
        )
        # Marked undone before the first op: a crash from here on leaves it marked (the
        # journal's recovery settles it, `Staging.recover`), never replayable.
        handle, claim = claim_and_apply(
            tree,
            ops,
            ledger=ledger,
            journal=journal,
            claimed=entries,
            undo_job_id=undo_job_id,
            redo=redo,
            roots=roots,
            device=device,
            store=store,
            expect=expect,
            fsync=fsync,
            job_id=entries[0].job_id,
        )
    except BaseException:
        tree.close()
        raise
    return AppliedUndo(redo, tuple(entries), handle, tree, ops, store, claim)


def _refuse_forged(
    entries: Sequence[UndoEntry], seal: UndoSeal, *, job_id: str, device: str, store: BlobStore
) -> None:
    """Refuse entries without a valid seal of this device for `job_id` (`UndoUnavailable`)."""
    forged = [
        entry.id
        for entry in entries
        if not seal.holds(entry) or entry.job_id != job_id or entry.device != device
    ]
    if forged:
        # Before anything is read on disk: its roots and ops are nobody's word. The seal
        # covers job_id and device: a genuine entry of another job (or device) is one the
        # broker's result for `job_id` should not list.
        raise UndoUnavailable(
            f"undo entry {', '.join(forged)} listed for job {job_id} has no valid seal of "
            f"this device for that job: it was not recorded by a worker sharing this blob "
            f"store ({store.root}) for job {job_id} on device {device!r}, or it was altered "
            "in the broker since; nothing was changed"
        )


def _refuse_undone(
    entries: Sequence[UndoEntry], ledger: UndoLedger, *, job_id: str, undo_job_id: str
) -> None:
    """Refuse entries the device's ledger says another undo job undid (`UndoUnavailable`)."""
    for entry in entries:
        mark = ledger.undone_by(entry.id)
        if mark is not None and mark.undo_job != undo_job_id:
            # The broker said it was not (its mark reset?): the device's record says it was.
            raise UndoUnavailable(
                f"job {job_id} was already undone by job {mark.undo_job} on this device "
                f"(recorded in {ledger.folder}); undo that job to bring its changes back"
            )


def _keep_destroyed(tree: HostTree, ops: Sequence[UndoOp], store: BlobStore) -> None:
    """What the undo destroys (the job's results) is kept, for the redo."""
    for op in ops:
        if isinstance(op, Put) and isinstance(op.before, FileState):
            if isinstance(op.after, FileState) and op.after.sha256 == op.before.sha256:
                continue
            fd = tree.open_file(op.path)
            try:
                store.put_fd(fd)
            finally:
                os.close(fd)


def claim_and_apply(
    tree: HostTree,
    ops: Sequence[UndoOp],
    *,
    ledger: UndoLedger,
    journal: Journal,
    claimed: Sequence[UndoEntry],
    undo_job_id: str,
    redo: UndoEntry,
    roots: tuple[str, ...],
    device: str,
    store: BlobStore,
    expect: dict[str, Fingerprint | None],
    fsync: bool,
    job_id: str,
) -> tuple[JournalHandle, UndoClaim]:
    """Mark `claimed` undone by `redo` in the device's ledger, journal `ops` and apply
    them (an undo's, a checkpoint restore's); on a failure the claim and the journal go
    (nothing stays applied).

    Raises:
        UndoConflict: a target changed meanwhile (`job_id` is the job named).
    """
    claim = ledger.claim(claimed, undo_job=undo_job_id, redo=redo.id)
    try:
        handle = journal.begin(
            JournalRecord(
                job_id=undo_job_id, entry_id=redo.id, roots=roots, ops=tuple(ops), device=device
            )
        )
    except BaseException:
        claim.release()
        raise
    _apply_claimed(
        tree,
        ops,
        store=store,
        expect=expect,
        handle=handle,
        claim=claim,
        fsync=fsync,
        job_id=job_id,
    )
    return handle, claim


def _apply_claimed(
    tree: HostTree,
    ops: Sequence[UndoOp],
    *,
    store: BlobStore,
    expect: dict[str, Fingerprint | None],
    handle: JournalHandle,
    claim: UndoClaim,
    fsync: bool,
    job_id: str,
) -> None:
    """Apply the undo's ops; on a failure the ledger's claim and the journal go (nothing
    stays applied)."""
    try:
        apply_ops(
            tree,
            ops,
            source=BlobSource(store),
            store=store,
            expect=expect,
            tag=handle.record.id,
            fsync=fsync,
        )
    except OpConflict as exc:
        claim.release()
        handle.close()
        raise UndoConflict(_conflict_text(job_id, exc.conflicts)) from None
    except BaseException:
        claim.release()
        handle.close()
        raise


def _as_found(op: UndoOp, found: dict[str, PathState]) -> UndoOp:
    """`op` with the state it replaces as `check_ops` found it (same kind, content and
    mode: only its mtime and owner can differ)."""
    if isinstance(op, Move):
        now = found.get(op.src)
        if isinstance(now, FileState) and isinstance(op.state, FileState):
            return Move(src=op.src, dst=op.dst, state=now)
        return op
    now = found.get(op.path)
    if now is not None and type(now) is type(op.before) and same_state(now, op.before):
        return Put(path=op.path, before=now, after=op.after)
    return op


def _conflict_text(job_id: str, conflicts: Sequence[Conflict]) -> str:
    what = f"not undone, nothing was changed: {len(conflicts)} path(s) changed since job {job_id}"
    return conflict_message(what, conflicts)
