"""Issue 20 on Redis: a real worker with ``--metrics`` on a private redis-server, scraped
and parsed with prometheus_client's parser. The queue depth and the oldest queued job's
age equal ``metnos-exec status --json`` (the age read 0 on Redis before: the broker did
not say it), and Redis going away is counted as broker errors by code."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import pytest

from metnos_exec.brokers.redis import RedisBroker
from metnos_exec.messages import Job
from tests.conftest import need
from tests.helpers.redis_server import RedisServer, redis_server_path
from tests.helpers.worker_cli import wait_for_event, worker_argv

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = pytest.mark.slow

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _until(what: str, fn: Any, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := fn()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)  # polling with a deadline
    return value


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_redis_queue_age_matches_status_and_outages_are_counted(
    tmp_path: Path, backend: str
) -> None:
    need(redis_server_path() is not None, "redis-server is not installed")
    server = RedisServer(tmp_path / "redis")
    server.start()
    executors = tmp_path / "executors" / "noop"
    executors.mkdir(parents=True)
    (executors / "manifest.toml").write_text(
        'name = "noop"\nversion = "1"\nruntime = "python"\nentry = "main.py"\n'
    )
    (executors / "main.py").write_text("print('{}')\n")
    url = f"{server.url}?prefix=m{backend}"
    port, log = _free_port(), tmp_path / "w.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("METNOS_")}
    argv = worker_argv(url, executors.parent, log, "--metrics", f"127.0.0.1:{port}")
    proc = subprocess.Popen(
        [*argv, "--arm", "echo", "--backend", backend], env=env, stdin=subprocess.DEVNULL
    )
    try:
        wait_for_event(log, "worker.started", proc, timeout=60)
        submitted = time.time()

        async def submit() -> None:
            async with RedisBroker(server.url, prefix=f"m{backend}") as b:
                await b.submit(Job(executor="nobody", submitted_at=submitted - 42))
                await b.submit(Job(executor="nobody"))
                await b.submit(Job(executor="nobody", not_before=submitted + 3600))

        anyio.run(submit, backend=backend)
        status = subprocess.run(
            [sys.executable, "-m", "metnos_exec", "status", "--broker", url, "--json"],
            env=env,
            capture_output=True,
            check=True,
            timeout=60,
        )
        queue = json.loads(status.stdout)["broker"]
        seen_at = time.time()
        assert (queue["queued"], queue["delayed"]) == (3, 1)
        assert queue["oldest_queued_at"] == pytest.approx(submitted - 42)
        # The worker reads the queue at most every 2 s: until its read is past the submits.
        samples = _until(
            "the scrape to see the submits",
            lambda: (
                (s := _scrape(port)) and _value(s, "metnos_queue_jobs", state="queued") == 3 and s
            ),
        )
        assert _value(samples, "metnos_queue_jobs", state="delayed") == queue["delayed"]
        age = _value(samples, "metnos_queue_oldest_age_seconds")
        assert abs(age - (seen_at - queue["oldest_queued_at"])) < 5
        assert age > 40  # not the 0 it read before

        # Redis goes away: the idle worker's next lease fails, counted by op and code.
        server.stop()
        samples = _until(
            "a broker error counted",
            lambda: (
                (s := _scrape(port))
                and _value(s, "metnos_broker_errors_total", op="lease", code="E_BROKER_UNAVAILABLE")
                and s
            ),
        )
        assert proc.poll() is None  # the worker stays up through the outage
        server.start()
        wait_for_event(log, "worker.started", proc)  # (still the same process)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        finally:
            server.stop()
