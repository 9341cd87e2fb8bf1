"""`compose` on plain entries (no host): what a checkpoint restore plans."""

from __future__ import annotations

from metnos_exec.messages import Absent, FileState, LinkState, Move, Put, UndoEntry
from metnos_exec.undo.restore import compose, describe


def _file(sha: str, mode: int = 0o644) -> FileState:
    return FileState(sha256=sha * 64, size=1, mode=mode)


def _entry(job: str, *ops: Put | Move) -> UndoEntry:
    return UndoEntry(job_id=job, device="d", executor="x", roots=("/r",), ops=ops)


def test_the_latest_before_and_the_earliest_after_make_one_op_per_path() -> None:
    # j1 creates f, j2 changes it, j3 makes a link and removes it again (j4).
    entries = [
        _entry("j1", Put(path="/r/f", before=_file("a"), after=Absent())),
        _entry("j2", Put(path="/r/f", before=_file("b"), after=_file("a"))),
        _entry("j3", Put(path="/r/l", before=LinkState(target="f"), after=Absent())),
        _entry("j4", Put(path="/r/l", before=Absent(), after=LinkState(target="f"))),
    ]
    composed = compose(entries)
    assert composed.conflicts == ()
    assert composed.ops == (Put(path="/r/f", before=_file("b"), after=Absent()),)
    assert describe(composed.ops[0]) == {"path": "/r/f", "kind": "deleted", "type": "Absent"}


def test_a_change_between_two_jobs_is_a_conflict_naming_the_later_job() -> None:
    entries = [
        _entry("j1", Put(path="/r/f", before=_file("a"), after=_file("0"))),
        # Someone wrote "x" by hand before j2 ran: j2 found x, not j1's a.
        _entry("j2", Put(path="/r/f", before=_file("b"), after=_file("x"))),
    ]
    [(conflict, job)] = compose(entries).conflicts
    assert (
        conflict.path == "/r/f" and job == "j2" and "between job j1 and job j2" in (conflict.reason)
    )


def test_a_mode_change_alone_differs_and_a_rename_nobody_else_touched_stays_one() -> None:
    entries = [
        _entry("j1", Put(path="/r/t", before=_file("a", 0o755), after=_file("a"))),
        _entry("j2", Move(src="/r/new", dst="/r/old", state=_file("c"))),
    ]
    composed = compose(entries)
    assert Move(src="/r/new", dst="/r/old", state=_file("c")) in composed.ops
    [mode] = [op for op in composed.ops if isinstance(op, Put)]
    assert describe(mode)["kind"] == "mode"


def test_a_rename_of_a_file_changed_later_is_a_delete_and_a_create() -> None:
    entries = [
        _entry("j1", Move(src="/r/b", dst="/r/a", state=_file("a"))),  # j1: a -> b
        _entry("j2", Put(path="/r/b", before=_file("b"), after=_file("a"))),  # j2 edits b
    ]
    composed = compose(entries)
    assert composed.conflicts == ()
    assert set(composed.ops) == {
        Put(path="/r/b", before=_file("b"), after=Absent()),
        Put(path="/r/a", before=Absent(), after=_file("a")),
    }


def test_a_job_and_its_undo_cancel_out() -> None:
    job = _entry("j1", Put(path="/r/f", before=_file("a"), after=Absent()))
    undo = _entry("u1", Put(path="/r/f", before=Absent(), after=_file("a")))
    assert compose([job, undo]).ops == ()
