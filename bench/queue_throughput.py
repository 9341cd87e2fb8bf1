"""Throughput of the whole worker pipeline on the SQLite broker.

Two measurements, in one run:

1. queue only: the echo arm (no process), one worker (this process), one SQLite file:
   jobs/s from "N jobs queued" to "N results stored". Logging is on, to a JSON-lines file,
   as in production. Target: >= 2,500 jobs/s.
2. end to end: a native no-op executor (reads its JSON args from stdin, prints ``{}``,
   under ``python -I -S``) through the real bwrap arm at concurrency 1, 2 and 4, next to
   the *raw spawn rate* of the very same bubblewrap command line (`derive_bwrap_argv` of
   the same planned job: same flags, same mounts), launched with plain
   ``anyio.run_process`` at the same concurrency, and the bwrap arm alone
   (``BwrapSandbox.run`` in a loop, no queue). For each concurrency the three blocks are
   interleaved for ``--rounds`` rounds (order rotated each round, so load drift hits all
   three alike); medians are reported, and the ratio is the ratio of the medians.
   Target: e2e >= 85 % of raw.

The process makes itself a child subreaper first, as the worker process does (so the arm
reaps bubblewrap's orphaned init at the end of each job, as in production).

Usage: python bench/queue_throughput.py [--echo-jobs N] [--bwrap-jobs N] [--rounds R]
       [--concurrency 1,2,4] [--backend asyncio|trio] [--skip-bwrap]
(with ``PYTHONPATH=.`` to measure this checkout rather than an editable install elsewhere)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import structlog

from metnos_exec.brokers.sqlite import SQLiteBroker
from metnos_exec.logs import configure_logging
from metnos_exec.manifest import ExecutorRegistry
from metnos_exec.messages import Job
from metnos_exec.plan import plan_invocation
from metnos_exec.sandbox.doubles import EchoSandbox
from metnos_exec.sandbox.select import ArmChoice
from metnos_exec.supervisor import Supervisor, SupervisorConfig

NOOP_MANIFEST = """\
name = "noop"
version = "1"
runtime = "python"
entry = "main.py"
"""


def _executors(root: Path) -> ExecutorRegistry:
    (root / "noop").mkdir(parents=True)
    (root / "noop" / "manifest.toml").write_text(NOOP_MANIFEST)
    # It reads its stdin, as every executor reads its args: a child that exits without
    # reading makes the raw baseline's ``anyio.run_process(input=...)`` fail at random
    # (BrokenResourceError when the pipe closes before the write).
    (root / "noop" / "main.py").write_text('import sys\nsys.stdin.read()\nprint("{}")\n')
    return ExecutorRegistry.load(root)


async def _drain(
    tmp: Path, registry: ExecutorRegistry, jobs: int, concurrency: int, chooser: Any
) -> float:
    db = tmp / f"q-{time.monotonic_ns()}.db"
    async with SQLiteBroker(db) as broker:
        batch = [Job(executor="noop") for _ in range(jobs)]
        for start in range(0, jobs, 1000):
            await broker.submit_many(batch[start : start + 1000])
        sup = Supervisor(
            broker,
            registry,
            SupervisorConfig(worker_id="bench", concurrency=concurrency, home=str(tmp)),
            arm_chooser=chooser,
        )
        t = time.perf_counter()
        await sup.run(burst=True)
        elapsed = time.perf_counter() - t
        stats = await broker.stats()
        assert stats.done == jobs, stats
    return jobs / elapsed


async def _raw_spawn(tmp: Path, registry: ExecutorRegistry, jobs: int, concurrency: int) -> float:
    from metnos_exec.sandbox.bwrap import _host_facts, bwrap_probe
    from metnos_exec.sandbox.flags import derive_bwrap_argv

    probe = bwrap_probe()
    assert probe.path is not None
    inv = plan_invocation(registry.get_executor("noop"), {}, home=str(tmp))
    # The same walls as the arm's command, masks of private host files included (the arm
    # adds only its harness fds: --json-status-fd and --block-fd).
    _host_facts.refresh()
    argv = derive_bwrap_argv(
        inv.job, bwrap=probe.path, features=probe.features, masked_paths=_host_facts.masked
    )
    remaining = jobs

    async def spawner() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            out = await anyio.run_process(argv, input=inv.job.stdin, env={})
            assert out.stdout.strip() == b"{}", out

    t = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(spawner)
    return jobs / (time.perf_counter() - t)


async def _arm_direct(tmp: Path, registry: ExecutorRegistry, jobs: int, concurrency: int) -> float:
    """The bwrap arm's own rate (no queue): separates arm cost from queue cost."""
    from metnos_exec.sandbox.select import choose_arm

    inv = plan_invocation(registry.get_executor("noop"), {}, home=str(tmp))
    arm = choose_arm("python", require_sandbox=False).sandbox
    remaining = jobs

    async def runner() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            out = await arm.run(inv.job)
            assert out.stdout.strip() == b"{}", out

    t = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(runner)
    return jobs / (time.perf_counter() - t)


def _echo_chooser(runtime: str, **_: Any) -> ArmChoice:
    return ArmChoice(EchoSandbox())


async def _main(ns: argparse.Namespace) -> list[tuple[str, float, str]]:
    rows: list[tuple[str, float, str]] = []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        registry = _executors(tmp / "executors")
        configure_logging(file=tmp / "bench.jsonl")
        try:
            # Warm-up: SQLite page cache, structlog and msgspec decoders.
            await _drain(tmp, registry, 200, ns.echo_concurrency, _echo_chooser)
            rate = await _drain(tmp, registry, ns.echo_jobs, ns.echo_concurrency, _echo_chooser)
            rows.append(
                (
                    f"queue only, echo arm, 1 worker, concurrency {ns.echo_concurrency}",
                    rate,
                    "target >= 2,500",
                )
            )
            if not ns.skip_bwrap:
                from metnos_exec.sandbox.select import choose_arm

                await _raw_spawn(tmp, registry, 5, 1)
                await _arm_direct(tmp, registry, 5, 1)
                blocks = {
                    "raw": lambda c: _raw_spawn(tmp, registry, ns.bwrap_jobs, c),
                    "arm": lambda c: _arm_direct(tmp, registry, ns.bwrap_jobs, c),
                    "e2e": lambda c: _drain(tmp, registry, ns.bwrap_jobs, c, choose_arm),
                }
                names = list(blocks)
                for c in ns.concurrency:
                    rates: dict[str, list[float]] = {name: [] for name in names}
                    for r in range(ns.rounds):
                        for name in names[r % 3 :] + names[: r % 3]:
                            rates[name].append(await blocks[name](c))
                    raw, arm, e2e = (statistics.median(rates[n]) for n in names)
                    per_round = " ".join(
                        f"{100 * e / w:.0f}%"
                        for e, w in zip(rates["e2e"], rates["raw"], strict=True)
                    )
                    rows.append(
                        (
                            f"raw bwrap spawn, concurrency {c}",
                            raw,
                            f"median of {ns.rounds} rounds "
                            + " ".join(f"{x:.0f}" for x in rates["raw"]),
                        )
                    )
                    rows.append(
                        (
                            f"bwrap arm alone (no queue), concurrency {c}",
                            arm,
                            f"{100 * arm / raw:.0f} % of raw",
                        )
                    )
                    rows.append(
                        (
                            f"e2e bwrap no-op, concurrency {c}",
                            e2e,
                            f"{100 * e2e / raw:.0f} % of raw (target >= 85 %), "
                            f"{100 * e2e / arm:.0f} % of the arm alone; "
                            f"per round e2e/raw: {per_round}",
                        )
                    )
        finally:
            factory = structlog.get_config()["logger_factory"]
            f = getattr(factory, "_file", None)
            if f is not None:
                f.close()
            structlog.reset_defaults()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="queue_throughput", description=__doc__.split("\n")[0])
    p.add_argument("--echo-jobs", type=int, default=10_000)
    p.add_argument("--echo-concurrency", type=int, default=64)
    p.add_argument("--bwrap-jobs", type=int, default=60, help="jobs per block")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per concurrency")
    p.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4]
    )
    p.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    p.add_argument("--skip-bwrap", action="store_true")
    ns = p.parse_args(argv)
    # As `metnos-exec worker` does: bubblewrap's orphaned inits are reaped by us, at once.
    from metnos_exec.process import become_subreaper

    become_subreaper()
    rows = anyio.run(_main, ns, backend=ns.backend)
    width = max(len(r[0]) for r in rows)
    print(f"backend {ns.backend}, {os.cpu_count()} cpus, python {sys.version.split()[0]}")
    print(f"{'measurement':<{width}}  {'jobs/s':>9}  note")
    for name, rate, note in rows:
        print(f"{name:<{width}}  {rate:>9,.0f}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
