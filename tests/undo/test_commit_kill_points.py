"""Issue 15, item 5, through real worker processes: a worker killed between the ``mkdir``
of a folder its job made of a file and that folder's ``chmod``.

The outside chaos run found it by chance (1 mix in 50 random kills): after recovery the
path was an empty 0700 folder and the original file was gone. Here the worker dies at
exactly that step (`metnos_exec.undo.journal.CRASH_ENV` = ``chmod:0``, the commit's first
``chmod``); a new worker process on the same state folder must roll the half commit back
before serving anything, so the tree is exactly as before (the file, its mode, its mtime);
the job, redelivered, commits fully; its undo, and the undo of that undo, are exact. Every
step of every kind of commit is crashed at in ``tests/undo/test_crash_points.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from metnos_exec.messages import Job, Result
from metnos_exec.sandbox.bwrap import bwrap_probe
from metnos_exec.undo.journal import CRASH_ENV, CRASH_EXIT
from tests.conftest import need
from tests.test_worker_process import Workers, events, wait_until, with_broker
from tests.undo.helpers import write_executor
from tests.undo.test_type_changes import full_snapshot

pytestmark = pytest.mark.slow


def _result(url: str, job_id: str) -> Result | None:
    return with_broker(url, lambda b: b.get_result(job_id))  # type: ignore[no-any-return]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_worker_killed_between_mkdir_and_chmod_leaves_no_mix(
    tmp_path: Path, backend: str
) -> None:
    probe = bwrap_probe()
    need(probe.working, f"bubblewrap cannot build a sandbox here: {probe.error}")
    home = tmp_path / "home"
    notes = home / "notes"
    notes.mkdir(parents=True)
    (notes / "f").write_text("a file becoming a folder\n")
    os.chmod(notes / "f", 0o640)
    os.utime(notes / "f", ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    before = full_snapshot(notes)
    common = ("--visibility", "2", "--backend", backend, "--home", str(home))
    common += ("--state-dir", str(tmp_path / "state"))
    workers = Workers(tmp_path, write_executor(tmp_path))
    try:
        workers.start("A", *common, env={CRASH_ENV: "chmod:0"})
        ops = [["rm", "f"], ["mkdir", "f"], ["write", "f/x", "x\n"]]
        job = Job(executor="mutate", args={"root": "~/notes", "ops": ops}, max_attempts=3)
        with_broker(workers.url, lambda b: b.submit(job))
        assert workers.procs[0].wait(60) == CRASH_EXIT
        # Killed where the chaos run's worker was: the folder made, its mode not set.
        half = full_snapshot(notes)
        assert half == {"f": ("dir", "0o700", *half["f"][2:])}

        log_b = workers.start("B", *common)
        recovered = wait_until(
            lambda: events(log_b, event="journal.recovered"), 30, "the journal recovery"
        )
        assert [(r["job_id"], r["action"], r["left"]) for r in recovered] == [
            (job.id, "rolled_back", [])
        ]
        assert full_snapshot(notes) == before

        result = wait_until(lambda: _result(workers.url, job.id), 30, "the rerun")
        assert result.status == "succeeded" and result.attempt == 2, result
        after = full_snapshot(notes)
        assert after["f"][:2] == ("dir", "0o755") and (notes / "f" / "x").read_text() == "x\n"

        undo = Job(executor="metnos:undo", args={"job_id": job.id})
        with_broker(workers.url, lambda b: b.submit(undo))
        undone = wait_until(lambda: _result(workers.url, undo.id), 30, "the undo")
        assert undone.status == "succeeded", undone
        assert full_snapshot(notes) == before
        redo = Job(executor="metnos:undo", args={"job_id": undo.id})
        with_broker(workers.url, lambda b: b.submit(redo))
        redone = wait_until(lambda: _result(workers.url, redo.id), 30, "the undo of the undo")
        assert redone.status == "succeeded", redone
        assert full_snapshot(notes) == after
    finally:
        workers.close()
