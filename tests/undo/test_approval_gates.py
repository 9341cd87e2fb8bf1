"""Approval gates and branches (issue 21, acceptance 1 and 4): real bubblewrap, real
overlays, a supervisor; the kept gate in the worker's state folder. Both backends."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from metnos_exec.client import Client
from metnos_exec.errors import ApprovalUnavailable, CommitConflict
from metnos_exec.messages import Job, Result
from tests.undo.helpers import World, make_world, seed, snapshot, staging_works

pytestmark = pytest.mark.anyio

KINDS = [
    ["write", "new.txt", "brand new\n"],
    ["append", "mod.txt", "appended\n"],
    ["rm", "del.txt"],
    ["mv", "mv.txt", "moved.txt"],
    ["chmod", "tool.sh", "755"],
    ["rmtree", "sub"],
    ["mkdir", "newdir/inner"],
    ["write", "newdir/inner/f.txt", "nested\n"],
    ["symlink", "link2", "keep.txt"],
]


@pytest.fixture
async def world(tmp_path: Path) -> World:
    w = make_world(tmp_path / "gated")
    try:
        yield w
    finally:
        await w.staging.aclose()


async def gated(world: World, ops: list[list[Any]], **fields: Any) -> Job:
    job = Job(executor="mutate", args={"root": "~/notes", "ops": ops}, commit="approve", **fields)
    await world.broker.submit(job)
    return job


async def answer(world: World, job_id: str, *, approve: bool = True) -> Result:
    """`Client.approve` / `reject` against a worker serving meanwhile (errors re-raised)."""
    sup = world.supervisor(idle_poll_s=0.01)
    error: BaseException | None = None
    result: Result | None = None
    async with anyio.create_task_group() as tg:
        await tg.start(sup.run)
        try:
            client = Client(world.broker)
            call = client.approve if approve else client.reject
            result = await call(job_id, wait=20)
        except Exception as exc:
            error = exc
        finally:
            await sup.drain(0)
    if error is not None:
        raise error
    assert result is not None
    return result


async def test_approve_commits_exactly_what_a_direct_run_does(world: World, tmp_path: Path) -> None:
    await staging_works(world)
    seed(world.notes)
    before = snapshot(world.notes)
    job = await gated(world, KINDS)
    other = Job(executor="mutate", args={"root": "~/notes", "ops": [["write", "o.txt", "o"]]})
    await world.broker.submit(other)
    with capture_logs() as logs:
        await world.burst(concurrency=1, prefetch=0)
    waiting = await world.broker.get_result(job.id)
    assert waiting is not None and waiting.status == "awaiting_approval", waiting
    assert waiting.changes is not None and not waiting.changes.committed
    assert waiting.undo_ids == ()
    # The slot was free while it waited: the second job ran, with concurrency 1.
    ran = await world.broker.get_result(other.id)
    assert ran is not None and ran.status == "succeeded"
    assert any(r["event"] == "approval.waiting" for r in logs)
    # Nothing of the gated job reached the folder (the other job's file did).
    now = snapshot(world.notes)
    assert now.pop("o.txt") and now == before
    # Kept in the worker's state folder, on disk.
    assert (world.staging.state_dir / "gates" / job.id / "record.json").is_file()

    with capture_logs() as logs:
        final = await answer(world, job.id)
    assert final.status == "succeeded" and len(final.undo_ids) == 1, final
    assert final.changes is not None and final.changes.committed
    assert any(r["event"] == "approval.granted" for r in logs)
    assert not (world.staging.state_dir / "gates" / job.id).exists()

    # Byte-identical to the same job run directly on the same tree.
    direct = make_world(tmp_path / "direct")
    try:
        seed(direct.notes)
        (direct.notes / "o.txt").write_text("o")
        assert (await direct.run(KINDS)).status == "succeeded"
        assert snapshot(world.notes) == snapshot(direct.notes)
    finally:
        await direct.staging.aclose()

    # The approved job undoes like any other.
    undo_id = await Client(world.broker).submit_undo(job.id)
    await world.burst()
    assert (await world.broker.get_result(undo_id)).status == "succeeded"  # type: ignore[union-attr]
    now = snapshot(world.notes)
    assert now.pop("o.txt") and now == before

    with pytest.raises(ApprovalUnavailable, match="not awaiting approval"):
        await answer(world, job.id)


async def test_reject_leaves_the_folder_unchanged(world: World) -> None:
    await staging_works(world)
    seed(world.notes)
    before = snapshot(world.notes)
    job = await gated(world, KINDS)
    await world.burst()
    with capture_logs() as logs:
        final = await answer(world, job.id, approve=False)
    assert final.status == "rejected" and final.error is not None
    assert final.error.code == "E_APPROVAL_REJECTED"
    assert any(r["event"] == "approval.rejected" for r in logs)
    assert snapshot(world.notes) == before
    assert not (world.staging.state_dir / "gates" / job.id).exists()


async def test_a_host_change_since_the_run_refuses_the_approval(world: World) -> None:
    await staging_works(world)
    seed(world.notes)
    job = await gated(world, [["append", "mod.txt", "job\n"], ["write", "new.txt", "n"]])
    await world.burst()
    (world.notes / "mod.txt").write_text("a person edited it meanwhile\n")
    (world.notes / "new.txt").write_text("and made this\n")
    now = snapshot(world.notes)
    with pytest.raises(CommitConflict) as caught:
        await answer(world, job.id)
    assert "mod.txt" in caught.value.message and "new.txt" in caught.value.message
    assert snapshot(world.notes) == now  # nothing half-applied
    still = await world.broker.get_result(job.id)
    assert still is not None and still.status == "awaiting_approval"
    # It can still be rejected.
    assert (await answer(world, job.id, approve=False)).status == "rejected"
    assert snapshot(world.notes) == now


async def test_a_gate_nobody_answers_expires(world: World) -> None:
    await staging_works(world)
    seed(world.notes)
    before = snapshot(world.notes)
    job = await gated(world, [["write", "new.txt", "n"]])
    await world.burst(approval_ttl_s=60)
    assert await world.supervisor().expire_gates() == 0  # not yet
    sup = world.supervisor(clock=lambda: time.time() + 61)
    with capture_logs() as logs:
        assert await sup.expire_gates() == 1
    assert any(r["event"] == "approval.expired" for r in logs)
    final = await world.broker.get_result(job.id)
    assert final is not None and final.status == "rejected"
    assert final.error is not None and final.error.code == "E_APPROVAL_EXPIRED"
    assert snapshot(world.notes) == before
    with pytest.raises(ApprovalUnavailable):
        await answer(world, job.id)


async def test_a_gated_job_that_cannot_be_staged_is_refused_before_it_runs(
    tmp_path: Path,
) -> None:
    w = make_world(tmp_path, overlay=False)
    try:
        seed(w.notes)
        before = snapshot(w.notes)
        job = await gated(w, [["write", "new.txt", "n"]])
        await w.burst()
        result = await w.broker.get_result(job.id)
        assert result is not None and result.status == "rejected"
        assert result.error is not None and result.error.code == "E_APPROVAL_UNAVAILABLE"
        assert "cannot be staged" in result.error.message and result.exit is None
        assert snapshot(w.notes) == before
    finally:
        await w.staging.aclose()


async def test_branches_one_approved_the_other_never_reaches_the_folder(
    world: World, tmp_path: Path
) -> None:
    await staging_works(world)
    seed(world.notes)
    first = await gated(world, [["write", "plan.txt", "approach A\n"], ["rm", "del.txt"]])
    second = Job(
        executor="mutate",
        args={"root": "~/notes", "ops": [["write", "plan.txt", "approach B\n"]]},
        branch_of=first.id,
    )
    await world.broker.submit(second)
    await world.burst()
    for job in (first, second):
        got = await world.broker.get_result(job.id)
        assert got is not None and got.status == "awaiting_approval", got
    with capture_logs() as logs:
        final = await answer(world, second.id)
    assert final.status == "succeeded"
    assert (world.notes / "plan.txt").read_text() == "approach B\n"
    assert (world.notes / "del.txt").exists()  # the first candidate's change never landed
    other = await world.broker.get_result(first.id)
    assert other is not None and other.status == "rejected"
    assert other.error is not None and "another branch" in other.error.message
    assert any(r["event"] == "approval.rejected" and r["reason"] == "branch" for r in logs)
    # Byte-exactly the approved candidate's tree.
    direct = make_world(tmp_path / "direct")
    try:
        seed(direct.notes)
        assert (await direct.run([["write", "plan.txt", "approach B\n"]])).status == "succeeded"
        assert snapshot(world.notes) == snapshot(direct.notes)
    finally:
        await direct.staging.aclose()
    shutil.rmtree(tmp_path / "direct", ignore_errors=True)
