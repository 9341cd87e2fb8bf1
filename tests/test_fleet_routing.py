"""Executor routing on real worker processes (issue 18, item 3; acceptance 3).

Two workers with disjoint executor folders and one with both, 1,000 mixed jobs, on SQLite
and on a private redis-server: every job is run by a worker that has its executor, none
is rejected, none runs twice. A job for an executor no worker has waits (no attempt
spent), ``status`` names it, and a client refuses the next one at submit.
"""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from metnos_exec.brokers import Broker
from metnos_exec.messages import Job, Result
from tests.helpers.redis_server import RedisServer
from tests.test_worker_process import Workers, has_event, wait_until, with_broker

pytestmark = pytest.mark.slow

ECHO = {"METNOS_ARM_OVERRIDE": "echo"}  # the queue and the routing are measured, not a run

MANIFEST = """\
name = "{name}"
version = "1"
runtime = "python"
entry = "main.py"
[args.i]
type = "integer"
"""


def _folder(root: Path, *names: str) -> Path:
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "manifest.toml").write_text(MANIFEST.format(name=name))
        (root / name / "main.py").write_text("print('{}')\n")
    return root


@pytest.fixture(params=["sqlite", "redis"])
def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Workers]:
    w = Workers(tmp_path, tmp_path / "unused")
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        w.url = f"{server.url}?prefix={tmp_path.name}&poll_interval_s=0.02"
    try:
        yield w
    finally:
        w.close()


def _status(url: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-m", "metnos_exec", "status", "--json", "--broker", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    doc: dict[str, object] = json.loads(out.stdout)
    return doc


def test_heterogeneous_workers_run_only_what_they_have(fleet: Workers, tmp_path: Path) -> None:
    folders = {
        "A": _folder(tmp_path / "ex-a", "alpha"),
        "B": _folder(tmp_path / "ex-b", "beta"),
        "AB": _folder(tmp_path / "ex-ab", "alpha", "beta"),
    }
    logs = {
        wid: fleet.start(wid, "--concurrency", "8", env=ECHO, executors=folder)
        for wid, folder in folders.items()
    }
    for log in logs.values():
        wait_until(functools.partial(has_event, log, "worker.started"), 20, "workers up")
    jobs = [Job(executor=("alpha", "beta")[i % 2], args={"i": i}) for i in range(1000)]
    orphan = Job(executor="gamma")
    with_broker(fleet.url, lambda b: b.submit_many([*jobs, orphan]))

    def done() -> bool:
        return bool(with_broker(fleet.url, lambda b: b.stats()).done >= 1000)

    wait_until(done, 120, "1000 results")

    async def fetch(b: Broker) -> list[Result | None]:
        return [await b.get_result(j.id) for j in jobs]

    results: list[Result | None] = with_broker(fleet.url, fetch)
    serves = {"alpha": {"A", "AB"}, "beta": {"B", "AB"}}
    for job, r in zip(jobs, results, strict=True):
        assert r is not None and r.status == "succeeded", (job, r)
        assert r.worker in serves[job.executor] and r.attempt == 1, (job, r)
    ran = {r.worker for r in results if r is not None}
    assert ran == {"A", "B", "AB"}  # every worker took part
    for log in logs.values():
        assert not [rec for rec in _records(log) if rec.get("event") == "job.rejected"]

    # The job nobody can run waits, untouched, and status says why.
    state = with_broker(fleet.url, lambda b: b.get_job_state(orphan.id))
    assert state is not None and (state.state, state.attempt) == ("queued", 0)
    doc = _status(fleet.url)
    assert doc["waiting_for_a_worker"] == [{"device": "server", "executor": "gamma", "queued": 1}]
    listed = {w["id"]: w for w in doc["workers"]}  # type: ignore[attr-defined]
    assert {k: (v["state"], sorted(v["executors"])) for k, v in listed.items()} == {
        "A": (
            "live",
            ["alpha", "metnos:approve", "metnos:checkpoint", "metnos:reject", "metnos:undo"],
        ),
        "B": (
            "live",
            ["beta", "metnos:approve", "metnos:checkpoint", "metnos:reject", "metnos:undo"],
        ),
        "AB": (
            "live",
            [
                "alpha",
                "beta",
                "metnos:approve",
                "metnos:checkpoint",
                "metnos:reject",
                "metnos:undo",
            ],
        ),
    }

    for p in fleet.procs:
        p.send_signal(signal.SIGTERM)
    assert [p.wait(20) for p in fleet.procs] == [0, 0, 0]
    doc = _status(fleet.url)
    assert {w["state"] for w in doc["workers"]} == {"stopped"}  # type: ignore[attr-defined]
    assert doc["waiting_for_a_worker"] == [{"device": "server", "executor": "gamma", "queued": 1}]


def _records(log: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
