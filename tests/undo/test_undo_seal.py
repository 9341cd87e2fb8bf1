"""Undo entries sealed by the device that recorded them (`metnos_exec.undo.seal`)."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import msgspec
import pytest

from metnos_exec.errors import HostFault, UndoUnavailable
from metnos_exec.messages import Absent, DirState, FileState, Put, UndoEntry
from metnos_exec.undo.seal import KEY_FILE, UndoLedger, UndoSeal


def entry(**kw: object) -> UndoEntry:
    fields: dict[str, object] = {
        "job_id": "01J0000000000000000000000A",
        "executor": "write_note",
        "roots": ("/home/u/notes",),
        "ops": (
            Put(
                path="/home/u/notes/a.md",
                before=FileState(sha256="a" * 64, size=3, mode=0o644),
                after=Absent(),
            ),
        ),
        **kw,
    }
    return UndoEntry(**fields)  # type: ignore[arg-type]


def test_a_sealed_entry_holds_after_the_wire_and_nothing_else_does(tmp_path: Path) -> None:
    seal = UndoSeal(tmp_path)
    sealed = seal.seal(entry())
    assert sealed.seal is not None and len(sealed.seal) == 64
    # Through the broker: encoded, stored, decoded.
    again = msgspec.json.decode(msgspec.json.encode(sealed), type=UndoEntry)
    assert seal.holds(again)
    assert not seal.holds(entry())  # no seal
    forged_root = msgspec.structs.replace(again, roots=("/etc",))
    assert not seal.holds(forged_root)
    forged_op = msgspec.structs.replace(
        again, ops=(Put(path="/home/u/notes", before=Absent(), after=DirState(mode=0o777)),)
    )
    assert not seal.holds(forged_op)
    # The seal of one entry on another.
    other = entry(job_id="01J0000000000000000000000B")
    assert not seal.holds(msgspec.structs.replace(other, seal=sealed.seal))
    # Another device's key.
    assert not UndoSeal(tmp_path / "elsewhere").holds(again)


def test_the_key_is_made_once_private_and_shared_by_the_devices_workers(tmp_path: Path) -> None:
    folder = tmp_path / "blobs"
    keys: list[bytes] = []
    barrier = threading.Barrier(8)

    def start() -> None:
        barrier.wait()
        keys.append(UndoSeal(folder).key)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(keys)) == 1 and len(keys[0]) == 32
    st = os.lstat(folder / KEY_FILE)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700
    assert sorted(p.name for p in folder.iterdir()) == [KEY_FILE]  # no temporary left
    sealed = UndoSeal(folder).seal(entry())
    assert UndoSeal(folder).holds(sealed)


def test_a_key_file_that_is_not_a_key_is_refused(tmp_path: Path) -> None:
    (tmp_path / KEY_FILE).write_bytes(b"short")
    with pytest.raises(HostFault, match="not an undo key"):
        UndoSeal(tmp_path).seal(entry())
    (tmp_path / KEY_FILE).unlink()
    (tmp_path / KEY_FILE).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(HostFault, match="undo key"):  # not followed
        UndoSeal(tmp_path).seal(entry())


# --- the ledger: which entries this device undid ----------------------------------------


def _undo(ledger: UndoLedger, undone: UndoEntry, undo_job: str) -> UndoEntry:
    """Claim and keep an undo of `undone` by `undo_job`; returns its redo entry."""
    redo = entry(job_id=undo_job, reverses=undone.id)
    ledger.claim([undone], undo_job=undo_job, redo=redo.id).keep()
    return redo


def test_an_undone_entry_stays_undone_until_its_undo_is_undone(tmp_path: Path) -> None:
    ledger = UndoLedger(tmp_path)
    job = entry()
    assert ledger.undone_by(job.id) is None
    first = _undo(ledger, job, "01J000000000000000000000U1")
    mark = ledger.undone_by(job.id)
    assert mark is not None and mark.undo_job == "01J000000000000000000000U1"
    with pytest.raises(UndoUnavailable, match="already undone by job 01J000000000000000000000U1"):
        ledger.claim([job], undo_job="01J000000000000000000000U2", redo="01J00000000000000000000R2")
    # The undo of the undo: the job's changes are back, so it may be undone again.
    second = _undo(ledger, first, "01J000000000000000000000U3")
    assert ledger.undone_by(first.id) is not None and ledger.undone_by(job.id) is None
    _undo(ledger, job, "01J000000000000000000000U4")
    assert ledger.undone_by(job.id).undo_job == "01J000000000000000000000U4"  # type: ignore[union-attr]
    # ... and the redo of the redo brings the first undo's effect back.
    _undo(ledger, second, "01J000000000000000000000U5")
    assert ledger.undone_by(first.id) is None
    assert stat.S_IMODE(os.lstat(ledger.folder).st_mode) == 0o700
    assert not list(ledger.folder.glob("*.redo")) and not list(ledger.folder.glob(".*"))


def test_a_rolled_back_undo_leaves_no_mark_and_recovery_settles_a_crashed_one(
    tmp_path: Path,
) -> None:
    ledger = UndoLedger(tmp_path)
    job = entry()
    ledger.claim(
        [job], undo_job="01J000000000000000000000U1", redo="01J00000000000000000000R1"
    ).release()
    assert ledger.undone_by(job.id) is None and not list(ledger.folder.iterdir())
    # A worker killed mid-undo: its marks and their list stay, the job counts as undone
    # (never replayable) until its journal is recovered.
    ledger.claim([job], undo_job="01J000000000000000000000U2", redo="01J00000000000000000000R2")
    assert ledger.undone_by(job.id) is not None
    ledger.settled("01J00000000000000000000R2", kept=False)  # rolled back
    assert ledger.undone_by(job.id) is None and not list(ledger.folder.iterdir())
    ledger.claim([job], undo_job="01J000000000000000000000U3", redo="01J00000000000000000000R3")
    ledger.settled("01J00000000000000000000R3", kept=True)
    assert ledger.undone_by(job.id).undo_job == "01J000000000000000000000U3"  # type: ignore[union-attr]
    assert not list(ledger.folder.glob("*.redo"))
    ledger.settled("01J00000000000000000000R9", kept=False)  # a commit's journal: nothing
    assert ledger.undone_by(job.id) is not None


def test_an_undo_job_takes_over_the_mark_its_own_earlier_attempt_left(tmp_path: Path) -> None:
    """Killed after its mark, before its journal: nothing was applied, and its redelivery
    is the one undo that may go on."""
    ledger = UndoLedger(tmp_path)
    job = entry()
    ledger.claim([job], undo_job="01J000000000000000000000U1", redo="01J00000000000000000000R1")
    with pytest.raises(UndoUnavailable, match="already undone"):
        ledger.claim([job], undo_job="01J000000000000000000000U2", redo="01J00000000000000000000R2")
    ledger.claim(
        [job], undo_job="01J000000000000000000000U1", redo="01J00000000000000000000R3"
    ).keep()
    mark = ledger.undone_by(job.id)
    assert mark is not None and mark.redo == "01J00000000000000000000R3"
    assert sorted(p.name for p in ledger.folder.iterdir())[0] == f"{job.id}.1"


def test_two_undos_racing_for_one_entry_one_wins(tmp_path: Path) -> None:
    job = entry()
    wins: list[str] = []
    losses: list[str] = []
    barrier = threading.Barrier(8)

    def undo(i: int) -> None:
        ledger = UndoLedger(tmp_path)  # one per worker process
        barrier.wait()
        try:
            ledger.claim(
                [job], undo_job=f"01J00000000000000000000U{i}", redo=f"01J0000000000000000000R{i}"
            )
        except UndoUnavailable as exc:
            losses.append(str(exc))
        else:
            wins.append(str(i))

    threads = [threading.Thread(target=undo, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and len(losses) == 7
    assert all("already undone" in m or "being undone" in m for m in losses)
