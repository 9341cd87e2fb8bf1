"""Acceptance tests on real worker processes and a real SQLite file.

2. kill -9 of a worker mid-job: another worker finishes it after the lease expires.
3. two worker processes drain 1,000 jobs (echo arm): one result each, no double run.
4. malformed message, unknown executor, manifest violation: dead/rejected with the code,
   and the worker keeps serving.
5. SIGTERM during a run: finish or release within the grace, exit 0, nothing lost.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from metnos_exec.brokers import Broker, BrokerStats, open_broker
from metnos_exec.client import Client
from metnos_exec.errors import UnknownExecutor
from metnos_exec.identities import slot_uid_range, slot_uids_unavailable
from metnos_exec.logs import iter_records
from metnos_exec.messages import Job, Result
from tests.conftest import need, need_privileged
from tests.helpers.worker_cli import wait_for_event, worker_argv

pytestmark = pytest.mark.slow

SLEEPY_MANIFEST = """\
name = "sleepy"
version = "1"
runtime = "python"
entry = "main.py"
[args.s]
type = "number"
default = 0
"""
SLEEPY_MAIN = """\
import json, sys, time
a = json.load(sys.stdin)
time.sleep(a["s"])
print(json.dumps({"slept": a["s"]}))
"""
READER_MANIFEST = """\
name = "reader"
version = "1"
runtime = "python"
entry = "main.py"
[args.path]
type = "string"
required = true
format = "path"
[[capabilities]]
name = "fs:read"
hints = ["~/notes/**"]
"""


def _bwrap_ok() -> bool:
    return shutil.which("bwrap") is not None


@pytest.fixture
def executors(tmp_path: Path) -> Path:
    root = tmp_path / "executors"
    (root / "sleepy").mkdir(parents=True)
    (root / "sleepy" / "manifest.toml").write_text(SLEEPY_MANIFEST)
    (root / "sleepy" / "main.py").write_text(SLEEPY_MAIN)
    (root / "reader").mkdir()
    (root / "reader" / "manifest.toml").write_text(READER_MANIFEST)
    (root / "reader" / "main.py").write_text("print('{}')\n")
    (root / "broken").mkdir()
    (root / "broken" / "manifest.toml").write_text('name = "broken"\nversion = 1\n')
    return root


class Workers:
    """Starts worker processes; kills whatever is left at teardown (and reaps it)."""

    def __init__(self, tmp_path: Path, executors: Path) -> None:
        self.tmp = tmp_path
        self.executors = executors
        self.url = f"sqlite:///{tmp_path / 'q.db'}"
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self,
        wid: str,
        *extra: str,
        env: dict[str, str] | None = None,
        executors: Path | None = None,
    ) -> Path:
        log = self.tmp / f"{wid}.jsonl"
        full_env = {**os.environ, "HOME": str(self.tmp), **(env or {})}
        folder = executors or self.executors
        proc = subprocess.Popen(
            worker_argv(self.url, folder, log, "--worker-id", wid, *extra),
            env=full_env,
            stdin=subprocess.DEVNULL,
        )
        self.procs.append(proc)
        return log

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture
def workers(tmp_path: Path, executors: Path) -> Iterator[Workers]:
    w = Workers(tmp_path, executors)
    try:
        yield w
    finally:
        w.close()


def with_broker(url: str, fn: Callable[[Broker], Any]) -> Any:
    async def main() -> Any:
        async with open_broker(url) as broker:
            return await fn(broker)

    return anyio.run(main)


def wait_until(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)  # polling with a deadline, not a synchronisation sleep


def events(log: Path, **kw: Any) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return list(iter_records(log, **kw))


def has_event(log: Path, event: str, job: str | None = None) -> bool:
    return bool(events(log, event=event, job=job))


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_kill_9_mid_job_is_finished_by_another_worker(workers: Workers, backend: str) -> None:
    need(_bwrap_ok(), "bubblewrap is not installed")
    log_a = workers.start("A", "--visibility", "2", "--backend", backend)
    wait_until(lambda: has_event(log_a, "worker.started"), 10, "worker A")
    job_id = with_broker(
        workers.url,
        lambda b: b.submit(Job(executor="sleepy", args={"s": 1.5}, max_attempts=3)),
    ).job_id
    wait_until(lambda: has_event(log_a, "job.started", job_id), 10, "A starts the job")
    workers.procs[0].send_signal(signal.SIGKILL)
    workers.procs[0].wait()
    killed_at = time.monotonic()
    log_b = workers.start("B", "--visibility", "2", "--backend", backend)

    result: Result = wait_until(
        lambda: with_broker(workers.url, lambda b: b.get_result(job_id)), 20, "the result"
    )
    assert result.status == "succeeded", result
    assert result.worker == "B" and result.attempt == 2
    assert result.output == {"slept": 1.5}
    # B could only take it once A's lease lapsed (visibility 2 s after A's last beat).
    assert time.monotonic() - killed_at >= 1.0
    received = events(log_b, event="job.received", job=job_id)
    assert [r["attempt"] for r in received] == [2]
    workers.procs[1].send_signal(signal.SIGTERM)
    assert workers.procs[1].wait(10) == 0
    stats = with_broker(workers.url, lambda b: b.stats())
    assert (stats.done, stats.queued, stats.running, stats.dead) == (1, 0, 0, 0)


def test_two_workers_drain_1000_jobs_exactly_once(workers: Workers) -> None:
    echo = {"METNOS_ARM_OVERRIDE": "echo"}
    # One worker on each backend: the queue semantics must not depend on the event loop.
    logs = [
        workers.start(
            wid, "--concurrency", "8", "--visibility", "30", "--backend", backend, env=echo
        )
        for wid, backend in (("W1", "asyncio"), ("W2", "trio"))
    ]
    for log in logs:
        wait_until(functools.partial(has_event, log, "worker.started"), 10, "workers up")
    jobs = [Job(executor="sleepy", args={"s": i / 1000}) for i in range(1000)]
    receipts = with_broker(workers.url, lambda b: b.submit_many(jobs))
    ids = {r.job_id for r in receipts}
    assert len(ids) == 1000

    def done() -> bool:
        stats: BrokerStats = with_broker(workers.url, lambda b: b.stats())
        return stats.done == 1000

    wait_until(done, 60, "1000 results")
    for p in workers.procs:
        p.send_signal(signal.SIGTERM)
    assert [p.wait(20) for p in workers.procs] == [0, 0]

    async def fetch(b: Broker) -> list[Result | None]:
        return [await b.get_result(i) for i in sorted(ids)]

    results = with_broker(workers.url, fetch)
    assert all(r is not None and r.status == "succeeded" for r in results)
    assert {r.job_id for r in results if r} == ids
    assert all(r is not None and r.attempt == 1 for r in results)
    # No double execution: across both logs, every job was received (run) exactly once.
    received = [rec["job_id"] for log in logs for rec in events(log, event="job.received")]
    assert len(received) == 1000 and set(received) == ids
    # Which worker ran how many is scheduling, not a promise (on a loaded machine one
    # may take them all): each job exactly once is what the product promises.
    per_worker = [len(events(log, event="job.received")) for log in logs]
    assert sum(per_worker) == 1000
    stats = with_broker(workers.url, lambda b: b.stats())
    assert (stats.done, stats.queued, stats.running, stats.dead) == (1000, 0, 0, 0)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_bad_jobs_end_with_codes_and_the_worker_keeps_serving(
    workers: Workers, backend: str
) -> None:
    need(_bwrap_ok(), "bubblewrap is not installed")
    log = workers.start("W", "--visibility", "5", "--backend", backend)
    wait_until(lambda: has_event(log, "worker.started"), 10, "worker up")

    async def submit(b: Broker) -> dict[str, str]:
        return {
            "malformed": await b.submit_raw(b'{"executor": "sleepy", "args": [1, 2'),
            "unknown": (await b.submit(Job(executor="no_such_tool"))).job_id,
            "denied": (await b.submit(Job(executor="reader", args={"path": "/etc/passwd"}))).job_id,
            "bad_manifest": (await b.submit(Job(executor="broken"))).job_id,
            "good": (await b.submit(Job(executor="sleepy", args={"s": 0}))).job_id,
        }

    ids = with_broker(workers.url, submit)

    async def fetch(b: Broker) -> dict[str, Result | None]:
        return {k: await b.wait_result(v, timeout=20) for k, v in ids.items()}

    unknown = ids.pop("unknown")
    results = with_broker(workers.url, fetch)
    summary = {
        k: (r.status, r.error.code if r.error else None) if r else None for k, r in results.items()
    }
    # No worker serves it: it waits for one (executor routing), no attempt spent; and a
    # client refuses the next such job at once, the worker's catalog being published.
    state = with_broker(workers.url, lambda b: b.get_job_state(unknown))
    assert state is not None and (state.state, state.attempt) == ("queued", 0)

    async def through_a_client(b: Broker) -> str:
        async with Client(b) as client:
            try:
                await client.submit("no_such_tool")
            except UnknownExecutor as exc:
                return exc.code
        return "queued"

    assert with_broker(workers.url, through_a_client) == "E_UNKNOWN_EXECUTOR"
    assert summary == {
        "malformed": ("dead", "E_BAD_MESSAGE"),
        "denied": ("rejected", "E_CAPABILITY_DENIED"),
        "bad_manifest": ("rejected", "E_BAD_MANIFEST"),
        "good": ("succeeded", None),
    }
    letters = with_broker(workers.url, lambda b: b.dead_letters())
    assert [d.job_id for d in letters] == [ids["malformed"]]
    assert letters[0].raw is not None and letters[0].raw.startswith(b'{"executor"')
    # Still serving after all that.
    assert workers.procs[0].poll() is None
    again = with_broker(
        workers.url,
        lambda b: b.submit(Job(executor="sleepy", args={"s": 0})),
    ).job_id
    r = with_broker(workers.url, lambda b: b.wait_result(again, timeout=20))
    assert r is not None and r.status == "succeeded"
    assert has_event(log, "executor.load_failed")
    workers.procs[0].send_signal(signal.SIGTERM)
    assert workers.procs[0].wait(10) == 0


def _zombie_children(pid: int) -> list[int]:
    found = []
    children: list[str] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:  # a thread may end meanwhile (an idle worker thread)
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children += f.read().split()
        except (FileNotFoundError, ProcessLookupError):  # gone meanwhile
            continue
    for child in children:
        try:
            with open(f"/proc/{child}/stat", "rb") as st:
                stat = st.read()
        except (FileNotFoundError, ProcessLookupError):  # gone meanwhile
            continue
        if stat[stat.rfind(b")") + 2 :].split()[0] == b"Z":
            found.append(int(child))
    return found


def test_the_worker_reaps_bubblewraps_orphans_so_job_budgets_stay_exact(
    workers: Workers,
) -> None:
    """bubblewrap's init outlives its monitor: an orphan per job. The worker process is a
    subreaper and reaps each as its job ends, so none waits in a slot's pids cgroup (where
    it would count against the next job's budget) nor goes to pytest, the next subreaper
    up, which would otherwise collect them here."""
    from metnos_exec import process

    need(_bwrap_ok(), "bubblewrap is not installed")
    log = workers.start("W", "--concurrency", "2")
    wait_until(lambda: has_event(log, "worker.started"), 10, "worker up")
    wpid = workers.procs[0].pid

    async def run(b: Broker) -> list[Result | None]:
        ids = [(await b.submit(Job(executor="sleepy"))).job_id for _ in range(12)]
        return [await b.wait_result(i, timeout=30) for i in ids]

    results = with_broker(workers.url, run)
    assert all(r is not None and r.status == "succeeded" for r in results), results
    assert _zombie_children(os.getpid()) == []  # none came up to us
    # The job's own init is reaped as the job ends; any other orphan (the start-up probe's
    # init, say) by the sweep the supervisor runs every cancel poll (0.5 s).
    wait_until(lambda: _zombie_children(wpid) == [], 5, "no zombie left in the worker")
    parent = process._cgroup_parent()
    if parent is not None and (parent / "tasks").exists():
        slots = sorted(parent.glob(f"{wpid}-slot-*"))
        assert slots, "the worker ran its bwrap jobs in pooled slots"
        # Only each slot's own thread is counted: no zombie eats the next budget.
        assert [(s / "pids.current").read_text().strip() for s in slots] == ["1"] * len(slots)
    workers.procs[0].send_signal(signal.SIGTERM)
    assert workers.procs[0].wait(10) == 0


def _wasmtime_ok() -> bool:
    from metnos_exec.sandbox._wasm_engine import load_wasmtime

    return load_wasmtime() is not None


def test_the_worker_preloads_wasm_modules_and_reports_a_runtime_it_cannot_use(
    workers: Workers, executors: Path
) -> None:
    """Compiling a module (python.wasm: 4-8 s cold) is done from the worker's start, not
    by its first job. A runtime that fails verification is said at start-up, does not keep
    the other modules from loading, and the worker serves on: the jobs that need the
    runtime get the same error."""
    need(_wasmtime_ok(), "wasmtime is not installed (install metnos-exec[wasm])")
    root = Path(__file__).resolve().parents[1]
    shutil.copytree(root / "examples" / "executors" / "wasm_hello", executors / "wasm_hello")
    (executors / "pyguest").mkdir()
    (executors / "pyguest" / "manifest.toml").write_text(
        'name = "pyguest"\nversion = "1"\nruntime = "wasm-python"\nentry = "main.py"\n'
    )
    (executors / "pyguest" / "main.py").write_text("print('{}')\n")
    bogus = workers.tmp / "python.wasm"
    bogus.write_bytes(b"\0asm not the pinned build")
    log = workers.start("W", env={"METNOS_PYTHON_WASM": str(bogus)})
    [failed] = wait_until(lambda: events(log, event="worker.preload_failed"), 20, "failure")
    assert (failed["module"], failed["code"]) == ("python", "E_RUNTIME_MISMATCH"), failed
    [loaded] = wait_until(lambda: events(log, event="worker.preloaded"), 20, "preload")
    assert loaded["module"].endswith("wasm_hello/hello.wat")
    assert loaded["how"] in ("compiled", "disk") and loaded["seconds"] >= 0

    async def run(b: Broker) -> dict[str, Result | None]:
        ids = {
            name: (await b.submit(Job(executor=name))).job_id for name in ("wasm_hello", "pyguest")
        }
        return {name: await b.wait_result(i, timeout=20) for name, i in ids.items()}

    results = with_broker(workers.url, run)
    summary = {
        n: (r.status, r.error.code if r.error else None) if r else None for n, r in results.items()
    }
    assert summary == {
        "wasm_hello": ("succeeded", None),
        "pyguest": ("rejected", "E_RUNTIME_MISMATCH"),
    }
    workers.procs[0].send_signal(signal.SIGTERM)
    assert workers.procs[0].wait(10) == 0


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sigterm_finishes_or_releases_within_grace(workers: Workers, backend: str) -> None:
    need(_bwrap_ok(), "bubblewrap is not installed")
    log = workers.start("W", "--grace", "1.5", "--backend", backend, "--concurrency", "2")
    wait_until(lambda: has_event(log, "worker.started"), 10, "worker up")

    async def submit(b: Broker) -> tuple[str, str]:
        short = (await b.submit(Job(executor="sleepy", args={"s": 0.6}))).job_id
        long = (await b.submit(Job(executor="sleepy", args={"s": 60}))).job_id
        return short, long

    short, long = with_broker(workers.url, submit)
    wait_until(
        lambda: has_event(log, "job.started", short) and has_event(log, "job.started", long),
        10,
        "both jobs running",
    )
    t0 = time.monotonic()
    workers.procs[0].send_signal(signal.SIGTERM)
    assert workers.procs[0].wait(15) == 0
    elapsed = time.monotonic() - t0
    assert elapsed < 1.5 + 3.0  # grace plus the kill-and-reap of the long job

    async def check(b: Broker) -> tuple[Result | None, Any, Any]:
        return await b.get_result(short), await b.get_job_state(long), await b.stats()

    short_result, long_state, stats = with_broker(workers.url, check)
    assert short_result is not None and short_result.status == "succeeded"
    # The long one was handed back untouched: queued again, no attempt used.
    assert long_state is not None and long_state.state == "queued"
    assert long_state.attempt == 0
    assert (stats.done, stats.queued, stats.running) == (1, 1, 0)
    names = [r["event"] for r in events(log)]
    assert names.index("worker.draining") < names.index("job.released")
    assert names[-1] == "worker.stopped"
    stopped = events(log, event="worker.stopped")[0]
    assert stopped["released"] == 1


@pytest.mark.anyio
async def test_serve_resolves_the_policy_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from metnos_exec.errors import BadConfig
    from metnos_exec.manifest import ExecutorRegistry
    from metnos_exec.policy import Policy
    from metnos_exec.worker import serve

    registry = ExecutorRegistry.load(tmp_path)
    monkeypatch.setenv("METNOS_REQUIRE_SANDBOX", "never")
    async with open_broker("memory://") as broker, anyio.create_task_group() as tg:
        sup = await tg.start(
            functools.partial(
                serve, broker, registry, burst=True, handle_signals=False, worker_id="w"
            )
        )
        # Changing the variable later changes nothing: the worker read it once.
        monkeypatch.setenv("METNOS_REQUIRE_SANDBOX", "always")
        assert sup.policy == Policy("never")
    monkeypatch.setenv("METNOS_REQUIRE_SANDBOX", "sometimes")
    async with open_broker("memory://") as broker:
        with pytest.raises(BadConfig):
            await serve(broker, registry, burst=True, handle_signals=False, worker_id="w")


@pytest.mark.anyio
async def test_a_preload_that_breaks_is_logged_and_never_takes_the_worker_down(
    executors: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from structlog.testing import capture_logs

    from metnos_exec import worker as worker_mod
    from metnos_exec.manifest import ExecutorRegistry
    from metnos_exec.sandbox import wasm as wasm_mod

    (executors / "pyguest").mkdir()
    (executors / "pyguest" / "manifest.toml").write_text(
        'name = "pyguest"\nversion = "1"\nruntime = "wasm-python"\nentry = "main.py"\n'
    )
    (executors / "pyguest" / "main.py").write_text("print('{}')\n")

    class Broken:
        def __init__(self, **_: Any) -> None:
            raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(wasm_mod, "WasmSandbox", Broken)
    with capture_logs() as logs:
        await worker_mod.preload_wasm(ExecutorRegistry.load(executors))
    [failed] = [e for e in logs if e["event"] == "worker.preload_failed"]
    assert failed["module"] == "python" and "home directory" in failed["error"]


# --- issue 9: the store failing under real worker processes ---------------------------


def _runs(pid: int) -> list[int]:
    """The direct arm's per-job processes (its reaper shim) among `pid`'s children."""
    found = []
    for child in _children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"_reaper" in f.read():
                    found.append(child)
        except (FileNotFoundError, ProcessLookupError):  # gone meanwhile
            continue
    return found


def _children(pid: int) -> list[int]:
    """`pid`'s children but its keeper (`process.start_keeper`), which lives as long."""
    kids: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:  # a thread may end meanwhile
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):  # gone meanwhile
            continue
    return [k for k in kids if not _is_keeper(k)]


def _is_keeper(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"_keeper.py" in f.read()
    except (FileNotFoundError, ProcessLookupError):  # gone meanwhile
        return False


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_worker_survives_its_store_failing_and_keeps_its_results(
    workers: Workers, backend: str
) -> None:
    """Finding 2, on a real worker process and a real SQLite file: the worker can no
    longer write any file (RLIMIT_FSIZE set from outside, as a full disk does to it) while
    two jobs run. It keeps their results, leases nothing new, does not exit, and stores
    them once it can write again; its log says what it lost and that the store is back."""
    from tests.helpers.faults import limit_file_size, restore_file_size

    log = workers.start(
        "W", "--concurrency", "2", "--backend", backend, env={"METNOS_SANDBOX": "off"}
    )
    wait_until(lambda: has_event(log, "worker.started"), 10, "worker up")
    wpid = workers.procs[0].pid

    async def submit(b: Broker) -> list[str]:
        jobs = [Job(executor="sleepy", args={"s": 0.8}) for _ in range(2)]
        return [r.job_id for r in await b.submit_many(jobs)]

    ids = with_broker(workers.url, submit)
    wait_until(lambda: all(has_event(log, "job.started", i) for i in ids), 20, "jobs started")
    # Their processes exist (spawned with the worker's limits as they were: the fault is
    # the worker's alone; a job spawned after it would inherit it and fail as a host fault).
    wait_until(lambda: len(_runs(wpid)) == 2, 20, "both runs spawned")
    before = limit_file_size(wpid)
    try:
        later = with_broker(workers.url, lambda b: b.submit(Job(executor="sleepy"))).job_id
        # The runs end (their processes are gone) and their results cannot be written.
        wait_until(lambda: not _children(wpid), 20, "the runs to end")
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # an observation window, not a wait for an event
            assert workers.procs[0].poll() is None, "the worker exited"
            assert with_broker(workers.url, lambda b: b.stats()).done == 0
            state = with_broker(workers.url, lambda b: b.get_job_state(later))
            assert state is not None and (state.state, state.worker) == ("queued", None)
            time.sleep(0.05)
    finally:
        restore_file_size(wpid, before)

    async def results(b: Broker) -> list[Result | None]:
        return [await b.wait_result(i, timeout=30) for i in [*ids, later]]

    got = with_broker(workers.url, results)
    assert [(r.status, r.attempt) if r else None for r in got] == [("succeeded", 1)] * 3
    wait_until(lambda: has_event(log, "broker.recovered"), 10, "broker.recovered")
    dropped = events(log, event="log.dropped")
    assert dropped and dropped[0]["count"] >= 1  # its broker.error records, among others
    workers.procs[0].send_signal(signal.SIGTERM)
    assert workers.procs[0].wait(20) == 0
    [stopped] = events(log, event="worker.stopped")
    assert stopped["unsettled"] == 0 and stopped["finished"] == 3
    stats = with_broker(workers.url, lambda b: b.stats())
    assert (stats.done, stats.queued, stats.running, stats.dead) == (3, 0, 0, 0)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_worker_started_on_a_full_disk_waits_for_it(workers: Workers, backend: str) -> None:
    """A worker (re)started while its store cannot grow (RLIMIT_FSIZE from its first
    instruction, as a full disk does; the chaos run's kill-and-restart met it) waits and
    tries again, as for a held lock, instead of exiting 4; once the disk has room it
    serves. (A missing folder or a read-only file is still said at once.)"""
    from tests.helpers.faults import restore_file_size

    ids = with_broker(workers.url, lambda b: b.submit(Job(executor="sleepy")))  # the file
    err = (workers.tmp / "full.err").open("wb")
    proc = subprocess.Popen(
        worker_argv(workers.url, workers.executors, workers.tmp / "full.jsonl",
                    "--worker-id", "full", "--backend", backend),
        env={**os.environ, "HOME": str(workers.tmp), "METNOS_SANDBOX": "off"},
        stdin=subprocess.DEVNULL,
        stderr=err,
        preexec_fn=lambda: resource.setrlimit(
            resource.RLIMIT_FSIZE, (1, resource.getrlimit(resource.RLIMIT_FSIZE)[1])
        ),
    )  # fmt: skip
    workers.procs.append(proc)
    try:
        # It tries to open the store and fails (its writes fail); a worker that gives up
        # is gone within this window.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:  # an observation window, not a wait for an event
            code = proc.poll()
            assert code is None, (code, (workers.tmp / "full.err").read_text())
            time.sleep(0.05)
    finally:
        restore_file_size(proc.pid, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        err.close()
    got = with_broker(workers.url, lambda b: b.wait_result(ids.job_id, timeout=30))
    assert got is not None and got.status == "succeeded"
    # Its broker.error records could not be written (nor can a log grow on a full disk):
    # the log says how many it lost, before the worker's start.
    names = [r["event"] for r in events(workers.tmp / "full.jsonl")]
    assert "log.dropped" in names and names.index("log.dropped") < names.index("worker.started")
    assert events(workers.tmp / "full.jsonl", event="log.dropped")[0]["count"] >= 1
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0


def test_a_worker_whose_queue_file_is_deleted_stops_with_a_clear_error(
    workers: Workers, tmp_path: Path
) -> None:
    """Finding 5: serving a deleted file would leave the worker alone with a queue nobody
    sees; it stops, says why, and exits 4."""
    with_broker(workers.url, lambda b: b.stats())  # the file exists
    log = tmp_path / "gone.jsonl"
    proc = subprocess.Popen(
        worker_argv(workers.url, workers.executors, log),
        env={**os.environ, "HOME": str(tmp_path), "METNOS_ARM_OVERRIDE": "echo"},
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_event(log, "worker.started", proc)
        db = tmp_path / "q.db"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{db}{suffix}").unlink(missing_ok=True)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 4, err
    assert "Traceback" not in err and "E_BROKER_GONE" in err and str(db) in err
    [stopped] = events(log, event="worker.stopped")
    assert stopped["error"] == "E_BROKER_GONE" and stopped["level"] == "error"


def test_a_worker_refuses_a_read_only_queue(workers: Workers, tmp_path: Path) -> None:
    """Finding 5: rather than start and fail every lease."""
    from tests.helpers.faults import read_only

    job_id = with_broker(workers.url, lambda b: b.submit(Job(executor="sleepy"))).job_id
    db = tmp_path / "q.db"
    log = tmp_path / "ro.jsonl"
    with read_only(db):
        out = subprocess.run(
            worker_argv(workers.url, workers.executors, log, "--burst"),
            env={**os.environ, "HOME": str(tmp_path), "METNOS_ARM_OVERRIDE": "echo"},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 4, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "E_BROKER_READONLY" in lines[0] and str(db) in lines[0]
    assert not has_event(log, "worker.started")
    state = with_broker(workers.url, lambda b: b.get_job_state(job_id))
    assert state is not None and (state.state, state.attempt) == ("queued", 0)


def test_a_worker_started_under_a_held_lock_waits_and_a_sigterm_stops_it_cleanly(
    workers: Workers, tmp_path: Path
) -> None:
    """Restarted while another process holds the queue's lock (past its busy timeout), a
    worker waits for it rather than exit 4; a SIGTERM meanwhile stops it with exit 0."""
    import sqlite3

    with_broker(workers.url, lambda b: b.stats())  # the file exists
    workers.url += "?busy_timeout_s=0.1"
    with contextlib.closing(sqlite3.connect(tmp_path / "q.db", isolation_level=None)) as other:
        other.execute("BEGIN IMMEDIATE")
        log = workers.start("W")
        wait_until(
            lambda: [e for e in events(log, event="broker.error") if e["op"] == "open"],
            20,
            "the worker to meet the lock",
        )
        assert workers.procs[0].poll() is None
        workers.procs[0].send_signal(signal.SIGTERM)
        assert workers.procs[0].wait(20) == 0
        other.execute("ROLLBACK")
    assert not has_event(log, "worker.started")


def test_a_worker_process_freezes_start_up_objects_and_collects_young_garbage_less_often(
    tmp_path: Path,
) -> None:
    """`run_worker` tunes the collector (it took 12-25 % of an echo worker's CPU): the
    objects alive at start are frozen and young collections come every 10,000
    allocations. Checked in a fresh process: the tuning is process-wide."""
    import json

    probe = (
        "import gc, json\n"
        "from metnos_exec import worker\n"
        "worker._tune_gc()\n"
        "print(json.dumps([gc.get_threshold()[0], gc.get_freeze_count()]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    threshold, frozen = json.loads(out.stdout)
    assert threshold == 10_000
    assert frozen > 10_000  # every module, class and function loaded so far


# --- a worker started from a login session (issue 15, item 2) ----------------------------

WHOAMI_MAIN = """\
import json
with open("/proc/self/status") as f:
    fields = dict(line.split(":", 1) for line in f if ":" in line)
print(json.dumps({"groups": fields["Groups"].split()}))
"""
#: Many supplementary groups, none named in /etc/group (what setpriv, a service manager
#: or a container runtime may give), the list well past a page of the kernel's.
MANY_GROUPS = [4, 27, *range(3000, 3062)]
#: A user of no account for the unprivileged worker (a copy of what it reads is its own).
WORKER_USER = 4243


def _ids(pid: int) -> dict[int, dict[str, list[int]]]:
    """Each thread of `pid` → its ``Uid``, ``Gid`` and ``Groups`` (the kernel's view)."""
    found: dict[int, dict[str, list[int]]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
            found[int(tid)] = {
                k: [int(x) for x in fields[k].split()] for k in ("Uid", "Gid", "Groups")
            }
    return found


def _descendant_worker(pid: int) -> int:
    """`pid`, or its descendant that runs the worker (runuser forks it, setpriv execs)."""
    todo = [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if f.read().split(b"\0")[1:3] == [b"-m", b"metnos_exec"]:
                    return p
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
    raise AssertionError(f"no worker below {pid}")


def _interpreter_for_anyone(env: dict[str, str]) -> str:
    """An interpreter an unprivileged user's sandbox can run (this one may sit below
    ``/root``, which bubblewrap does not show it), with this one's packages."""
    import sysconfig

    here = os.path.realpath(sys.executable)
    if all(os.stat(d).st_mode & 0o001 for d in Path(here).parents):
        return sys.executable
    system = shutil.which("python3", path="/usr/bin:/bin")
    need(
        system is not None
        and subprocess.run(
            [system, "-c", f"import sys; sys.exit(sys.version_info[:2] != {sys.version_info[:2]})"],
            check=False,
        ).returncode
        == 0,
        f"no Python {sys.version_info[0]}.{sys.version_info[1]} outside {here}'s folders",
    )
    assert system is not None
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = f"{repo}:{sysconfig.get_paths()['purelib']}"
    return system


def _login_nofile() -> None:
    # A login session's soft limit (PAM's default), whatever this test process has.
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))


@pytest.mark.parametrize(
    "session",
    [
        pytest.param("runuser -G adm", id="runuser, one group, primary gid adm"),
        pytest.param("setpriv 64 groups", id="setpriv, 64 groups"),
        pytest.param("unprivileged 64 groups", id="an unprivileged user with 64 groups"),
    ],
)
def test_a_worker_started_with_supplementary_groups_runs_its_jobs(
    workers: Workers, tmp_path: Path, session: str
) -> None:
    # Issue 15: a root worker from a login or su/runuser session died at its first job
    # ("cannot switch thread back to root: [Errno 14] Bad address", exit 70): restoring
    # the spawner thread's groups passed their address to an untyped variadic syscall().
    # As whoever operators start it as; the soft open-file limit of a login (1024) too.
    need(_bwrap_ok(), "bubblewrap is not installed")
    need_privileged(os.geteuid() == 0, "giving a worker supplementary groups")
    as_root = not session.startswith("unprivileged")
    if as_root:
        need_privileged(slot_uids_unavailable() is None, f"{slot_uids_unavailable()}")
        folder = tmp_path
    else:
        # Everything the user's worker reads or writes is its own (tmp_path's parents
        # are root's only): home, queue, log, state, executors.
        folder = Path(tempfile.mkdtemp(prefix="metnos-groups-"))
        workers.tmp = folder  # its teardown removes it (below)
    try:
        _run_whoami_in_session(workers, folder, session, as_root)
    finally:
        if not as_root:
            shutil.rmtree(folder, ignore_errors=True)


def _run_whoami_in_session(workers: Workers, folder: Path, session: str, as_root: bool) -> None:
    executors = folder / "executors" if not as_root else workers.executors
    (executors / "whoami").mkdir(parents=True)
    (executors / "whoami" / "manifest.toml").write_text(
        'name = "whoami"\nversion = "1"\nruntime = "python"\nentry = "main.py"\n'
    )
    (executors / "whoami" / "main.py").write_text(WHOAMI_MAIN)
    url = f"sqlite:///{folder / 'q.db'}"
    env = {**os.environ, "HOME": str(folder)}
    if session.startswith("runuser"):
        need(shutil.which("runuser") is not None, "runuser (util-linux) is not installed")
        prefix = ["runuser", "-u", "root", "-G", "adm", "--"]
        expected = {"Uid": [0] * 4, "Gid": [4] * 4, "Groups": [4]}
    else:
        need(shutil.which("setpriv") is not None, "setpriv (util-linux) is not installed")
        groups = ",".join(map(str, MANY_GROUPS))
        uid = 0 if as_root else WORKER_USER
        prefix = ["setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={groups}", "--"]
        expected = {"Uid": [uid] * 4, "Gid": [uid] * 4, "Groups": sorted(MANY_GROUPS)}
    job_id = with_broker(url, lambda b: b.submit(Job(executor="whoami", max_attempts=1))).job_id
    if not as_root:
        env["METNOS_STATE_DIR"] = str(folder / "state")
        folder.chmod(0o755)
        for path in [folder, *folder.rglob("*")]:
            os.chown(path, WORKER_USER, WORKER_USER)
    log = folder / "W.jsonl"
    argv = worker_argv(url, executors, log, "--concurrency", "1")
    if not as_root:
        argv[0] = _interpreter_for_anyone(env)
    proc = subprocess.Popen(
        [*prefix, *argv],
        env=env,
        stdin=subprocess.DEVNULL,
        preexec_fn=_login_nofile,
    )
    workers.procs.append(proc)
    wait_for_event(log, "worker.started", proc, timeout=30)
    wpid = _descendant_worker(proc.pid)
    assert _ids(wpid)[wpid] == expected  # the session's ids, as given

    result: Result | None = with_broker(url, lambda b: b.wait_result(job_id, timeout=60))
    assert result is not None and result.status == "succeeded", (result.error, proc.poll())
    assert result.containment is not None
    user = result.containment.user.reason
    if as_root:
        assert result.output == {"groups": []}  # none of the session's groups reached it
        uid_range = slot_uid_range()
        assert uid_range is not None
        slot = int(user.split("host uid ")[1].split(" ")[0].rstrip(","))
        assert uid_range[0] <= slot < sum(uid_range), user  # its slot's own uid
    else:
        # No slot uid tried: the job runs as the worker, its groups unmapped inside.
        assert "host uid" not in user, user
        assert set(result.output["groups"]) <= {"65534"}, result.output
    # Every thread, the slot's spawner that switched included, is back to the session's
    # ids: its uid, its primary gid (not 0 for runuser -G) and every group.
    assert all(ids == expected for ids in _ids(wpid).values()), _ids(wpid)
    os.kill(wpid, signal.SIGTERM)
    assert proc.wait(30) == 0
