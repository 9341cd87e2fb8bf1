"""Warm one-shot sandboxes against cold starts (issue 22, acceptance 1 and 4): submit ->
result latency of a no-op ``python`` executor through a real worker on SQLite, warm and
cold side by side in one run; the same for a job reading one read-only folder; and
throughput at concurrency 4, warm against cold.

One real worker (``metnos-exec worker``, the bwrap arm) serves a SQLite queue in a temp
folder. Its executors come in pairs, the same code and manifest but for ``warm``: ``noop``
and ``noop_warm`` (`bench/_noop.py`), ``read`` and ``read_warm`` (lists one file of a
read-only folder under the worker's ``--home``). This process is the client
(`Client.run`, waiting for each result): the calls alternate cold, warm, cold, ... so both
see the same machine. Then ``--jobs`` jobs of each kind are submitted at once to a
worker with ``--concurrency 4`` and the wall time to the last result gives jobs/s.

Targets: warm median under 5 ms and at least 4x faster than cold; warm throughput at
least 1.5x cold. ``--cold-only`` measures the cold pairs alone (both of a pair cold: the
same job twice, the noise floor; and a tree without warm sandboxes).

Usage: metnos-exec bench warm_start [--calls 100] [--warmup 10] [--jobs 200] [--warm 4]
       [--cold-only] [--json]   (or PYTHONPATH=. python bench/warm_start.py ...)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from metnos_exec.client import Client
from metnos_exec.logs import iter_records

HERE = Path(__file__).resolve().parent

NOOP = """\
name = "{name}"
version = "1.0.0"
description = "Do nothing: the benchmark's job"
runtime = "python"
entry = "main.py"
{warm}
[limits]
timeout_s = 30
"""

READ = """\
name = "{name}"
version = "1.0.0"
description = "List one read-only folder: the benchmark's job"
runtime = "python"
entry = "main.py"
{warm}
[[capabilities]]
name = "fs:read"
hints = ["~/notes/**"]

[limits]
timeout_s = 30
"""

READ_MAIN = """\
import json, os, sys
sys.stdin.read()
json.dump({"notes": sorted(os.listdir(os.path.expanduser("~/notes")))}, sys.stdout)
"""


def _setup(tmp: Path, warm: int, cold_only: bool) -> tuple[Path, Path]:
    executors = tmp / "executors"
    home = tmp / "home"
    (home / "notes").mkdir(parents=True)
    (home / "notes" / "a.md").write_text("a note\n")
    line = "" if cold_only else f"warm = {warm}\n"
    for name, manifest, main in (
        ("noop", NOOP, (HERE / "_noop.py").read_text()),
        ("read", READ, READ_MAIN),
    ):
        for suffix, warm_line in (("", ""), ("_warm", line)):
            folder = executors / f"{name}{suffix}"
            folder.mkdir(parents=True)
            text = manifest.format(name=f"{name}{suffix}", warm=warm_line)
            (folder / "manifest.toml").write_text(text)
            (folder / "main.py").write_text(main)
    os.chmod(tmp, 0o755)  # a root worker's slot uids read the executors and the home
    return executors, home


def _start_worker(tmp: Path, broker: str, executors: Path, home: Path, concurrency: int) -> Any:
    log = tmp / f"worker-{concurrency}.jsonl"
    argv = [sys.executable, "-m", "metnos_exec", "worker", "--broker", broker]
    argv += ["--executors", str(executors), "--log-file", str(log), "--home", str(home)]
    argv += ["--concurrency", str(concurrency), "--prefetch", "4"]
    proc = subprocess.Popen(argv, cwd=tmp, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (log.exists() and any(iter_records(log, event="worker.started"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the worker did not start (exit {proc.poll()})")
        time.sleep(0.05)
    return proc


def _stop(worker: Any) -> None:
    worker.send_signal(signal.SIGTERM)
    worker.wait(60)


def _stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": statistics.median(ordered) * 1000,
        "p90_ms": ordered[max(int(len(ordered) * 0.9) - 1, 0)] * 1000,
    }


async def _latency(broker: str, name: str, calls: int, warmup: int) -> dict[str, Any]:
    """Alternate ``name`` (cold) and ``name_warm`` one call at a time."""
    cold: list[float] = []
    warm: list[float] = []
    async with Client(broker) as client:
        for i in range(warmup + calls):
            kinds = ("cold", "warm") if i % 2 else ("warm", "cold")
            for kind in kinds:
                executor = name if kind == "cold" else f"{name}_warm"
                # Let the pool refill between calls, as between an agent's tool calls.
                await anyio.sleep(0.02)
                t0 = time.perf_counter()
                result = await client.run(executor, {}, wait=60)
                elapsed = time.perf_counter() - t0
                if result.status != "succeeded":
                    raise SystemExit(f"a {kind} {name} call did not succeed: {result}")
                if i >= warmup:
                    (cold if kind == "cold" else warm).append(elapsed)
    c, w = _stats(cold), _stats(warm)
    return {"cold": c, "warm": w, "speedup": c["median_ms"] / w["median_ms"]}


async def _throughput(broker: str, name: str, jobs: int) -> float:
    async with Client(broker) as client:
        t0 = time.perf_counter()
        ids = [await client.submit(name, {}) for _ in range(jobs)]
        for job_id in ids:
            result = await client.result(job_id, wait=120)
            if result is None or result.status != "succeeded":
                raise SystemExit(f"a {name} job did not succeed: {result}")
        return jobs / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--warm", type=int, default=4, help="warm sandboxes per executor")
    p.add_argument("--cold-only", action="store_true", help="no warm = N in the manifests")
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-warm-"))
    out: dict[str, Any] = {"load": os.getloadavg(), "cold_only": ns.cold_only}
    try:
        executors, home = _setup(tmp, ns.warm, ns.cold_only)
        broker = f"sqlite:///{tmp / 'q.db'}"
        worker = _start_worker(tmp, broker, executors, home, 1)
        try:
            out["noop"] = anyio.run(_latency, broker, "noop", ns.calls, ns.warmup)
            out["read"] = anyio.run(_latency, broker, "read", ns.calls, ns.warmup)
        finally:
            _stop(worker)
        worker = _start_worker(tmp, broker, executors, home, 4)
        try:
            anyio.run(_throughput, broker, "noop_warm", 8)  # the pools fill
            cold = anyio.run(_throughput, broker, "noop", ns.jobs)
            warm = anyio.run(_throughput, broker, "noop_warm", ns.jobs)
        finally:
            _stop(worker)
        out["throughput"] = {"cold_per_s": cold, "warm_per_s": warm, "ratio": warm / cold}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out["load_after"] = os.getloadavg()
    if ns.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"load {out['load'][0]:.2f} -> {out['load_after'][0]:.2f}")
    for name in ("noop", "read"):
        r = out[name]
        print(
            f"{name}: cold {r['cold']['median_ms']:.2f} ms (p90 {r['cold']['p90_ms']:.2f}), "
            f"warm {r['warm']['median_ms']:.2f} ms (p90 {r['warm']['p90_ms']:.2f}), "
            f"{r['speedup']:.2f}x"
        )
    t = out["throughput"]
    print(
        f"throughput at concurrency 4: cold {t['cold_per_s']:.1f}/s, "
        f"warm {t['warm_per_s']:.1f}/s, {t['ratio']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
