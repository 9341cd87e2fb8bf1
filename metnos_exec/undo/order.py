"""The order ops are applied in, and their inverse (see `metnos_exec.undo.journal`).

Undo, redo and roll-back share one code path: the reverse of a list is the inverse of each
op put through the same order (`reverse_ops`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Final

import msgspec

from ..messages import Absent, DirState, Move, Put, UndoOp

__all__ = ("inverse", "order_ops", "reverse_ops")

_OWNER_WX: Final = 0o300


def inverse(op: UndoOp) -> UndoOp:
    if isinstance(op, Move):
        return Move(src=op.dst, dst=op.src, state=op.state)
    return Put(path=op.path, before=op.after, after=op.before)


def _split(op: UndoOp) -> Iterator[UndoOp]:
    """A type change becomes a removal and a creation (never one step on the host). A
    folder made without its owner's write and search bits is made with them and given its
    mode with the other mode changes, last: a worker that is not root could not make the
    folder's entries in it (the commit of a job that made a read-only folder with
    contents failed as a host fault)."""
    pieces: tuple[UndoOp, ...] = (op,)
    if (
        isinstance(op, Put)
        and not isinstance(op.before, Absent)
        and not isinstance(op.after, Absent)
        and type(op.before) is not type(op.after)
    ):
        pieces = (
            Put(path=op.path, before=op.before, after=Absent()),
            Put(path=op.path, before=Absent(), after=op.after),
        )
    for piece in pieces:
        if (
            isinstance(piece, Put)
            and isinstance(piece.before, Absent)
            and isinstance(piece.after, DirState)
            and piece.after.mode & _OWNER_WX != _OWNER_WX
        ):
            made = msgspec.structs.replace(piece.after, mode=piece.after.mode | _OWNER_WX)
            yield Put(path=piece.path, before=Absent(), after=made)
            yield Put(path=piece.path, before=made, after=piece.after)
        else:
            yield piece


def _depth(path: str) -> int:
    return path.count("/")


def order_ops(ops: Iterable[UndoOp]) -> tuple[UndoOp, ...]:
    """The safe order to apply `ops` in (see `metnos_exec.undo.journal`)."""
    split = [piece for op in ops for piece in _split(op)]
    removed_dirs = {
        op.path
        for op in split
        if isinstance(op, Put) and isinstance(op.before, DirState) and isinstance(op.after, Absent)
    }

    def key(op: UndoOp) -> tuple[int, int, str]:
        if isinstance(op, Move):
            phase = 6 if op.dst in removed_dirs else 3
            return phase, 0, op.dst
        before, after = op.before, op.after
        if isinstance(before, DirState) and isinstance(after, DirState):
            opens = after.mode & 0o200 and not before.mode & 0o200
            return (0 if opens else 7), -_depth(op.path), op.path
        if isinstance(after, Absent):
            if isinstance(before, DirState):
                return 5, -_depth(op.path), op.path
            return 1, 0, op.path
        if isinstance(after, DirState):
            return 2, _depth(op.path), op.path
        if isinstance(before, Absent) and op.path in removed_dirs:
            return 6, 0, op.path
        return 4, 0, op.path

    return tuple(sorted(split, key=key))


def reverse_ops(ops: Iterable[UndoOp]) -> tuple[UndoOp, ...]:
    """The ops that take the host back from the ``after`` of `ops` to their ``before``."""
    return order_ops(inverse(op) for op in ops)
