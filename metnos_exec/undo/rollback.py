"""Recovery: reverting applied ops from whatever state a crash left the host in.

`rollback` reverts a list of ops (in reverse), each path only when it holds what the op
left there, or a state a crash between two of its steps leaves (a folder made, its mode not
yet set; a file written, its mode not yet set), or what a roll-back cut short left; a path
holding neither the op's ``before`` nor its ``after`` is someone else's and is left alone
(returned as a conflict). It is what `metnos_exec.undo.journal.apply_ops` runs on a failure
and what a worker's recovery runs on a journal whose owner died.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

from ..messages import Absent, DirState, FileState, Move, PathState, Put, UndoOp, writes_content
from .applier import Applier, BlobSource, temp_name
from .blobs import BlobMissing, BlobStore
from .crash_points import step
from .host_tree import Blocked, Conflict, HostTree, same_state
from .order import inverse

__all__ = ("below_no_folder", "op_path", "rollback")

_CHUNK: Final = 1024 * 1024


def rollback(
    tree: HostTree,
    applied: Sequence[UndoOp],
    *,
    store: BlobStore,
    tag: str,
) -> list[Conflict]:
    """Revert `applied` (in reverse), each path only when it holds what the op left there
    (or a partial creation of it). Returns the paths left alone because they hold neither
    the op's ``before`` nor its ``after`` (someone else changed them)."""
    left: list[Conflict] = []
    applier = Applier(tree, BlobSource(store), tag=f"{tag}-rb")
    earlier = _earlier_states(applied)
    found: dict[str, PathState] = {}
    for op in applied:
        found.setdefault(op.src if isinstance(op, Move) else op.path, _found_by(op))
    for index, op in reversed(list(enumerate(applied))):
        tree.release()
        # Temp files of an interrupted replace, and of an interrupted roll-back's.
        if isinstance(op, Put):
            for temp in (temp_name(tag, index), temp_name(f"{tag}-rb", index)):
                with contextlib.suppress(OSError, Blocked):
                    parent, _ = tree.split(op.path)
                    os.stat(temp, dir_fd=parent, follow_symlinks=False)
                    step("unlink")
                    os.unlink(temp, dir_fd=parent)
        try:
            undo = _revert_step(tree, op, earlier[index], store)
        except Blocked as exc:
            if _creates(op) and below_no_folder(op_path(op), found):
                # Below a file or link the ops replace by a folder, which is not a folder
                # (yet, or again): the op never ran, or was reverted with it.
                continue
            left.append(Conflict(op.path if isinstance(op, Put) else op.dst, str(exc)))
            continue
        if isinstance(undo, Conflict):
            left.append(undo)
        elif undo is not None:
            try:
                applier.apply(undo, index)
            except (OSError, Blocked, BlobMissing) as exc:
                left.append(Conflict(op_path(op), f"roll-back failed: {exc}"))
    return left


def _found_by(op: UndoOp) -> PathState:
    return op.state if isinstance(op, Move) else op.before


def _creates(op: UndoOp) -> bool:
    """Whether `op` makes something where nothing was (a move makes its ``dst``)."""
    return isinstance(op, Move) or isinstance(op.before, Absent)


def op_path(op: UndoOp) -> str:
    return op.dst if isinstance(op, Move) else op.path


def below_no_folder(path: str, found: Mapping[str, PathState]) -> bool:
    """Whether a parent of `path` is, by `found` (what a list of ops finds at its paths),
    a file or a symlink: a folder the ops make again in its place, and nothing of theirs
    is below it until they do."""
    parent = posixpath.dirname(path)
    while parent != path:
        state = found.get(parent)
        if state is not None and not isinstance(state, DirState | Absent):
            return True
        path, parent = parent, posixpath.dirname(parent)
    return False


def _earlier_states(ops: Sequence[UndoOp]) -> list[tuple[PathState, ...]]:
    """For each op, what the ops before it found and left at its path (its ``dst`` for a
    move): a type change, or a folder made and then given its mode, is two ops on one
    path; a crash in the first leaves half of its ``after``, and a roll-back cut short
    may have put back its ``before`` already."""
    seen: dict[str, list[PathState]] = {}
    out: list[tuple[PathState, ...]] = []
    for op in ops:
        path = op_path(op)
        out.append(tuple(seen.get(path, ())))
        if isinstance(op, Move):
            seen.setdefault(op.src, []).extend((op.state, Absent()))
            seen.setdefault(op.dst, []).append(op.state)
        else:
            seen.setdefault(path, []).extend((op.before, op.after))
    return out


def _partial(current: PathState | None, target: PathState) -> bool:
    """Whether `current` may be `target` created in place and cut short by a crash: a
    folder whose mode or owner is not set yet (``mkdir``, then ``chmod``, ``chown``), a
    file shorter than it or with all of its content but not its mode or owner yet
    (created ``O_EXCL`` and written in place). A link is made in one step."""
    if isinstance(target, DirState):
        return isinstance(current, DirState)
    if isinstance(target, FileState) and isinstance(current, FileState):
        return current.size < target.size or current.sha256 == target.sha256
    return False


def _begins(
    tree: HostTree, path: str, current: PathState, original: PathState, store: BlobStore | None
) -> bool:
    """Whether the file at `path` (`current`, shorter than `original`) holds the first
    bytes of `original` (its blob in `store`): a restore cut short, not someone's file.
    Anything else (a folder) is `_partial` enough."""
    if not (isinstance(current, FileState) and isinstance(original, FileState)):
        return True
    if current.sha256 == original.sha256:
        return True
    if store is None:
        return False
    try:
        blob = store.open_checked(original.sha256, original.size)
    except BlobMissing:
        return False
    try:
        fd = tree.open_file(path)
    except (OSError, Blocked):
        os.close(blob)
        return False
    try:
        left = current.size
        while left:
            mine = os.read(fd, min(left, _CHUNK))
            if not mine or os.read(blob, len(mine)) != mine:
                return False
            left -= len(mine)
        return True
    finally:
        os.close(fd)
        os.close(blob)


def _any_of(current: PathState | None, states: Iterable[PathState]) -> bool:
    """Whether `current` is one of `states`, or one cut short (`_partial`)."""
    return any(same_state(current, s) or _partial(current, s) for s in states)


def _exact(tree: HostTree, current: PathState | None, expected: PathState) -> bool:
    """`same_state`, and the metadata a roll-back restores too: the mtime when it was
    recorded, the owner when this process restores owners."""
    if not same_state(current, expected):
        return False
    if (
        isinstance(expected, FileState)
        and isinstance(current, FileState)
        and expected.mtime_ns is not None
        and current.mtime_ns != expected.mtime_ns
    ):
        return False
    if tree.as_root and isinstance(expected, FileState | DirState) and expected.uid is not None:
        assert isinstance(current, FileState | DirState)
        return (current.uid, current.gid) == (expected.uid, expected.gid)
    return True


def _revert_step(
    tree: HostTree,
    op: UndoOp,
    earlier: Sequence[PathState] = (),
    store: BlobStore | None = None,
) -> UndoOp | Conflict | None:
    """The op that reverts `op` given what the host holds now; ``None``: nothing to do.

    The host may hold `op`'s ``after`` (revert it), its ``before`` (nothing to do), or a
    state a crash left half-way (`metnos_exec.undo.journal`'s table): `op` cut short
    (`_partial`: what it was creating is removed), an earlier roll-back of `op` cut short
    (its ``before`` is finished), or, on a path two ops change (a type change), what an
    earlier roll-back put back for the op before it (`earlier`: left to that op).
    """
    if isinstance(op, Move):
        src, dst = tree.lstat(op.src), tree.lstat(op.dst)
        if (
            src is not None
            and dst is not None
            and (src.st_ino, src.st_dev) == (dst.st_ino, dst.st_dev)
        ):
            # Crashed between link and unlink (of the move, or of its roll-back): drop
            # the new name.
            return Put(path=op.dst, before=op.state, after=Absent())
        if src is None and dst is not None and same_state(tree.state(op.dst), op.state):
            return inverse(op)
        if src is not None and (dst is None or _any_of(tree.state(op.dst), earlier)):
            return None
        return Conflict(op.dst, "neither where the move left it nor where it found it")
    current = tree.state(op.path)
    if same_state(current, op.after):
        return inverse(op)
    if _exact(tree, current, op.before):
        return None
    if current is None:
        return Conflict(op.path, "is now a special file")
    if not isinstance(current, Absent) and (
        same_state(current, op.before)
        or (
            isinstance(op.after, Absent)
            and _partial(current, op.before)
            and _begins(tree, op.path, current, op.before, store)
        )
    ):
        # A roll-back of `op` cut short: the content is back but not yet its mode, owner
        # or mtime, or a removed folder or file made again but not finished.
        return Put(path=op.path, before=current, after=op.before)
    if isinstance(op.before, Absent) and _partial(current, op.after):
        # A creation cut short by the crash.
        return Put(path=op.path, before=current, after=Absent())
    if _any_of(current, earlier):
        return None  # an earlier op's roll-back was under way: that op takes it from here
    if (
        isinstance(op.before, FileState)
        and isinstance(op.after, FileState)
        and not writes_content(op)
        and isinstance(current, FileState)
        and current.sha256 == op.after.sha256
    ):
        # Metadata only, half applied (mode set, mtime not): put the old metadata back.
        return Put(path=op.path, before=current, after=op.before)
    return Conflict(op.path, "changed by someone else since")
