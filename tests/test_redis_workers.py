"""Acceptance on real worker processes against a private redis-server (issue 11).

2. Three workers with different device ids drain 3,000 mixed jobs: one result each;
   device jobs ran only on their device; server-pinned jobs never on a device.
3. kill -9 of a worker holding leases: another takes them over after the lease window and
   completes them. A long job with heartbeats is never taken over while its owner lives.
4. Redis restarted (append-only file on) while workers run: they reconnect, no job is
   lost, no worker exits.
"""

from __future__ import annotations

import functools
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from metnos_exec.brokers import Broker, BrokerStats
from metnos_exec.messages import Job, Result
from tests.conftest import need, need_import
from tests.helpers.redis_server import RedisServer, redis_server_path
from tests.test_worker_process import (
    SLEEPY_MAIN,
    SLEEPY_MANIFEST,
    Workers,
    _bwrap_ok,
    events,
    has_event,
    wait_until,
    with_broker,
)

pytestmark = pytest.mark.slow

PINNED_MANIFEST = """\
name = "mailer"
version = "1"
runtime = "python"
entry = "main.py"
[[capabilities]]
name = "provider:access"
hints = ["google_mail"]
"""

ECHO = {"METNOS_ARM_OVERRIDE": "echo"}


@pytest.fixture
def executors(tmp_path: Path) -> Path:
    root = tmp_path / "executors"
    for name, manifest, main in (
        ("sleepy", SLEEPY_MANIFEST, SLEEPY_MAIN),
        ("mailer", PINNED_MANIFEST, "print('{}')\n"),
    ):
        (root / name).mkdir(parents=True)
        (root / name / "manifest.toml").write_text(manifest)
        (root / name / "main.py").write_text(main)
    return root


@pytest.fixture
def trust(tmp_path: Path, executors: Path) -> list[str]:
    """Device workers run only signed executors: sign them, return the worker options."""
    need_import("cryptography", "device")
    from metnos_exec.devices.signing import generate_key, sign_folder

    key, pub = generate_key(tmp_path / "keys" / "server.key")
    for folder in executors.iterdir():
        sign_folder(folder, key)
    return ["--trust-key", str(pub)]


@pytest.fixture
def workers(tmp_path: Path, executors: Path, redis_server: RedisServer) -> Iterator[Workers]:
    w = Workers(tmp_path, executors)
    # One queue per test on the session's server: its own key prefix.
    w.url = f"{redis_server.url}?prefix={tmp_path.name}&poll_interval_s=0.02"
    try:
        yield w
    finally:
        w.close()


def _results(url: str, ids: list[str]) -> list[Result | None]:
    async def fetch(b: Broker) -> list[Result | None]:
        return [await b.get_result(i) for i in ids]

    out: list[Result | None] = with_broker(url, fetch)
    return out


def _stats(url: str) -> BrokerStats:
    stats: BrokerStats = with_broker(url, lambda b: b.stats())
    return stats


def test_three_devices_drain_3000_mixed_jobs(workers: Workers, trust: list[str]) -> None:
    devices = {"S": "server", "P": "phone", "L": "laptop"}
    logs = {
        wid: workers.start(
            wid,
            *trust,
            "--device",
            device,
            "--concurrency",
            "8",
            "--backend",
            "trio" if wid == "P" else "asyncio",
            env=ECHO,
        )
        for wid, device in devices.items()
    }
    for log in logs.values():
        wait_until(functools.partial(has_event, log, "worker.started"), 15, "workers up")
    jobs: list[Job] = []
    target: dict[str, str | None] = {}
    for i in range(3000):
        kind = i % 6
        if kind == 4:
            job = Job(executor="mailer", args={})  # provider authority: server-pinned
        elif kind == 5:
            job = Job(executor="mailer", args={}, device="phone")  # pinned, mis-targeted
        else:
            device = (None, "server", "phone", "laptop")[kind]
            job = Job(executor="sleepy", args={"s": i / 1e6}, device=device)
        jobs.append(job)
        target[job.id] = job.device
    with_broker(workers.url, lambda b: b.submit_many(jobs))
    wait_until(lambda: _stats(workers.url).done == 3000, 120, "3000 results")
    for p in workers.procs:
        p.send_signal(signal.SIGTERM)
    assert [p.wait(20) for p in workers.procs] == [0, 0, 0]

    ids = [j.id for j in jobs]
    results = _results(workers.url, ids)
    assert all(r is not None for r in results)
    by_id = {r.job_id: r for r in results if r is not None}
    assert set(by_id) == set(ids)  # every job exactly one result (a result is written once)
    worker_of_device = {device: wid for wid, device in devices.items()}
    started = {
        wid: {rec["job_id"] for rec in events(log, event="job.started")}
        for wid, log in logs.items()
    }
    for job in jobs:
        r = by_id[job.id]
        want = job.device or "server"
        assert (r.device, r.worker) == (want, worker_of_device[want]), (job, r)
        if job.executor == "mailer" and job.device == "phone":
            # Refused on the device, never run there.
            assert r.status == "rejected" and r.error is not None
            assert r.error.code == "E_SERVER_PINNED"
            assert job.id not in started["P"]
        else:
            assert r.status == "succeeded", r
            assert r.attempt == 1
    # Each job ran at most once, and only on its device's worker.
    assert sum(len(s) for s in started.values()) == len({i for s in started.values() for i in s})
    pinned = {j.id for j in jobs if j.executor == "mailer"}
    assert not pinned & (started["P"] | started["L"])
    stats = _stats(workers.url)
    assert (stats.done, stats.queued, stats.running, stats.dead) == (3000, 0, 0, 0)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_kill_9_of_a_worker_holding_leases(workers: Workers, backend: str) -> None:
    need(_bwrap_ok(), "bubblewrap is not installed")
    log_a = workers.start("A", "--visibility", "2", "--concurrency", "3", "--backend", backend)
    wait_until(lambda: has_event(log_a, "worker.started"), 15, "worker A")
    jobs = [Job(executor="sleepy", args={"s": 1.0}, max_attempts=3) for _ in range(5)]
    with_broker(workers.url, lambda b: b.submit_many(jobs))
    wait_until(lambda: len(events(log_a, event="job.started")) >= 3, 15, "A runs 3 jobs")
    held = {rec["job_id"] for rec in events(log_a, event="job.started")}
    workers.procs[0].send_signal(signal.SIGKILL)
    workers.procs[0].wait()
    log_b = workers.start("B", "--visibility", "2", "--concurrency", "3", "--backend", backend)

    ids = [j.id for j in jobs]
    wait_until(lambda: _stats(workers.url).done == 5, 60, "5 results")
    results = _results(workers.url, ids)
    assert all(r is not None and r.status == "succeeded" for r in results), results
    by_id = {r.job_id: r for r in results if r is not None}
    for job_id in held:
        # Nothing of A's stored: B took each over after A's lease lapsed.
        assert (by_id[job_id].worker, by_id[job_id].attempt) == ("B", 2)
    received = [rec["job_id"] for rec in events(log_b, event="job.received")]
    assert sorted(received) == sorted(ids) or set(received) >= held
    workers.procs[1].send_signal(signal.SIGTERM)
    assert workers.procs[1].wait(15) == 0
    stats = _stats(workers.url)
    assert (stats.done, stats.queued, stats.running, stats.dead) == (5, 0, 0, 0)


def test_a_long_job_with_heartbeats_is_never_taken_over(workers: Workers) -> None:
    need(_bwrap_ok(), "bubblewrap is not installed")
    # A 1 s lease window, renewed every 1/3 s, around a 4 s job; B polls all along.
    log_a = workers.start("A", "--visibility", "1", "--concurrency", "1")
    wait_until(lambda: has_event(log_a, "worker.started"), 15, "worker A")
    job = Job(executor="sleepy", args={"s": 4.0}, max_attempts=5)
    with_broker(workers.url, lambda b: b.submit(job))
    wait_until(lambda: has_event(log_a, "job.started", job.id), 15, "A starts it")
    log_b = workers.start("B", "--visibility", "1", "--concurrency", "1", "--backend", "trio")
    wait_until(lambda: has_event(log_b, "worker.started"), 15, "worker B")
    result: Result = wait_until(
        lambda: with_broker(workers.url, lambda b: b.get_result(job.id)), 30, "the result"
    )
    assert (result.status, result.worker, result.attempt) == ("succeeded", "A", 1)
    assert not has_event(log_b, "job.received", job.id)
    assert not has_event(log_a, "lease.lost")
    for p in workers.procs:
        p.send_signal(signal.SIGTERM)
    assert [p.wait(15) for p in workers.procs] == [0, 0]


def test_redis_restarted_while_workers_run(workers: Workers, tmp_path: Path) -> None:
    need(redis_server_path() is not None, "redis-server is not installed")
    server = RedisServer(tmp_path / "redis-aof", appendonly=True)
    server.start()
    try:
        workers.url = f"{server.url}?poll_interval_s=0.02"
        logs = [
            workers.start(
                wid, "--concurrency", "8", "--visibility", "5", "--backend", backend, env=ECHO
            )
            for wid, backend in (("W1", "asyncio"), ("W2", "trio"))
        ]
        for log in logs:
            wait_until(functools.partial(has_event, log, "worker.started"), 15, "workers up")
        first = [Job(executor="sleepy", args={"s": i / 1e6}) for i in range(3000)]
        with_broker(workers.url, lambda b: b.submit_many(first))
        wait_until(lambda: _stats(workers.url).done >= 300, 60, "work under way")
        server.restart()  # SIGTERM: Redis writes its append-only file and stops
        second = [Job(executor="sleepy", args={"s": i / 1e5}) for i in range(500)]
        with_broker(workers.url, lambda b: b.submit_many(second))
        wait_until(lambda: _stats(workers.url).done == 3500, 120, "3500 results")
        assert [p.poll() for p in workers.procs] == [None, None], "no worker exited"
        for log in logs:
            assert has_event(log, "broker.error"), "each worker saw Redis go"
            assert has_event(log, "broker.recovered"), "and come back"
        ids = [j.id for j in first + second]
        results = _results(workers.url, ids)
        bad = [r for r in results if r is None or r.status != "succeeded"]
        assert not bad, bad[:3]
        for p in workers.procs:
            p.send_signal(signal.SIGTERM)
        assert [p.wait(20) for p in workers.procs] == [0, 0]
        stats = _stats(workers.url)
        assert (stats.done, stats.queued, stats.running, stats.dead) == (3500, 0, 0, 0)
    finally:
        workers.close()
        server.stop()


def test_a_worker_started_before_redis_waits_for_it(workers: Workers, tmp_path: Path) -> None:
    need(redis_server_path() is not None, "redis-server is not installed")
    from tests.helpers.redis_server import _free_port

    server = RedisServer(tmp_path / "redis-late", appendonly=True)
    server.port = _free_port()
    try:
        workers.url = f"{server.url}?poll_interval_s=0.02&connect_timeout_s=0.5"
        log = workers.start("W", "--backend", "trio", env=ECHO)
        wait_until(lambda: has_event(log, "broker.error"), 15, "the worker says Redis is down")
        assert workers.procs[0].poll() is None
        server.start()
        job = Job(executor="sleepy", args={"s": 0})
        with_broker(workers.url, lambda b: b.submit(job))
        result: Result = wait_until(
            lambda: with_broker(workers.url, lambda b: b.get_result(job.id)), 30, "the result"
        )
        assert result.status == "succeeded" and result.worker == "W"
        assert has_event(log, "broker.recovered")
        workers.procs[0].send_signal(signal.SIGTERM)
        assert workers.procs[0].wait(15) == 0
    finally:
        workers.close()
        server.stop()
