"""Issue 15, item 7: a worker never settles another queue's commit journal.

Two queues (two SQLite files) served by real ``metnos-exec worker`` processes on one
machine, sharing one state folder (as they did by default): recovery looked the journal's
job up in its own queue, found nothing, and rolled back a commit the other queue had
acknowledged as ``succeeded`` (170 operations; its undo then refused). A journal now
names its queue and device; another queue's worker leaves it (``journal.recovered``,
action ``skipped``), and the default state folder is per queue.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import msgspec
import pytest

from metnos_exec.brokers.base import Broker, JobState
from metnos_exec.messages import Job, Result
from metnos_exec.undo.journal import reverse_ops
from metnos_exec.undo.staging import default_state_dir
from tests.test_worker_process import Workers, events, wait_until, with_broker
from tests.undo.helpers import bwrap_works, seed, snapshot, write_executor

pytestmark = pytest.mark.slow

OPS = [
    ["write", "a.txt", "A\n"],
    ["append", "mod.txt", "job\n"],
    ["rm", "del.txt"],
    ["write", "b.txt", "B\n"],
    ["write", "c.txt", "C\n"],
]


def _setup(tmp_path: Path) -> tuple[Workers, Path, tuple[str, ...], str, str]:
    bwrap_works()
    home = tmp_path / "home"
    notes = home / "notes"
    notes.mkdir(parents=True)
    seed(notes)
    workers = Workers(tmp_path, write_executor(tmp_path))
    common = ("--home", str(home), "--state-dir", str(tmp_path / "state"), "--visibility", "2")
    return (
        workers,
        notes,
        common,
        f"sqlite:///{tmp_path / 'q1.db'}",
        f"sqlite:///{tmp_path / 'q2.db'}",
    )


def queue_id_of(url: str) -> str:
    async def get(broker: Broker) -> str:
        return broker.queue_id

    return str(with_broker(url, get))


def lease_lapsed(url: str, job_id: str) -> bool:
    async def get(broker: Broker) -> JobState | None:
        return await broker.get_job_state(job_id)

    state = with_broker(url, get)
    return state is not None and (state.lease_until or 0.0) < time.time()


def _run(workers: Workers, url: str, wid: str, *extra: str) -> Path:
    """A burst worker on `url` (it serves what is queued, then exits 0)."""
    workers.url = url
    log = workers.start(wid, *extra, "--burst")
    assert workers.procs[-1].wait(60) == 0
    return log


def test_a_half_commit_is_left_to_its_own_queue(tmp_path: Path) -> None:
    workers, notes, common, q1, q2 = _setup(tmp_path)
    before = snapshot(notes)
    marker = tmp_path / "paused"
    try:
        job = Job(executor="mutate", args={"root": "~/notes", "ops": OPS}, max_attempts=3)
        with_broker(q1, lambda b: b.submit(job))
        workers.url = q1
        workers.start("A", *common, env={"METNOS_TEST_PAUSE_COMMIT": str(marker)})
        wait_until(marker.exists, 30, "the commit to reach its middle")
        workers.procs[0].send_signal(signal.SIGKILL)
        workers.procs[0].wait()
        half = snapshot(notes)
        assert half != before

        # Another queue's worker on the same state folder: it must not touch q1's commit.
        with_broker(q2, lambda b: b.submit(Job(executor="mutate", args={"root": "~/notes"})))
        log = _run(workers, q2, "Q2", *common)
        skipped = events(log, event="journal.recovered")
        assert [(r["job_id"], r["action"]) for r in skipped] == [(job.id, "skipped")]
        assert "another queue" in skipped[0]["reason"]
        assert snapshot(notes) == half

        # q1's own worker settles it (rolled back: never acknowledged), then reruns it,
        # once the dead worker's lease has lapsed (a burst worker leases what it can now).
        wait_until(lambda: lease_lapsed(q1, job.id), 30, "the dead worker's lease to lapse")
        log = _run(workers, q1, "Q1", *common)
        recovered = events(log, event="journal.recovered")
        assert [(r["job_id"], r["action"]) for r in recovered] == [(job.id, "rolled_back")]
        result: Result = with_broker(q1, lambda b: b.get_result(job.id))
        assert result.status == "succeeded" and result.attempt == 2, result
        assert (notes / "mod.txt").read_text() == "old content\njob\n"
        assert list((tmp_path / "state" / "journal").iterdir()) == []
    finally:
        workers.close()


@pytest.mark.parametrize("stamped", [True, False], ids=["journal-names-queue", "old-journal"])
def test_an_acknowledged_commit_survives_another_queues_recovery(
    tmp_path: Path, stamped: bool
) -> None:
    """The commit was acknowledged, its worker died before it removed the journal (the
    journal is left as that worker would have left it, in the format it wrote: naming its
    queue, or from before journals did)."""
    workers, notes, common, q1, q2 = _setup(tmp_path)
    before = snapshot(notes)
    try:
        job = Job(executor="mutate", args={"root": "~/notes", "ops": OPS})
        with_broker(q1, lambda b: b.submit(job))
        _run(workers, q1, "Q1", *common)
        result: Result = with_broker(q1, lambda b: b.get_result(job.id))
        assert result.status == "succeeded" and len(result.undo_ids) == 1, result
        after = snapshot(notes)
        [record] = with_broker(q1, lambda b: b.get_undo(result.undo_ids))
        entry = record.entry
        left: dict[str, object] = {
            "v": 1,
            "id": "01J0000000000000000000LEFT",
            "job_id": job.id,
            "entry_id": entry.id,
            "roots": list(entry.roots),
            "ops": msgspec.to_builtins(reverse_ops(entry.ops)),
            "pid": 1,
        }
        if stamped:
            left["queue"] = queue_id_of(q1)
            left["device"] = "server"
        journal = tmp_path / "state" / "journal" / f"{left['id']}.journal"
        journal.write_bytes(msgspec.json.encode(left))

        log = _run(workers, q2, "Q2", *common)
        [skipped] = events(log, event="journal.recovered")
        assert (skipped["job_id"], skipped["action"]) == (job.id, "skipped")
        assert snapshot(notes) == after  # not rolled back by a queue that never had it
        assert journal.exists()

        log = _run(workers, q1, "Q1b", *common)
        [kept] = events(log, event="journal.recovered")
        assert (kept["job_id"], kept["action"]) == (job.id, "kept")
        assert not journal.exists() and snapshot(notes) == after
        undo = Job(executor="metnos:undo", args={"job_id": job.id})
        with_broker(q1, lambda b: b.submit(undo))
        _run(workers, q1, "Q1c", *common)
        undone: Result = with_broker(q1, lambda b: b.get_result(undo.id))
        assert undone.status == "succeeded", undone
        assert snapshot(notes) == before
    finally:
        workers.close()


def test_the_default_state_folder_is_per_queue_and_an_old_one_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("METNOS_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    base = tmp_path / "xdg" / "metnos-exec"
    one = queue_id_of(f"sqlite:///{tmp_path / 'q1.db'}")
    two = queue_id_of(f"sqlite:///{tmp_path / 'q2.db'}")
    assert one != two
    assert default_state_dir(queue=one) != default_state_dir(queue=two)
    assert default_state_dir(queue=one).parent == base / "queues"
    assert default_state_dir(queue=one).name.startswith("sqlite-")
    assert default_state_dir(queue=one) == default_state_dir(queue=one)
    assert default_state_dir() == base
    # An install from before: its one folder holds the blobs and key of entries already
    # recorded, so it stays every queue's (their journals now name their queue).
    (base / "blobs").mkdir(parents=True)
    assert default_state_dir(queue=one) == base == default_state_dir(queue=two)
    monkeypatch.setenv("METNOS_STATE_DIR", str(tmp_path / "explicit"))
    assert default_state_dir(queue=one) == tmp_path / "explicit"


def test_two_queues_workers_default_to_two_state_folders(tmp_path: Path) -> None:
    workers, notes, _, q1, q2 = _setup(tmp_path)
    xdg = tmp_path / "xdg"
    env = {"XDG_STATE_HOME": str(xdg), "METNOS_STATE_DIR": ""}
    try:
        for wid, url in (("Q1", q1), ("Q2", q2)):
            job = Job(executor="mutate", args={"root": "~/notes", "ops": [["write", wid, wid]]})
            with_broker(url, lambda b, job=job: b.submit(job))
            workers.url = url
            workers.start(wid, "--home", str(notes.parent), "--burst", env=env)
            assert workers.procs[-1].wait(60) == 0
            result: Result = with_broker(url, lambda b, job=job: b.get_result(job.id))
            assert result.status == "succeeded", result
        folders = sorted(os.listdir(xdg / "metnos-exec" / "queues"))
        assert len(folders) == 2 and all(f.startswith("sqlite-") for f in folders), folders
        assert not (xdg / "metnos-exec" / "blobs").exists()
    finally:
        workers.close()


@pytest.mark.anyio
async def test_a_blob_store_another_queue_uses_is_not_collected(tmp_path: Path) -> None:
    """Collection keeps what *this* queue's entries need: in a store another queue's
    worker also keeps its blobs in, it deleted that queue's originals (its undo then
    found them gone). Such a store is now left alone, and said."""
    from structlog.testing import capture_logs

    from metnos_exec.brokers.memory import MemoryBroker
    from metnos_exec.undo.staging import Staging

    staging = Staging(tmp_path / "state", overlay=False)
    mine, theirs = MemoryBroker(), MemoryBroker()
    digest = staging.store.put_bytes(b"another queue's original")
    staging.serves(mine.queue_id)
    staging.serves(mine.queue_id)  # idempotent: one note per queue
    await staging.collect(mine, min_age_s=0)
    assert not staging.store.has(digest)  # one queue: collected as before

    digest = staging.store.put_bytes(b"another queue's original")
    staging.serves(theirs.queue_id)
    with capture_logs() as logs:
        await staging.collect(mine, min_age_s=0)
    assert staging.store.has(digest)
    [said] = [r for r in logs if r["event"] == "worker.error"]
    assert theirs.queue_id in said["error"] and "not collected" in said["error"]
