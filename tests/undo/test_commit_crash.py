"""Issue 10, acceptance 3: kill -9 of a real worker in the middle of a commit.

A real ``metnos-exec worker`` process (SQLite queue, real bubblewrap, real overlays) is
stopped half-way through applying a job's changes by the test hook
(``METNOS_TEST_PAUSE_COMMIT``: the commit creates the marker file and blocks), then
SIGKILLed. The tree is then half-committed on purpose. A new worker process on the same
state folder must, before serving anything, roll the half commit back (the job's result
was never stored), so the tree is exactly as before the job; the job, redelivered once its
lease lapses, then runs again and commits fully, with its undo entry; undoing it brings
back the tree from before. Never a mix. Both backends.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from metnos_exec.messages import Job, Result
from metnos_exec.sandbox.bwrap import bwrap_probe
from tests.conftest import need
from tests.test_worker_process import Workers, events, has_event, wait_until, with_broker
from tests.undo.helpers import seed, snapshot, write_executor

pytestmark = pytest.mark.slow

OPS = [
    ["write", "a.txt", "A\n"],
    ["append", "mod.txt", "job\n"],
    ["rm", "del.txt"],
    ["write", "b.txt", "B\n"],
    ["mv", "mv.txt", "moved.txt"],
    ["chmod", "tool.sh", "700"],
    ["rmtree", "sub"],
    ["write", "c.txt", "C\n"],
]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_kill_9_mid_commit_leaves_all_or_nothing(tmp_path: Path, backend: str) -> None:
    probe = bwrap_probe()
    need(probe.working, f"bubblewrap cannot build a sandbox here: {probe.error}")
    home = tmp_path / "home"
    notes = home / "notes"
    notes.mkdir(parents=True)
    seed(notes)
    before = snapshot(notes)
    executors = write_executor(tmp_path)
    marker = tmp_path / "paused"
    state = tmp_path / "state"
    common = ("--visibility", "2", "--backend", backend, "--home", str(home))
    common += ("--state-dir", str(state))
    workers = Workers(tmp_path, executors)
    try:
        log_a = workers.start("A", *common, env={"METNOS_TEST_PAUSE_COMMIT": str(marker)})
        job = Job(executor="mutate", args={"root": "~/notes", "ops": OPS}, max_attempts=3)
        with_broker(workers.url, lambda b: b.submit(job))
        wait_until(marker.exists, 30, "the commit to reach its middle")
        if not has_event(log_a, "job.started", job.id):  # pragma: no cover - diagnosis
            raise AssertionError(events(log_a))
        half = snapshot(notes)
        assert half != before  # the kill lands in the middle, for real
        workers.procs[0].send_signal(signal.SIGKILL)
        workers.procs[0].wait()

        log_b = workers.start("B", *common)
        recovered = wait_until(
            lambda: events(log_b, event="journal.recovered"), 30, "the journal recovery"
        )
        assert [(r["job_id"], r["action"]) for r in recovered] == [(job.id, "rolled_back")]
        assert recovered[0]["left"] == []
        # Recovery runs before the first lease: nothing of the job is left.
        assert snapshot(notes) == before
        assert with_broker(workers.url, lambda b: b.get_result(job.id)) is None

        result: Result = wait_until(
            lambda: with_broker(workers.url, lambda b: b.get_result(job.id)), 30, "the rerun"
        )
        assert result.status == "succeeded", result
        assert result.worker == "B" and result.attempt == 2 and len(result.undo_ids) == 1
        after = snapshot(notes)
        assert (notes / "a.txt").read_text() == "A\n" and (notes / "c.txt").read_text() == "C\n"
        assert (notes / "mod.txt").read_text() == "old content\njob\n"
        assert "del.txt" not in after and "sub" not in after and "moved.txt" in after
        assert after["tool.sh"][1] == "0o700"
        records = with_broker(workers.url, lambda b: b.get_undo(result.undo_ids))
        assert len(records) == 1 and records[0].entry.job_id == job.id

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
