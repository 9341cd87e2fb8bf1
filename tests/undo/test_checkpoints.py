"""Checkpoints end to end (issue 21, acceptance 3 and 5): real bubblewrap, real overlays,
real SQLite, a supervisor. A session of 20 jobs after a checkpoint, then a restore: the
tree (content, modes, link targets) hashes as it did; with one file changed outside
meanwhile nothing is undone and the conflict is named. Both backends, root or not."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from structlog.testing import capture_logs

from metnos_exec.brokers.sqlite import SQLiteBroker
from metnos_exec.client import Client
from metnos_exec.messages import CHECKPOINT_EXECUTOR, Job, Result, UndoEntry
from metnos_exec.undo.checkpoints import CHECKPOINTS_DIR, CheckpointBook, checkpoint_job_args
from metnos_exec.undo.seal import ENTRIES_DIR
from metnos_exec.undo.staging import Staging
from tests.helpers.crash_driver import crash_driver
from tests.undo.helpers import World, make_world, seed, snapshot, staging_works

pytestmark = pytest.mark.anyio

#: 20 jobs: writes, appends, modes, symlinks, deletes, renames, folders made and removed,
#: files made then renamed, changed again, deleted.
SESSION: list[list[list[Any]]] = [
    [["write", "a.txt", "first\n"]],
    [["append", "mod.txt", "appended\n"]],
    [["rm", "del.txt"]],
    [["mv", "mv.txt", "moved.txt"]],
    [["chmod", "tool.sh", "755"]],
    [["rmtree", "sub"]],
    [["mkdir", "newdir/inner"]],
    [["write", "newdir/inner/f.txt", "nested\n"]],
    [["symlink", "link2", "keep.txt"]],
    [["rm", "link"]],
    [["write", "a.txt", "second\n"]],
    [["mv", "a.txt", "b.txt"]],
    [["chmod", "b.txt", "600"]],
    [["append", "mod.txt", "again\n"]],
    [["mkdir", "sub"], ["write", "sub/deep.txt", "other deep\n"]],
    [["symlink", "link", "mod.txt"]],
    [["rm", "moved.txt"]],
    [["write", "keep.txt", "kept no more\n"]],
    [["rmtree", "newdir"]],
    [["write", "z.bin", "\u0000\u0001binary"], ["chmod", "z.bin", "700"]],
]


def tree_hash(root: Path) -> str:
    """SHA-256 over every entry: name, kind, mode, content hash or link target."""
    return hashlib.sha256(json.dumps(sorted(snapshot(root).items())).encode()).hexdigest()


@pytest.fixture
async def world(tmp_path: Path) -> Any:
    w = make_world(tmp_path)
    async with SQLiteBroker(tmp_path / "queue.db") as broker:
        w.broker = broker  # type: ignore[assignment]
        try:
            yield w
        finally:
            await w.staging.aclose()


async def checkpoint(world: World, action: str, name: str | None = None) -> Result:
    job = Job(executor=CHECKPOINT_EXECUTOR, args=checkpoint_job_args(action, name))
    await world.broker.submit(job)
    await world.burst()
    result = await world.broker.get_result(job.id)
    assert result is not None
    return result


async def session(world: World) -> list[str]:
    ids = []
    for ops in SESSION:
        result = await world.run(ops)
        assert result.status == "succeeded", result
        ids.append(result.job_id)
    return ids


async def test_a_restore_puts_the_tree_back_and_its_undo_brings_the_session_back(
    world: World,
) -> None:
    await staging_works(world)
    seed(world.notes)
    before = tree_hash(world.notes)
    made = await checkpoint(world, "create", "before-session")
    assert made.status == "succeeded", made
    jobs = await session(world)
    # One job undone on its own meanwhile: the restore skips it (nothing done twice).
    undone = await Client(world.broker).submit_undo(jobs[-3])
    await world.burst()
    assert (await world.broker.get_result(undone)).status == "succeeded"  # type: ignore[union-attr]
    after = tree_hash(world.notes)
    assert after != before

    diff = await checkpoint(world, "diff", "before-session")
    assert diff.status == "succeeded", diff
    assert isinstance(diff.output, dict) and diff.output["conflicts"] == []
    kinds = {c["path"].rsplit("/", 1)[-1]: c["kind"] for c in diff.output["changes"]}
    assert kinds["b.txt"] == "deleted" and kinds["del.txt"] == "created"
    assert kinds["tool.sh"] == "mode" and kinds["mod.txt"] == "modified"
    assert tree_hash(world.notes) == after  # a diff writes nothing

    with capture_logs() as logs:
        restored = await checkpoint(world, "restore", "before-session")
    assert restored.status == "succeeded", restored
    assert tree_hash(world.notes) == before
    assert isinstance(restored.output, dict) and restored.output["restored"] == "before-session"
    assert set(restored.output["jobs"]) >= set(jobs) - {jobs[-3]}
    events = [r for r in logs if r["event"] == "checkpoint.restored"]
    assert len(events) == 1 and events[0]["name"] == "before-session"

    # The restore is undoable: every job's changes come back.
    redo = await Client(world.broker).submit_undo(restored.job_id)
    await world.burst()
    assert (await world.broker.get_result(redo)).status == "succeeded"  # type: ignore[union-attr]
    assert tree_hash(world.notes) == after
    # And restored again.
    again = await checkpoint(world, "restore", "before-session")
    assert again.status == "succeeded", again
    assert tree_hash(world.notes) == before


async def test_a_file_changed_outside_refuses_the_whole_restore_naming_it(world: World) -> None:
    await staging_works(world)
    seed(world.notes)
    await checkpoint(world, "create", "cp")
    jobs = await session(world)
    (world.notes / "mod.txt").write_text("edited by hand\n")
    after = tree_hash(world.notes)
    with capture_logs() as logs:
        refused = await checkpoint(world, "restore", "cp")
    assert refused.status == "rejected" and refused.error is not None
    assert refused.error.code == "E_UNDO_CONFLICT"
    assert "mod.txt" in refused.error.message and jobs[13] in refused.error.message
    assert tree_hash(world.notes) == after  # nothing undone
    assert [r["event"] for r in logs if r["event"].startswith("checkpoint.")] == [
        "checkpoint.refused"
    ]
    diff = await checkpoint(world, "diff", "cp")
    assert isinstance(diff.output, dict)
    assert [c["path"].rsplit("/", 1)[-1] for c in diff.output["conflicts"]] == ["mod.txt"]


async def test_unknown_tampered_and_taken_checkpoints_are_refused(world: World) -> None:
    await staging_works(world)
    seed(world.notes)
    unknown = await checkpoint(world, "restore", "nope")
    assert unknown.error is not None and unknown.error.code == "E_CHECKPOINT_UNKNOWN"
    assert (await checkpoint(world, "create", "cp")).status == "succeeded"
    taken = await checkpoint(world, "create", "cp")
    assert taken.error is not None and taken.error.code == "E_BAD_ARGS"
    listed = await checkpoint(world, "list")
    assert isinstance(listed.output, dict)
    assert [m["name"] for m in listed.output["checkpoints"]] == ["cp"]
    await world.run([["write", "a.txt", "x"]])
    # An entry of the device's log rewritten (its roots pointed elsewhere): refused, as
    # the broker's copy would be, before anything is read below the roots.
    [logged] = (world.staging.store.root / ENTRIES_DIR).glob("[0-9A-Z]*")
    original = logged.read_bytes()
    entry = msgspec.json.decode(original)
    entry["roots"] = ["/etc"]
    logged.write_bytes(msgspec.json.encode(entry))
    forged = await checkpoint(world, "restore", "cp")
    assert forged.error is not None and forged.error.code == "E_UNDO_UNAVAILABLE"
    assert "no valid seal" in forged.error.message
    assert (world.notes / "a.txt").read_text() == "x"
    logged.write_bytes(original)
    # A mark moved later on disk (its boundary rewritten) would hide the job: refused.
    path = world.staging.store.root / CHECKPOINTS_DIR / "cp.mark"
    mark = msgspec.json.decode(path.read_bytes())
    mark["boundary"] = "9" * 26
    path.write_bytes(msgspec.json.encode(mark))
    tampered = await checkpoint(world, "restore", "cp")
    assert tampered.error is not None and tampered.error.code == "E_UNDO_UNAVAILABLE"
    assert (world.notes / "a.txt").read_text() == "x"
    bad = await checkpoint(world, "create", "../x")
    assert bad.error is not None and bad.error.code == "E_BAD_ARGS"


async def test_the_client_methods_wait_for_their_jobs(world: World) -> None:
    import anyio

    await staging_works(world)
    seed(world.notes)
    before = tree_hash(world.notes)
    sup = world.supervisor(idle_poll_s=0.01)
    client = Client(world.broker)
    async with anyio.create_task_group() as tg:
        await tg.start(sup.run)
        try:
            await client.checkpoint("c1", wait=30)
            assert [m["name"] for m in await client.checkpoints(wait=30)] == ["c1"]
            for ops in SESSION[:2]:
                job_id = await client.submit("mutate", {"root": "~/notes", "ops": ops})
                done = await client.result(job_id, wait=30)
                assert done is not None and done.status == "succeeded", done
            diff = await client.checkpoint_diff("c1", wait=30)
            assert isinstance(diff.output, dict)
            result = await client.restore_checkpoint("c1", wait=30)
            assert result.status == "succeeded"
        finally:
            await sup.drain(0)
    assert tree_hash(world.notes) == before


# --- a crash at any step of a restore -------------------------------------------------


async def _recover(world: World) -> list[tuple[str, str]]:
    """A fresh worker's start on the state folder: its recovery leaves no path alone."""
    with capture_logs() as logs:
        done = await Staging(world.staging.state_dir, overlay=False).recover(
            world.broker, device=world.device
        )
    assert [r["left"] for r in logs if r["event"] == "journal.recovered"] == [[]] * len(done)
    return done


async def test_a_restore_killed_at_any_step_is_rolled_back_or_completed_never_half_done(
    world: World,
) -> None:
    await staging_works(world)
    seed(world.notes)
    before = tree_hash(world.notes)
    await checkpoint(world, "create", "cp")
    # Mixed kinds, a folder made and filled, a rename, a mode, a link, a type change.
    for ops in (*SESSION[:12], [["rm", "keep.txt"], ["mkdir", "keep.txt"]]):
        assert (await world.run(list(ops))).status == "succeeded"
    after = tree_hash(world.notes)
    book = CheckpointBook(world.staging.store.root)
    entries = book.entries_after(book.get("cp", device=world.device))
    assert len(entries) == 13
    job = Job(executor=CHECKPOINT_EXECUTOR, args=checkpoint_job_args("restore", "cp"))
    await world.broker.submit(job)  # queued, as a worker's restore job is: no result yet
    request = {
        "state": str(world.staging.state_dir),
        "entries": [msgspec.to_builtins(e) for e in entries],
        "name": "cp",
        "restore_job_id": job.id,
        "device": world.device,
    }
    steps: list[str] = []
    async with crash_driver() as driver:
        async for n, step in driver.crash_everywhere("restore", **request):
            steps.append(step)
            done = await _recover(world)
            assert done in ([], [(job.id, "rolled_back")]), (n, step, done)
            assert tree_hash(world.notes) == after, f"a restore killed before step {n} ({step})"
        # Completed, its result never stored: rolled back.
        assert tree_hash(world.notes) == before
        assert await _recover(world) == [(job.id, "rolled_back")]
        assert tree_hash(world.notes) == after
        # Completed and its result stored: it stands.
        out = world.tmp / "redo.json"
        await driver("restore", None, **request, redo_out=str(out))
    redo = msgspec.json.decode(out.read_bytes(), type=UndoEntry)
    [lease] = await world.broker.lease("w", visibility_s=30)
    await world.broker.ack(lease, Result(job_id=job.id, status="succeeded", undo_ids=(redo.id,)))
    assert await _recover(world) == [(job.id, "kept")]
    assert tree_hash(world.notes) == before
    assert {"mkdir", "write", "rename", "unlink", "rmdir", "symlink", "chmod"} <= set(steps)
