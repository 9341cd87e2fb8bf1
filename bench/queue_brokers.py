"""The queue alone, on Redis and on SQLite, next to taskiq, Dramatiq and Huey (issue 11).

Every system drains the same number of no-op jobs from the same private redis-server
(started here on a free loopback port, never the shared 6379), or from a fresh SQLite
file, with real worker processes:

- metnos-exec: ``metnos-exec worker`` processes with the echo arm
  (``METNOS_ARM_OVERRIDE=echo``: no executor process, the queue alone), JSON logs to a
  file as in production, each result stored; 1, 2 and 4 worker processes;
- taskiq with taskiq-redis's ``RedisStreamBroker`` (streams and a consumer group, acked
  when executed, no result backend), ``taskiq worker --workers N``;
- Dramatiq with its ``RedisBroker``, ``dramatiq --processes N --threads T``;
- Huey with ``RedisHuey`` and ``SqliteHuey`` (``results=False``),
  ``huey_consumer -k thread -w T`` (one process; Huey has no multi-process mode with
  threads, so it runs at 1 process only).

Each peer runs with the thread count that drained no-op jobs fastest here
(`PEER_THREADS`, from a sweep of 1-64 recorded in bench/RESULTS.md): Dramatiq drains
three times faster with 32 threads than with 8 (its prefetch grows with them), Huey is
fastest with 2-4; one count for all (8, before) was unfair to Dramatiq.

The peers store no result; metnos-exec stores one per job and logs every step: the
comparison favours them.

Besides jobs/s, each drain reports the CPU time (user + system) its worker processes and
their children used per job during the timed window, and the redis-server's: a measure of
the work per job that moves far less with the machine's load than the rate does.

How a drain is timed: the jobs are queued first, then the workers start; the clock runs
from the moment the first job leaves the queue (with several metnos-exec processes: from
the moment the last of them logged ``worker.started``) to the moment none is left (queued
or in flight), polled every 5 ms, so process start-up is not counted. Rounds rotate the
order of the systems; medians are reported.

Usage: python bench/queue_brokers.py [--jobs N] [--rounds R] [--processes 1,2,4]
       [--concurrency C] [--peers taskiq,dramatiq,huey]
       [--peer-threads huey=2,huey-sqlite=4,dramatiq=32] [--baseline TREE]
(with ``PYTHONPATH=.`` from the repository root; the peers come from the ``bench``
extra: ``pip install -e '.[bench]'``.)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402

from tests.helpers.redis_server import RedisServer  # noqa: E402

PEERS_APP = '''\
"""No-op tasks for the peers, configured by environment variables (bench/queue_brokers.py)."""
import os

KIND = os.environ["BENCH_KIND"]
URL = os.environ.get("BENCH_REDIS_URL", "")
NS = os.environ.get("BENCH_NS", "bench")
# "like" mode: each job's result stored, as metnos-exec does; "quiet": nothing stored.
RESULTS = os.environ.get("BENCH_RESULTS") == "1"

if KIND == "taskiq":
    from taskiq_redis import RedisAsyncResultBackend, RedisStreamBroker

    # consumer_id="0": the group reads the jobs queued before the workers started.
    broker = RedisStreamBroker(url=URL, queue_name=NS, consumer_group_name=NS, consumer_id="0")
    if RESULTS:
        broker = broker.with_result_backend(RedisAsyncResultBackend(redis_url=URL))

    @broker.task
    async def noop() -> None:
        return None

elif KIND == "dramatiq":
    import dramatiq
    from dramatiq.brokers.redis import RedisBroker

    redis_broker = RedisBroker(url=URL, namespace=NS)
    if RESULTS:
        from dramatiq.results import Results
        from dramatiq.results.backends.redis import RedisBackend

        redis_broker.add_middleware(Results(backend=RedisBackend(url=URL, namespace=NS)))
    dramatiq.set_broker(redis_broker)

    # store_results exists only with the Results middleware.
    @dramatiq.actor(queue_name="q", max_retries=0, **({"store_results": True} if RESULTS else {}))
    def noop() -> None:
        return None

elif KIND in ("huey", "huey-sqlite"):
    from huey import RedisHuey, SqliteHuey

    if KIND == "huey":
        huey = RedisHuey(NS, url=URL, results=RESULTS)
    else:
        huey = SqliteHuey(NS, filename=os.environ["BENCH_SQLITE"], results=RESULTS)

    @huey.task()
    def noop() -> None:
        return None
'''

#: Worker threads per peer (``--peer-threads`` overrides): each one's fastest in a sweep
#: of 1, 2, 4, 8, 16, 32, 64 threads on this 2-core machine (bench/RESULTS.md).
#: (taskiq runs its tasks on its event loop: no threads.)
PEER_THREADS: dict[str, int] = {"huey": 2, "huey-sqlite": 4, "dramatiq": 32}

NOOP_MANIFEST = 'name = "noop"\nversion = "1"\nruntime = "python"\nentry = "main.py"\n'


def _redis_client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url)


_TICK = os.sysconf("SC_CLK_TCK")


def _tree_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) used so far by `pids` and their descendants."""
    total = 0
    seen: set[int] = set()
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return total / _TICK


class Drain:
    """One system's drain: queue jobs, start workers, report jobs/s."""

    #: The source tree whose metnos_exec the worker processes import.
    root: Path = ROOT

    def __init__(self, name: str, tmp: Path, jobs: int) -> None:
        self.name = name
        self.tmp = tmp
        self.jobs = jobs

    def prefill(self, tag: str) -> None:
        raise NotImplementedError

    def remaining(self) -> int:
        raise NotImplementedError

    def workers(self, tag: str) -> list[subprocess.Popen[bytes]]:
        raise NotImplementedError

    def ready(self, tag: str) -> bool:
        """Every worker process is serving (the clock may start). Default: at once."""
        return True

    #: Worker CPU seconds per job during the last drain (all its processes).
    cpu_per_job: float = 0.0
    #: redis-server CPU seconds per job during the last drain (0 on SQLite).
    server_cpu_per_job: float = 0.0
    #: The private redis-server's pid (set by `main`).
    server_pid: int = 0
    uses_redis: bool = True

    def run(self, tag: str) -> float:
        self.prefill(tag)
        procs = self.workers(tag)
        try:
            t0 = r0 = None
            deadline = time.monotonic() + 600
            while not self.ready(tag):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"{self.name}: workers did not start")
                time.sleep(0.005)
            while True:
                left = self.remaining()
                now = time.perf_counter()
                if t0 is None and (left < self.jobs or len(procs) > 1):
                    # With several processes the clock starts once all of them serve:
                    # jobs drained while the last one was still starting do not count.
                    t0, r0 = now, left
                    cpu0 = _tree_cpu([p.pid for p in procs])
                    server0 = _tree_cpu([self.server_pid]) if self.uses_redis else 0.0
                if left == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name}: {left} jobs left after 600 s")
                time.sleep(0.005)  # the harness polls; the same for every system
            assert t0 is not None and r0 is not None
            self.cpu_per_job = (_tree_cpu([p.pid for p in procs]) - cpu0) / max(r0, 1)
            if self.uses_redis:
                server = _tree_cpu([self.server_pid]) - server0
                self.server_cpu_per_job = server / max(r0, 1)
            if r0 == 0:
                raise RuntimeError(f"{self.name}: drained before the first poll; use more jobs")
            return r0 / (now - t0)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    def _spawn(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{self.name}.out", "ab")  # noqa: SIM115 (kept by Popen)
        try:
            return subprocess.Popen(
                argv,
                env={**os.environ, "PYTHONPATH": f"{self.tmp}:{self.root}", **env},
                cwd=self.tmp,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        finally:
            log.close()


class Metnos(Drain):
    def __init__(
        self,
        tmp: Path,
        jobs: int,
        *,
        url: str | None,
        processes: int,
        concurrency: int,
        root: Path | None = None,
    ) -> None:
        kind = "redis" if url else "sqlite"
        label = "metnos-exec" if root is None else "baseline"
        super().__init__(f"{label} {kind} x{processes}", tmp, jobs)
        if root is not None:
            self.root = root
        self.uses_redis = url is not None
        self.redis_url = url
        self.processes = processes
        self.concurrency = concurrency
        self.executors = tmp / "executors"
        (self.executors / "noop").mkdir(parents=True, exist_ok=True)
        (self.executors / "noop" / "manifest.toml").write_text(NOOP_MANIFEST)
        (self.executors / "noop" / "main.py").write_text("")
        self.url = ""
        self._poll: Callable[[], int] = lambda: 0

    def prefill(self, tag: str) -> None:
        from metnos_exec.brokers import open_broker
        from metnos_exec.messages import Job

        if self.redis_url:
            self.url = f"{self.redis_url}?prefix=m{tag}"
            client = _redis_client(self.redis_url)
            counts = "{m" + tag + "}:counts"

            def poll() -> int:
                queued, running = client.hmget(counts, "queued", "running")
                return int(queued or 0) + int(running or 0)

            self._poll = poll
        else:
            db = self.tmp / f"m{tag}.db"
            self.url = f"sqlite:///{db}"

            def poll_sqlite() -> int:
                with sqlite3.connect(db) as conn:
                    (n,) = conn.execute(
                        "SELECT count(*) FROM jobs WHERE state IN ('queued', 'running')"
                    ).fetchone()
                return int(n)

            self._poll = poll_sqlite

        async def fill() -> None:
            async with open_broker(self.url) as broker:
                jobs = [Job(executor="noop") for _ in range(self.jobs)]
                for i in range(0, len(jobs), 1000):
                    await broker.submit_many(jobs[i : i + 1000])

        anyio.run(fill)

    def remaining(self) -> int:
        return self._poll()

    def ready(self, tag: str) -> bool:
        for i in range(self.processes):
            log = self.tmp / f"m{tag}-w{i}.jsonl"
            if not log.exists() or b'"worker.started"' not in log.read_bytes():
                return False
        return True

    def workers(self, tag: str) -> list[subprocess.Popen[bytes]]:
        return [
            self._spawn(
                [
                    sys.executable,
                    "-m",
                    "metnos_exec",
                    "worker",
                    "--broker",
                    self.url,
                    "--executors",
                    str(self.executors),
                    "--concurrency",
                    str(self.concurrency),
                    "--worker-id",
                    f"w{i}",
                    "--log-file",
                    str(self.tmp / f"m{tag}-w{i}.jsonl"),
                ],
                {"METNOS_ARM_OVERRIDE": "echo"},
            )
            for i in range(self.processes)
        ]


class Peer(Drain):
    def __init__(
        self,
        kind: str,
        tmp: Path,
        jobs: int,
        *,
        url: str,
        processes: int,
        threads: int,
        like: bool = False,
    ) -> None:
        super().__init__(f"{kind} x{processes}{' like' if like else ''}", tmp, jobs)
        self.kind = kind
        self.like = like
        self.uses_redis = kind != "huey-sqlite"
        self.url = url
        self.processes = processes
        self.threads = threads
        self.env: dict[str, str] = {}
        self.app: Any = None

    def _load(self, tag: str) -> Any:
        self.env = {
            "BENCH_KIND": self.kind,
            "BENCH_REDIS_URL": self.url,
            "BENCH_NS": f"p{tag}",
            "BENCH_RESULTS": "1" if self.like else "0",
        }
        if self.kind == "huey-sqlite":
            self.env["BENCH_SQLITE"] = str(self.tmp / f"p{tag}.db")
        os.environ.update(self.env)
        sys.modules.pop("peers_app", None)
        return importlib.import_module("peers_app")

    def prefill(self, tag: str) -> None:
        app = self.app = self._load(tag)
        if self.kind == "taskiq":

            async def fill() -> None:
                await app.broker.startup()
                for _ in range(self.jobs):
                    await app.noop.kiq()
                await app.broker.shutdown()

            anyio.run(fill)
        elif self.kind == "dramatiq":
            for _ in range(self.jobs):
                app.noop.send()
        else:
            for _ in range(self.jobs):
                app.noop()

    def remaining(self) -> int:
        ns = self.env["BENCH_NS"]
        if self.kind == "taskiq":
            client = _redis_client(self.url)
            groups = client.xinfo_groups(ns)
            return sum(int(g["lag"] or 0) + int(g["pending"]) for g in groups)
        if self.kind == "dramatiq":
            return int(_redis_client(self.url).hlen(f"{ns}:q.msgs"))
        return int(self.app.huey.pending_count())

    def workers(self, tag: str) -> list[subprocess.Popen[bytes]]:
        bin_dir = Path(sys.executable).parent
        if self.kind == "taskiq":
            argv = [
                str(bin_dir / "taskiq"),
                "worker",
                "peers_app:broker",
                "--workers",
                str(self.processes),
                *([] if self.like else ["--no-configure-logging"]),
            ]
        elif self.kind == "dramatiq":
            argv = [
                str(bin_dir / "dramatiq"),
                "peers_app",
                "--processes",
                str(self.processes),
                "--threads",
                str(self.threads),
            ]
        else:
            argv = [
                str(bin_dir / "huey_consumer"),
                "peers_app.huey",
                "-k",
                "thread",
                "-w",
                str(self.threads),
                *([] if self.like else ["-q"]),
            ]
        return [self._spawn(argv, self.env)]


def _ratios(medians: dict[str, float], counts: list[int], label: str) -> None:
    """The acceptance ratios of `label`'s workers ("metnos-exec" or "baseline")."""
    one_redis = medians[f"{label} redis x1"]
    one_sqlite = medians[f"{label} sqlite x1"]
    for mode in ("", " like"):
        redis_peers = {
            k: v
            for k, v in medians.items()
            if not k.startswith(("metnos", "baseline", "huey-sqlite")) and k.endswith("x1" + mode)
        }
        sqlite_peers = {
            k: v
            for k, v in medians.items()
            if k.startswith("huey-sqlite") and k.endswith("x1" + mode)
        }
        what = "results stored, default logs" if mode else "quiet"
        for kind, one, peer_rates in (
            ("redis", one_redis, redis_peers),
            ("sqlite", one_sqlite, sqlite_peers),
        ):
            if peer_rates:
                best = max(peer_rates, key=peer_rates.__getitem__)
                print(
                    f"  {label} {kind}: 1 process / fastest peer ({what}: {best}) = "
                    f"{one / peer_rates[best]:.2f}x"
                )
    for kind, one in (("redis", one_redis), ("sqlite", one_sqlite)):
        for n in counts:
            if n > 1:
                ratio = medians[f"{label} {kind} x{n}"] / one
                print(f"  {label} {kind}: {n} processes / 1 = {ratio:.2f}x")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--concurrency", type=int, default=32, help="metnos-exec slots")
    parser.add_argument("--peers", default="taskiq,dramatiq,huey")
    parser.add_argument(
        "--baseline",
        default="",
        metavar="TREE",
        help="also drain with the workers of another source tree (e.g. a `git archive` of "
        "main), as 'baseline', for before/after side by side in one run",
    )
    parser.add_argument(
        "--peer-threads",
        default="",
        help="worker threads: N for every peer, or kind=N,... (default: PEER_THREADS)",
    )
    parser.add_argument(
        "--peer-modes",
        default="quiet,like",
        help="quiet: no result stored, no per-job log (their fastest); like: results "
        "stored and default logging, as metnos-exec works",
    )
    ns = parser.parse_args(argv)
    counts = [int(x) for x in ns.processes.split(",") if x]
    threads = dict(PEER_THREADS)
    for item in (x for x in ns.peer_threads.split(",") if x):
        if "=" in item:
            kind, n = item.split("=", 1)
            threads[kind] = int(n)
        else:
            threads = dict.fromkeys(("huey", "huey-sqlite", "dramatiq"), int(item))
    peers = []
    for peer in (p for p in ns.peers.split(",") if p):
        module = {"taskiq": "taskiq_redis"}.get(peer, peer)
        if importlib.util.find_spec(module) is None or importlib.util.find_spec("redis") is None:
            print(f"{peer}: not installed, left out (pip install -e '.[bench]')")
        else:
            peers.append(peer)
    print(f"peer threads: {threads}; metnos-exec concurrency {ns.concurrency}", flush=True)
    medians: dict[str, float] = {}
    cpu_medians: dict[str, float] = {}
    server_medians: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        (tmp / "peers_app.py").write_text(PEERS_APP)
        sys.path.insert(0, str(tmp))  # the harness queues the peers' jobs itself
        server = RedisServer(tmp / "redis")
        server.start()
        assert server.proc is not None
        Drain.server_pid = server.proc.pid
        try:
            systems: list[Drain] = []
            for n in counts:
                systems.append(
                    Metnos(tmp, ns.jobs, url=server.url, processes=n, concurrency=ns.concurrency)
                )
                systems.append(
                    Metnos(tmp, ns.jobs, url=None, processes=n, concurrency=ns.concurrency)
                )
                if ns.baseline:
                    for url in (server.url, None):
                        systems.append(
                            Metnos(
                                tmp,
                                ns.jobs,
                                url=url,
                                processes=n,
                                concurrency=ns.concurrency,
                                root=Path(ns.baseline).resolve(),
                            )
                        )
            modes = [m for m in ns.peer_modes.split(",") if m]
            for peer in peers:
                for kind in (peer, "huey-sqlite") if peer == "huey" else (peer,):
                    for mode in modes:
                        systems.append(
                            Peer(
                                kind,
                                tmp,
                                ns.jobs,
                                url=server.url,
                                processes=1,
                                threads=threads.get(kind, 1),
                                like=mode == "like",
                            )
                        )
            rates: dict[str, list[float]] = {s.name: [] for s in systems}
            cpus: dict[str, list[float]] = {s.name: [] for s in systems}
            server_cpus: dict[str, list[float]] = {s.name: [] for s in systems}
            for r in range(ns.rounds):
                order = systems[r % len(systems) :] + systems[: r % len(systems)]
                for i, system in enumerate(order):
                    rate = system.run(f"{r}x{i}")
                    rates[system.name].append(rate)
                    cpus[system.name].append(system.cpu_per_job)
                    server_cpus[system.name].append(system.server_cpu_per_job)
                    print(
                        f"round {r + 1} {system.name:28s} {rate:8.0f} jobs/s "
                        f"{system.cpu_per_job * 1e6:5.0f} + {system.server_cpu_per_job * 1e6:3.0f}"
                        " CPU us/job (workers + redis-server)",
                        flush=True,
                    )
            for name, values in rates.items():
                medians[name] = statistics.median(values)
                cpu_medians[name] = statistics.median(cpus[name])
                server_medians[name] = statistics.median(server_cpus[name])
        finally:
            server.stop()
    load = os.getloadavg()
    print(f"\n{ns.jobs} no-op jobs per drain, {ns.rounds} rounds, medians (load {load[0]:.2f}):")
    for name, value in medians.items():
        cpu, server_cpu = cpu_medians[name] * 1e6, server_medians[name] * 1e6
        print(
            f"  {name:28s} {value:8.0f} jobs/s {cpu:5.0f} + {server_cpu:3.0f} "
            "CPU us/job (workers + redis-server)"
        )
    if 1 in counts:
        for label in ("metnos-exec", "baseline") if ns.baseline else ("metnos-exec",):
            _ratios(medians, counts, label)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
