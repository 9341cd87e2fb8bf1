"""A fleet with jobs that wait: 1, 2, 4, 8 worker processes on Redis and SQLite (issue 18).

On a 2-core machine a CPU-bound drain cannot show four workers beating one; jobs that
wait can. Each job is the echo arm waiting a scripted time (``METNOS_ECHO_DELAY_S``,
50-200 ms drawn per job by default, as a tool call waiting on the network does): no
executor process starts, so the queue and the supervisor are what is measured.

Each drain: ``jobs-per-worker x N`` jobs queued first (from this process), then N real
``python -m metnos_exec worker`` processes (``--concurrency C``, ``--worker-id wI``,
JSON logs to files), started through ``bench/_fleet_worker.py``, which times their
lease calls and, on SQLite, the CPU inside the store's calls (``--plain``: without it).
The clock starts once every worker logged ``worker.started`` (process start-up is not
counted) and stops when no job is queued or running (polled every 20 ms). Reported:

- jobs/s: the jobs left at the start of the window / the window;
- broker ops/job. Redis: the scripts the workers ran (``EVALSHA`` calls in ``INFO
  commandstats``; every call of theirs is one) per job, and after the line the commands
  those scripts ran per job (commandstats counts them too; the bench's own HMGET polls
  and INFO taken out); SQLite: the workers' calls into SQLite (one transaction or one
  read each, `SQLiteStore._run`) per job;
- broker CPU/job. Redis: the redis-server process's CPU (``INFO cpu``, user + system),
  and in brackets the time inside the scripts (their commandstats usec); SQLite
  has no server: the CPU the workers' threads spent inside the calls into SQLite
  (`time.thread_time` around each, every try of a call that waited for the lock
  counted), and in brackets those calls' wall time;
- worker CPU/job: every worker process's CPU (user + system), all it does per job;
- lease p50/p99: the wall time of the workers' ``lease`` calls that took a job, in the
  window, as their lease loop waits for them; on Redis, beside it, the round trip of
  the bench's own polls (one HMGET: how quickly the server answers at all);
- fleet cores (workers + redis-server CPU / window) and how busy the whole machine was
  (/proc/stat: this fleet and anything else running): a ratio read while the machine
  was saturated measures the machine, not the queue;
- then ``--idle-s`` with the same workers and nothing queued: per worker and second, the
  broker calls their idle polls make, the broker CPU they cost (as above), and the
  worker's own CPU: the load that grows with the number of workers, not of jobs.

Rounds rotate the order of the drains; medians are reported, then the acceptance ratios
(N workers / 1: jobs/s, and broker CPU per job).

Usage: python bench/fleet.py [--workers 1,2,4,8] [--concurrency 4] [--jobs-per-worker 300]
       [--delay 0.05-0.2] [--rounds 1] [--brokers redis,sqlite] [--idle-s 2] [--plain]
(or ``metnos-exec bench fleet ...``; ``PYTHONPATH=.`` from the repository root.)
"""

from __future__ import annotations

import argparse
import array
import os
import signal
import socket
import sqlite3
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402

from tests.helpers.redis_server import RedisServer  # noqa: E402

MANIFEST = 'name = "wait"\nversion = "1"\nruntime = "python"\nentry = "main.py"\n'
_TICK = os.sysconf("SC_CLK_TCK")
_POLL_S = 0.02


def _cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) `pid` used so far; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def _machine() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, every core (/proc/stat)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks[:8]) - idle) / _TICK, sum(ticks[:8]) / _TICK


class Resp:
    """A few commands to the private redis-server (no Redis client in the base install)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.buf = self.sock.makefile("rb")

    def call(self, *args: str) -> Any:
        out = [f"*{len(args)}\r\n".encode()]
        for a in args:
            b = a.encode()
            out.append(b"$%d\r\n%s\r\n" % (len(b), b))
        self.sock.sendall(b"".join(out))
        return self._read()

    def _read(self) -> Any:
        line = self.buf.readline().rstrip(b"\r\n")
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self.buf.read(n + 2)[:-2].decode()
        if kind == b"*":
            return [self._read() for _ in range(int(rest))]
        if kind == b":":
            return int(rest)
        if kind == b"-":
            raise RuntimeError(rest.decode())
        return rest.decode()

    def cpu(self) -> float:
        """The server's CPU seconds so far (``INFO cpu``: getrusage, microseconds; /proc's
        10 ms ticks are too coarse for one idle worker)."""
        fields = dict(
            line.split(":", 1) for line in self.call("INFO", "cpu").splitlines() if ":" in line
        )
        return float(fields["used_cpu_sys"]) + float(fields["used_cpu_user"])

    def clients(self) -> int:
        """Connections open now (``INFO clients``), this one included."""
        for line in self.call("INFO", "clients").splitlines():
            if line.startswith("connected_clients:"):
                return int(line.split(":")[1])
        return 0

    def commandstats(self) -> dict[str, tuple[int, int]]:
        """command → (calls, usec)."""
        stats: dict[str, tuple[int, int]] = {}
        for line in self.call("INFO", "commandstats").splitlines():
            if line.startswith("cmdstat_"):
                name, _, rest = line[len("cmdstat_") :].partition(":")
                kv = dict(item.split("=", 1) for item in rest.split(","))
                stats[name] = (int(kv["calls"]), int(kv["usec"]))
        return stats


class Drain:
    """One drain's figures (or the medians of several)."""

    def __init__(self, broker: str, workers: int, **figures: Any) -> None:
        self.broker = broker
        self.workers = workers
        self.rate = 0.0
        self.ops = 0.0
        self.broker_cpu_us = 0.0
        self.inside_us = 0.0
        self.worker_cpu_us = 0.0
        self.lease_ms = (0.0, 0.0)
        self.top = ""
        #: Cores the fleet (workers + redis-server) used in the window, on average.
        self.fleet_cores = 0.0
        #: The share of the machine's CPU in use in the window (this fleet and the rest).
        self.machine_busy = 0.0
        #: Idle, per worker and second: broker CPU ms, broker calls, the worker's CPU ms.
        self.idle_broker_ms = 0.0
        self.idle_ops = 0.0
        self.idle_worker_ms = 0.0
        #: Redis connections per worker process at the end of the drain.
        self.connections = 0.0
        #: p50, p99 of the bench's own HMGET round trips in the window (Redis only).
        self.rtt_ms = (0.0, 0.0)
        for k, v in figures.items():
            setattr(self, k, v)


class Fleet:
    def __init__(self, ns: argparse.Namespace, tmp: Path, server: RedisServer | None) -> None:
        self.ns = ns
        self.tmp = tmp
        self.server = server
        self.resp = Resp(server.port) if server is not None else None
        self.executors = tmp / "executors"
        (self.executors / "wait").mkdir(parents=True)
        (self.executors / "wait" / "manifest.toml").write_text(MANIFEST)
        (self.executors / "wait" / "main.py").write_text("")  # the echo arm runs nothing
        (tmp / "home").mkdir()

    def _prefill(self, url: str, n: int) -> None:
        from metnos_exec.brokers import open_broker
        from metnos_exec.messages import Job

        async def fill() -> None:
            async with open_broker(url) as broker:
                jobs = [Job(executor="wait") for _ in range(n)]
                for i in range(0, n, 1000):
                    await broker.submit_many(jobs[i : i + 1000])

        anyio.run(fill)

    def _spawn(self, url: str, tag: str, i: int) -> subprocess.Popen[bytes]:
        base = self.tmp / f"{tag}-w{i}"
        head = [sys.executable] + (
            ["-m", "metnos_exec"] if self.ns.plain else [str(ROOT / "bench" / "_fleet_worker.py")]
        )
        argv = [
            *head,
            "worker",
            "--broker",
            url,
            "--executors",
            str(self.executors),
            "--concurrency",
            str(self.ns.concurrency),
            "--worker-id",
            f"w{i}",
            "--log-file",
            f"{base}.jsonl",
        ]
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "HOME": str(self.tmp / "home"),
            "METNOS_ARM_OVERRIDE": "echo",
            "METNOS_ECHO_DELAY_S": self.ns.delay,
            "BENCH_FLEET_STATS": str(base),
        }
        with open(f"{base}.out", "wb") as out:
            return subprocess.Popen(
                argv, env=env, cwd=self.tmp, stdin=subprocess.DEVNULL, stdout=out, stderr=out
            )

    def _sqlite_stats(self, tag: str, n: int) -> tuple[float, float, float]:
        total = [0.0, 0.0, 0.0]
        for i in range(n):
            path = self.tmp / f"{tag}-w{i}.sqlite"
            if path.exists() and path.stat().st_size == 24:
                for k, v in enumerate(struct.unpack("ddd", path.read_bytes())):
                    total[k] += v
        return total[0], total[1], total[2]

    def run(self, kind: str, n: int, tag: str) -> Drain:
        jobs = n * self.ns.jobs_per_worker
        polls = 0
        rtt: list[float] = []  # the bench's own HMGET polls: how quickly Redis answers
        if kind == "redis":
            assert self.server is not None and self.resp is not None
            url = f"{self.server.url}?prefix={tag}"
            counts = "{" + tag + "}:counts"
            resp = self.resp

            def remaining() -> int:
                nonlocal polls
                polls += 1
                t = time.perf_counter()
                queued, running = resp.call("HMGET", counts, "queued", "running")
                rtt.append(time.perf_counter() - t)
                return int(queued or 0) + int(running or 0)
        else:
            db = self.tmp / f"{tag}.db"
            url = f"sqlite:///{db}"
            conn: sqlite3.Connection | None = None

            def remaining() -> int:
                nonlocal conn
                if conn is None:  # once the broker made the file (after the prefill)
                    conn = sqlite3.connect(db, isolation_level=None)
                (left,) = conn.execute(
                    "SELECT count(*) FROM jobs WHERE state IN ('queued', 'running')"
                ).fetchone()
                return int(left)

        self._prefill(url, jobs)
        procs = [self._spawn(url, tag, i) for i in range(n)]
        drain = Drain(kind, n)
        try:
            deadline = time.monotonic() + 120
            logs = [self.tmp / f"{tag}-w{i}.jsonl" for i in range(n)]
            while not all(p.exists() and b'"worker.started"' in p.read_bytes() for p in logs):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"{kind} x{n}: the workers did not start ({self.tmp})")
                time.sleep(_POLL_S)
            t0 = time.monotonic()
            left0 = remaining()
            cpu0 = sum(_cpu(p.pid) for p in procs)
            busy0, total0 = _machine()
            broker0 = self._broker_snapshot(kind, tag, n)
            polls = 0
            rtt.clear()
            expected = left0 / (n * self.ns.concurrency) * 0.2
            deadline = time.monotonic() + 60 + 10 * expected
            while remaining() > 0:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{kind} x{n}: jobs left after the deadline")
                time.sleep(_POLL_S)
            t1 = time.monotonic()
            worker_cpu = sum(_cpu(p.pid) for p in procs) - cpu0
            busy1, total1 = _machine()
            broker1 = self._broker_snapshot(kind, tag, n)
            if left0 < jobs // 2:
                raise RuntimeError(
                    f"{kind} x{n}: {jobs - left0} of {jobs} jobs ran before every worker "
                    "started; use more --jobs-per-worker"
                )
            drain.rate = left0 / (t1 - t0)
            drain.worker_cpu_us = worker_cpu / left0 * 1e6
            drain.machine_busy = (busy1 - busy0) / max(total1 - total0, 1e-9)
            server_cpu = self._broker_figures(drain, broker0, broker1, left0, polls)
            if len(rtt) >= 2:
                q = statistics.quantiles(rtt, n=100, method="inclusive")
                drain.rtt_ms = (statistics.median(rtt) * 1e3, q[98] * 1e3)
            drain.fleet_cores = (worker_cpu + server_cpu) / (t1 - t0)
            if self.ns.idle_s > 0:
                self._idle(drain, kind, tag, procs)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            if kind == "sqlite" and conn is not None:
                conn.close()
        if not self.ns.plain:
            drain.lease_ms = self._lease_latency(tag, n, t0, t1)
        return drain

    def _broker_snapshot(self, kind: str, tag: str, n: int) -> Any:
        if kind == "redis":
            assert self.server is not None and self.server.proc is not None
            assert self.resp is not None
            return (self.resp.cpu(), self.resp.commandstats(), self.resp.clients())
        return self._sqlite_stats(tag, n)

    def _broker_figures(self, d: Drain, before: Any, after: Any, jobs: int, polls: int) -> float:
        """Fill `d`'s broker figures from two snapshots; the broker server's CPU seconds."""
        if d.broker != "redis":
            if not self.ns.plain:
                d.broker_cpu_us = (after[0] - before[0]) / jobs * 1e6
                d.inside_us = (after[1] - before[1]) / jobs * 1e6
                d.ops = (after[2] - before[2]) / jobs
            return 0.0
        (server0, stats0, _), (server1, stats1, clients) = before, after
        d.broker_cpu_us = (server1 - server0) / jobs * 1e6
        d.connections = (clients - 1) / d.workers  # the bench's own one out
        delta = {
            k: (c - stats0.get(k, (0, 0))[0], u - stats0.get(k, (0, 0))[1])
            for k, (c, u) in stats1.items()
            if k != "info"
        }
        if "hmget" in delta:
            c, u = delta["hmget"]
            delta["hmget"] = (c - polls, u)  # the bench's polls (their few usec stay in)
        # The workers' own calls are scripts; commandstats also counts every command a
        # script runs (TYPE for the guard, XREADGROUP, HSET...).
        scripts = [k for k in delta if k in ("evalsha", "evalsha_ro", "eval")]
        d.ops = sum(delta[k][0] for k in scripts) / jobs
        d.inside_us = sum(delta[k][1] for k in scripts) / jobs
        inner = sum(c for k, (c, _) in delta.items() if k not in scripts) / jobs
        top = sorted(delta.items(), key=lambda kv: -kv[1][0])[:3]
        d.top = f"{inner:.0f} commands/job, most: " + " ".join(
            f"{k} {c / jobs:.1f}" for k, (c, _) in top if c > 0
        )
        return float(server1 - server0)

    def _idle(self, d: Drain, kind: str, tag: str, procs: list[Any]) -> None:
        """The same workers with nothing to do for ``--idle-s``: what their polling costs
        the broker, per worker and second (the bench itself does not poll meanwhile)."""
        n = len(procs)
        before = self._broker_snapshot(kind, tag, n)
        cpu0 = sum(_cpu(p.pid) for p in procs)
        time.sleep(self.ns.idle_s)
        after = self._broker_snapshot(kind, tag, n)
        per = n * self.ns.idle_s
        d.idle_worker_ms = (sum(_cpu(p.pid) for p in procs) - cpu0) / per * 1e3
        if kind == "redis":
            (c0, s0, _), (c1, s1, _) = before, after
            d.idle_broker_ms = (c1 - c0) / per * 1e3
            calls = [c - s0.get(k, (0, 0))[0] for k, (c, _) in s1.items() if k.startswith("eval")]
            d.idle_ops = sum(calls) / per
        elif not self.ns.plain:
            d.idle_broker_ms = (after[0] - before[0]) / per * 1e3
            d.idle_ops = (after[2] - before[2]) / per

    def _lease_latency(self, tag: str, n: int, t0: float, t1: float) -> tuple[float, float]:
        took: list[float] = []
        for i in range(n):
            path = self.tmp / f"{tag}-w{i}.lease"
            if not path.exists():
                continue
            a = array.array("d")
            a.frombytes(path.read_bytes())
            for k in range(0, len(a) - 2, 3):
                start, secs, got = a[k], a[k + 1], a[k + 2]
                if got > 0 and t0 <= start <= t1:
                    took.append(secs * 1e3)
        if len(took) < 2:
            return (0.0, 0.0)
        q = statistics.quantiles(took, n=100, method="inclusive")
        return (statistics.median(took), q[98])


def _line(d: Drain) -> str:
    p50, p99 = d.lease_ms
    inside = "" if d.broker != "redis" and not d.inside_us else f" ({d.inside_us:5.0f})"
    return (
        f"{d.broker:6s} x{d.workers:<2d} {d.rate:8.1f} jobs/s  ops/job {d.ops:5.2f}  "
        f"broker CPU us/job {d.broker_cpu_us:5.0f}{inside}  worker CPU us/job "
        f"{d.worker_cpu_us:5.0f}  lease p50 {p50:6.2f} p99 {p99:6.2f} ms  fleet "
        f"{d.fleet_cores:4.2f} cores, machine {100 * d.machine_busy:3.0f}% busy; idle per "
        f"worker: {d.idle_ops:4.1f} calls/s, broker {d.idle_broker_ms:4.2f} ms/s, worker "
        f"{d.idle_worker_ms:4.1f} ms/s"
        + (f"; {d.connections:.1f} connections/worker" if d.connections else "")
        + (f"; bench RTT p50 {d.rtt_ms[0]:.2f} p99 {d.rtt_ms[1]:.2f} ms" if d.rtt_ms[0] else "")
        + (f"  [{d.top}]" if d.top else "")
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fleet", description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="1,2,4,8", help="worker process counts")
    p.add_argument("--concurrency", type=int, default=4, help="slots per worker")
    p.add_argument("--jobs-per-worker", type=int, default=300)
    p.add_argument("--delay", default="0.05-0.2", help="METNOS_ECHO_DELAY_S per job")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--brokers", default="redis,sqlite")
    p.add_argument("--plain", action="store_true", help="workers without the bench's clocks")
    p.add_argument(
        "--idle-s", type=float, default=2.0, help="then the workers idle this long (0: not)"
    )
    ns = p.parse_args(argv)
    counts = [int(x) for x in ns.workers.split(",") if x]
    kinds = [k for k in ns.brokers.split(",") if k]
    load0 = os.getloadavg()
    print(
        f"fleet: workers {counts}, {ns.concurrency} slots each, {ns.jobs_per_worker} jobs per "
        f"worker, delay {ns.delay} s, {ns.rounds} round(s), {os.cpu_count()} cpus, "
        f"load {load0[0]:.2f}",
        flush=True,
    )
    results: dict[tuple[str, int], list[Drain]] = {}
    os.umask(0o077)  # the queue files private from the start, as a worker wants them
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp_s:
        tmp = Path(tmp_s)
        server = None
        if "redis" in kinds:
            server = RedisServer(tmp / "redis")
            server.start()
            probe = Resp(server.port)
            idle0 = probe.cpu()
            time.sleep(2)
            idle = (probe.cpu() - idle0) / 2
            print(f"redis-server idle: {idle * 1e3:.1f} ms CPU per s", flush=True)
        try:
            fleet = Fleet(ns, tmp, server)
            plan = [(k, n) for n in counts for k in kinds]
            for r in range(ns.rounds):
                order = plan[r % len(plan) :] + plan[: r % len(plan)]
                for i, (kind, n) in enumerate(order):
                    d = fleet.run(kind, n, f"r{r}d{i}")
                    results.setdefault((kind, n), []).append(d)
                    print(f"round {r + 1} {_line(d)}", flush=True)
        finally:
            if server is not None:
                server.stop()
    load1 = os.getloadavg()
    print(f"\nmedians of {ns.rounds} round(s) (load {load0[0]:.2f} -> {load1[0]:.2f}):")
    med: dict[tuple[str, int], Drain] = {}
    for key, ds in results.items():
        m = Drain(
            key[0],
            key[1],
            rate=statistics.median(d.rate for d in ds),
            ops=statistics.median(d.ops for d in ds),
            broker_cpu_us=statistics.median(d.broker_cpu_us for d in ds),
            inside_us=statistics.median(d.inside_us for d in ds),
            worker_cpu_us=statistics.median(d.worker_cpu_us for d in ds),
            lease_ms=(
                statistics.median(d.lease_ms[0] for d in ds),
                statistics.median(d.lease_ms[1] for d in ds),
            ),
            fleet_cores=statistics.median(d.fleet_cores for d in ds),
            idle_broker_ms=statistics.median(d.idle_broker_ms for d in ds),
            idle_ops=statistics.median(d.idle_ops for d in ds),
            idle_worker_ms=statistics.median(d.idle_worker_ms for d in ds),
            connections=statistics.median(d.connections for d in ds),
            rtt_ms=(
                statistics.median(d.rtt_ms[0] for d in ds),
                statistics.median(d.rtt_ms[1] for d in ds),
            ),
            machine_busy=statistics.median(d.machine_busy for d in ds),
        )
        med[key] = m
        print(f"  {_line(m)}")
    for kind in kinds:
        one = med.get((kind, 1))
        if one is None:
            continue
        for n in counts:
            if n == 1:
                continue
            m = med[(kind, n)]
            cpu = (
                f"{m.broker_cpu_us / one.broker_cpu_us:.2f}x"
                if one.broker_cpu_us
                else "not measured (--plain)"
            )
            print(
                f"  {kind}: {n} workers / 1 = {m.rate / one.rate:.2f}x jobs/s "
                f"(ideal {n}x), broker CPU per job {cpu}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
