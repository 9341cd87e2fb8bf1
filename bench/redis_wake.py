"""The Redis queue's wake-up (issue 22, acceptance 1, the queue's part): an echo job's
submit -> result latency through an idle worker, and that idle worker's CPU.

A private redis-server (a free loopback port), one real ``metnos-exec worker --arm echo``
process on it (no sandbox: the queue path alone) and, in this process, `Client.run` of a
no-op job ``--calls`` times one after another, each timed until its result is in hand.
Then the same worker left idle for ``--seconds``: its own CPU time (user + system, from
/proc), in ms per second of idling. For a before/after run it with ``PYTHONPATH`` set to
each tree (the script uses only the public client and the CLI).

Usage: PYTHONPATH=<tree> python bench/redis_wake.py [--calls 200] [--seconds 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

import metnos_exec
from metnos_exec.client import Client
from tests.helpers.redis_server import RedisServer

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


async def _latencies(url: str, calls: int, warmup: int) -> list[float]:
    out: list[float] = []
    async with Client(url) as client:
        for i in range(warmup + calls):
            t0 = time.perf_counter()
            result = await client.run("noop", {}, wait=30)
            took = time.perf_counter() - t0
            assert result.status == "succeeded", result
            if i >= warmup:
                out.append(took * 1000)
    return out


def _round(tmp: Path, url: str, calls: int, seconds: float) -> tuple[list[float], float]:
    log = tmp / f"w-{time.monotonic_ns()}.jsonl"
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "metnos_exec", "worker", "--broker", url),
            *("--executors", str(tmp / "executors"), "--log-file", str(log), "--arm", "echo"),
        ],
        stdin=subprocess.DEVNULL,
        env={**os.environ, "METNOS_RETENTION_DAYS": "never"},
    )
    try:
        deadline = time.monotonic() + 30
        while not (log.exists() and b"worker.started" in log.read_bytes()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the worker did not start")
            time.sleep(0.05)
        lat = anyio.run(_latencies, url, calls, 10)
        time.sleep(1.0)  # past the last job's settling
        before = _cpu_s(proc.pid)
        time.sleep(seconds)
        idle = (_cpu_s(proc.pid) - before) * 1000 / seconds
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    return lat, idle


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ns = ap.parse_args(argv)
    print(f"tree: {Path(metnos_exec.__file__).parents[1]}; load: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        noop = tmp / "executors" / "noop"
        noop.mkdir(parents=True)
        (noop / "manifest.toml").write_text(
            'name = "noop"\nversion = "1"\nruntime = "python"\nentry = "main.py"\n'
        )
        (noop / "main.py").write_text("print('{}')\n")
        server = RedisServer(tmp / "redis")
        server.start()
        try:
            lats: list[float] = []
            idles: list[float] = []
            for r in range(ns.rounds):
                url = f"{server.url}?prefix=bench{r}"
                lat, idle = _round(tmp, url, ns.calls, ns.seconds)
                lats += lat
                idles.append(idle)
        finally:
            server.stop()
    lats.sort()
    p90 = lats[int(len(lats) * 0.9)]
    print(
        f"echo job through an idle worker: median {statistics.median(lats):.2f} ms, p90 {p90:.2f}"
    )
    print(f"idle worker CPU, ms per second: {', '.join(f'{x:.1f}' for x in idles)}")
    print(f"load after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
