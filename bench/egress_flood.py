"""A job that floods the network wall does not slow the worker or the other jobs (issue 17).

One arm in one process, as in a worker. A *victim* job makes `--requests` short requests
through the wall one after another (a new connection each, to a loopback echo server
named by a literal hint, forwarded) and times each inside the job. It runs alone, then
beside `--flooders` jobs that each, for as long as the victim runs, open connections to
the wall's HTTP proxy as fast as they can: half ask for a refused destination (the
broker's Redis port: a 403 each), half are held open past the job's connection limit
(refused: a 503 each). The control: as many jobs that only burn CPU for as long (a job
that floods the wall should cost the others no more than one that spins). Quiet, flooded
and spinning rounds alternate so all see the same machine.

Measured: the victim's median and 95th-percentile request time, quiet and flooded; the
bench process's event-loop lag (a task asking for 5 ms sleeps: how late each wake-up
is), the worker's own health; and how many connections the flooders got answered.

The echo server runs in a process of its own. Every server binds 127.0.0.1.

Usage: PYTHONPATH=. python bench/egress_flood.py [--rounds 5] [--flooders 3]
       [--requests 300] [--backend asyncio|trio]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

import anyio

from metnos_exec.logs import configure_logging
from metnos_exec.sandbox._types import ResourceLimits, SandboxJob, Success
from metnos_exec.sandbox.bwrap import BwrapSandbox
from metnos_exec.sandbox.egress import EgressLimits, policy_for
from metnos_exec.sandbox.flags import guest_python

ECHO = r"""
import socket, threading
l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind(("127.0.0.1", 0)); l.listen(512)
print(l.getsockname()[1], flush=True)
def one(c):
    with c:
        while data := c.recv(4096):
            c.sendall(data)
while True:
    c, _ = l.accept()
    threading.Thread(target=one, args=(c,), daemon=True).start()
"""

VICTIM = r"""
import json, socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
times = []
for _ in range(n):
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"ping\n")
        got = b""
        while not got.endswith(b"\n"):
            got += s.recv(64)
    times.append(time.perf_counter() - t)
print(json.dumps(times))
"""

FLOOD = r"""
import json, os, socket, sys, time
proxy = int(os.environ["HTTP_PROXY"].rsplit(":", 1)[1])
end = time.monotonic() + float(sys.argv[1])
held, answered, failed = [], {}, 0
while time.monotonic() < end:
    try:
        s = socket.create_connection(("127.0.0.1", proxy), timeout=5)
    except OSError:
        failed += 1
        continue
    if len(held) < 64:  # past the job's connection limit: the rest get a 503
        held.append(s)
        continue
    try:
        s.sendall(b"CONNECT 127.0.0.1:6379 HTTP/1.1\r\n\r\n")
        status = s.recv(64).split(b" ")[1:2]
        key = status[0].decode() if status else "closed"
        answered[key] = answered.get(key, 0) + 1
    except OSError:
        failed += 1
    finally:
        s.close()
    if len(held) >= 64 and sum(answered.values()) % 200 == 0:
        for h in held:
            h.close()
        held = []
print(json.dumps({"answered": answered, "failed": failed}))
"""


SPIN = r"""
import json, sys, time
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    pass
print(json.dumps({"answered": {}, "failed": 0}))
"""


def q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


async def lag_probe(samples: list[float], stop: anyio.Event) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await anyio.sleep(0.005)
        samples.append(time.perf_counter() - t - 0.005)


async def one_round(
    arm: BwrapSandbox, port: int, requests: int, flooders: int, code: str = FLOOD
) -> tuple[list[float], list[float], list[dict[str, object]]]:
    limits = ResourceLimits(wall_time_s=300, memory_bytes=256 << 20)
    victim = SandboxJob(
        argv=(guest_python(), "-c", VICTIM, str(port), str(requests)),
        network=True,
        egress=policy_for([("http", f"127.0.0.1:{port}")]),
        limits=limits,
    )
    flood = SandboxJob(
        argv=(guest_python(), "-c", code, "1.0"),
        network=True,
        egress=policy_for([("http", f"127.0.0.1:{port}")], limits=EgressLimits(connections=32)),
        limits=ResourceLimits(wall_time_s=30, memory_bytes=256 << 20),
    )
    lags: list[float] = []
    reports: list[dict[str, object]] = []
    done = anyio.Event()
    times: list[float] = []

    async def run_victim() -> None:
        out = await arm.run(victim)
        assert out.exit == Success(), out.stderr[-2000:]
        times.extend(json.loads(out.stdout))
        done.set()

    async def run_flooder() -> None:
        while not done.is_set():  # one-second floods, one after another, till the victim ends
            out = await arm.run(flood)
            if out.stdout:
                reports.append(json.loads(out.stdout.splitlines()[-1]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(lag_probe, lags, done)
        for _ in range(flooders):
            tg.start_soon(run_flooder)
        await run_victim()
    return times, lags, reports


async def main(rounds: int, flooders: int, requests: int) -> dict[str, float]:
    server = subprocess.Popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE)  # noqa: ASYNC220
    assert server.stdout is not None
    port = int(server.stdout.readline())
    arm = BwrapSandbox()
    quiet_t: list[float] = []
    flood_t: list[float] = []
    quiet_lag: list[float] = []
    flood_lag: list[float] = []
    spin_t: list[float] = []
    spin_lag: list[float] = []
    answered: dict[str, int] = {}
    try:
        await one_round(arm, port, 20, 0)  # warm-up
        for _ in range(rounds):
            t, lag, _ = await one_round(arm, port, requests, 0)
            quiet_t += t
            quiet_lag += lag
            t, lag, reports = await one_round(arm, port, requests, flooders)
            flood_t += t
            flood_lag += lag
            t, lag, _ = await one_round(arm, port, requests, flooders, SPIN)
            spin_t += t
            spin_lag += lag
            for r in reports:
                for k, v in r["answered"].items():  # type: ignore[union-attr]
                    answered[k] = answered.get(k, 0) + int(v)
                answered["failed"] = answered.get("failed", 0) + int(r["failed"])  # type: ignore[call-overload]
    finally:
        server.kill()
        server.wait()
    out = {
        "victim_quiet_p50_ms": statistics.median(quiet_t) * 1e3,
        "victim_flood_p50_ms": statistics.median(flood_t) * 1e3,
        "victim_spin_p50_ms": statistics.median(spin_t) * 1e3,
        "victim_quiet_p95_ms": q(quiet_t, 0.95) * 1e3,
        "victim_flood_p95_ms": q(flood_t, 0.95) * 1e3,
        "victim_spin_p95_ms": q(spin_t, 0.95) * 1e3,
        "loop_lag_quiet_p50_ms": statistics.median(quiet_lag) * 1e3,
        "loop_lag_flood_p50_ms": statistics.median(flood_lag) * 1e3,
        "loop_lag_quiet_p99_ms": q(quiet_lag, 0.99) * 1e3,
        "loop_lag_flood_p99_ms": q(flood_lag, 0.99) * 1e3,
        "loop_lag_spin_p99_ms": q(spin_lag, 0.99) * 1e3,
    }
    out["victim_p50_ratio"] = out["victim_flood_p50_ms"] / out["victim_quiet_p50_ms"]
    out["victim_p95_ratio"] = out["victim_flood_p95_ms"] / out["victim_quiet_p95_ms"]
    # The claim: flooding the wall costs the others no more than burning CPU does.
    out["flood_vs_spin_p50"] = out["victim_flood_p50_ms"] / out["victim_spin_p50_ms"]
    out["flood_vs_spin_p95"] = out["victim_flood_p95_ms"] / out["victim_spin_p95_ms"]
    for k, v in sorted(answered.items()):
        out[f"flood_answers_{k}"] = float(v)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--flooders", type=int, default=3)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--backend", default="asyncio", choices=("asyncio", "trio"))
    args = parser.parse_args()
    # Logs as a worker writes them (JSON lines to a file), not rendered for a terminal.
    log = tempfile.NamedTemporaryFile(prefix="egress-flood-", suffix=".jsonl")  # noqa: SIM115
    configure_logging(file=log.name)
    result = anyio.run(main, args.rounds, args.flooders, args.requests, backend=args.backend)
    for k, v in result.items():
        print(f"{k:28} {v:10.3f}")
