"""Acceptance 1 of issue 20: real worker processes with ``--metrics`` on loopback, a mix of
jobs (succeeded, failed, refused, timed out, retried then dead, degraded), then a scrape
parsed with prometheus_client's own parser: the counters equal those jobs per label, and
the queue depth and the oldest age equal ``metnos-exec status --json``.

Two workers on one queue, each on its own port (how several workers on one machine are
scraped): ``A`` runs in bubblewrap and serves the mix; ``B`` runs with
``METNOS_SANDBOX=off`` and serves only ``marker``, so its one job is the degraded one.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from metnos_exec.brokers.sqlite import SQLiteBroker
from metnos_exec.messages import Job, Result
from metnos_exec.sandbox._types import AXES
from tests.conftest import need
from tests.helpers.worker_cli import wait_for_event, worker_argv

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = pytest.mark.slow

_PY = """\
name = "{name}"
version = "1"
runtime = "python"
entry = "main.py"
{extra}
"""
_EXECUTORS = {
    "sleepy": (
        "[args.s]\ntype = 'number'\ndefault = 0\n",
        "import json, sys, time\na = json.load(sys.stdin)\ntime.sleep(a['s'])\n"
        "print(json.dumps({'slept': a['s']}))\n",
    ),
    "failer": ("", "import sys\nsys.exit(3)\n"),
    "tempfail": ("", "import sys\nsys.exit(75)\n"),
    "reader": (
        "[args.path]\ntype = 'string'\nrequired = true\nformat = 'path'\n"
        "[[capabilities]]\nname = 'fs:read'\nhints = ['~/notes/**']\n",
        "print('{}')\n",
    ),
}


def _write(root: Path, name: str, extra: str, main: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "manifest.toml").write_text(_PY.format(name=name, extra=extra))
    (root / name / "main.py").write_text(main)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


class _Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
            p.wait()


@pytest.fixture
def procs() -> Iterator[_Procs]:
    p = _Procs()
    try:
        yield p
    finally:
        p.close()


def _wait_results(db: Path, ids: list[str], timeout: float = 60) -> list[Result]:
    async def poll() -> list[Result]:
        async with SQLiteBroker(db) as broker:
            with anyio.fail_after(timeout):
                while True:
                    got = [await broker.get_result(i) for i in ids]
                    dead = {d.job_id for d in await broker.dead_letters(limit=100)}
                    if all(r is not None or i in dead for r, i in zip(got, ids, strict=True)):
                        return [r for r in got if r is not None]
                    await anyio.sleep(0.05)  # polling the store, under a deadline

    return anyio.run(poll)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_scraped_counters_equal_the_jobs_run(tmp_path: Path, procs: _Procs, backend: str) -> None:
    need(bool(_which("bwrap")), "bubblewrap is not installed")
    full, marker = tmp_path / "executors", tmp_path / "marker-only"
    for name, (extra, main) in _EXECUTORS.items():
        _write(full, name, extra, main)
    _write(marker, "marker", "", "print('{}')\n")
    db = tmp_path / "q.db"
    url = f"sqlite:///{db}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("METNOS_")}
    env["HOME"] = str(tmp_path)
    (tmp_path / "notes").mkdir()
    port_a, port_b = _free_port(), _free_port()
    log_a, log_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    common = ("--backend", backend, "--visibility", "10", "--concurrency", "2")
    a = procs.start(
        worker_argv(
            url, full, log_a, "--worker-id", "A", "--metrics", f"127.0.0.1:{port_a}", *common
        ),
        env,
    )
    b = procs.start(
        worker_argv(
            url, marker, log_b, "--worker-id", "B", "--metrics", f"127.0.0.1:{port_b}", *common
        ),
        {**env, "METNOS_SANDBOX": "off"},
    )
    wait_for_event(log_a, "worker.started", a, timeout=60)
    wait_for_event(log_b, "worker.started", b, timeout=60)

    jobs = [
        Job(executor="sleepy", args={"s": 0}),
        Job(executor="sleepy", args={"s": 0}),
        Job(executor="sleepy", args={"s": 30}, timeout_s=1),
        Job(executor="failer"),
        Job(executor="tempfail", max_attempts=2),
        Job(executor="reader", args={"path": str(tmp_path / "outside.txt")}),
        Job(executor="marker"),
    ]

    async def submit(batch: list[Job]) -> list[str]:
        async with SQLiteBroker(db) as broker:
            return [(await broker.submit(j)).job_id for j in batch]

    ids = anyio.run(submit, jobs, backend=backend)
    results = {r.job_id: r for r in _wait_results(db, ids)}
    assert len(results) == 7

    # What the queue holds now, and stays: a job for an executor nobody serves, and one
    # not due for an hour.
    anyio.run(
        submit,
        [Job(executor="nobody"), Job(executor="nobody", not_before=time.time() + 3600)],
        backend=backend,
    )
    status = subprocess.run(
        [sys.executable, "-m", "metnos_exec", "status", "--broker", url, "--json"],
        env=env,
        capture_output=True,
        check=True,
        timeout=60,
    )
    queue = json.loads(status.stdout)["broker"]
    seen_at = time.time()
    sa, sb = _scrape(port_a), _scrape(port_b)

    by_status: dict[str, dict[str, int]] = {"sleepy": {}, "failer": {}, "reader": {}}
    by_status["tempfail"] = {}
    for job in jobs:
        r = results.get(job.id)
        if r is not None and job.executor in by_status:
            by_status[job.executor][r.status] = by_status[job.executor].get(r.status, 0) + 1
    assert by_status == {
        "sleepy": {"succeeded": 2, "timed_out": 1},
        "failer": {"failed": 1},
        "reader": {"rejected": 1},
        "tempfail": {"dead": 1},
    }
    fin = "metnos_jobs_finished_total"
    assert _value(sa, fin, executor="sleepy", status="succeeded", exit="success", arm="bwrap") == 2
    assert _value(sa, fin, executor="sleepy", status="timed_out", exit="timeout", arm="bwrap") == 1
    assert _value(sa, fin, executor="failer", status="failed", exit="failure", arm="bwrap") == 1
    assert _value(sa, fin, executor="reader", status="rejected", exit="none", arm="not_run") == 1
    assert _value(sb, fin, executor="marker", status="succeeded", exit="success", arm="none") == 1
    assert _value(sa, fin, executor="tempfail", status="dead", exit="none", arm="not_run") == 1
    assert sum(v for (n, _), v in sa.items() if n == fin) == 6
    # Leased: every delivery (the tempfail job twice), and that second one a redelivery.
    assert _value(sa, "metnos_jobs_leased_total", executor="sleepy") == 3
    assert _value(sa, "metnos_jobs_leased_total", executor="tempfail") == 2
    assert _value(sa, "metnos_jobs_redelivered_total", executor="tempfail") == 1
    assert _value(sa, "metnos_retries_total", code="E_TEMPFAIL") == 1
    assert _value(sa, "metnos_dead_letters_total", code="E_TEMPFAIL") == 1
    # The walls: each axis of each result's report, as the results say them.
    for samples, names in ((sa, ("sleepy", "failer", "reader")), (sb, ("marker",))):
        want: dict[tuple[str, str], int] = {}
        for job in jobs:
            r = results.get(job.id)
            if job.executor in names and r is not None and r.containment is not None:
                assert r.status != "dead"  # a dead result has no report: not counted
                for axis in AXES:
                    key = (axis, getattr(r.containment, axis).state)
                    want[key] = want.get(key, 0) + 1
        got = {
            (dict(labels)["axis"], dict(labels)["verdict"]): v
            for (n, labels), v in samples.items()
            if n == "metnos_containment_total"
        }
        assert got == want
    assert _value(sb, "metnos_degradations_total", reason="sandbox_off") == 1
    assert not [k for k in sa if k[0] == "metnos_degradations_total"]
    # Phases: one plan per planned job, one run per launched one.
    assert _value(sa, "metnos_job_phase_seconds_count", phase="run", executor="sleepy") == 3
    assert _value(sa, "metnos_job_phase_seconds_count", phase="queue_wait", executor="sleepy") == 3
    # The queue as `status` says it (both workers read the same store).
    for samples in (sa, sb):
        for state, key in (("queued", "queued"), ("delayed", "delayed"), ("leased", "running")):
            assert _value(samples, "metnos_queue_jobs", state=state) == queue[key], state
        assert _value(samples, "metnos_queue_jobs", state="dead") == queue["dead"] == 1
        assert _value(samples, "metnos_queue_jobs", state="done") == queue["done"] == 6
        assert queue["oldest_queued_at"] is not None
        age = _value(samples, "metnos_queue_oldest_age_seconds")
        assert abs(age - (seen_at - queue["oldest_queued_at"])) < 5
        assert _value(samples, "metnos_jobs_running") == 0
        assert _value(samples, "metnos_slots_free") == 2
    assert queue["queued"] == 2 and queue["delayed"] == 1
    # No job id anywhere in the labels.
    for samples in (sa, sb):
        for _, labels in samples:
            assert not {v for _, v in labels} & set(ids)


def _which(name: str) -> str | None:
    import shutil

    return shutil.which(name)
