"""Soak of the network wall (issue 17, acceptance 5): many jobs with network at once
through one arm for a while; afterwards no fd or memory growth in the worker and no
connection left open.

Each job is bash behind the wall: it opens a connection to the bench's loopback server
(a literal hint, forwarded), sends a line, reads the answer, keeps the connection open
for `--hold` seconds and exits; a few also try a refused port. Jobs are started
`--concurrency` at a time for `--seconds`. The worker's open fds and RSS are read
before the first job (after a warm-up) and after the last one; the server counts the
connections still open once every job has ended.

``--no-wall`` runs the same jobs without network (``sleep`` only): the control for what
the pooled job slots themselves hold.

Usage: PYTHONPATH=. python bench/egress_soak.py [--concurrency 200] [--seconds 60]
       [--hold 1] [--backend asyncio|trio] [--no-wall]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import anyio
import anyio.abc
import anyio.lowlevel

from metnos_exec.sandbox._types import ResourceLimits, SandboxJob, Success
from metnos_exec.sandbox.bwrap import BwrapSandbox
from metnos_exec.sandbox.egress import policy_for

SCRIPT = (
    'exec 3<>/dev/tcp/127.0.0.1/"$1" && echo hello >&3 && read -r line <&3 && '
    '[ "$line" = hello ] && sleep "$2"; (exec 4<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; exit 0'
)


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def main(concurrency: int, seconds: float, hold: float, wall: bool) -> dict[str, float]:
    open_now = 0
    served = 0

    async def echo(stream: anyio.abc.SocketStream) -> None:
        nonlocal open_now, served
        open_now += 1
        served += 1
        try:
            async with stream:
                while True:
                    data = await stream.receive()
                    await stream.send(data)
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
        finally:
            open_now -= 1

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    arm = BwrapSandbox()
    policy = policy_for([("http", f"127.0.0.1:{port}")])
    job = SandboxJob(
        argv=("/bin/bash", "-c", SCRIPT if wall else 'sleep "$2"', "job", str(port), str(hold)),
        network=wall,
        egress=policy if wall else None,
        limits=ResourceLimits(wall_time_s=30, memory_bytes=64 << 20, pids=16),
    )
    ran = failed = 0
    slots = anyio.Semaphore(concurrency)

    async def one() -> None:
        nonlocal ran, failed
        try:
            outcome = await arm.run(job)
        finally:
            slots.release()
        ran += 1
        if outcome.exit != Success() or (wall and not any(r.allowed for r in outcome.egress)):
            failed += 1

    async def wave(seconds: float) -> float:
        """Keep `concurrency` jobs in flight for `seconds` (at least one wave)."""
        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            first = True
            while first or time.monotonic() - started < seconds:
                for _ in range(concurrency):
                    await slots.acquire()
                    tg.start_soon(one)
                first = False
        return time.monotonic() - started

    async with listener, anyio.create_task_group() as server:
        server.start_soon(listener.serve, echo)
        # A first wave at full concurrency: the helper, the caches and the pooled job
        # slots (each holds its cgroup fds) exist before the baseline is read.
        await wave(0)
        gc.collect()
        fds0, rss0 = fds(), rss_kib()
        elapsed = await wave(seconds)
        # Every job has ended: a connection still open on the server's side would be
        # one that outlived its job (the echo handler ends when the wall closes it).
        await anyio.lowlevel.checkpoint()
        left_open = open_now
        gc.collect()
        fds1, rss1 = fds(), rss_kib()
        server.cancel_scope.cancel()
    return {
        "jobs": ran,
        "failed": failed,
        "jobs_per_s": ran / elapsed,
        "connections_served": served,
        "connections_left_open": left_open,
        "fds_before": fds0,
        "fds_after": fds1,
        "rss_kib_before": rss0,
        "rss_kib_after": rss1,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--hold", type=float, default=1.0)
    parser.add_argument("--backend", default="asyncio", choices=("asyncio", "trio"))
    parser.add_argument(
        "--no-wall", action="store_true", help="the control: the same jobs without network"
    )
    args = parser.parse_args()
    out = anyio.run(
        main, args.concurrency, args.seconds, args.hold, not args.no_wall, backend=args.backend
    )
    for k, v in out.items():
        print(f"{k:24} {v}")
    sys.exit(0 if out["failed"] == 0 and out["connections_left_open"] == 0 else 1)
