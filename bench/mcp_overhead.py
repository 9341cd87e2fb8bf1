"""What the MCP server adds to a job (issue 19, acceptance 5): an MCP ``call_tool`` of a
no-op executor against `Client.run` of the same job, side by side in one run.

One real worker (``metnos-exec worker``, the real sandbox unless ``--arm echo``) serves a
SQLite queue in a temp folder with one executor, ``noop`` (`bench/_noop.py`: reads its
arguments, answers ``{}``). One ``metnos-exec mcp --stdio`` on the same queue is driven by
the ``mcp`` SDK's own client. The calls are interleaved one by one (a ``Client.run``, an
MCP ``call_tool``, ...) so both see the same machine; each is timed from the caller's side
until its result is in hand. Printed: the median (and p90) of each, and the ratio of the
medians; target: at most 1.2x.

``--arm echo`` has the worker answer every job without a sandbox: what is left is the
queue path alone, where the MCP hop (a JSON-RPC round trip over a pipe, the server's own
submit and wait) is a far larger share.

Usage: metnos-exec bench mcp_overhead [--calls 200] [--warmup 10] [--arm echo] [--json]
       (or PYTHONPATH=. python bench/mcp_overhead.py ...)
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

MANIFEST = """\
name = "noop"
version = "1.0.0"
description = "Do nothing: the benchmark's job"
runtime = "python"
entry = "main.py"

[limits]
timeout_s = 30
"""


def _setup(tmp: Path) -> Path:
    folder = tmp / "executors" / "noop"
    folder.mkdir(parents=True)
    (folder / "manifest.toml").write_text(MANIFEST)
    shutil.copy(HERE / "_noop.py", folder / "main.py")
    return folder.parent


def _start_worker(tmp: Path, broker: str, executors: Path, arm: str | None) -> Any:
    log = tmp / "worker.jsonl"
    argv = [sys.executable, "-m", "metnos_exec", "worker", "--broker", broker]
    argv += ["--executors", str(executors), "--log-file", str(log)]
    if arm:
        argv += ["--arm", arm]
    proc = subprocess.Popen(argv, cwd=tmp, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (log.exists() and any(iter_records(log, event="worker.started"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the worker did not start (exit {proc.poll()})")
        time.sleep(0.05)
    return proc


def _stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": statistics.median(ordered) * 1000,
        "p90_ms": ordered[int(len(ordered) * 0.9) - 1] * 1000,
    }


async def _measure(broker: str, executors: Path, calls: int, warmup: int) -> dict[str, Any]:
    from mcp import Client as McpClient
    from mcp import StdioServerParameters

    serve = ["mcp", "--stdio", "--quiet", "--broker", broker, "--executors", str(executors)]
    server = StdioServerParameters(
        command=sys.executable,
        args=["-m", "metnos_exec", *serve],
        env=dict(os.environ),
    )
    direct: list[float] = []
    via_mcp: list[float] = []
    async with Client(broker) as client, McpClient(server) as mcp:
        for i in range(warmup + calls):
            # Which goes first alternates, so neither always follows the other's work.
            for kind in ("direct", "mcp") if i % 2 else ("mcp", "direct"):
                t0 = time.perf_counter()
                if kind == "direct":
                    result = await client.run("noop", {}, wait=60)
                    ok = result.status == "succeeded"
                else:
                    out = await mcp.call_tool("noop", {})
                    ok = not out.is_error
                elapsed = time.perf_counter() - t0
                if not ok:
                    raise SystemExit(f"a {kind} call did not succeed")
                if i >= warmup:
                    (direct if kind == "direct" else via_mcp).append(elapsed)
    d, m = _stats(direct), _stats(via_mcp)
    return {
        "calls": calls,
        "client_run": d,
        "mcp_call_tool": m,
        "ratio": m["median_ms"] / d["median_ms"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--arm", choices=["echo"], default=None)
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-mcp-"))
    broker = f"sqlite:///{tmp / 'q.db'}"
    executors = _setup(tmp)
    worker = _start_worker(tmp, broker, executors, ns.arm)
    try:
        out = anyio.run(_measure, broker, executors, ns.calls, ns.warmup)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    out["arm"] = ns.arm or "sandbox"
    if ns.json:
        print(json.dumps(out))
        return 0
    d, m = out["client_run"], out["mcp_call_tool"]
    print(
        f"noop x{ns.calls} ({out['arm']}): Client.run median {d['median_ms']:.1f} ms "
        f"(p90 {d['p90_ms']:.1f}); MCP call_tool median {m['median_ms']:.1f} ms "
        f"(p90 {m['p90_ms']:.1f}); ratio {out['ratio']:.2f}x (target <= 1.2x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
