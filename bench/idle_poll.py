"""The CPU an idle worker spends polling its queue, with many delayed jobs and with none.

A real ``metnos-exec worker`` process on a SQLite queue that holds only jobs not yet due
(``not_before`` an hour ahead) polls every 50 ms for due work. Issue 9, finding 7: with
20,000 delayed jobs each poll scanned them all (7.7 ms every 50 ms). Measured: the worker's
own CPU time (user + system, from /proc) over ``--seconds`` once it has started, with
``--delayed`` jobs and with an empty queue, alternating in every round. Reported: the
medians, in CPU milliseconds per second of idling, and their ratio.

Usage: python bench/idle_poll.py [--delayed N] [--seconds S] [--rounds R]
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

from metnos_exec.brokers.sqlite import SQLiteBroker
from metnos_exec.messages import Job

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


async def _fill(db: Path, delayed: int) -> None:
    later = time.time() + 3600
    async with SQLiteBroker(db) as broker:
        for start in range(0, delayed, 1000):
            count = min(1000, delayed - start)
            await broker.submit_many(
                [Job(executor="noop", not_before=later + i) for i in range(count)]
            )


def _idle_cpu_ms_per_s(tmp: Path, delayed: int, seconds: float) -> float:
    db = tmp / f"q-{delayed}-{time.monotonic_ns()}.db"
    anyio.run(_fill, db, delayed)
    log = tmp / f"w-{time.monotonic_ns()}.jsonl"
    executors = tmp / "executors"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "metnos_exec",
            "worker",
            "--broker",
            f"sqlite:///{db}",
            "--executors",
            str(executors),
            "--log-file",
            str(log),
            "--arm",
            "echo",
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
        time.sleep(1.0)  # past start-up work (imports, the first purge, preloads)
        before = _cpu_s(proc.pid)
        time.sleep(seconds)
        used = _cpu_s(proc.pid) - before
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    return used * 1000 / seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delayed", type=int, default=20_000)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ns = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        (tmp / "executors" / "noop").mkdir(parents=True)
        (tmp / "executors" / "noop" / "manifest.toml").write_text(
            'name = "noop"\nversion = "1"\nruntime = "python"\nentry = "main.py"\n'
        )
        (tmp / "executors" / "noop" / "main.py").write_text("print('{}')\n")
        empty, full = [], []
        for _ in range(ns.rounds):
            empty.append(_idle_cpu_ms_per_s(tmp, 0, ns.seconds))
            full.append(_idle_cpu_ms_per_s(tmp, ns.delayed, ns.seconds))
    e, f = statistics.median(empty), statistics.median(full)
    print(f"idle worker CPU, ms per second (median of {ns.rounds} rounds of {ns.seconds:g} s)")
    print(f"  empty queue:          {e:7.1f}   rounds: {', '.join(f'{x:.1f}' for x in empty)}")
    print(
        f"  {ns.delayed:,} delayed jobs: {f:7.1f}   rounds: {', '.join(f'{x:.1f}' for x in full)}"
    )
    print(f"  ratio delayed / empty: {f / e if e else float('inf'):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
