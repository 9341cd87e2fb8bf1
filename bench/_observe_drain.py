"""One queue-only drain of N echo jobs (`observe_cost`'s, untimed), with observability off,
metrics, tracing (1 % sampled) or both (``on``): what `observe_instructions.sh` counts.

Usage: python bench/_observe_drain.py off|metrics|tracing|on N
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

import anyio

sys.path.insert(0, os.path.dirname(__file__))
import observe_cost as oc

from metnos_exec.logs import configure_logging
from metnos_exec.manifest import ExecutorRegistry
from metnos_exec.observe import NULL_OBSERVER, make_observer

which, n = sys.argv[1], int(sys.argv[2])
ns = argparse.Namespace(
    jobs=n,
    concurrency=64,
    scrape_every=0,
    sample=0.01,
    on=frozenset({"metrics", "tracing"}),
    backend="asyncio",
    rounds=1,
)


async def main():
    provider = oc._tracer_provider()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        (tmp / "executors" / "noop").mkdir(parents=True)
        (tmp / "executors" / "noop" / "manifest.toml").write_text(oc.NOOP_MANIFEST)
        (tmp / "executors" / "noop" / "main.py").write_text("print('{}')\n")
        reg = ExecutorRegistry.load(tmp / "executors")
        configure_logging(file=tmp / "b.jsonl")
        obs = (
            NULL_OBSERVER
            if which == "off"
            else make_observer(
                metrics=("127.0.0.1", 0) if which in ("on", "metrics") else None,
                trace=which in ("on", "tracing"),
            )
        )
        await oc._drain(tmp, reg, ns, obs)
    provider.shutdown()


anyio.run(main)
