"""Issue 3: cancelling a RUNNING job, on real processes and a real SQLite file.

A worker process (the CLI, bwrap arm) runs a long native job whose processes carry a
unique token in their argv — inside bubblewrap pids are namespaced, so the token is how
the test finds them from the host (/proc/PID/cmdline). Once they run, the test calls
``metnos-exec cancel`` (a CLI subprocess) and checks: the result is ``cancelled`` with
``E_CANCELLED``; no process of the job is left; the worker serves the next job.

The worker notices the cancel flag at its next heartbeat (``visibility / 3``): the worker
runs with ``--visibility 3``, so within about a second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from metnos_exec.brokers.sqlite import SQLiteBroker
from metnos_exec.logs import iter_records
from metnos_exec.messages import Job, Result
from metnos_exec.sandbox.bwrap import bwrap_probe
from tests.conftest import need

pytestmark = [pytest.mark.slow, pytest.mark.bwrap]

VISIBILITY_S = 3

LONG_MANIFEST = """\
name = "long"
version = "1"
runtime = "python"
entry = "main.py"
[args.token]
type = "string"
required = true
"""
# The job forks a child and both sleep with the token in their argv: a tree to kill.
LONG_MAIN = """\
import json, subprocess, sys, os
a = json.load(sys.stdin)
argv = [sys.executable, "-c", "import time; time.sleep(600)", a["token"]]
subprocess.Popen(argv)
os.execv(sys.executable, argv)
"""
QUICK_MANIFEST = """\
name = "quick"
version = "1"
runtime = "python"
entry = "main.py"
"""
QUICK_MAIN = "import json, sys\njson.load(sys.stdin)\nprint(json.dumps({'ok': True}))\n"


def _pids_with(token: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def _wait_until(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)  # polling with a deadline, not a synchronisation sleep


@pytest.fixture
def executors(tmp_path: Path) -> Path:
    root = tmp_path / "executors"
    for name, manifest, main in (
        ("long", LONG_MANIFEST, LONG_MAIN),
        ("quick", QUICK_MANIFEST, QUICK_MAIN),
    ):
        (root / name).mkdir(parents=True)
        (root / name / "manifest.toml").write_text(manifest)
        (root / name / "main.py").write_text(main)
    return root


@pytest.fixture
def worker_proc(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_cancel_a_running_job_kills_its_tree_and_the_worker_serves_on(
    tmp_path: Path,
    executors: Path,
    worker_proc: list[subprocess.Popen[bytes]],
    backend: str,
) -> None:
    need(bwrap_probe().working, "bubblewrap missing or unable to create namespaces here")
    db = tmp_path / "q.db"
    url = f"sqlite:///{db}"
    log = tmp_path / "worker.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("METNOS_")}
    env["HOME"] = str(tmp_path)
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "metnos_exec",
            "worker",
            "--broker",
            url,
            "--executors",
            str(executors),
            "--worker-id",
            "W",
            "--log-file",
            str(log),
            "--visibility",
            str(VISIBILITY_S),
            "--backend",
            backend,
        ],
        env=env,
        stdin=subprocess.DEVNULL,
    )
    worker_proc.append(worker)
    token = f"metnos-cancel-{os.getpid()}-{time.monotonic_ns()}"

    async def submit(job: Job) -> str:
        async with SQLiteBroker(db) as broker:
            return (await broker.submit(job)).job_id

    async def state(job_id: str) -> str | None:
        async with SQLiteBroker(db) as broker:
            st = await broker.get_job_state(job_id)
            return st.state if st is not None else None

    async def wait_result(job_id: str) -> Result | None:
        async with SQLiteBroker(db) as broker:
            return await broker.wait_result(job_id, timeout=20)

    job_id = anyio.run(submit, Job(executor="long", args={"token": token}), backend=backend)
    # Running: the broker says so, and both processes of the job are visible on the host.
    _wait_until(lambda: anyio.run(state, job_id, backend=backend) == "running", 20, "the lease")
    pids = _wait_until(lambda: len(_pids_with(token)) >= 2 and _pids_with(token), 20, "the tree")
    assert worker.poll() is None

    t0 = time.monotonic()
    cancel = subprocess.run(
        [sys.executable, "-m", "metnos_exec", "cancel", "--broker", url, job_id],
        env=env,
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert cancel.returncode == 0, cancel.stderr.decode()
    assert b"cancelling" in cancel.stdout, cancel.stdout

    result = anyio.run(wait_result, job_id, backend=backend)
    noticed_s = time.monotonic() - t0
    assert result is not None
    assert result.status == "cancelled", result
    assert result.error is not None and result.error.code == "E_CANCELLED"
    # Noticed at a heartbeat (every VISIBILITY_S / 3 s), then TERM, grace, KILL, reap.
    assert noticed_s < VISIBILITY_S / 3 + 5, noticed_s
    # The job's processes are gone once the result is stored (0.5 s for the kernel).
    deadline = time.monotonic() + 0.5
    while (left := [p for p in pids if os.path.exists(f"/proc/{p}")]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.01)  # polling with a deadline: reaping is asynchronous
    assert left == [], f"processes of the cancelled job survived: {left}"
    finished = next(iter_records(log, job=job_id, event="job.finished"))
    assert finished["status"] == "cancelled", finished
    assert _pids_with(token) == []
    names = [r["event"] for r in iter_records(log, job=job_id)]
    assert names == ["job.received", "job.started", "job.cancelled", "job.finished"], names

    # The worker keeps serving.
    assert worker.poll() is None
    next_id = anyio.run(submit, Job(executor="quick"), backend=backend)
    nxt = anyio.run(wait_result, next_id, backend=backend)
    assert nxt is not None and nxt.status == "succeeded" and nxt.output == {"ok": True}
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(15) == 0
