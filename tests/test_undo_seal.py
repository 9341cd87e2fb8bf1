"""Undo entries sealed by the device that recorded them (`metnos_exec.undo_seal`)."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import msgspec
import pytest

from metnos_exec.errors import HostFault
from metnos_exec.messages import Absent, DirState, FileState, Put, UndoEntry
from metnos_exec.undo_seal import KEY_FILE, UndoSeal


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
