"""Issue 15, item 8: a commit longer than the lease window keeps its job.

A real worker (SQLite queue, real bubblewrap, real overlays, a 1 s lease window) is held
in the middle of a job's commit by the test hook (``METNOS_TEST_PAUSE_COMMIT``) for
several windows. Its heartbeats must go on through the commit: a second worker on the
same queue and state folder must never be handed the job meanwhile (on main at 0a203bb
it was, ran it on the half-committed folder, and stored a final ``failed`` while the first
then rolled back). Once the first dies, the second settles the half commit (rolled back)
before it runs the job again, from the tree as it was.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import anyio
import pytest

from metnos_exec.messages import Job, Result
from metnos_exec.undo.folder_lock import FolderLock
from tests.test_worker_process import Workers, events, wait_until, with_broker
from tests.undo.helpers import (
    bwrap_works,
    make_world,
    seed,
    snapshot,
    staging_works,
    wait_for,
    write_executor,
)

VISIBILITY_S = 1.0
OPS = [
    ["write", "a.txt", "A\n"],
    ["append", "mod.txt", "job\n"],
    ["rm", "del.txt"],
    ["write", "b.txt", "B\n"],
    ["write", "c.txt", "C\n"],
]


@pytest.mark.slow
def test_a_commit_longer_than_the_lease_is_not_run_again_meanwhile(tmp_path: Path) -> None:
    bwrap_works()
    home = tmp_path / "home"
    notes = home / "notes"
    notes.mkdir(parents=True)
    seed(notes)
    before = snapshot(notes)
    marker = tmp_path / "paused"
    common = ("--visibility", str(VISIBILITY_S), "--home", str(home))
    common += ("--state-dir", str(tmp_path / "state"))
    workers = Workers(tmp_path, write_executor(tmp_path))
    try:
        workers.start("A", *common, env={"METNOS_TEST_PAUSE_COMMIT": str(marker)})
        job = Job(executor="mutate", args={"root": "~/notes", "ops": OPS}, max_attempts=3)
        with_broker(workers.url, lambda b: b.submit(job))
        wait_until(marker.exists, 30, "the commit to reach its middle")
        assert snapshot(notes) != before  # held half-way, for real
        log_b = workers.start("B", *common)
        wait_until(lambda: events(log_b, event="worker.started"), 30, "worker B to start")
        # Five lease windows with the commit held: the lease must stay A's throughout.
        deadline = time.monotonic() + 5 * VISIBILITY_S
        while time.monotonic() < deadline:  # polling for an absence, with a deadline
            assert not events(log_b, event="job.received", job=job.id), "B was handed the job"
            state = with_broker(workers.url, lambda b: b.get_job_state(job.id))
            assert state is not None and state.attempt == 1, state
            time.sleep(0.1)
        assert with_broker(workers.url, lambda b: b.get_result(job.id)) is None

        workers.procs[0].send_signal(signal.SIGKILL)
        workers.procs[0].wait()
        result: Result = wait_until(
            lambda: with_broker(workers.url, lambda b: b.get_result(job.id)), 30, "the rerun"
        )
        assert result.status == "succeeded", result
        assert result.worker == "B" and result.attempt == 2
        recovered = events(log_b, event="journal.recovered")
        assert [(r["job_id"], r["action"]) for r in recovered] == [(job.id, "rolled_back")]
        assert (notes / "mod.txt").read_text() == "old content\njob\n"  # once, not twice
        undo = Job(executor="metnos:undo", args={"job_id": job.id})
        with_broker(workers.url, lambda b: b.submit(undo))
        undone: Result = wait_until(
            lambda: with_broker(workers.url, lambda b: b.get_result(undo.id)), 30, "the undo"
        )
        assert undone.status == "succeeded", undone
        assert snapshot(notes) == before
        workers.procs[1].send_signal(signal.SIGTERM)
        assert workers.procs[1].wait(10) == 0
    finally:
        workers.close()


@pytest.mark.anyio
async def test_a_job_is_staged_only_once_a_commit_on_its_folder_is_settled(
    tmp_path: Path,
) -> None:
    """Another worker's commit of the folder (held here: its lock taken, a file half
    changed) is unsettled when a job on the folder arrives: a redelivered job whose
    predecessor is still committing, or any other. The job must start from the settled
    tree, not stage over the half-changed one (its commit then conflicted with the
    roll-back, or layered its change on a state that never stood)."""
    world = make_world(tmp_path)
    try:
        await staging_works(world)
        seed(world.notes)
        mod = world.notes / "mod.txt"
        job = Job(
            executor="mutate", args={"root": "~/notes", "ops": [["append", "mod.txt", "job\n"]]}
        )
        sup = world.supervisor(idle_poll_s=0.01)
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            lock = FolderLock([str(world.notes)])
            try:
                mod.write_text("half applied\n")  # the other commit, half-way
                await world.broker.submit(job)
                with anyio.move_on_after(3 * VISIBILITY_S):  # it must not finish meanwhile
                    await wait_for(lambda: world.broker._results.get(job.id), 10)
                assert await world.broker.get_result(job.id) is None
                mod.write_text("old content\n")  # ... rolled back
            finally:
                lock.release()
            await wait_for(lambda: world.broker._results.get(job.id), 20)
            await sup.drain(0)
        result = await world.broker.get_result(job.id)
        assert result is not None and result.status == "succeeded", result
        assert mod.read_text() == "old content\njob\n"
    finally:
        await world.staging.aclose()


@pytest.mark.anyio
async def test_an_undo_waits_for_another_committer_of_its_folder(tmp_path: Path) -> None:
    """An undo checks and replaces like a commit: while another process's commit of the
    folder holds it (here: its lock taken, the file being replaced), the undo must not
    check and apply in between; it applies once the other is settled."""
    world = make_world(tmp_path)
    try:
        await staging_works(world)
        seed(world.notes)
        before = snapshot(world.notes)
        done = await world.run([["append", "mod.txt", "job\n"]])
        assert done.status == "succeeded", done
        undo = Job(executor="metnos:undo", args={"job_id": done.job_id})
        sup = world.supervisor(idle_poll_s=0.01)
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            lock = FolderLock([str(world.notes)])
            try:
                await world.broker.submit(undo)
                with anyio.move_on_after(3 * VISIBILITY_S):  # it must not finish meanwhile
                    await wait_for(lambda: world.broker._results.get(undo.id), 10)
                assert await world.broker.get_result(undo.id) is None
                assert (world.notes / "mod.txt").read_text() == "old content\njob\n"
            finally:
                lock.release()
            await wait_for(lambda: world.broker._results.get(undo.id), 20)
            await sup.drain(0)
        result = await world.broker.get_result(undo.id)
        assert result is not None and result.status == "succeeded", result
        assert snapshot(world.notes) == before
    finally:
        await world.staging.aclose()
