"""A run stopped once launched says what it measured, never what was planned (issue 15 #14).

One real ``metnos-exec worker`` process per anyio backend (the bwrap arm, a SQLite queue)
serves one executor that burns CPU and holds 48 MiB, with a unique token in its argv (how
the test finds its processes from the host). Four ways its run ends:

1. its own timeout (the control: the arm's measured report, as it always was);
2. ``cancel`` while it runs: the ``cancelled`` result;
3. a lost lease: the worker is stopped (SIGSTOP) past its visibility, another worker
   takes the job, the worker goes on and finds its lease gone: no result, a
   ``job.stopped`` record;
4. a drain (SIGTERM) past the grace: released, a ``job.stopped`` record.

Each must carry the containment the run measured (the same as the control's: no axis
"known once it runs" or "unknown until run") and its usage: CPU time and peak memory,
as the control has them.

Then the supervisor's side in process, with an arm that leaves a measured outcome when
stopped (as the bwrap and direct arms do): the backstop's ``timed_out`` result, a
cancelled result, and a host fault after the run (a ``job.stopped`` record) use it.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from metnos_exec.brokers.memory import MemoryBroker
from metnos_exec.brokers.sqlite import SQLiteBroker
from metnos_exec.errors import HostFault
from metnos_exec.logs import iter_records
from metnos_exec.manifest import ExecutorRegistry
from metnos_exec.messages import Job, Result
from metnos_exec.sandbox._types import (
    AxisVerdict,
    ContainmentReport,
    Killed,
    SandboxJob,
    SandboxOutcome,
    Usage,
    record_stopped,
)
from metnos_exec.sandbox.bwrap import bwrap_probe
from metnos_exec.supervisor import Supervisor
from metnos_exec.supervisor.config import split_settings
from tests.conftest import need

VISIBILITY_S = 3
MiB = 1 << 20
HELD_MIB = 48
MANIFEST = """\
name = "burn"
version = "1"
runtime = "python"
entry = "main.py"
[args.token]
type = "string"
required = true
[limits]
timeout_s = 60
memory_mb = 256
"""
# 48 MiB written (so resident), then a busy loop, with the token in the argv.
MAIN = f"""\
import json, os, sys
a = json.load(sys.stdin)
code = "held = b'x' * ({HELD_MIB} << 20)\\nwhile True: pass"
os.execv(sys.executable, [sys.executable, "-c", code, a["token"]])
"""
#: Words of a report made before the run (`bwrap.ROOT_UNKNOWN_REASON`, resources).
PLANNED = ("known once it runs", "unknown until run")


def _pids_with(token: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def _cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_until(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)  # polling with a deadline, not a synchronisation sleep


@dataclass
class Runs:
    """What became of each run: results, and the log records of those without one."""

    backend: str
    results: dict[str, Result] = field(default_factory=dict)
    #: CPU seconds each run was seen to have burnt before it was stopped.
    burnt: dict[str, float] = field(default_factory=dict)
    stopped: dict[str, dict[str, Any]] = field(default_factory=dict)
    log: list[dict[str, Any]] = field(default_factory=list)


def _serve(tmp: Path, backend: str) -> Runs:
    root = tmp / "executors" / "burn"
    root.mkdir(parents=True)
    (root / "manifest.toml").write_text(MANIFEST)
    (root / "main.py").write_text(MAIN)
    db, log = tmp / "q.db", tmp / "worker.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("METNOS_")}
    env["HOME"] = str(tmp)
    worker = subprocess.Popen(
        [sys.executable, "-m", "metnos_exec", "worker", "--broker", f"sqlite:///{db}",
         "--executors", str(tmp / "executors"), "--worker-id", "W", "--log-file", str(log),
         "--visibility", str(VISIBILITY_S), "--backend", backend, "--grace", "0.2",
         "--concurrency", "1"],
        env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    runs = Runs(backend)
    stem = f"metnos-stop-{os.getpid()}-{time.monotonic_ns()}"

    def call(fn: Callable[[SQLiteBroker], Any]) -> Any:
        async def go() -> Any:
            async with SQLiteBroker(db) as broker:
                return await fn(broker)

        return anyio.run(go, backend=backend)

    def start(name: str, **kw: Any) -> str:
        """Submit a run; return once it has burnt 0.3 s of CPU (noted in `Runs.burnt`:
        the least its report may say), or has ended."""
        token = f"{stem}-{name}"
        job = Job(executor="burn", args={"token": token}, max_attempts=3, **kw)
        job_id: str = call(lambda b: b.submit(job)).job_id
        # Running, and it has burnt some CPU: a report of the run has figures to give.
        pid = _wait_until(lambda: _pids_with(token), 30, f"{name}'s process")[0]

        def burnt() -> bool:
            runs.burnt[name] = max(runs.burnt.get(name, 0.0), _cpu_s(pid))
            return runs.burnt[name] >= 0.3 or not os.path.exists(f"/proc/{pid}")

        _wait_until(burnt, 30, f"{name}'s CPU time")
        return job_id

    def result(job_id: str) -> Result:
        got: Result | None = call(lambda b: b.wait_result(job_id, timeout=30))
        assert got is not None, f"no result for {job_id}"
        return got

    def stopped_record(job_id: str) -> dict[str, Any]:
        """The run's ``job.stopped`` record; ``{"job_id": job_id}`` when none came in 15 s
        (the test that reads it fails then, the others go on)."""
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            record = next(iter_records(log, job=job_id, event="job.stopped"), None)
            if record is not None:
                return record
            time.sleep(0.05)  # polling the log with a deadline
        return {"job_id": job_id}

    try:
        # 1. The control: its own timeout.
        runs.results["timeout"] = result(start("timeout", timeout_s=3))
        # 2. Cancelled while it runs.
        job_id = start("cancel")
        assert call(lambda b: b.cancel(job_id)) == "cancelling"
        runs.results["cancel"] = result(job_id)
        # 3. The lease lost: the worker stalls past its visibility, another takes the job.
        job_id = start("lease")
        worker.send_signal(signal.SIGSTOP)
        try:

            def steal() -> Any:
                got = call(lambda b: b.lease("thief", visibility_s=600))
                return got[0] if got else None

            _wait_until(steal, VISIBILITY_S + 10, "the lease to expire")
        finally:
            worker.send_signal(signal.SIGCONT)
        runs.stopped["lease_lost"] = stopped_record(job_id)
        # 4. Drained (SIGTERM) while it runs: released after the grace.
        job_id = start("drain")
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)
        runs.stopped["drain"] = stopped_record(job_id)
    finally:
        if worker.poll() is None:
            worker.kill()
        stderr = worker.communicate()[1]
    assert worker.returncode == 0, stderr.decode()[-3000:]
    assert _pids_with(stem) == [], "a run outlived its stop"
    runs.log = list(iter_records(log))
    return runs


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Runs]:
    probe = bwrap_probe()
    need(probe.working, f"bubblewrap not usable here: {probe.error}")
    yield _serve(tmp_path_factory.mktemp(f"stopped-{request.param}"), request.param)


def _states(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k != "sandbox"}


@pytest.mark.bwrap
def test_the_control_times_out_with_the_measured_report(runs: Runs) -> None:
    r = runs.results["timeout"]
    assert r.status == "timed_out", r
    assert r.containment is not None and r.containment.sandbox == "bwrap"
    for axis, verdict in r.containment.axes().items():
        assert not any(w in verdict.reason for w in PLANNED), (axis, verdict)
    assert r.usage is not None and r.usage.cpu_s is not None, r.usage
    assert r.usage.cpu_s >= runs.burnt["timeout"] > 0.1, (r.usage, runs.burnt)
    assert r.usage.peak_memory_bytes is not None, r.usage
    assert r.usage.peak_memory_bytes >= HELD_MIB * MiB, r.usage


@pytest.mark.bwrap
def test_a_cancelled_run_carries_what_it_measured(runs: Runs) -> None:
    control, r = runs.results["timeout"], runs.results["cancel"]
    assert r.status == "cancelled" and r.error is not None and r.error.code == "E_CANCELLED"
    assert r.containment is not None and control.containment is not None
    # The same walls held as in the control's run: every axis's state and reason (a
    # root worker's slot uid may differ between the two runs: its number is left out).
    for axis, verdict in r.containment.axes().items():
        assert not any(w in verdict.reason for w in PLANNED), (axis, verdict)
        assert verdict.state == control.containment.axes()[axis].state, (axis, verdict)
    assert r.usage is not None and control.usage is not None
    assert r.usage.cpu_s is not None and r.usage.cpu_s >= runs.burnt["cancel"] >= 0.3, r.usage
    assert r.usage.peak_memory_bytes is not None, r.usage
    assert r.usage.peak_memory_bytes >= HELD_MIB * MiB, r.usage
    assert r.started_at is not None and r.usage.wall_s > 0


@pytest.mark.bwrap
@pytest.mark.parametrize("reason", ["lease_lost", "drain"])
def test_a_run_stopped_without_a_result_says_what_it_measured(runs: Runs, reason: str) -> None:
    control = runs.results["timeout"]
    record = runs.stopped[reason]
    assert record.get("reason") == reason, f"no job.stopped record for the {reason} run: {record}"
    assert control.containment is not None
    summary = record["containment"]
    assert summary["sandbox"] == "bwrap"
    assert _states(summary) == {k: v.state for k, v in control.containment.axes().items()}
    usage = record["usage"]
    key = "lease" if reason == "lease_lost" else reason
    assert usage["cpu_s"] is not None and usage["cpu_s"] >= runs.burnt[key] >= 0.3, usage
    assert usage["peak_memory_bytes"] is not None, usage
    assert usage["peak_memory_bytes"] >= HELD_MIB * MiB, usage
    # Nothing else was said for it: no result of this worker.
    finished = [
        e for e in runs.log if e.get("job_id") == record["job_id"] and e["event"] == "job.finished"
    ]
    assert finished == []


# --- the supervisor's side, in process: every stop uses what the arm measured ------------

_KEPT = AxisVerdict("kept", "measured")
MEASURED = SandboxOutcome(
    stdout=b"",
    stderr=b"",
    exit=Killed(signal=9),
    usage=Usage(wall_s=1.5, cpu_s=1.25, peak_memory_bytes=7 * MiB),
    containment=ContainmentReport("measured", _KEPT, _KEPT, _KEPT, _KEPT, _KEPT),
)
PLAN = ContainmentReport(
    "measured", *(AxisVerdict("partial", "unknown until run") for _ in range(5))
)


class StoppedArm:
    """An arm whose run blocks until stopped, then leaves `MEASURED` (as the bwrap arm
    does), or leaves it and raises a host fault (`fault`)."""

    name = "measured"

    def __init__(self, *, fault: bool = False) -> None:
        self.fault = fault
        self.started = anyio.Event()

    def containment(self, job: SandboxJob) -> ContainmentReport:
        return PLAN

    async def run(self, job: SandboxJob) -> SandboxOutcome:
        self.started.set()
        if self.fault:
            record_stopped(MEASURED)
            raise HostFault("the status pipe broke after the run")
        try:
            await anyio.sleep_forever()
        finally:
            record_stopped(MEASURED)
        raise AssertionError("unreachable")


def _supervisor(tmp: Path, broker: MemoryBroker, arm: Any, **kw: Any) -> Supervisor:
    root = tmp / "executors" / "echo"
    root.mkdir(parents=True)
    (root / "manifest.toml").write_text(
        'name = "echo"\nversion = "1"\nruntime = "python"\nentry = "main.py"\n'
    )
    (root / "main.py").write_text("print('{}')\n")

    def choose(runtime: str, **_: Any) -> Any:
        return SimpleNamespace(sandbox=arm, degraded=False)

    config, collaborators = split_settings({"worker_id": "w1", "home": "/nonexistent", **kw})
    return Supervisor(
        broker,
        ExecutorRegistry.load(tmp / "executors"),
        config,
        arm_chooser=choose,
        predict_arm=lambda runtime: arm.name,
        **collaborators,
    )


@pytest.mark.anyio
async def test_the_backstop_result_carries_what_the_arm_measured(tmp_path: Path) -> None:
    broker = MemoryBroker()
    sup = _supervisor(tmp_path, broker, StoppedArm(), backstop_margin_s=0.05)
    job_id = (await broker.submit(Job(executor="echo", timeout_s=0.05))).job_id
    with anyio.fail_after(10):
        await sup.run(burst=True)
    r = await broker.get_result(job_id)
    assert r is not None and r.status == "timed_out"
    assert r.containment == MEASURED.containment and r.usage == MEASURED.usage


@pytest.mark.anyio
async def test_a_cancelled_result_carries_what_the_arm_measured(tmp_path: Path) -> None:
    broker = MemoryBroker()
    arm = StoppedArm()
    sup = _supervisor(tmp_path, broker, arm, heartbeat_s=0.01)
    job_id = (await broker.submit(Job(executor="echo"))).job_id
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(sup.run, burst=True))
        await arm.started.wait()
        assert await broker.cancel(job_id) == "cancelling"
        with anyio.fail_after(10):
            r = await broker.wait_result(job_id, timeout=None)
    assert r is not None and r.status == "cancelled"
    assert r.containment == MEASURED.containment and r.usage == MEASURED.usage


@pytest.mark.anyio
async def test_a_host_fault_after_the_run_logs_what_it_measured(tmp_path: Path) -> None:
    broker = MemoryBroker()
    sup = _supervisor(tmp_path, broker, StoppedArm(fault=True))
    await broker.submit(Job(executor="echo", max_attempts=1))
    with capture_logs() as logs, anyio.fail_after(10):
        await sup.run(burst=True)
    [stopped] = [e for e in logs if e["event"] == "job.stopped"]
    assert stopped["reason"] == "host_fault"
    assert stopped["usage"] == MEASURED.usage
    assert stopped["containment"]["sandbox"] == "measured"
    assert {k: v for k, v in stopped["containment"].items() if k != "sandbox"} == dict.fromkeys(
        ("files", "network", "process_tree", "user", "resources"), "kept"
    )
