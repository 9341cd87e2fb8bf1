"""The wasm arm's spare processes (`spare_processes`): a job served by a process started
before it shares nothing with another job's, and no spare outlives its owner (the pool's
context, a draining worker, a SIGKILLed worker).

The arm's own suite (tests/sandbox/test_wasm.py) and the conformance matrix run every
async test with spares on as well; these are the properties only a pool has."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import anyio
import pytest

from metnos_exec.messages import Job
from metnos_exec.sandbox import wasm
from metnos_exec.sandbox._types import (
    PYTHON_WASM_MODULE,
    ResourceLimits,
    SandboxJob,
    Success,
    WasmProgram,
)
from metnos_exec.sandbox.wasm import WasmSandbox, spare_processes, waiting_spares
from tests.conftest import need
from tests.helpers.worker_cli import wait_for_event, worker_argv
from tests.sandbox.spares import spares_settled
from tests.sandbox.test_wasm import HAVE_RUNTIME, NO_RUNTIME, PY_FUEL, wasm_cache
from tests.test_worker_process import with_broker

__all__ = ("wasm_cache",)

SEEDS = "import os, random\nprint(os.urandom(16).hex(), random.getrandbits(64), hash('spare'))"


def _alive(pid: int) -> bool:
    """`pid` exists, a zombie included (a spare killed but not reaped)."""
    return os.path.exists(f"/proc/{pid}")


@pytest.mark.anyio
async def test_jobs_from_two_spares_see_different_randomness(wasm_cache: Path) -> None:
    need(HAVE_RUNTIME, NO_RUNTIME)
    arm = WasmSandbox(cache_dir=wasm_cache)
    job = SandboxJob(
        wasm=WasmProgram(PYTHON_WASM_MODULE, ("python", "-c", SEEDS)),
        limits=ResourceLimits(fuel=PY_FUEL, wall_time_s=30),
    )
    outs, pids = [], []
    async with spare_processes(1, cache_dir=wasm_cache):
        assert wasm._pool is not None
        for _ in range(3):
            await spares_settled()
            pids.append(waiting_spares()[0])
            out = await arm.run(job)
            assert out.exit == Success(), out
            outs.append(out.stdout.split())
            assert not _alive(pids[-1]), "a spare outlived its job"
        assert wasm._pool.served == 3
    assert len(set(pids)) == 3  # one process per job, never reused
    for column in range(3):  # urandom, random's seed, the str hash seed
        values = [o[column] for o in outs]
        assert len(set(values)) == 3, (column, values)


@pytest.mark.anyio
async def test_closing_the_pool_kills_and_reaps_its_spares(wasm_cache: Path) -> None:
    need(HAVE_RUNTIME, NO_RUNTIME)
    async with spare_processes(2, cache_dir=wasm_cache):
        await spares_settled(count=2)
        pids = waiting_spares()
    assert wasm._pool is None and waiting_spares() == []
    for pid in pids:  # reaped, not only killed: no zombie either
        assert not _alive(pid), pid


@pytest.mark.anyio
async def test_without_the_pool_jobs_take_no_spare(wasm_cache: Path) -> None:
    need(HAVE_RUNTIME, NO_RUNTIME)
    assert wasm._pool is None
    out = await WasmSandbox(cache_dir=wasm_cache).run(
        SandboxJob(
            wasm=WasmProgram(PYTHON_WASM_MODULE, ("python", "-c", "print(1)")),
            limits=ResourceLimits(fuel=PY_FUEL),
        )
    )
    assert out.stdout == b"1\n"
    assert _spares_of(str(wasm_cache)) == []  # a plain arm never starts a spare


def _spares_of(marker: str) -> list[int]:
    """Live (not zombie) spare processes whose command line names `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if b"--spare" in cmd and marker.encode() in cmd and state != b"Z":
            found.append(int(entry))
    return found


@pytest.mark.parametrize("how", ["drain", "sigkill"])
def test_a_worker_with_spares_leaves_no_process(how: str, tmp_path: Path, wasm_cache: Path) -> None:
    need(HAVE_RUNTIME, NO_RUNTIME)
    executors = tmp_path / "executors"
    (executors / "pyguest").mkdir(parents=True)
    (executors / "pyguest" / "manifest.toml").write_text(
        'name = "pyguest"\nversion = "1"\nruntime = "wasm-python"\nentry = "main.py"\n'
    )
    (executors / "pyguest" / "main.py").write_text("import json\nprint(json.dumps({'ok': 1}))\n")
    url = f"sqlite:///{tmp_path / 'q.db'}"
    cache_root = tmp_path / "cache"
    # The session's compiled python.wasm: the worker's preload finds it (no cold compile).
    (cache_root).mkdir()
    os.symlink(wasm_cache, cache_root / "wasm")
    log = tmp_path / "w.jsonl"

    async def submit(broker: object) -> str:
        job = await broker.submit(Job(executor="pyguest"))  # type: ignore[attr-defined]
        result = await broker.wait_result(job.job_id, timeout=60)  # type: ignore[attr-defined]
        return str(result.status) if result else "none"

    proc = subprocess.Popen(
        worker_argv(url, executors, log, "--concurrency", "2", "--grace", "1"),
        env={**os.environ, "HOME": str(tmp_path), "METNOS_CACHE_DIR": str(cache_root)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    marker = str(cache_root)
    try:
        wait_for_event(log, "worker.started", proc, timeout=60)
        assert with_broker(url, submit) == "succeeded"
        deadline = time.monotonic() + 30
        while not _spares_of(marker):  # the next spare, started after the job took one
            assert proc.poll() is None and time.monotonic() < deadline, "no spare started"
            time.sleep(0.02)  # polling with a deadline
        spare = _spares_of(marker)[0]
        with open(f"/proc/{spare}/stat", "rb") as f:
            assert int(f.read().rsplit(b")", 1)[1].split()[1]) == proc.pid  # the worker's
        proc.send_signal(signal.SIGTERM if how == "drain" else signal.SIGKILL)
        code = proc.wait(30)
        assert code == (0 if how == "drain" else -signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    left = _spares_of(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.02)  # polling with a deadline: the kernel delivers the death signal
        left = _spares_of(marker)
    for pid in left:  # leave the machine clean whatever the verdict
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"spares survived the worker ({how}): {left}"


@pytest.mark.anyio
async def test_a_second_entry_adds_no_pool(wasm_cache: Path) -> None:
    need(HAVE_RUNTIME, NO_RUNTIME)
    async with spare_processes(1, cache_dir=wasm_cache):
        outer = wasm._pool
        async with spare_processes(1, cache_dir=wasm_cache):
            assert wasm._pool is outer
        assert wasm._pool is outer  # the inner exit closed nothing
        await spares_settled()
    assert wasm._pool is None and waiting_spares() == []


@pytest.mark.anyio
async def test_a_pool_that_cannot_build_its_arm_serves_without_spares(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Broken:
        def __init__(self, **_: object) -> None:
            raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(wasm, "WasmSandbox", Broken)
    async with spare_processes(1):  # a worker's serve() must not fail for it
        assert wasm._pool is None


@pytest.mark.anyio
async def test_a_spare_refused_at_its_start_leaves_nothing_open(
    monkeypatch: pytest.MonkeyPatch, wasm_cache: Path
) -> None:
    # An engine older than the pin is refused when a spare is started (a pool entered
    # before the check, or refilled after it): the spare's socket pair and result pipe,
    # made before the refusal, were left open (found by an unprivileged full run).
    need(HAVE_RUNTIME, NO_RUNTIME)
    monkeypatch.setattr(wasm, "wasmtime_version", lambda: "45.0.0")
    before = set(os.listdir("/proc/self/fd"))
    async with spare_processes(1, cache_dir=wasm_cache):
        pool = wasm._pool
        assert pool is not None
        with anyio.fail_after(20):
            while pool.broken is None:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        assert "50.0.1" in pool.broken
    assert set(os.listdir("/proc/self/fd")) <= before  # (the fixture checks it too)
