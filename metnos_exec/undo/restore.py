"""Restoring a checkpoint: every later job of the device undone, all or nothing.

The entries the device sealed after the mark (`metnos_exec.undo.checkpoints`) that stand
(their job's stored result lists them) are *composed*, latest first, into one list of
operations from what the host holds now to what it held at the checkpoint (`compose`):
for each path, what the latest entry expects to find and what the earliest one puts
back. Undos and restores made since are entries too (their redo), so a job undone on its
own and its undo cancel out: it is skipped, nothing is done twice. A rename whose two
names no other entry touches stays a rename; any other is a removal and a creation
(content from the blob store, where each job's commit kept what it replaced).

The composed list is then an undo like any other (`metnos_exec.undo.apply`): checked
whole against the host under the folders' locks (content, kind, link target, mode), then
applied through the crash-safe journal with one journal record, so a crash at any step
is rolled back by the next start unless the restore's result was stored (then it
stands): never half a restore. A conflict anywhere, between the host and the latest
entry or between two entries (a file changed outside the jobs between them), refuses
the whole restore with ``E_UNDO_CONFLICT``, naming each path and the job it belongs to;
nothing changes.

A restore is undoable: it records its own entry (the composed list reversed), sealed and
logged like any other, so ``undo RESTORE_JOB`` brings every job's changes back. The
entries it undid are marked undone by it in the device's ledger and the broker (those
not undone already).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UndoConflict, UndoUnavailable
from ..messages import (
    CHECKPOINT_EXECUTOR,
    Absent,
    DirState,
    FileState,
    LinkState,
    Move,
    PathState,
    Put,
    UndoEntry,
    UndoOp,
)
from .apply import (
    AppliedUndo,
    _as_found,
    _keep_destroyed,
    check_ops,
    claim_and_apply,
    missing_blobs,
)
from .blobs import BlobStore
from .checkpoints import roots_of
from .journal import (
    Conflict,
    Fingerprint,
    HostTree,
    Journal,
    conflict_message,
    order_ops,
    reverse_ops,
    same_state,
)
from .seal import UndoLedger, UndoSeal

__all__ = ("Composed", "apply_restore", "compose", "describe", "plan_restore")


@dataclass(frozen=True)
class Composed:
    """What a restore would do.

    Attributes:
        ops: the composed operations, ordered (`order_ops`).
        conflicts: ``(conflict, job id)``: a path and the job whose change it breaks.
    """

    ops: tuple[UndoOp, ...]
    conflicts: tuple[tuple[Conflict, str], ...]


@dataclass
class _Chain:
    first: PathState  # what the latest entry expects now
    last: PathState  # what the earliest entry seen so far puts back
    job: str  # the job of that earliest entry


def _steps(op: UndoOp) -> list[tuple[str, PathState, PathState]]:
    if isinstance(op, Move):
        return [(op.src, op.state, Absent()), (op.dst, Absent(), op.state)]
    return [(op.path, op.before, op.after)]


def compose(entries: Sequence[UndoEntry]) -> Composed:
    """Compose `entries` (in the order they were sealed) into one undo, latest first."""
    touched: dict[str, int] = {}
    for entry in entries:
        for path in {p for op in entry.ops for p, _, _ in _steps(op)}:
            touched[path] = touched.get(path, 0) + 1
    chains: dict[str, _Chain] = {}
    moves: list[UndoOp] = []
    conflicts: list[tuple[Conflict, str]] = []
    for entry in reversed(entries):
        for op in entry.ops:
            if isinstance(op, Move) and touched[op.src] == touched[op.dst] == 1:
                moves.append(op)
                continue
            for path, before, after in _steps(op):
                chain = chains.get(path)
                if chain is None:
                    chains[path] = _Chain(before, after, entry.job_id)
                    continue
                if not same_state(chain.last, before):
                    why = f"changed outside the jobs between job {entry.job_id} and job {chain.job}"
                    conflicts.append((Conflict(path, why), chain.job))
                chain.last, chain.job = after, entry.job_id
    puts = [
        Put(path=path, before=chain.first, after=chain.last)
        for path, chain in chains.items()
        if not _same(chain.first, chain.last)
    ]
    return Composed(order_ops([*puts, *moves]), tuple(conflicts))


def _same(a: PathState, b: PathState) -> bool:
    """No op needed from `a` to `b` (content, kind, target, mode; not times or owners)."""
    return type(a) is type(b) and same_state(a, b)


def describe(op: UndoOp) -> dict[str, str]:
    """What `op` does to the host, for ``checkpoint diff``: ``{"path", "kind"}``."""
    if isinstance(op, Move):
        return {"path": op.src, "kind": "renamed", "to": op.dst}
    before, after = op.before, op.after
    if isinstance(after, Absent):
        kind = "deleted"
    elif isinstance(before, Absent):
        kind = "created"
    elif type(before) is not type(after):
        kind = "replaced"
    elif isinstance(after, FileState) and isinstance(before, FileState):
        kind = "modified" if after.sha256 != before.sha256 else "mode"
    elif isinstance(after, LinkState):
        kind = "relinked"
    elif isinstance(after, DirState):
        kind = "mode"
    else:
        kind = "changed"
    return {"path": op.path, "kind": kind, "type": type(after).__name__.removesuffix("State")}


def _refuse(conflicts: Sequence[tuple[Conflict, str]], name: str) -> UndoConflict:
    jobs = sorted({job for _, job in conflicts})
    what = (
        f"checkpoint {name!r} not restored, nothing was changed: {len(conflicts)} path(s) "
        f"changed outside the jobs since (job {', '.join(jobs[:5])})"
    )
    return UndoConflict(conflict_message(what, [c for c, _ in conflicts]))


def _host_conflicts(
    tree: HostTree, composed: Composed, entries: Sequence[UndoEntry], found: dict[str, PathState]
) -> tuple[dict[str, Fingerprint | None], list[tuple[Conflict, str]]]:
    """`check_ops` on the composed list; each conflict with the latest job touching it."""
    expect, host = check_ops(tree, composed.ops, found)
    latest: dict[str, str] = {}
    for entry in entries:
        for op in entry.ops:
            for path, _, _ in _steps(op):
                latest[path] = entry.job_id
    return expect, [(c, latest.get(c.path, "?")) for c in host]


def plan_restore(
    entries: Sequence[UndoEntry], *, name: str
) -> tuple[Composed, list[tuple[Conflict, str]]]:
    """The composed restore and every conflict (between entries, and with the host), no
    write (blocking; ``checkpoint diff``)."""
    composed = compose(entries)
    conflicts = list(composed.conflicts)
    if composed.ops:
        tree = HostTree(roots_of(entries))
        try:
            conflicts += _host_conflicts(tree, composed, entries, {})[1]
        finally:
            tree.close()
    return composed, conflicts


def apply_restore(
    entries: Sequence[UndoEntry],
    *,
    name: str,
    restore_job_id: str,
    device: str,
    store: BlobStore,
    journal: Journal,
    fsync: bool = False,
) -> AppliedUndo | None:
    """Check and apply the restore of `entries` (blocking; run it in a thread, under the
    folders' locks). ``None``: nothing to change.

    Raises:
        UndoConflict: a path changed outside the jobs; nothing was changed.
        UndoUnavailable: an original is not in `store`; nothing was changed.
        HostFault: the device's undo key or ledger cannot be read.
    """
    composed = compose(entries)
    if composed.conflicts:
        raise _refuse(composed.conflicts, name)
    if not composed.ops:
        return None
    seal = UndoSeal.beside(store.root)
    ledger = UndoLedger.beside(store.root)
    roots = roots_of(entries)
    tree = HostTree(roots)
    try:
        found: dict[str, PathState] = {}
        expect, conflicts = _host_conflicts(tree, composed, entries, found)
        if conflicts:
            raise _refuse(conflicts, name)
        ops = tuple(_as_found(op, found) for op in composed.ops)
        _keep_destroyed(tree, ops, store)
        missing = missing_blobs(ops, store)
        if missing:
            raise UndoUnavailable(
                conflict_message(
                    f"checkpoint {name!r} not restored: originals are not in this worker's "
                    "blob store",
                    missing,
                )
            )
        redo = seal.seal(
            UndoEntry(
                job_id=restore_job_id,
                device=device,
                executor=CHECKPOINT_EXECUTOR,
                method=entries[-1].method,
                roots=roots,
                ops=reverse_ops(ops),
                reverses=entries[-1].id,
                lost="; ".join(e.lost for e in entries if e.lost) or None,
            )
        )
        standing = [e for e in entries if ledger.undone_by(e.id) is None]
        handle, claim = claim_and_apply(
            tree,
            ops,
            ledger=ledger,
            journal=journal,
            claimed=standing,
            undo_job_id=restore_job_id,
            redo=redo,
            roots=roots,
            device=device,
            store=store,
            expect=expect,
            fsync=fsync,
            job_id=entries[-1].job_id,
        )
    except BaseException:
        tree.close()
        raise
    return AppliedUndo(redo, tuple(standing), handle, tree, ops, store, claim)
