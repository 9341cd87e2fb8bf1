"""Issue 15, item 5, on the plan of a real staged job: a crash at every step of its commit.

`tests/undo/test_crash_points.py` crashes a commit whose ops are written by hand; here they are
the ones the planner made from a real job's overlay (bubblewrap, the staging helper): the
job creates, appends, deletes, renames (onto an existing file too), changes a mode, turns
a file into a folder, a folder into a file, a symlink into a file, and makes a read-only
folder with contents. The job is undone through the queue (which keeps its results as
blobs, for a redo), then its commit is replayed in a child that dies before its N-th step,
for every N; after each, the journal recovery of a fresh start must leave the tree
exactly as before the job (mtimes included). Completed, the commit is the job's tree.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from metnos_exec.brokers.memory import MemoryBroker
from metnos_exec.client import Client
from metnos_exec.messages import Job
from metnos_exec.undo.journal import JournalRecord, reverse_ops
from tests.helpers.crash_driver import crash_driver
from tests.undo.helpers import World, make_world, seed, staging_works
from tests.undo.test_crash_points import recover, snapshot

pytestmark = pytest.mark.anyio

OPS = [
    ["write", "new.txt", "brand new\n"],
    ["append", "mod.txt", "appended\n"],
    ["rm", "del.txt"],
    ["mv", "mv.txt", "keep.txt"],
    ["chmod", "tool.sh", "755"],
    ["rm", "f"],
    ["mkdir", "f/q"],
    ["write", "f/q/x", "x\n"],
    ["rmtree", "sub"],
    ["write", "sub", "was a folder\n"],
    ["rm", "link"],
    ["write", "link", "was a link\n"],
    ["mkdir", "ro"],
    ["write", "ro/z", "z\n"],
    ["chmod", "ro", "555"],
]


@pytest.fixture
async def world(tmp_path: Path) -> Any:
    w = make_world(tmp_path)
    try:
        yield w
    finally:
        await w.staging.aclose()


async def test_a_crash_at_any_step_of_a_real_commit_is_rolled_back(world: World) -> None:
    await staging_works(world)
    seed(world.notes)
    (world.notes / "f").write_text("a file becoming a folder\n")
    for name in ("keep.txt", "mod.txt", "mv.txt", "f", "sub/deep.txt"):
        os.utime(world.notes / name, ns=(1_000_000_000_000_000_000,) * 2)
    before = snapshot(world.notes)
    result = await world.run(OPS)
    assert result.status == "succeeded" and len(result.undo_ids) == 1, result
    job_tree = snapshot(world.notes, mtimes=False)
    [record] = await world.broker.get_undo(result.undo_ids)
    entry = record.entry
    undo_id = await Client(world.broker).submit_undo(result.job_id)
    await world.burst()
    undone = await world.broker.get_result(undo_id)
    assert undone is not None and undone.status == "succeeded", undone
    assert snapshot(world.notes) == before

    # The job's commit again, as planned (the undo kept the job's files as blobs).
    commit = JournalRecord(
        job_id=result.job_id, entry_id=entry.id, roots=entry.roots, ops=reverse_ops(entry.ops)
    )
    state = str(world.staging.state_dir)
    no_result = MemoryBroker()  # the job's queue, its result not stored
    await no_result.submit(Job(id=result.job_id, executor="edit"))
    crashed = 0
    async with crash_driver() as driver:
        async for n, step in driver.crash_everywhere(
            "commit", state=state, record=msgspec.to_builtins(commit)
        ):
            crashed += 1
            assert await recover(world.staging, no_result) in ([], [(result.job_id, "rolled_back")])
            assert snapshot(world.notes) == before, f"a crash before step {n} ({step}) left a mix"
    assert crashed > len(commit.ops)
    assert snapshot(world.notes, mtimes=False) == job_tree
    assert await recover(world.staging, no_result) == [(result.job_id, "rolled_back")]
    assert snapshot(world.notes) == before
