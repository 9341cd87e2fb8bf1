"""The change set of a staged job, as its result carries it (`Result.changes`).

Each path the job created, modified, deleted or renamed, with its sizes and modes, and for
a text file up to `MAX_DIFF_BYTES` a unified diff (any other file by its SHA-256). The set
is capped: at most `MAX_ENTRIES` entries and `MAX_TOTAL_DIFF_BYTES` of diffs in all; what
is left out is counted (`ChangeSet.total`, `truncated`) and the caps are named in the set
itself, so a reader knows what it is not seeing. It is derived from the commit's plan
(`metnos_exec.undo.changes`), never from a second walk of the folders.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

__all__ = (
    "APPROVE_EXECUTOR",
    "REJECT_EXECUTOR",
    "MAX_DIFF_BYTES",
    "MAX_ENTRIES",
    "MAX_TOTAL_DIFF_BYTES",
    "ChangeEntry",
    "ChangeKind",
    "ChangeSet",
    "describe_changes",
)

#: The reserved executors of an approval gate's answer (`metnos_exec.supervisor.gate_jobs`):
#: one argument, ``job_id``, the job awaiting approval; routed to the device that ran it.
APPROVE_EXECUTOR: Final = "metnos:approve"
REJECT_EXECUTOR: Final = "metnos:reject"

#: Entries a change set lists at most (the rest are counted in `ChangeSet.total`).
MAX_ENTRIES: Final = 1000
#: A file larger than this (before or after) has no diff: its hashes only.
MAX_DIFF_BYTES: Final = 64 * 1024
#: Diff text a change set carries in all at most (later files have their hashes only).
MAX_TOTAL_DIFF_BYTES: Final = 256 * 1024

ChangeKind = Literal["created", "modified", "deleted", "renamed"]


class ChangeEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One path the job changed.

    Attributes:
        path: the host path (for a rename: where it went).
        kind: created, modified (content, mode or type), deleted, renamed.
        type: what the path holds after (``file``, ``symlink``, ``dir``; for a deletion:
            what it held).
        src: a rename's former path.
        size_before / size_after: bytes of a file (``None``: not a file then).
        mode_before / mode_after: permission bits (``None``: absent, or a link).
        sha256_before / sha256_after: a file's content hash (``None``: not a file).
        target_before / target_after: a symlink's target text.
        diff: a unified diff of a text file (``None``: binary, too large, or over the
            set's diff budget; see `binary` and `diff_omitted`).
        binary: the content is not UTF-8 text (compare it by hash).
        diff_omitted: why a text file has no diff (``"too_large"``, ``"budget"``), else ``""``.
    """

    path: str
    kind: ChangeKind
    type: Literal["file", "symlink", "dir"]
    src: str | None = None
    size_before: int | None = None
    size_after: int | None = None
    mode_before: int | None = None
    mode_after: int | None = None
    sha256_before: str | None = None
    sha256_after: str | None = None
    target_before: str | None = None
    target_after: str | None = None
    diff: str | None = None
    binary: bool = False
    diff_omitted: str = ""


class ChangeSet(msgspec.Struct, frozen=True, kw_only=True):
    """What a staged job changed (see the module docstring).

    Attributes:
        entries: the changes, in path order, at most `max_entries`.
        total: changes in all (more than ``len(entries)`` when `truncated`).
        truncated: some changes are not listed (past `max_entries`).
        committed: the changes were applied to the real folders (``False``: they wait
            for an approval, or were discarded).
        max_entries / max_diff_bytes / max_total_diff_bytes: the caps this set was made with.
    """

    entries: tuple[ChangeEntry, ...] = ()
    total: int = 0
    truncated: bool = False
    committed: bool = True
    max_entries: int = MAX_ENTRIES
    max_diff_bytes: int = MAX_DIFF_BYTES
    max_total_diff_bytes: int = MAX_TOTAL_DIFF_BYTES


def describe_changes(changes: ChangeSet, *, diffs: bool = True) -> str:
    """The change set as text for people (``metnos-exec result JOB --changes``)."""
    lines: list[str] = []
    for e in changes.entries:
        renamed = e.kind == "renamed"
        head = f"renamed  {e.src} -> {e.path}" if renamed else f"{e.kind:<8} {e.path}"
        bits: list[str] = [e.type]
        if e.size_before is not None or e.size_after is not None:
            bits.append(f"size {_num(e.size_before)} -> {_num(e.size_after)}")
        if e.mode_before != e.mode_after:
            bits.append(f"mode {_mode(e.mode_before)} -> {_mode(e.mode_after)}")
        if e.target_before != e.target_after:
            bits.append(f"target {e.target_before!r} -> {e.target_after!r}")
        if e.binary:
            bits.append(f"binary sha256 {e.sha256_before or '-'} -> {e.sha256_after or '-'}")
        elif e.diff_omitted:
            bits.append(f"no diff ({e.diff_omitted})")
        lines.append(f"{head}  ({', '.join(bits)})")
        if diffs and e.diff:
            lines.extend("    " + line for line in e.diff.rstrip("\n").split("\n"))
    state = "committed" if changes.committed else "not committed"
    tail = f"{changes.total} change(s), {state}"
    if changes.truncated:
        tail += (
            f"; only the first {len(changes.entries)} listed (max_entries {changes.max_entries})"
        )
    lines.append(tail)
    return "\n".join(lines)


def _num(value: int | None) -> str:
    return "-" if value is None else str(value)


def _mode(value: int | None) -> str:
    return "-" if value is None else f"{value:o}"
