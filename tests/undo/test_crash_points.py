"""Issue 15, item 5: a crash at any step of a commit, an undo or a recovery leaves the
tree as it was before or as it is after, never a mix.

A mixed commit (create, replace, change a mode, delete, rename, file ↔ folder ↔ symlink,
nested, a folder made read-only, a new read-only one with contents, a file of several
writes) is run in a child process that dies (``os._exit``, as a kill) just before its
N-th step that changes the host or the journal (`metnos_exec.undo.journal.CRASH_ENV`), for
every N until the commit completes. After each
crash the journal is recovered as a fresh worker's start does (`Staging.recover`, no result
stored) and the tree must be byte-exactly the one from before: names, kinds, modes,
owners, contents, link targets and the files' mtimes, no temp file left. The same for the
undo of the commit (after each crash: the committed tree, exactly), for the undo of that
undo, and for the recovery itself (a crash at each step of a roll-back, then a second
recovery). The commit used to leave a mix where it was killed between a new folder's
``mkdir`` and its ``chmod``: the roll-back took the 0700 folder for someone else's.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from structlog.testing import capture_logs

from metnos_exec.brokers.memory import MemoryBroker
from metnos_exec.messages import (
    Absent,
    DirState,
    FileState,
    Job,
    LinkState,
    Move,
    PathState,
    Put,
    Result,
    UndoEntry,
    UndoOp,
)
from metnos_exec.undo.journal import Blocked, HostTree, JournalRecord, order_ops, reverse_ops
from metnos_exec.undo.staging import Staging
from tests.helpers.crash_driver import Driver, crash_driver

_OLD_NS = 1_000_000_000_123_456_789
_BIG = 1024 * 1024 + 4096  # two writes: a crash between them leaves half the content


def snapshot(root: Path, *, mtimes: bool = True) -> dict[str, tuple[Any, ...]]:
    """Every entry below `root`: kind, mode, owner, content hash, link target, and for a
    file its mtime (`mtimes`)."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, root)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", oct(stat.S_IMODE(st.st_mode)), st.st_uid, st.st_gid)
            else:
                digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
                when = st.st_mtime_ns if mtimes else None
                mode = oct(stat.S_IMODE(st.st_mode))
                out[rel] = ("file", mode, st.st_uid, st.st_gid, digest, when)
    return out


def seed(root: Path) -> None:
    """The tree before the commit."""
    root.mkdir()

    def write(rel: str, data: bytes, mode: int = 0o644) -> None:
        path = root / rel
        path.write_bytes(data)
        os.chmod(path, mode)

    def folder(rel: str, mode: int = 0o755) -> None:
        (root / rel).mkdir()
        os.chmod(root / rel, mode)

    write("keep.txt", b"keep\n")
    write("mod.txt", b"old content\n", 0o640)
    write("tool.sh", b"#!/bin/sh\n")
    write("del.txt", b"delete me\n")
    write("mv.txt", b"move me\n")
    write("f2d", b"a file becoming a folder\n", 0o600)
    folder("d2f", 0o750)
    write("d2f/a.txt", b"a\n")
    folder("d2f/s")
    write("d2f/s/b.txt", b"b\n")
    write("f2l", b"a file becoming a link\n")
    os.symlink("keep.txt", root / "l2f")
    folder("d2l")
    write("d2l/c.txt", b"c\n")
    os.symlink("nowhere", root / "l2d")
    os.symlink("a", root / "ln")
    folder("ro")
    folder("gone")
    write("gone/g1", b"g1\n")
    write("gone/g2", b"g2\n")
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            os.utime(os.path.join(dirpath, name), ns=(_OLD_NS, _OLD_NS), follow_symlinks=False)


def mixed_ops(root: Path, store: Any) -> tuple[UndoOp, ...]:
    """The commit: every kind of change `metnos_exec.undo.changes` plans, with the
    host's states as the planner reads them (mtimes and owners included) and the new
    contents in the blob store (as a commit's are in its upper folders)."""
    r = str(root)
    with HostTree([r]) as tree:

        def now(rel: str) -> PathState:
            state = tree.state(f"{r}/{rel}")
            assert state is not None
            return state

        def new(data: bytes, mode: int = 0o644) -> FileState:
            return FileState(sha256=store.put_bytes(data), size=len(data), mode=mode)

        for dirpath, _, filenames in os.walk(root):
            for name in filenames:
                if not os.path.islink(os.path.join(dirpath, name)):
                    store.put_bytes(Path(dirpath, name).read_bytes())  # the originals
        tool = now("tool.sh")
        assert isinstance(tool, FileState)
        ops: list[UndoOp] = [
            Put(path=f"{r}/new.txt", before=Absent(), after=new(b"brand new\n")),
            Put(path=f"{r}/big.new", before=Absent(), after=new(b"n" * _BIG)),
            Put(path=f"{r}/mod.txt", before=now("mod.txt"), after=new(b"new content\n", 0o600)),
            Put(path=f"{r}/tool.sh", before=tool, after=msgspec.structs.replace(tool, mode=0o755)),
            Put(path=f"{r}/del.txt", before=now("del.txt"), after=Absent()),
            Put(path=f"{r}/newdir", before=Absent(), after=DirState(mode=0o750)),
            Put(path=f"{r}/newdir/n.txt", before=Absent(), after=new(b"n\n")),
            Move(src=f"{r}/mv.txt", dst=f"{r}/newdir/moved.txt", state=now("mv.txt")),  # type: ignore[arg-type]
            # file → folder with contents
            Put(path=f"{r}/f2d", before=now("f2d"), after=DirState(mode=0o755)),
            Put(path=f"{r}/f2d/inner.txt", before=Absent(), after=new(b"inner\n")),
            Put(path=f"{r}/f2d/q", before=Absent(), after=DirState(mode=0o700)),
            Put(path=f"{r}/f2d/q/y", before=Absent(), after=new(b"y\n")),
            # folder with contents → file
            Put(path=f"{r}/d2f/s/b.txt", before=now("d2f/s/b.txt"), after=Absent()),
            Put(path=f"{r}/d2f/s", before=now("d2f/s"), after=Absent()),
            Put(path=f"{r}/d2f/a.txt", before=now("d2f/a.txt"), after=Absent()),
            Put(path=f"{r}/d2f", before=now("d2f"), after=new(b"now a file\n")),
            # file → link, link → file, folder → link, link → folder, link → link
            Put(path=f"{r}/f2l", before=now("f2l"), after=LinkState(target="keep.txt")),
            Put(path=f"{r}/l2f", before=now("l2f"), after=new(b"was a link\n")),
            Put(path=f"{r}/d2l/c.txt", before=now("d2l/c.txt"), after=Absent()),
            Put(path=f"{r}/d2l", before=now("d2l"), after=LinkState(target="elsewhere")),
            Put(path=f"{r}/l2d", before=now("l2d"), after=DirState(mode=0o755)),
            Put(path=f"{r}/l2d/d.txt", before=Absent(), after=new(b"d\n")),
            Put(path=f"{r}/ln", before=now("ln"), after=LinkState(target="b")),
            # a file made in a folder the job made read-only; a folder deleted whole
            Put(path=f"{r}/ro/r.txt", before=Absent(), after=new(b"r\n")),
            Put(path=f"{r}/ro", before=now("ro"), after=DirState(mode=0o555)),
            # a read-only folder made with contents (made writable, its mode set last)
            Put(path=f"{r}/newro", before=Absent(), after=DirState(mode=0o555)),
            Put(path=f"{r}/newro/z", before=Absent(), after=new(b"z\n")),
            Put(path=f"{r}/gone/g1", before=now("gone/g1"), after=Absent()),
            Put(path=f"{r}/gone/g2", before=now("gone/g2"), after=Absent()),
            Put(path=f"{r}/gone", before=now("gone"), after=Absent()),
        ]
    if tree.as_root:
        # A root worker commits what is new as its folder's owner (the planner's rule).
        owner = os.lstat(root)
        ops = [_owned(op, owner.st_uid, owner.st_gid) for op in ops]
    return order_ops(ops)


def _owned(op: UndoOp, uid: int, gid: int) -> UndoOp:
    if isinstance(op, Put) and isinstance(op.after, FileState | DirState) and op.after.uid is None:
        return msgspec.structs.replace(
            op, after=msgspec.structs.replace(op.after, uid=uid, gid=gid)
        )
    return op


@pytest.fixture
async def driver() -> AsyncIterator[Driver]:
    async with crash_driver() as d:
        yield d


async def recover(staging: Staging, broker: MemoryBroker) -> list[tuple[str, str]]:
    """A fresh worker's start: a new `Staging` on the state folder, its recovery (which
    must leave no path alone, nor the journal)."""
    with capture_logs() as logs:
        done = await Staging(staging.state_dir, overlay=False).recover(broker)
    assert [r["left"] for r in logs if r["event"] == "journal.recovered"] == [[]] * len(done)
    assert list(staging.journal.folder.iterdir()) == []
    return done


@pytest.mark.anyio
async def test_a_crash_at_any_step_leaves_before_or_after_never_a_mix(
    tmp_path: Path, driver: Driver
) -> None:
    root = tmp_path / "root"
    seed(root)
    staging = Staging(tmp_path / "state", overlay=False)
    state = str(staging.state_dir)
    ops = mixed_ops(root, staging.store)
    before = snapshot(root)
    broker = MemoryBroker()
    job = Job(executor="x")
    await broker.submit(job)
    entry = staging.seal.seal(
        UndoEntry(
            job_id=job.id,
            device="d",
            executor="x",
            method="staged",
            roots=(str(root),),
            ops=reverse_ops(ops),
        )
    )
    record = JournalRecord(job_id=job.id, entry_id=entry.id, roots=(str(root),), ops=ops)
    record_json = msgspec.to_builtins(record)

    # --- the commit ---------------------------------------------------------------
    steps: list[str] = []
    async for n, step in driver.crash_everywhere("commit", state=state, record=record_json):
        steps.append(step)
        done = await recover(staging, broker)
        assert done in ([], [(job.id, "rolled_back")]), (n, step, done)
        assert snapshot(root) == before, f"a crash before step {n} ({step}) left a mix"
    # Every kind of step was crashed at (the hook counts what it should).
    assert {"mkdir", "chmod", "create", "write", "rename", "link", "unlink", "rmdir"} <= set(
        steps
    ) and "symlink" in steps
    # Completed but its result never stored: rolled back too.
    check_after(root)
    assert await recover(staging, broker) == [(job.id, "rolled_back")]
    assert snapshot(root) == before

    # --- the recovery itself, from the completed commit -------------------------------
    await driver("commit", None, state=state, record=record_json)
    committed = snapshot(root, mtimes=False)
    async for n, step in driver.crash_everywhere(
        "recover", state=state, jobs=[msgspec.to_builtins(job)]
    ):
        # The next start's recovery finishes the roll-back (the journal is still there).
        assert await recover(staging, broker) == [(job.id, "rolled_back")], (n, step)
        assert snapshot(root) == before, f"a recovery killed before step {n} ({step})"
        await driver("commit", None, state=state, record=record_json)
        assert snapshot(root, mtimes=False) == committed
    assert snapshot(root) == before  # the last recovery completed
    assert list(staging.journal.folder.iterdir()) == []

    # --- the commit stands once its result is stored ------------------------------------
    await driver("commit", None, state=state, record=record_json)
    [lease] = await broker.lease("w", visibility_s=30)
    await broker.ack(lease, Result(job_id=job.id, status="succeeded", undo_ids=(entry.id,)))
    assert await recover(staging, broker) == [(job.id, "kept")]
    after = snapshot(root)
    assert snapshot(root, mtimes=False) == committed
    check_after(root)

    # --- the undo, and the undo of the undo -----------------------------------------------
    undo_job = Job(executor="metnos:undo", args={"job_id": job.id})
    await broker.submit(undo_job)  # queued before it runs, as a worker's undo job is
    entries = [msgspec.to_builtins(entry)]
    async for n, step in driver.crash_everywhere(
        "undo", state=state, entries=entries, undo_job_id=undo_job.id, device="d"
    ):
        done = await recover(staging, broker)
        assert done in ([], [(undo_job.id, "rolled_back")]), (n, step, done)
        assert snapshot(root) == after, f"an undo killed before step {n} ({step}) left a mix"
    # The undo completed (its result not stored: recovered as rolled back, tested above
    # at every step); now applied again and kept.
    assert await recover(staging, broker) == [(undo_job.id, "rolled_back")]
    assert snapshot(root) == after
    redo = await undo_kept(driver, staging, broker, undo_job, [entry])
    assert snapshot(root) == before

    redo_job = Job(executor="metnos:undo", args={"job_id": undo_job.id})
    await broker.submit(redo_job)
    redo_entries = [msgspec.to_builtins(redo)]
    async for n, step in driver.crash_everywhere(
        "undo", state=state, entries=redo_entries, undo_job_id=redo_job.id, device="d"
    ):
        done = await recover(staging, broker)
        assert done in ([], [(redo_job.id, "rolled_back")]), (n, step, done)
        assert snapshot(root) == before, f"a redo killed before step {n} ({step}) left a mix"
    assert await recover(staging, broker) == [(redo_job.id, "rolled_back")]
    await undo_kept(driver, staging, broker, redo_job, [redo])
    assert snapshot(root) == after


async def undo_kept(
    driver: Driver, staging: Staging, broker: MemoryBroker, undo_job: Job, entries: list[UndoEntry]
) -> UndoEntry:
    """Apply an undo in the driver, store its result as the worker does, recover (the
    undo is kept); its redo entry."""
    out = staging.state_dir.parent / f"redo-{undo_job.id}.json"
    await driver(
        "undo",
        None,
        state=str(staging.state_dir),
        entries=[msgspec.to_builtins(e) for e in entries],
        undo_job_id=undo_job.id,
        device="d",
        redo_out=str(out),
    )
    redo = msgspec.json.decode(out.read_bytes(), type=UndoEntry)
    if await broker.get_job_state(undo_job.id) is None:
        await broker.submit(undo_job)
    [lease] = await broker.lease("w", visibility_s=30)
    await broker.ack(lease, Result(job_id=undo_job.id, status="succeeded", undo_ids=(redo.id,)))
    assert await recover(staging, broker) == [(undo_job.id, "kept")]
    return redo


def check_after(root: Path) -> None:
    """The committed tree is what the ops say (the snapshot comparisons rest on it)."""
    assert (root / "new.txt").read_bytes() == b"brand new\n"
    assert (root / "big.new").read_bytes() == b"n" * _BIG
    assert (root / "mod.txt").read_bytes() == b"new content\n"
    assert (root / "newdir" / "moved.txt").read_bytes() == b"move me\n"
    assert not (root / "mv.txt").exists() and not (root / "del.txt").exists()
    assert (root / "f2d" / "q" / "y").read_bytes() == b"y\n"
    assert (root / "d2f").read_bytes() == b"now a file\n"
    assert os.readlink(root / "f2l") == "keep.txt" and os.readlink(root / "d2l") == "elsewhere"
    assert (root / "l2f").read_bytes() == b"was a link\n"
    assert (root / "l2d" / "d.txt").read_bytes() == b"d\n" and os.readlink(root / "ln") == "b"
    assert stat.S_IMODE(os.lstat(root / "ro").st_mode) == 0o555
    assert (root / "ro" / "r.txt").read_bytes() == b"r\n" and not (root / "gone").exists()
    assert stat.S_IMODE(os.lstat(root / "newro").st_mode) == 0o555
    assert (root / "newro" / "z").read_bytes() == b"z\n"
    assert stat.S_IMODE(os.lstat(root / "tool.sh").st_mode) == 0o755


def test_nothing_is_below_a_file_and_a_symlink_is_never_walked(tmp_path: Path) -> None:
    """What lets an undo look for a folder's entries where a file now is (item 6): below
    a file nothing can be, so nothing is found; below a symlink nothing is looked at."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "f").write_bytes(b"x")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "x").write_bytes(b"outside")
    os.symlink(tmp_path / "outside", root / "l")
    with HostTree([str(root)]) as tree:
        assert tree.lstat(f"{root}/f/x") is None
        assert tree.lstat(f"{root}/f/deeper/x") is None
        assert isinstance(tree.state(f"{root}/f/x"), Absent)
        with pytest.raises(Blocked, match="not a plain folder"):
            tree.lstat(f"{root}/l/x")
        with pytest.raises(Blocked):
            tree.split(f"{root}/f/x")  # nothing is ever made below it either


def test_a_restore_cut_short_is_finished_and_someone_elses_file_left(tmp_path: Path) -> None:
    """A roll-back killed while it wrote a removed file back leaves its first bytes: the
    next one finishes it. A shorter file that does not begin so is someone else's: left,
    and said."""
    from metnos_exec.undo.blobs import BlobStore
    from metnos_exec.undo.journal import rollback

    root = tmp_path / "root"
    root.mkdir()
    store = BlobStore(tmp_path / "blobs")
    original = b"the original content, all of it\n"
    state = FileState(sha256=store.put_bytes(original), size=len(original), mode=0o644)
    r = str(root)
    ops = (
        Put(path=f"{r}/a", before=state, after=Absent()),
        Put(path=f"{r}/b", before=state, after=Absent()),
    )
    (root / "a").write_bytes(original[:10])  # a restore cut short
    (root / "b").write_bytes(b"someone's")  # shorter, but not the original's beginning
    with HostTree([r]) as tree:
        left = rollback(tree, ops, store=store, tag="t")
    assert (root / "a").read_bytes() == original
    assert (root / "b").read_bytes() == b"someone's"
    assert [c.path for c in left] == [f"{r}/b"]
