"""The Redis queue's own cost: ``submit_many`` then ``lease`` / ``ack_many`` of N jobs on a
private redis-server (a free loopback port), in jobs/s. For a before/after of the scripts,
run it from each tree: ``cd TREE && PYTHONPATH=. python bench/redis_cycle.py``.

Usage: PYTHONPATH=. python bench/redis_cycle.py [--jobs 4000] [--backend asyncio|trio]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import anyio

from metnos_exec.brokers.redis import RedisBroker
from metnos_exec.messages import Job, Result
from tests.helpers.redis_server import RedisServer


async def cycle(url: str, n: int) -> float:
    async with RedisBroker(url, prefix=f"bench{time.time_ns()}") as b:
        jobs = [Job(executor="echo") for _ in range(n)]
        t = time.perf_counter()
        await b.submit_many(jobs)
        done = 0
        while done < n:
            leases = await b.lease("w", visibility_s=60, limit=100)
            await b.ack_many([(le, Result(job_id=le.job.id, status="succeeded")) for le in leases])
            done += len(leases)
        return n / (time.perf_counter() - t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4000)
    parser.add_argument("--backend", default="asyncio", choices=("asyncio", "trio"))
    args = parser.parse_args()
    server = RedisServer(Path(tempfile.mkdtemp(prefix="bench-redis-")))
    server.start()
    try:
        rate = anyio.run(cycle, server.url, args.jobs, backend=args.backend)
    finally:
        server.stop()
    print(f"jobs_per_s {rate:10.0f}")


if __name__ == "__main__":
    main()
