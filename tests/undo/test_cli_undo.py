"""``metnos-exec undo`` against a real worker process: exit codes scripts rely on."""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from metnos_exec.cli import EXIT
from metnos_exec.messages import UNDO_EXECUTOR, Job, Result
from tests.test_worker_process import Workers, events, has_event, wait_until, with_broker
from tests.undo.helpers import bwrap_works, seed, snapshot, write_executor

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("broker", ["sqlite", "redis"])
def test_undo_command(tmp_path: Path, broker: str, request: pytest.FixtureRequest) -> None:
    bwrap_works()
    home = tmp_path / "home"
    notes = home / "notes"
    notes.mkdir(parents=True)
    workers = Workers(tmp_path, write_executor(tmp_path))
    if broker == "redis":
        server = request.getfixturevalue("redis_server")
        workers.url = f"{server.url}?prefix={tmp_path.name}"
    env = {"METNOS_BROKER": workers.url, "HOME": str(home)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "metnos_exec", *args],
            env={**_environ(), **env},
            capture_output=True,
            text=True,
            timeout=60,
        )

    try:
        log = workers.start("W", "--home", str(home), "--state-dir", str(tmp_path / "state"))
        wait_until(lambda: has_event(log, "worker.started"), 20, "the worker")
        ops = json.dumps({"root": "~/notes", "ops": [["write", "a.txt", "by the job"]]})
        done = cli("submit", "mutate", "--args-json", ops, "--wait", "30", "--json")
        assert done.returncode == 0, done.stderr
        job_id = json.loads(done.stdout)["job_id"]
        (notes / "a.txt").write_text("edited afterwards")

        refused = cli("undo", job_id, "--wait", "30")
        assert refused.returncode == EXIT["rejected"], refused
        assert "E_UNDO_CONFLICT" in refused.stdout and "a.txt" in refused.stdout
        assert (notes / "a.txt").read_text() == "edited afterwards"

        (notes / "a.txt").write_text("by the job")
        undone = cli("undo", job_id, "--wait", "30", "--json")
        assert undone.returncode == 0, undone
        result = json.loads(undone.stdout)
        assert result["status"] == "succeeded" and result["output"]["undone"] == job_id
        assert not (notes / "a.txt").exists()

        again = cli("undo", job_id, "--wait", "30")
        assert again.returncode == EXIT["rejected"] and "already undone" in again.stdout
        queued = cli("undo", result["job_id"], "--no-wait")  # the undo of the undo
        assert queued.returncode == 0 and queued.stdout.strip()
        redo = cli("result", queued.stdout.strip(), "--wait", "30")
        assert redo.returncode == 0, redo
        assert (notes / "a.txt").read_text() == "by the job"
        workers.procs[0].send_signal(signal.SIGTERM)
        assert workers.procs[0].wait(20) == 0
    finally:
        workers.close()


class _Store:
    """The broker's store written directly, as anyone who can write it could (the
    outside suite did this to the SQLite file and the Redis keys)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def reset_undone(self, entry_id: str) -> None:
        if self.url.startswith("sqlite"):
            self._sql("UPDATE undo_entries SET undone_by = NULL WHERE id = ?", entry_id)
        else:
            self._redis(lambda r, k: r.hdel(k.base + "undo:" + entry_id, ["undone_by"]))

    def point_result_at(self, job_id: str, entry_ids: list[str]) -> None:
        if self.url.startswith("sqlite"):
            self._sql(
                "UPDATE results SET body = json_set(body, '$.undo_ids', json(?)) WHERE job_id = ?",
                json.dumps(entry_ids),
                job_id,
            )
            return

        async def graft(r: Any, k: Any) -> None:
            body = json.loads(await r.hget(k.job(job_id), "result"))
            body["undo_ids"] = entry_ids
            await r.hset(k.job(job_id), {"result": json.dumps(body)})

        self._redis(graft)

    def _sql(self, query: str, *args: str) -> None:
        path = self.url.removeprefix("sqlite:///")
        with contextlib.closing(sqlite3.connect(path, timeout=10)) as db, db:
            assert db.execute(query, args).rowcount == 1

    def _redis(self, fn: Callable[[Any, Any], Awaitable[Any]]) -> None:
        import anyio
        import coredis

        from metnos_exec.brokers.redis import Keys

        base, _, prefix = self.url.partition("?prefix=")

        async def main() -> None:
            client = coredis.Redis.from_url(base)
            async with client:
                await fn(client, Keys(prefix))

        anyio.run(main)


@pytest.mark.parametrize("broker", ["sqlite", "redis"])
def test_a_rewritten_broker_can_neither_replay_nor_graft_an_undo(
    tmp_path: Path, broker: str, request: pytest.FixtureRequest
) -> None:
    """Issue 15 item 9. The seal covers an entry, not its state: resetting its
    ``undone_by`` in the store made a second undo of the same job succeed (deleting the
    file the user had made since), and a result pointed at another job's entry made
    `undo` of that job apply it. Both are refused; undoing the undo still works."""
    bwrap_works()
    home = tmp_path / "home"
    notes = home / "notes"
    notes.mkdir(parents=True)
    workers = Workers(tmp_path, write_executor(tmp_path))
    if broker == "redis":
        server = request.getfixturevalue("redis_server")
        workers.url = f"{server.url}?prefix={tmp_path.name}"
    store = _Store(workers.url)
    env = {"METNOS_BROKER": workers.url, "HOME": str(home)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "metnos_exec", *args],
            env={**_environ(), **env},
            capture_output=True,
            text=True,
            timeout=60,
        )

    def run(ops: list[list[str]]) -> dict[str, Any]:
        args = json.dumps({"root": "~/notes", "ops": ops})
        done = cli("submit", "mutate", "--args-json", args, "--wait", "30", "--json")
        assert done.returncode == 0, done.stderr
        result: dict[str, Any] = json.loads(done.stdout)
        return result

    try:
        log = workers.start("W", "--home", str(home), "--state-dir", str(tmp_path / "state"))
        wait_until(lambda: has_event(log, "worker.started"), 20, "the worker")
        job = run([["write", "a.txt", "by the job"]])
        (entry_id,) = job["undo_ids"]
        undone = cli("undo", job["job_id"], "--wait", "30", "--json")
        assert undone.returncode == 0, undone
        undo_job = json.loads(undone.stdout)["job_id"]
        assert not (notes / "a.txt").exists()
        # The user makes the file again, as the job had left it: only the undone state
        # stands between a replayed undo and the user's file.
        (notes / "a.txt").write_text("by the job")

        store.reset_undone(entry_id)
        replay = cli("undo", job["job_id"], "--wait", "30")
        assert replay.returncode == EXIT["rejected"], replay
        assert "E_UNDO_UNAVAILABLE" in replay.stdout and "already undone" in replay.stdout
        assert undo_job in replay.stdout
        assert (notes / "a.txt").read_text() == "by the job"

        # Another job's result pointed at a sealed entry it never made (not undone yet).
        other = run([["write", "c.txt", "by job c"]])
        bystander = run([])
        assert bystander["undo_ids"] == []
        store.point_result_at(bystander["job_id"], other["undo_ids"])
        graft = cli("undo", bystander["job_id"], "--wait", "30")
        assert graft.returncode == EXIT["rejected"], graft
        assert "E_UNDO_UNAVAILABLE" in graft.stdout and other["job_id"] in graft.stdout
        assert (notes / "c.txt").read_text() == "by job c"

        # What people do still works: the undo of the undo, then the job's undo again.
        (notes / "a.txt").unlink()
        redo = cli("undo", undo_job, "--wait", "30")
        assert redo.returncode == 0, redo
        assert (notes / "a.txt").read_text() == "by the job"
        again = cli("undo", job["job_id"], "--wait", "30")
        assert again.returncode == 0, again
        assert not (notes / "a.txt").exists()
        assert cli("undo", other["job_id"], "--wait", "30").returncode == 0
        assert not (notes / "c.txt").exists()
        workers.procs[0].send_signal(signal.SIGTERM)
        assert workers.procs[0].wait(20) == 0
    finally:
        workers.close()


def _environ() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "METNOS_ARM_OVERRIDE"}


def test_an_undo_killed_half_way_leaves_the_job_undoable(tmp_path: Path) -> None:
    """The device's ledger marks an undo's entries before its first op; a worker killed
    half-way leaves the mark, and the recovery that rolls the half undo back removes it:
    the job can be undone by a new undo job (the dead one never comes back)."""
    bwrap_works()
    home = tmp_path / "home"
    notes = home / "notes"
    notes.mkdir(parents=True)
    seed(notes)
    before = snapshot(notes)
    marker = tmp_path / "paused"
    common = ("--visibility", "2", "--home", str(home), "--state-dir", str(tmp_path / "state"))
    workers = Workers(tmp_path, write_executor(tmp_path))
    try:
        log = workers.start("A0", *common)
        ops = [["write", "a.txt", "A\n"], ["append", "mod.txt", "job\n"], ["rm", "del.txt"]]
        job = Job(executor="mutate", args={"root": "~/notes", "ops": ops})
        with_broker(workers.url, lambda b: b.submit(job))
        wait_until(lambda: with_broker(workers.url, lambda b: b.get_result(job.id)), 30, "the job")
        after = snapshot(notes)
        workers.procs[0].send_signal(signal.SIGTERM)
        assert workers.procs[0].wait(20) == 0

        log = workers.start("A", *common, env={"METNOS_TEST_PAUSE_COMMIT": str(marker)})
        undo = Job(executor=UNDO_EXECUTOR, args={"job_id": job.id}, max_attempts=1)
        with_broker(workers.url, lambda b: b.submit(undo))
        wait_until(marker.exists, 30, "the undo to reach its middle")
        assert has_event(log, "job.started", undo.id)
        assert snapshot(notes) not in (before, after)  # half undone, for real
        workers.procs[1].send_signal(signal.SIGKILL)
        workers.procs[1].wait()

        log = workers.start("B", *common)
        recovered = wait_until(
            lambda: events(log, event="journal.recovered"), 30, "the journal recovery"
        )
        assert [(r["job_id"], r["action"]) for r in recovered] == [(undo.id, "rolled_back")]
        assert snapshot(notes) == after
        dead: Result = wait_until(
            lambda: with_broker(workers.url, lambda b: b.get_result(undo.id)), 30, "the dead undo"
        )
        assert dead.status == "dead", dead

        again = Job(executor=UNDO_EXECUTOR, args={"job_id": job.id})
        with_broker(workers.url, lambda b: b.submit(again))
        done: Result = wait_until(
            lambda: with_broker(workers.url, lambda b: b.get_result(again.id)), 30, "the undo"
        )
        assert done.status == "succeeded", done
        assert snapshot(notes) == before
        workers.procs[2].send_signal(signal.SIGTERM)
        assert workers.procs[2].wait(20) == 0
    finally:
        workers.close()
