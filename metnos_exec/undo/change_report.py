"""A staged job's change set (`metnos_exec.changeset.ChangeSet`), derived from its commit's
plan (`metnos_exec.undo.changes.CommitPlan`): the ops already say, per path, what the host
holds and what the job staged; the contents a diff needs come from the host tree (before)
and the plan's source (after). No second walk of the folders.

Read while the host is still as planned (before the ops are applied): a file the worker
cannot read has no diff (``diff_omitted = "unreadable"``), never an error.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable
from dataclasses import dataclass

from ..changeset import (
    MAX_DIFF_BYTES,
    MAX_ENTRIES,
    MAX_TOTAL_DIFF_BYTES,
    ChangeEntry,
    ChangeKind,
    ChangeSet,
)
from ..messages import Absent, DirState, FileState, LinkState, Move, PathState, UndoOp
from .host_tree import Blocked, HostTree

__all__ = ("change_set", "host_reader", "read_content")

#: Reads a file's content by path and state (``None``: it cannot be read).
Reader = Callable[[str, FileState], bytes | None]


@dataclass
class _Path:
    before: PathState
    after: PathState
    src: str | None = None


def _merge(ops: tuple[UndoOp, ...] | list[UndoOp]) -> dict[str, _Path]:
    """Per path, the state before the first op and after the last (type changes and new
    folders are split into several ops by `order_ops`)."""
    paths: dict[str, _Path] = {}
    for op in ops:
        if isinstance(op, Move):
            paths.setdefault(op.src, _Path(op.state, Absent())).after = Absent()
            dst = paths.setdefault(op.dst, _Path(Absent(), op.state))
            dst.after, dst.src = op.state, op.src
            continue
        found = paths.get(op.path)
        if found is None:
            paths[op.path] = _Path(op.before, op.after)
        else:
            found.after = op.after
    # A moved file's source is listed once, as the rename.
    moved = {p.src for p in paths.values() if p.src is not None}
    return {
        path: p
        for path, p in paths.items()
        if not (path in moved and isinstance(p.after, Absent) and p.src is None)
    }


def _type(state: PathState) -> str:
    if isinstance(state, FileState):
        return "file"
    if isinstance(state, LinkState):
        return "symlink"
    return "dir"


def _kind(p: _Path) -> ChangeKind:
    if p.src is not None:
        return "renamed"
    if isinstance(p.before, Absent):
        return "created"
    if isinstance(p.after, Absent):
        return "deleted"
    return "modified"


class _Budget:
    def __init__(self) -> None:
        self.left = MAX_TOTAL_DIFF_BYTES


def _entry(path: str, p: _Path, before: Reader, after: Reader, budget: _Budget) -> ChangeEntry:
    b, a = p.before, p.after
    shown = a if not isinstance(a, Absent) else b
    fields: dict[str, object] = {
        "path": path,
        "kind": _kind(p),
        "type": _type(shown),
        "src": p.src,
    }
    for side, state in (("before", b), ("after", a)):
        if isinstance(state, FileState):
            fields[f"size_{side}"] = state.size
            fields[f"mode_{side}"] = state.mode
            fields[f"sha256_{side}"] = state.sha256
        elif isinstance(state, DirState):
            fields[f"mode_{side}"] = state.mode
        elif isinstance(state, LinkState):
            fields[f"target_{side}"] = state.target
    if isinstance(b, FileState) or isinstance(a, FileState):
        fields.update(_diff(path, p, before, after, budget))
    return ChangeEntry(**fields)  # type: ignore[arg-type]


def _diff(path: str, p: _Path, before: Reader, after: Reader, budget: _Budget) -> dict[str, object]:
    b = p.before if isinstance(p.before, FileState) else None
    a = p.after if isinstance(p.after, FileState) else None
    if b is not None and a is not None and b.sha256 == a.sha256:
        return {}  # a mode change, or a rename: the same bytes
    if (b is not None and b.size > MAX_DIFF_BYTES) or (a is not None and a.size > MAX_DIFF_BYTES):
        return {"diff_omitted": "too_large"}
    old = b"" if b is None else before(p.src or path, b)
    new = b"" if a is None else after(path, a)
    if old is None or new is None:
        return {"diff_omitted": "unreadable"}
    try:
        old_text, new_text = old.decode(), new.decode()
    except UnicodeDecodeError:
        return {"binary": True}
    if "\0" in old_text or "\0" in new_text:
        return {"binary": True}
    name = path.lstrip("/")
    text = "".join(
        difflib.unified_diff(
            old_text.splitlines(keepends=True),
            new_text.splitlines(keepends=True),
            fromfile="/dev/null" if b is None else f"a/{(p.src or path).lstrip('/')}",
            tofile="/dev/null" if a is None else f"b/{name}",
        )
    )
    size = len(text.encode())
    if size > budget.left:
        return {"diff_omitted": "budget"}
    budget.left -= size
    return {"diff": text}


def change_set(
    ops: tuple[UndoOp, ...] | list[UndoOp],
    *,
    before: Reader,
    after: Reader,
    committed: bool = True,
) -> ChangeSet:
    """The change set of `ops` (a commit's plan, in apply order).

    Args:
        before: reads a host file's current content (the state the plan expects).
        after: reads a staged file's content.
        committed: whether the ops are being applied (``False``: awaiting approval).
    """
    merged = {
        path: p
        for path, p in _merge(ops).items()
        if not (isinstance(p.before, Absent) and isinstance(p.after, Absent))
    }
    budget = _Budget()
    entries = [
        _entry(path, merged[path], before, after, budget) for path in sorted(merged)[:MAX_ENTRIES]
    ]
    total = len(merged)
    return ChangeSet(
        entries=tuple(entries),
        total=total,
        truncated=total > len(entries),
        committed=committed,
    )


def read_content(fetch: Callable[[str, FileState], bytes | int]) -> Reader:
    """A `Reader` over a `ContentSource`-like ``fetch`` (bytes, or an fd it hands over)."""

    def read(path: str, state: FileState) -> bytes | None:
        try:
            got = fetch(path, state)
        except (OSError, KeyError, Blocked):
            return None
        if isinstance(got, bytes):
            return got
        try:
            return os.pread(got, state.size + 1, 0)[: state.size]
        except OSError:
            return None
        finally:
            os.close(got)

    return read


def host_reader(tree: HostTree) -> Reader:
    """A `Reader` of the host's current files, through `tree` (no link followed)."""

    def fetch(path: str, state: FileState) -> int:
        tree.release()
        return tree.open_file(path)

    return read_content(fetch)
