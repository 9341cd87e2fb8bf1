"""Issue 21, acceptance 1 and 2 with real parts: real ``metnos-exec worker`` processes, a
real SQLite queue, real bubblewrap and overlays.

A gated job awaits approval while a second job runs on the one slot; the worker is
SIGKILLed while the gate waits; a new worker on the same state folder approves it, and is
itself SIGKILLed half-way through applying it (``METNOS_TEST_PAUSE_COMMIT``); a third
worker rolls the half commit back before serving anything, the approval is delivered again
and commits: the folder is byte-identical to a direct run of the job, never a mix."""

from __future__ import annotations

import os
import shutil
import signal
import stat
from pathlib import Path

import pytest

from metnos_exec.messages import APPROVE_EXECUTOR, Job, Result
from tests.test_worker_process import Workers, events, wait_until, with_broker
from tests.undo.helpers import bwrap_works, seed, snapshot, write_executor

pytestmark = pytest.mark.slow

OPS = [
    ["write", "a.txt", "A\n"],
    ["append", "mod.txt", "job\n"],
    ["rm", "del.txt"],
    ["mv", "mv.txt", "moved.txt"],
    ["chmod", "tool.sh", "700"],
    ["rmtree", "sub"],
    ["write", "b.txt", "B\n"],
    ["write", "c.txt", "C\n"],
]


def direct_run(notes: Path) -> None:
    """What the job does, done to `notes` directly (the byte-exact reference)."""
    (notes / "a.txt").write_text("A\n")
    with open(notes / "mod.txt", "a") as f:
        f.write("job\n")
    (notes / "del.txt").unlink()
    os.rename(notes / "mv.txt", notes / "moved.txt")
    os.chmod(notes / "tool.sh", 0o700)
    shutil.rmtree(notes / "sub")
    (notes / "b.txt").write_text("B\n")
    (notes / "c.txt").write_text("C\n")


def result_of(url: str, job_id: str) -> Result | None:
    found: Result | None = with_broker(url, lambda b: b.get_result(job_id))
    return found


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_kill_9_while_waiting_and_mid_approval(tmp_path: Path, backend: str) -> None:
    bwrap_works()
    home = tmp_path / "home"
    notes = home / "notes"
    notes.mkdir(parents=True)
    seed(notes)
    before = snapshot(notes)
    reference = tmp_path / "reference"
    shutil.copytree(notes, reference, symlinks=True)
    direct_run(reference)
    marker = tmp_path / "paused"
    state = tmp_path / "state"
    common = ("--visibility", "2", "--backend", backend, "--home", str(home))
    common += ("--state-dir", str(state), "--concurrency", "1")
    workers = Workers(tmp_path, write_executor(tmp_path))
    url = workers.url
    try:
        log_a = workers.start("A", *common)
        gated = Job(executor="mutate", args={"root": "~/notes", "ops": OPS}, commit="approve")
        other = Job(executor="mutate", args={"root": "~/notes", "ops": []})
        with_broker(url, lambda b: b.submit(gated))
        with_broker(url, lambda b: b.submit(other))
        waiting = wait_until(lambda: result_of(url, gated.id), 30, "the gated job")
        assert waiting.status == "awaiting_approval", waiting
        assert waiting.changes is not None and waiting.changes.total >= 7
        # One slot, and the second job ran while the first waited.
        ran = wait_until(lambda: result_of(url, other.id), 30, "the second job")
        assert ran.status == "succeeded", ran
        assert snapshot(notes) == before
        assert events(log_a, event="approval.waiting")

        workers.procs[0].send_signal(signal.SIGKILL)
        workers.procs[0].wait()
        assert snapshot(notes) == before

        # A new worker, the same state folder: it approves, and dies half-way through.
        workers.start("B", *common, env={"METNOS_TEST_PAUSE_COMMIT": str(marker)})
        approve = Job(executor=APPROVE_EXECUTOR, args={"job_id": gated.id})
        with_broker(url, lambda b: b.submit(approve))
        wait_until(marker.exists, 30, "the approval's commit to reach its middle")
        assert snapshot(notes) != before  # half applied, for real
        workers.procs[1].send_signal(signal.SIGKILL)
        workers.procs[1].wait()

        log_c = workers.start("C", *common)
        recovered = wait_until(
            lambda: events(log_c, event="journal.recovered"), 30, "the journal recovery"
        )
        assert [(r["job_id"], r["action"]) for r in recovered] == [(gated.id, "rolled_back")]
        answered = wait_until(lambda: result_of(url, approve.id), 60, "the approval")
        assert answered.status == "succeeded", answered
        assert answered.attempt == 2 and answered.worker == "C"
        final = result_of(url, gated.id)
        assert final is not None and final.status == "succeeded" and len(final.undo_ids) == 1
        assert final.changes is not None and final.changes.committed
        assert snapshot(notes) == snapshot(reference)  # byte-identical to a direct run
        assert stat.S_IMODE(os.stat(notes / "tool.sh").st_mode) == 0o700
        assert events(log_c, event="approval.granted")
        assert not (state / "gates" / gated.id).exists()
        workers.procs[2].send_signal(signal.SIGTERM)
        assert workers.procs[2].wait(10) == 0
    finally:
        workers.close()
