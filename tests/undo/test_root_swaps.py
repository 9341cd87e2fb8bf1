"""A writable root reached through a symlink *above* it, after the job started.

The mount sources are opened without following a symlink (`mount_sources.open_source`),
but the commit, the undo and the roll-back reached each root again by path, with
``O_NOFOLLOW`` on its last component only: a parent swapped for a symlink in the meantime
(by another job's commit: one job may write ``~/w/**``, another ``~/w/x/y/**``) sent the
writes to wherever the link pointed, as the worker (root), while the report said files
``kept``. Here the test swaps the parent itself, as that other job's commit does.
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from metnos_exec.client import Client
from metnos_exec.messages import Job
from tests.undo.helpers import (
    World,
    make_world,
    seed,
    snapshot,
    staged_file_seen,
    staging_works,
    wait_for,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
async def world(tmp_path: Path) -> World:
    w = make_world(tmp_path)
    try:
        yield w
    finally:
        await w.staging.aclose()


def swap_home_for_a_link(world: World) -> tuple[Path, Path]:
    """Move the home away and put a symlink to another folder (with a ``notes/``) in its
    place: ``~/notes``, the job's root, now leads outside. Returns (moved home, outside)."""
    outside = world.tmp / "outside"
    (outside / "notes").mkdir(parents=True)
    moved = world.tmp / "home-moved"
    os.rename(world.home, moved)
    os.symlink(outside, world.home)
    return moved, outside


async def test_a_commit_never_writes_through_a_parent_swapped_for_a_symlink(
    world: World,
) -> None:
    await staging_works(world)
    (world.notes / "go").write_text("wait")
    ops = [["write", "planted", "the job's"], ["waitfor", "go"]]
    job = Job(executor="mutate", args={"root": "~/notes", "ops": ops})
    await world.broker.submit(job)
    async with anyio.create_task_group() as tg:
        tg.start_soon(world.burst)
        await wait_for(lambda: staged_file_seen(world, "planted"), 20)
        moved, outside = swap_home_for_a_link(world)
        (moved / "notes" / "go").write_text("go")
    result = await world.broker.get_result(job.id)
    assert list((outside / "notes").iterdir()) == []  # nothing written through the link
    assert sorted(os.listdir(moved / "notes")) == ["go"]
    assert result is not None and result.status == "failed", result
    assert result.error is not None and result.error.code == "E_COMMIT_CONFLICT", result.error
    assert "notes" in result.error.message
    assert result.undo_ids == () and await world.entries_count() == 0


async def test_an_undo_never_writes_through_a_parent_swapped_for_a_symlink(
    world: World,
) -> None:
    await staging_works(world)
    seed(world.notes)
    done = await world.run([["rm", "del.txt"], ["append", "mod.txt", "job\n"]])
    assert done.status == "succeeded", done
    moved, outside = swap_home_for_a_link(world)
    (outside / "notes" / "mod.txt").write_text("old content\njob\n")  # what the job left
    before = snapshot(outside)
    undo_id = await Client(world.broker).submit_undo(done.job_id)
    await world.burst()
    refused = await world.broker.get_result(undo_id)
    # del.txt is not restored outside the root, mod.txt there is not rewritten.
    assert snapshot(outside) == before
    assert refused is not None and refused.error is not None, refused
    assert refused.error.code == "E_UNDO_CONFLICT", refused.error
    assert not (moved / "notes" / "del.txt").exists()
