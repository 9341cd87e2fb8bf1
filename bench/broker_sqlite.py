"""Queue-only throughput of the SQLite broker (no sandbox, no supervisor).

Measures, on a fresh file:
- submit: jobs/s through `submit_many` (one transaction per batch) and `submit` (one each);
- lease+ack round trips/s for one consumer, leasing `--batch` jobs at a time and acking
  each job on its own (the supervisor's pattern), and with `ack_many`.

Usage: python bench/broker_sqlite.py [--jobs N] [--batch B] [--backend asyncio|trio]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import anyio

from metnos_exec.brokers.sqlite import SQLiteBroker
from metnos_exec.messages import Job, Result


def _result(lease_job: Job, attempt: int) -> Result:
    return Result(job_id=lease_job.id, status="succeeded", output={"ok": True}, attempt=attempt)


async def _run(jobs: int, batch: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        async with SQLiteBroker(Path(tmp) / "bench.db") as broker:
            items = [Job(executor="echo", args={"i": i}) for i in range(jobs)]
            t = time.perf_counter()
            for start in range(0, jobs, 500):
                await broker.submit_many(items[start : start + 500])
            out["submit_many jobs/s"] = jobs / (time.perf_counter() - t)

            t = time.perf_counter()
            done = 0
            while True:
                leases = await broker.lease("bench", visibility_s=30, limit=batch)
                if not leases:
                    break
                for lease in leases:
                    assert await broker.ack(lease, _result(lease.job, lease.attempt))
                    done += 1
            out[f"lease(limit={batch})+ack each, jobs/s"] = done / (time.perf_counter() - t)
            assert done == jobs

            items = [Job(executor="echo", args={"i": i}) for i in range(jobs)]
            t = time.perf_counter()
            for j in items:
                await broker.submit(j)
            out["submit (one each) jobs/s"] = jobs / (time.perf_counter() - t)

            t = time.perf_counter()
            done = 0
            while True:
                leases = await broker.lease("bench", visibility_s=30, limit=batch)
                if not leases:
                    break
                oks = await broker.ack_many([(le, _result(le.job, le.attempt)) for le in leases])
                done += sum(oks)
            out[f"lease(limit={batch})+ack_many, jobs/s"] = done / (time.perf_counter() - t)
            assert done == jobs

            items = [Job(executor="echo", args={"i": i}) for i in range(jobs // 5)]
            await broker.submit_many(items)
            t = time.perf_counter()
            done = 0
            while True:
                leases = await broker.lease("bench", visibility_s=30, limit=1)
                if not leases:
                    break
                assert await broker.ack(leases[0], _result(leases[0].job, 1))
                done += 1
            out["lease(limit=1)+ack, jobs/s"] = done / (time.perf_counter() - t)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    args = parser.parse_args(argv)
    results = anyio.run(_run, args.jobs, args.batch, backend=args.backend)
    for name, value in results.items():
        print(f"{name:40s} {value:10,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
