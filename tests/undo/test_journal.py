"""Applying ops to the host: order, reversal, symlink safety, conflicts, the journal."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from metnos_exec.brokers.memory import MemoryBroker
from metnos_exec.messages import (
    Absent,
    DirState,
    FileState,
    Job,
    LinkState,
    Move,
    Put,
    Result,
    UndoOp,
)
from metnos_exec.undo.blobs import BlobStore
from metnos_exec.undo.journal import (
    MAX_OPEN_FOLDERS,
    BlobSource,
    Blocked,
    HostTree,
    Journal,
    JournalRecord,
    OpConflict,
    apply_ops,
    fingerprints,
    order_ops,
    reverse_ops,
    rollback,
)
from metnos_exec.undo.staging import Staging
from tests.undo.helpers import snapshot


def file_state(store: BlobStore, data: bytes, mode: int = 0o644) -> FileState:
    return FileState(sha256=store.put_bytes(data), size=len(data), mode=mode)


def apply(tree: HostTree, ops: tuple[UndoOp, ...], store: BlobStore, tag: str = "t") -> None:
    paths = [p for op in ops for p in ((op.src, op.dst) if isinstance(op, Move) else (op.path,))]
    expect = fingerprints(tree, dict.fromkeys(paths))
    apply_ops(tree, ops, source=BlobSource(store), store=store, expect=expect, tag=tag)


def test_order_splits_type_changes_and_puts_parents_first() -> None:
    f = FileState(sha256="a" * 64, size=1, mode=0o644)
    ops = order_ops(
        [
            Put(path="/r/d/x", before=Absent(), after=f),
            Put(path="/r/d", before=Absent(), after=DirState(mode=0o755)),
            Put(path="/r/old", before=DirState(mode=0o755), after=Absent()),
            Put(path="/r/old/y", before=f, after=Absent()),
            Put(path="/r/t", before=f, after=DirState(mode=0o700)),
            Put(path="/r/ro", before=DirState(mode=0o755), after=DirState(mode=0o555)),
        ]
    )
    paths = [
        (op.path, type(op.before).__name__, type(op.after).__name__)
        for op in ops
        if isinstance(op, Put)
    ]
    assert paths.index(("/r/t", "FileState", "Absent")) < paths.index(
        ("/r/t", "Absent", "DirState")
    )
    assert paths.index(("/r/d", "Absent", "DirState")) < paths.index(
        ("/r/d/x", "Absent", "FileState")
    )
    assert paths.index(("/r/old/y", "FileState", "Absent")) < paths.index(
        ("/r/old", "DirState", "Absent")
    )
    assert paths[-1] == ("/r/ro", "DirState", "DirState")  # made read-only last


def test_apply_then_reverse_is_byte_exact(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "f").write_bytes(b"original")
    os.chmod(root / "f", 0o640)
    os.symlink("f", root / "ln")
    (root / "d" / "inner").write_bytes(b"inner")
    (root / "moveme").write_bytes(b"move")
    before = snapshot(root)
    store = BlobStore(tmp_path / "blobs")
    r = str(root)
    f0 = file_state(store, b"original", 0o640)
    move = FileState(sha256=hashlib.sha256(b"move").hexdigest(), size=4, mode=0o644)
    inner = file_state(store, b"inner")
    ops = order_ops(
        [
            Put(path=f"{r}/f", before=f0, after=file_state(store, b"changed", 0o600)),
            Put(path=f"{r}/ln", before=LinkState(target="f"), after=LinkState(target="d")),
            Put(path=f"{r}/d/inner", before=inner, after=Absent()),
            Put(path=f"{r}/d", before=DirState(mode=0o755), after=Absent()),
            Put(path=f"{r}/new/deep", before=Absent(), after=DirState(mode=0o750)),
            Put(path=f"{r}/new", before=Absent(), after=DirState(mode=0o755)),
            Put(path=f"{r}/new/deep/x", before=Absent(), after=file_state(store, b"x")),
            Move(src=f"{r}/moveme", dst=f"{r}/new/moved", state=move),
        ]
    )
    with HostTree([r]) as tree:
        apply(tree, ops, store)
    after = snapshot(root)
    assert (root / "f").read_bytes() == b"changed" and after["f"][1] == "0o600"
    assert os.readlink(root / "ln") == "d" and not (root / "d").exists()
    assert (root / "new" / "deep" / "x").read_bytes() == b"x"
    assert (root / "new" / "moved").read_bytes() == b"move" and not (root / "moveme").exists()
    with HostTree([r]) as tree:
        apply(tree, reverse_ops(ops), store)
    assert snapshot(root) == before
    with HostTree([r]) as tree:
        apply(tree, ops, store)
    assert snapshot(root) == after


@pytest.mark.parametrize("fsync", [False, True])
def test_a_tree_keeps_a_bounded_number_of_folders_open(tmp_path: Path, fsync: bool) -> None:
    # One fd per folder used to stay open until the tree closed: a commit of 1,500
    # folders failed under a service's 1,024 open files (tests/adversarial:
    # files.many_folders). Applied, and rolled back, with at most MAX_OPEN_FOLDERS.
    root = tmp_path / "root"
    root.mkdir()
    store = BlobStore(tmp_path / "blobs")
    r = str(root)
    x = file_state(store, b"x")
    n = 3 * MAX_OPEN_FOLDERS
    ops = order_ops(
        [Put(path=f"{r}/{i}", before=Absent(), after=DirState(mode=0o755)) for i in range(n)]
        + [Put(path=f"{r}/{i}/f", before=Absent(), after=x) for i in range(n)]
    )
    fds = len(os.listdir("/proc/self/fd"))
    with HostTree([r]) as tree:
        apply_ops(tree, ops, source=BlobSource(store), store=store, expect={}, tag="t", fsync=fsync)
        assert len(os.listdir("/proc/self/fd")) <= fds + MAX_OPEN_FOLDERS + 1
        assert all((root / str(i) / "f").read_bytes() == b"x" for i in range(n))
        assert rollback(tree, ops, store=store, tag="t") == []
        assert len(os.listdir("/proc/self/fd")) <= fds + MAX_OPEN_FOLDERS + 1
    assert list(root.iterdir()) == []


def test_a_symlink_below_a_root_is_never_walked_through(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    # Someone replaced a folder of the job's tree with a link out of it.
    os.symlink(outside, root / "d")
    store = BlobStore(tmp_path / "blobs")
    op = Put(path=f"{root}/d/planted", before=Absent(), after=file_state(store, b"x"))
    with HostTree([str(root)]) as tree:
        with pytest.raises(Blocked, match="not a plain folder"):
            tree.lstat(op.path)
        with pytest.raises((Blocked, OpConflict)):
            apply_ops(tree, (op,), source=BlobSource(store), store=store, expect={}, tag="t")
    assert list(outside.iterdir()) == []


def test_a_host_change_mid_apply_rolls_back_everything(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "a").write_bytes(b"a0")
    (root / "b").write_bytes(b"b0")
    before = snapshot(root)
    store = BlobStore(tmp_path / "blobs")
    r = str(root)
    ops = order_ops(
        [
            Put(path=f"{r}/a", before=file_state(store, b"a0"), after=file_state(store, b"a1")),
            Put(path=f"{r}/b", before=file_state(store, b"b0"), after=file_state(store, b"b1")),
            Put(path=f"{r}/c", before=Absent(), after=file_state(store, b"c1")),
        ]
    )
    with HostTree([r]) as tree:
        expect = fingerprints(tree, [f"{r}/a", f"{r}/b", f"{r}/c"])
        (root / "b").write_bytes(b"someone else")  # after the plan, before the apply
        with pytest.raises(OpConflict, match="changed on the host"):
            apply_ops(tree, ops, source=BlobSource(store), store=store, expect=expect, tag="t")
    (root / "b").write_bytes(b"b0")
    assert snapshot(root) == before  # "a" was written, then put back


def test_rollback_reverts_only_what_the_ops_left(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    store = BlobStore(tmp_path / "blobs")
    r = str(root)
    big = file_state(store, b"complete content")
    ops = (
        Put(path=f"{r}/partial", before=Absent(), after=big),
        Put(path=f"{r}/done", before=Absent(), after=big),
        Put(path=f"{r}/theirs", before=Absent(), after=big),
    )
    (root / "partial").write_bytes(b"comp")  # a creation cut short by a crash
    (root / "done").write_bytes(b"complete content")
    (root / "theirs").write_bytes(b"someone else's, longer than what the op wrote")
    with HostTree([r]) as tree:
        left = rollback(tree, ops, store=store, tag="t")
    assert sorted(os.listdir(root)) == ["theirs"]
    assert [c.path for c in left] == [f"{r}/theirs"]


def test_a_rollback_never_restores_a_blob_whose_size_is_wrong(tmp_path: Path) -> None:
    """A blob cut short (a disk that filled under an older version's store, a disk that
    lost it) must not be copied over the user's file: the path is left, and said."""
    root = tmp_path / "root"
    root.mkdir()
    store = BlobStore(tmp_path / "blobs")
    r = str(root)
    before = file_state(store, b"the original, all of it\n")
    after = file_state(store, b"the job's\n")
    op = Put(path=f"{r}/f", before=before, after=after)
    (root / "f").write_bytes(b"the original, all of it\n")
    with HostTree([r]) as tree:
        apply(tree, (op,), store)
    os.truncate(store.path(before.sha256), 4)
    with HostTree([r]) as tree:
        left = rollback(tree, (op,), store=store, tag="t")
    assert [c.path for c in left] == [f"{r}/f"] and "size" in left[0].reason
    assert (root / "f").read_bytes() == b"the job's\n"
    assert not store.has(before.sha256, size=before.size)


def _dead_owner(journal: Path, record: JournalRecord) -> None:
    """A process that begins a journal and dies without settling it."""
    code = (
        "import sys, os, msgspec\n"
        "from metnos_exec.undo.journal import Journal, JournalRecord\n"
        "rec = msgspec.json.decode(sys.stdin.buffer.read(), type=JournalRecord)\n"
        f"Journal({str(journal)!r}).begin(rec)\n"
        "os._exit(0)\n"
    )
    import msgspec

    subprocess.run([sys.executable, "-c", code], input=msgspec.json.encode(record), check=True)


def test_the_journal_belongs_to_its_live_owner_only(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    record = JournalRecord(job_id="J", entry_id="E", roots=(), ops=())
    mine = journal.begin(record)
    assert journal.orphans() == ([], [])  # held by us: alive
    mine.close(remove=False)
    taken, _ = journal.orphans()
    assert [h.record for h in taken] == [record]
    taken[0].close()
    assert list((tmp_path / "j").iterdir()) == []
    _dead_owner(tmp_path / "j", record)
    [orphan], _ = journal.orphans()
    assert orphan.record.job_id == "J"
    orphan.close()
    # One that cannot be read is reported and left for a person; the others still go.
    (tmp_path / "j" / "bad.journal").write_text("{not json")
    _dead_owner(tmp_path / "j", record)
    found, unreadable = journal.orphans()
    assert [h.record.job_id for h in found] == ["J"]
    assert [p for p, _ in unreadable] == [str(tmp_path / "j" / "bad.journal")]
    found[0].close()
    assert (tmp_path / "j" / "bad.journal").exists()


@pytest.mark.anyio
async def test_recovery_keeps_a_stored_commit_and_rolls_back_the_others(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    staging = Staging(tmp_path / "state", overlay=False)
    store = staging.store
    r = str(root)
    broker = MemoryBroker()
    jobs = [Job(executor="x"), Job(executor="x")]
    for job in jobs:
        await broker.submit(job)
    leases = await broker.lease("w", visibility_s=30, limit=2)
    for i, lease in enumerate(leases):
        op = Put(path=f"{r}/f{i}", before=Absent(), after=file_state(store, b"x"))
        record = JournalRecord(job_id=lease.job.id, entry_id=f"E{i}", roots=(r,), ops=(op,))
        with HostTree([r]) as tree:
            apply(tree, (op,), store)
        staging.journal.begin(record).close(remove=False)  # its worker "died"
        if i == 0:
            stored = Result(job_id=lease.job.id, status="succeeded", undo_ids=("E0",))
            assert await broker.ack(lease, stored)
    done = await staging.recover(broker)
    assert sorted(done) == sorted([(leases[0].job.id, "kept"), (leases[1].job.id, "rolled_back")])
    assert sorted(os.listdir(root)) == ["f0"]
    assert list(staging.journal.folder.iterdir()) == []


def test_a_name_taken_on_the_host_meanwhile_is_a_conflict(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "a").write_bytes(b"a0")
    store = BlobStore(tmp_path / "blobs")
    r = str(root)
    ops = order_ops(
        [
            Put(path=f"{r}/a", before=file_state(store, b"a0"), after=file_state(store, b"a1")),
            Put(path=f"{r}/z", before=Absent(), after=file_state(store, b"mine")),
        ]
    )
    with HostTree([r]) as tree:
        expect = fingerprints(tree, [f"{r}/a", f"{r}/z"])
        (root / "z").write_bytes(b"theirs")  # created after the plan said "absent"
        with pytest.raises(OpConflict, match="appeared on the host"):
            apply_ops(tree, ops, source=BlobSource(store), store=store, expect=expect, tag="t")
    assert (root / "a").read_bytes() == b"a0" and (root / "z").read_bytes() == b"theirs"
