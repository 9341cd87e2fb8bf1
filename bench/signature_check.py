"""The per-job cost of the signature check for a cached, unchanged executor.

Two measures, each side by side with no check, alternating in every round:

- **check alone**: `TrustStore.check` on a verified, unchanged executor (the stat of every
  file and folder of its source and of its private copy) against an empty loop;
- **end to end**: one in-process worker (`Supervisor`, memory broker, echo arm: no
  process, so the check is not hidden behind a spawn) draining ``--jobs`` jobs of the
  example executors, signed, with ``trust=`` set and without it.

The target (issue 12, acceptance 5): under 1 ms added per job. Reported: the median over
rounds of each side and of the difference per job.

Usage: python bench/signature_check.py [--jobs N] [--rounds R] [--backend asyncio|trio]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import structlog

from metnos_exec.brokers.memory import MemoryBroker
from metnos_exec.devices.signing import TrustStore, generate_key, load_public_key, sign_folder
from metnos_exec.logs import configure_logging
from metnos_exec.manifest import ExecutorRegistry
from metnos_exec.messages import Job
from metnos_exec.sandbox.doubles import EchoSandbox
from metnos_exec.sandbox.select import ArmChoice
from metnos_exec.supervisor import Supervisor, SupervisorConfig

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "executors"
#: Jobs of these (python, all arguments defaulted or given here), round-robin.
JOBS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("read_notes", {}),
    ("write_note", {"path": "~/notes/x.md", "text": "hi"}),
    ("fetch_url", {"url": "https://example.com/"}),
)


async def _drain(registry: ExecutorRegistry, home: Path, trust: TrustStore | None, n: int) -> float:
    broker = MemoryBroker()
    for i in range(n):
        name, args = JOBS[i % len(JOBS)]
        await broker.submit(Job(executor=name, args=args))
    arm = EchoSandbox()
    sup = Supervisor(
        broker,
        registry,
        SupervisorConfig(worker_id="bench", concurrency=4, home=str(home)),
        arm_chooser=lambda runtime, **_: ArmChoice(sandbox=arm),
        trust=trust,
    )
    t = time.perf_counter()
    await sup.run(burst=True)
    elapsed = time.perf_counter() - t
    assert sup.stats["finished"] == n and sup.stats["rejected"] == 0, sup.stats
    return elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--checks", type=int, default=20000, help="calls per round, check alone")
    ap.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    ns = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        key, pub = generate_key(tmp / "keys" / "bench.key")
        root = tmp / "executors"
        for name, _ in JOBS:
            shutil.copytree(EXAMPLES / name, root / name)
            sign_folder(root / name, key)
        (tmp / "home" / "notes").mkdir(parents=True)
        # As a real worker logs: JSON lines to a file (a console renderer would dominate).
        configure_logging(file=tmp / "bench.jsonl")
        registry = ExecutorRegistry.load(root)
        # A clock "long after" the files were written: none is racily clean (a real worker
        # gets there RACY_NS after the last change).
        trust = TrustStore(
            [load_public_key(str(pub))], verified_dir=tmp / "verified", clock_ns=lambda: 2**62
        )
        for name in registry:
            trust.verify(registry[name])
        executor = registry["write_note"]
        assert trust.cached(executor) is not None

        alone_on, alone_off, e2e_on, e2e_off = [], [], [], []
        for _ in range(ns.rounds):
            t = time.perf_counter()
            for _ in range(ns.checks):
                pass
            alone_off.append((time.perf_counter() - t) / ns.checks)
            t = time.perf_counter()
            for _ in range(ns.checks):
                trust.check(executor)
            alone_on.append((time.perf_counter() - t) / ns.checks)
            e2e_off.append(
                anyio.run(_drain, registry, tmp / "home", None, ns.jobs, backend=ns.backend)
                / ns.jobs
            )
            e2e_on.append(
                anyio.run(_drain, registry, tmp / "home", trust, ns.jobs, backend=ns.backend)
                / ns.jobs
            )

        factory = structlog.get_config()["logger_factory"]
        f = getattr(factory, "_file", None)
        if f is not None:
            f.close()
        structlog.reset_defaults()

    def us(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1e6:8.1f} µs"

    added_alone = [on - off for on, off in zip(alone_on, alone_off, strict=True)]
    added_e2e = [on - off for on, off in zip(e2e_on, e2e_off, strict=True)]
    print(f"signature check, cached and unchanged ({ns.rounds} rounds, {ns.backend})")
    print(
        f"  check alone:  with {us(alone_on)}   without {us(alone_off)}   added {us(added_alone)}"
    )
    print(f"  end to end:   with {us(e2e_on)}   without {us(e2e_off)}   added {us(added_e2e)}")
    print("  added per job, per round (µs): " + " ".join(f"{x * 1e6:.0f}" for x in added_e2e))
    worst = statistics.median(added_e2e)
    print(f"  target < 1000 µs added per job: {'met' if worst < 1e-3 else 'NOT met'}")
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
