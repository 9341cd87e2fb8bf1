"""Purging a backlog while a producer submits (issue 18, item 7; acceptance 5).

Fills a queue with ``--jobs`` finished jobs two days old (through the broker itself,
whose clock is set back: the rows are what a worker's acks write), then runs the real
``metnos-exec purge --older-than-days 1`` in a subprocess while a producer in this
process submits one job every ``--interval-ms`` through `Client`. Reports the purge's
wall time and what it said, and the submit waits (max, p99, median) from the purge's
start to its end, with any submit that failed. The target: no submit waits more than
500 ms. SQLite on a temporary file; Redis on a private redis-server (a free loopback
port).

Usage: PYTHONPATH=. python bench/purge_backlog.py [--jobs 100000] [--broker sqlite|redis|both]
       [--interval-ms 5] [--backend asyncio|trio]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from metnos_exec.brokers.base import Broker
from metnos_exec.client import Client
from metnos_exec.messages import Job, Result
from metnos_exec.sandbox._types import AxisVerdict, ContainmentReport, Success, Usage

ROOT = Path(__file__).resolve().parent.parent
_AGE_S = 2 * 86400.0  # the backlog's age: past a one-day retention
_BATCH = 500


def _result(job: Job, attempt: int) -> Result:
    """A result shaped like a bwrap echo job's (containment, usage, a little output)."""
    kept = AxisVerdict("kept", "bwrap namespaces, seccomp and landlock in place")
    now = time.time() - _AGE_S
    return Result(
        job_id=job.id,
        status="succeeded",
        output={"echo": job.args, "ok": True},
        exit=Success(),
        stderr="",
        containment=ContainmentReport(
            sandbox="bwrap", files=kept, network=kept, process_tree=kept, user=kept, resources=kept
        ),
        usage=Usage(wall_s=0.0123, cpu_s=0.004, peak_memory_bytes=12_345_678),
        worker="bench-worker-1",
        attempt=attempt,
        started_at=now,
        finished_at=now,
    )


async def _fill(broker: Broker, n: int) -> None:
    for start in range(0, n, _BATCH):
        count = min(_BATCH, n - start)
        jobs = [
            Job(
                executor="echo",
                args={"text": f"hello {start + i}"},
                idempotency_key=f"bench-{start + i}" if (start + i) % 4 == 0 else None,
                correlation_id="step-1",
            )
            for i in range(count)
        ]
        await broker.submit_many(jobs)
        taken = 0
        while taken < count:
            leases = await broker.lease("bench-worker-1", visibility_s=600, limit=_BATCH)
            if not leases:
                break
            await broker.ack_many([(le, _result(le.job, le.attempt)) for le in leases])
            taken += len(leases)


def _open_filler(url: str) -> Broker:
    clock = lambda: time.time() - _AGE_S  # noqa: E731
    if url.startswith("sqlite"):
        from metnos_exec.brokers.sqlite import SQLiteBroker

        return SQLiteBroker(url.removeprefix("sqlite:///"), clock=clock)
    from metnos_exec.brokers.redis import RedisBroker

    return RedisBroker(url, clock=clock)


async def _measure(url: str, n: int, interval_s: float) -> dict[str, Any]:
    t = time.perf_counter()
    async with _open_filler(url) as filler:
        await _fill(filler, n)
    fill_s = time.perf_counter() - t
    waits: list[float] = []
    worst = (0.0, 0.0)  # the longest wait, and when it began (seconds into the purge)
    errors: list[str] = []
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "metnos_exec", "purge", "--broker", url]
    argv += ["--older-than-days", "1", "--json"]
    async with Client(url) as client:
        await client.submit("echo", {"text": "warm-up"})
        done = anyio.Event()
        out: dict[str, Any] = {}

        async def purge() -> None:
            start = time.perf_counter()
            proc = await anyio.run_process(argv, env=env, check=False)
            out["purge_s"] = time.perf_counter() - start
            out["purge_rc"] = proc.returncode
            text = proc.stdout.decode()
            out["purge_said"] = json.loads(text) if proc.returncode == 0 else text
            if proc.returncode:
                out["purge_stderr"] = proc.stderr.decode()[-2000:]
            done.set()

        began = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(purge)
            while not done.is_set():
                start = time.perf_counter()
                try:
                    await client.submit("echo", {"text": "during the purge"})
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
                waits.append(time.perf_counter() - start)
                worst = max(worst, (waits[-1], start - began))
                with anyio.move_on_after(interval_s):
                    await done.wait()
    waits.sort()
    return {
        "fill_s": round(fill_s, 1),
        **out,
        "submits": len(waits),
        "submit_failed": len(errors),
        "first_errors": errors[:3],
        "wait_max_ms": round(waits[-1] * 1000, 1),
        "wait_max_at_s": round(worst[1], 2),
        "wait_p99_ms": round(waits[int(0.99 * (len(waits) - 1))] * 1000, 1),
        "wait_median_ms": round(statistics.median(waits) * 1000, 2),
    }


def _run(kind: str, n: int, interval_s: float, backend: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-purge-") as tmp:
        if kind == "sqlite":
            url = f"sqlite:///{Path(tmp) / 'queue.db'}"
            return anyio.run(_measure, url, n, interval_s, backend=backend)
        from tests.helpers.redis_server import RedisServer

        server = RedisServer(Path(tmp) / "redis")
        server.start()
        try:
            return anyio.run(_measure, server.url, n, interval_s, backend=backend)
        finally:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--broker", default="both", choices=("sqlite", "redis", "both"))
    parser.add_argument("--interval-ms", type=float, default=5.0)
    parser.add_argument("--backend", default="asyncio", choices=("asyncio", "trio"))
    args = parser.parse_args(argv)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # tests.helpers, when run by `metnos-exec bench`
    worst = 0
    for kind in ("sqlite", "redis") if args.broker == "both" else (args.broker,):
        report = _run(kind, args.jobs, args.interval_ms / 1000, args.backend)
        print(kind, json.dumps(report, indent=2))
        if report["submit_failed"] or report["wait_max_ms"] > 500 or report.get("purge_rc"):
            worst = 1
    return worst


if __name__ == "__main__":
    sys.exit(main())
