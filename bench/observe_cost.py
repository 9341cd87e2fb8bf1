"""What metrics and tracing cost a worker (issue 20, acceptance 4: at most 5 % fewer jobs/s).

The queue-only drain of `bench/queue_throughput.py` (the echo arm, no process; one
worker in this process; one SQLite file; JSON logs to a file, as in production), twice
per round, side by side: **off** (`NULL_OBSERVER`: no metrics, no tracing) and **on**
(the metrics recorded and ``/metrics`` listening on a loopback port, scraped every
``--scrape-every`` seconds; every job traced: its CONSUMER span a child of the context it
carries, sampled on ``--sample`` of them, the phase spans, through the SDK's
``BatchSpanProcessor`` to an exporter that drops them, so the cost measured is the
worker's, not a collector's). The order
alternates each round so load drift hits both alike; medians are reported, and the
ratio is on / off of the medians.

Usage: python bench/observe_cost.py [--jobs N] [--rounds R] [--concurrency C]
       [--backend asyncio|trio] [--scrape-every S] [--sample RATIO]
       [--on metrics|tracing|metrics,tracing]
(with ``PYTHONPATH=.`` to measure this checkout)
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from metnos_exec.brokers.sqlite import SQLiteBroker
from metnos_exec.logs import configure_logging
from metnos_exec.manifest import ExecutorRegistry
from metnos_exec.messages import Job, TraceContext
from metnos_exec.observe import NULL_OBSERVER, Observer, make_observer
from metnos_exec.sandbox.doubles import EchoSandbox
from metnos_exec.sandbox.select import ArmChoice
from metnos_exec.supervisor import Supervisor, SupervisorConfig
from metnos_exec.worker import _tune_gc

NOOP_MANIFEST = 'name = "noop"\nversion = "1"\nruntime = "python"\nentry = "main.py"\n'


def _parent(i: int, sample: float) -> TraceContext:
    """A producer's context, as a traced producer sampling at `sample` writes it: the
    sampled flag on that share of the jobs (the worker's parent-based sampler follows)."""
    every = round(1 / sample) if sample > 0 else 0
    flag = "01" if every and i % every == 0 else "00"
    return TraceContext(traceparent=f"00-{i + 1:032x}-b7ad6b7169203331-{flag}")


def _tracer_provider() -> Any:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class Drop(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    trace.set_tracer_provider(provider)
    return provider


def _echo(runtime: str, **_: Any) -> ArmChoice:
    return ArmChoice(EchoSandbox())


async def _drain(
    tmp: Path, registry: ExecutorRegistry, ns: argparse.Namespace, observer: Observer
) -> tuple[float, float]:
    """One drain: jobs/s, and this process's CPU seconds per job while it ran (every
    thread: the span processor's and the scraper's too), which other load on the
    machine disturbs less than the rate."""
    db = tmp / f"q-{time.monotonic_ns()}.db"
    traced = observer is not NULL_OBSERVER and "tracing" in ns.on
    scraped = observer is not NULL_OBSERVER and "metrics" in ns.on
    async with SQLiteBroker(db) as broker:
        batch = [
            Job(executor="noop", trace=_parent(i, ns.sample) if traced else None)
            for i in range(ns.jobs)
        ]
        for start in range(0, ns.jobs, 1000):
            await broker.submit_many(batch[start : start + 1000])
        sup = Supervisor(
            broker,
            registry,
            SupervisorConfig(worker_id="bench", concurrency=ns.concurrency, home=str(tmp)),
            arm_chooser=_echo,
            observer=observer,
        )
        async with anyio.create_task_group() as tg:
            t, cpu = time.perf_counter(), time.process_time()
            # Ready means /metrics listens (the supervisor starts it before leasing).
            await tg.start(functools.partial(sup.run, burst=True))
            if scraped and ns.scrape_every > 0:
                tg.start_soon(_scrape_loop, observer, ns.scrape_every)
            await sup.wait_stopped()
            elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
            tg.cancel_scope.cancel()
        stats = await broker.stats()
        assert stats.done == ns.jobs, stats
    return ns.jobs / elapsed, cpu / ns.jobs


async def _scrape_loop(observer: Any, every: float) -> None:
    """Scrape ``/metrics`` as Prometheus would (from a thread: a blocking HTTP client)."""
    url = f"http://127.0.0.1:{observer.metrics.port}/metrics"

    def scrape() -> None:
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                reply.read()
        except OSError:
            pass  # the drain ended during this scrape: the worker's listener is gone

    while True:
        await anyio.sleep(every)
        await anyio.to_thread.run_sync(scrape, abandon_on_cancel=True)


async def _main(ns: argparse.Namespace) -> list[tuple[str, float, str]]:
    provider = _tracer_provider()
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        (tmp / "executors" / "noop").mkdir(parents=True)
        (tmp / "executors" / "noop" / "manifest.toml").write_text(NOOP_MANIFEST)
        (tmp / "executors" / "noop" / "main.py").write_text("print('{}')\n")
        registry = ExecutorRegistry.load(tmp / "executors")
        configure_logging(file=tmp / "bench.jsonl")

        def on() -> Observer:
            # Port 0: the kernel picks a free loopback port (`Metrics.port` says which).
            bind = ("127.0.0.1", 0) if "metrics" in ns.on else None
            return make_observer(metrics=bind, trace="tracing" in ns.on)

        arms = {"off": lambda: NULL_OBSERVER, "on": on}
        for make in arms.values():  # warm-up: page cache, decoders, the SDK
            await _drain(tmp, registry, _small(ns), make())
        rates: dict[str, list[float]] = {name: [] for name in arms}
        cpus: dict[str, list[float]] = {name: [] for name in arms}
        names = list(arms)
        for r in range(ns.rounds):
            for name in names[r % 2 :] + names[: r % 2]:
                rate, cpu = await _drain(tmp, registry, ns, arms[name]())
                rates[name].append(rate)
                cpus[name].append(cpu)
    provider.shutdown()
    off, on_rate = (statistics.median(rates[n]) for n in names)
    cpu_off, cpu_on = (statistics.median(cpus[n]) * 1e6 for n in names)
    rounds = " ".join(f"{100 * b / a:.0f}%" for a, b in zip(rates["off"], rates["on"], strict=True))
    return [
        (
            f"off (no observer), concurrency {ns.concurrency}",
            off,
            f"median of {ns.rounds}; CPU {cpu_off:.0f} us/job",
        ),
        (
            f"on ({'+'.join(sorted(ns.on))}, {ns.sample:g} sampled), concurrency {ns.concurrency}",
            on_rate,
            f"{100 * on_rate / off:.1f} % of off (target >= 95 %); rounds {rounds}; "
            f"CPU {cpu_on:.0f} us/job ({100 * (cpu_on / cpu_off - 1):+.1f} %)",
        ),
    ]


def _small(ns: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(ns), "jobs": min(ns.jobs, 200)})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    p.add_argument("--scrape-every", type=float, default=1.0, metavar="S")
    p.add_argument(
        "--on",
        type=lambda text: frozenset(text.split(",")),
        default=frozenset({"metrics", "tracing"}),
        metavar="PARTS",
        help="what the 'on' side turns on: metrics, tracing, or metrics,tracing (default)",
    )
    p.add_argument(
        "--sample",
        type=float,
        default=1.0,
        metavar="RATIO",
        help="share of the jobs whose producer span is sampled (1: every job, the worst "
        "case; 0.01: a typical production ratio)",
    )
    ns = p.parse_args(argv)
    # The collector tuned as in a worker process (`metnos_exec.worker`): spans allocate,
    # and at CPython's default thresholds that is paid again in collections.
    _tune_gc()
    rows = anyio.run(_main, ns, backend=ns.backend)
    for label, rate, note in rows:
        print(f"{label:55s} {rate:10.0f} jobs/s   {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
