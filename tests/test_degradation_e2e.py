"""Issue 2, acceptance 8, at worker level: each fallback trigger, on a real worker process.

A real ``metnos-exec worker`` (the CLI, ``--burst``) serves native jobs from a SQLite file
with one trigger of the fallback ladder in its environment:

* ``sandbox_off``: ``METNOS_SANDBOX=off``;
* ``bwrap_missing``: ``METNOS_BWRAP`` unset and a ``PATH`` without bubblewrap (an explicit
  ``METNOS_BWRAP`` naming nothing is a configuration error, not "missing");
* ``userns_unavailable``: ``METNOS_BWRAP`` pointing at the fake bubblewrap of
  `tests/sandbox/test_select.py`, which answers like bubblewrap does when the kernel
  refuses to create namespaces.

Each job must produce exactly one ``sandbox.degraded`` record in the JSON log file,
carrying that job's ``job_id``, and a result whose containment says ``sandbox: "none"``.
With ``METNOS_REQUIRE_SANDBOX=always`` the same jobs are rejected with
``E_SANDBOX_REQUIRED`` and never run (their marker files are never written).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from metnos_exec.brokers.sqlite import SQLiteBroker
from metnos_exec.logs import iter_records
from metnos_exec.messages import Job, Result
from metnos_exec.sandbox._types import AXES
from tests.sandbox.test_select import write_fake_bwrap

TRIGGERS = ("sandbox_off", "bwrap_missing", "userns_unavailable")
BACKENDS = ("asyncio", "trio")
JOBS = 2

MARKER_MANIFEST = """\
name = "marker"
version = "1"
runtime = "python"
entry = "main.py"
[args.n]
type = "number"
required = true
"""


def _marker_main(markers: Path) -> str:
    # No capability: the job writes its marker straight to the host path, which it can
    # only do unsandboxed (the direct arm) — exactly the degraded case under test.
    return (
        "import json, sys\n"
        "a = json.load(sys.stdin)\n"
        f"open({str(markers)!r} + '/ran-%d' % a['n'], 'w').write('ran')\n"
        "print(json.dumps({'n': a['n']}))\n"
    )


def _worker_env(trigger: str, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METNOS_")}
    env["HOME"] = str(tmp_path)
    if trigger == "sandbox_off":
        env["METNOS_SANDBOX"] = "off"
    elif trigger == "bwrap_missing":
        empty = tmp_path / "empty-bin"
        empty.mkdir()
        env["PATH"] = str(empty)  # the worker itself is started by absolute path
    elif trigger == "userns_unavailable":
        env["METNOS_BWRAP"] = str(write_fake_bwrap(tmp_path / "fake-bwrap"))
    else:  # pragma: no cover
        raise AssertionError(trigger)
    return env


def _serve_burst(
    tmp_path: Path, trigger: str, backend: str, *, require: str | None = None
) -> tuple[list[str], list[Result], list[dict[str, Any]], Path]:
    """Submit JOBS marker jobs, run one burst worker over them; results and log records."""
    executors = tmp_path / "executors"
    (executors / "marker").mkdir(parents=True)
    markers = tmp_path / "markers"
    markers.mkdir()
    (executors / "marker" / "manifest.toml").write_text(MARKER_MANIFEST)
    (executors / "marker" / "main.py").write_text(_marker_main(markers))
    db = tmp_path / "q.db"
    log = tmp_path / "worker.jsonl"

    async def submit() -> list[str]:
        async with SQLiteBroker(db) as broker:
            jobs = [Job(executor="marker", args={"n": i}) for i in range(JOBS)]
            return [r.job_id for r in await broker.submit_many(jobs)]

    ids = anyio.run(submit, backend=backend)
    env = _worker_env(trigger, tmp_path)
    if require is not None:
        env["METNOS_REQUIRE_SANDBOX"] = require
    # --burst: the worker exits once the queue is empty, so its exit is the sync point.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "metnos_exec",
            "worker",
            "--broker",
            f"sqlite:///{db}",
            "--executors",
            str(executors),
            "--worker-id",
            "W",
            "--log-file",
            str(log),
            "--backend",
            backend,
            "--burst",
        ],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]

    async def fetch() -> list[Result]:
        async with SQLiteBroker(db) as broker:
            got = [await broker.get_result(i) for i in ids]
        assert all(r is not None for r in got), got
        return [r for r in got if r is not None]

    results = anyio.run(fetch, backend=backend)
    return ids, results, list(iter_records(log)), markers


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("trigger", TRIGGERS)
def test_each_trigger_degrades_once_per_job_on_a_real_worker(
    tmp_path: Path, trigger: str, backend: str
) -> None:
    ids, results, records, markers = _serve_burst(tmp_path, trigger, backend)
    degraded = [r for r in records if r["event"] == "sandbox.degraded"]
    # Exactly one record per job, each bound to its job.
    assert sorted(str(r.get("job_id")) for r in degraded) == sorted(ids), degraded
    for rec in degraded:
        assert rec["level"] == "warning", rec
        assert (rec["requested"], rec["used"], rec["reason"]) == ("bwrap", "none", trigger)
        assert rec["axes_lost"] == list(AXES)
    for result in results:
        assert result.status == "succeeded", result
        assert result.containment is not None and result.containment.sandbox == "none"
        assert result.containment.lost() == list(AXES)
    # Degraded, yet each job really ran (unsandboxed, it could write the host path).
    assert sorted(p.name for p in markers.iterdir()) == [f"ran-{i}" for i in range(JOBS)]
    started = [r for r in records if r["event"] == "job.started"]
    assert len(started) == JOBS and all(r["degraded"] is True for r in started)
    assert all(r["sandbox"] == "none" for r in started)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("trigger", TRIGGERS)
def test_required_sandbox_rejects_and_nothing_runs_on_a_real_worker(
    tmp_path: Path, trigger: str, backend: str
) -> None:
    ids, results, records, markers = _serve_burst(tmp_path, trigger, backend, require="always")
    for result in results:
        assert result.status == "rejected", result
        assert result.error is not None and result.error.code == "E_SANDBOX_REQUIRED"
        assert trigger in result.error.message
        assert result.exit is None and result.started_at is None
    assert list(markers.iterdir()) == []  # never ran
    events = [r["event"] for r in records]
    assert "sandbox.degraded" not in events
    assert "job.started" not in events
    rejected = [r for r in records if r["event"] == "job.rejected"]
    assert sorted(r["job_id"] for r in rejected) == sorted(ids)
