"""What executor routing costs a worker's queue cycle (issue 18, item 3).

Submits N jobs spread over K executors, then leases (100 at a time) and acks them all,
on SQLite (a temporary file) and on a private redis-server (a free loopback port); each
round runs the cycle twice side by side: a worker serving every executor by name (the
routed lease: per-executor index walks on SQLite, per-executor streams on Redis) and one
leasing without a filter (``executors=None``, the lease of the build before routing, which
walks one index on SQLite and reads every route on Redis). Reported in jobs/s, with
the ratio routed / unfiltered per round, for K = 1 and K = 100.

Usage: PYTHONPATH=. python bench/routing_cost.py [--jobs 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio

from metnos_exec.brokers import Broker, open_broker
from metnos_exec.messages import Job, Result
from tests.helpers.redis_server import RedisServer


@contextlib.asynccontextmanager
async def _fresh(kind: str, where: str) -> AsyncIterator[Broker]:
    if kind == "sqlite":
        url = f"sqlite:///{Path(tempfile.mkdtemp(prefix='bench-route-')) / 'q.db'}"
    else:
        url = f"{where}?prefix=route{time.time_ns()}"
    async with open_broker(url) as b:
        yield b


async def cycle(kind: str, where: str, n: int, k: int, routed: bool) -> float:
    names = [f"tool{i:03d}" for i in range(k)]
    async with _fresh(kind, where) as b:
        jobs = [Job(executor=names[i % k]) for i in range(n)]
        t = time.perf_counter()
        for start in range(0, n, 500):
            await b.submit_many(jobs[start : start + 500])
        done = 0
        while done < n:
            leases = await b.lease(
                "w", visibility_s=60, limit=100, executors=names if routed else None
            )
            await b.ack_many([(le, Result(job_id=le.job.id, status="succeeded")) for le in leases])
            done += len(leases)
        return n / (time.perf_counter() - t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    server = RedisServer(Path(tempfile.mkdtemp(prefix="bench-redis-")))
    server.start()
    try:
        for kind in ("sqlite", "redis"):
            for k in (1, 100):
                ratios, routed_rates, plain_rates = [], [], []
                for _ in range(args.rounds):
                    plain = anyio.run(cycle, kind, server.url, args.jobs, k, False)
                    routed = anyio.run(cycle, kind, server.url, args.jobs, k, True)
                    plain_rates.append(plain)
                    routed_rates.append(routed)
                    ratios.append(routed / plain)
                print(
                    f"{kind:6} executors={k:3}  unfiltered {statistics.median(plain_rates):7.0f}"
                    f" jobs/s  routed {statistics.median(routed_rates):7.0f} jobs/s  "
                    f"routed/unfiltered per round: {', '.join(f'{r:.2f}' for r in ratios)}"
                )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
