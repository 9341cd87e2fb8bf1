"""A folder the worker binds from, swapped for a symlink between its checks, is refused.

Every mount source is reached without following a symlink (`sandbox.mount_sources`): the
executors root and each executor's folder (real paths taken once, when the registry
loads), the hint folders, the writable roots a staged job's overlay is built on, and the
wasm arm's preopens. Each case runs through a worker (`Supervisor`): the executors root
swapped for a link to a folder of someone else's code after the worker loaded it (the
worker used to resolve it again per job and run that code), and a staged job's write
root whose parent was swapped between planning and staging (the staging checked the last
component only).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import pytest

from metnos_exec.brokers.memory import MemoryBroker
from metnos_exec.manifest import ExecutorRegistry
from metnos_exec.messages import Job, Result
from metnos_exec.supervisor import Supervisor, SupervisorConfig
from metnos_exec.supervisor import pipeline as supervisor_mod
from metnos_exec.undo.staging import Staging
from tests.conftest import need
from tests.undo.helpers import bwrap_works

MANIFEST = """\
name = "{name}"
version = "1"
runtime = "{runtime}"
entry = "{entry}"
[[capabilities]]
name = "fs:write"
hints = ["~/notes/**"]
[limits]
timeout_s = 20
fuel = 1000000000
"""

HONEST = 'import json\nprint(json.dumps({"who": "loaded"}))\n'
IMPOSTOR = 'import json\nprint(json.dumps({"who": "impostor"}))\n'
WRITER = 'import json\nopen("{path}", "w").write("x")\nprint(json.dumps({{"who": "writer"}}))\n'


def _executor(root: Path, name: str, code: str, runtime: str = "python") -> None:
    folder = root / name
    folder.mkdir(parents=True)
    entry = "main.py" if runtime == "python" else "main.wat"
    (folder / "manifest.toml").write_text(MANIFEST.format(name=name, runtime=runtime, entry=entry))
    (folder / entry).write_text(code)


async def _serve(sup: Supervisor, broker: MemoryBroker, job: Job) -> Result:
    await broker.submit(job)
    with anyio.fail_after(30):
        await sup.run(burst=True)
    result = await broker.get_result(job.id)
    assert result is not None
    return result


WAT_OK = """(module
  (import "wasi_snapshot_preview1" "fd_write"
    (func $w (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 8) "{\\"who\\": \\"loaded\\"}\\n")
  (func (export "_start")
    (i32.store (i32.const 0) (i32.const 8))
    (i32.store (i32.const 4) (i32.const 18))
    (drop (call $w (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 100)))))
"""


@pytest.mark.anyio
# The wasm case: the process-wide engine's one-time files (its I/O runtime, a module's
# memory image) stay open for the process's life.
@pytest.mark.allow_fd_leak
@pytest.mark.parametrize("runtime", ["python", "wasm"])
async def test_the_executors_root_swapped_for_a_symlink_after_loading_is_refused(
    tmp_path: Path, runtime: str
) -> None:
    if runtime == "python":
        bwrap_works()
    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True)
    executors = tmp_path / "skills"
    _executor(executors, "e", HONEST if runtime == "python" else WAT_OK, runtime)
    registry = ExecutorRegistry.load(executors)
    broker = MemoryBroker()
    staging = Staging(tmp_path / "state", overlay=False)
    try:
        sup = Supervisor(
            broker, registry, SupervisorConfig(worker_id="w", home=str(home)), staging=staging
        )
        # Someone who may write the root's parent swaps the root for a link to a copy
        # whose code is theirs (same names: the worker's registry still matches).
        elsewhere = tmp_path / "elsewhere"
        _executor(elsewhere, "e", IMPOSTOR if runtime == "python" else WAT_OK, runtime)
        if runtime == "wasm":
            (elsewhere / "e" / "planted").write_text("")
        executors.rename(tmp_path / "old-skills")
        executors.symlink_to(elsewhere)
        second = await _serve(sup, broker, Job(executor="e"))
    finally:
        await staging.aclose()
    assert second.status == "rejected", second
    assert second.error is not None and second.error.code == "E_SYMLINKED_FOLDER"
    assert str(executors) in second.error.message
    assert second.exit is None  # nothing ran


@pytest.mark.anyio
async def test_a_write_root_whose_parent_is_swapped_after_planning_is_not_staged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bwrap_works()
    home = tmp_path / "home"
    notes = home / "notes"
    notes.mkdir(parents=True)
    victim = tmp_path / "victim"
    (victim / "notes").mkdir(parents=True)
    executors = tmp_path / "executors"
    _executor(executors, "w", WRITER.format(path=notes / "planted"))
    staging = Staging(tmp_path / "state")
    reason = await staging.start()
    need(reason is None, f"overlay staging is unavailable here: {reason}")
    real_plan = supervisor_mod.plan_invocation

    def plan_then_swap(*args: Any, **kw: Any) -> Any:
        planned = real_plan(*args, **kw)
        # After the plan's checks, before the overlay is built on ~/notes: the home is
        # replaced by a link to another folder that has a notes/ of its own.
        home.rename(tmp_path / "home-moved")
        home.symlink_to(victim)
        return planned

    monkeypatch.setattr(supervisor_mod, "plan_invocation", plan_then_swap)
    broker = MemoryBroker()
    try:
        sup = Supervisor(
            broker,
            ExecutorRegistry.load(executors),
            SupervisorConfig(worker_id="w", home=str(home)),
            staging=staging,
        )
        result = await _serve(sup, broker, Job(executor="w"))
    finally:
        await staging.aclose()
    assert result.status == "rejected", result
    assert result.error is not None and result.error.code == "E_SYMLINKED_FOLDER", result.error
    assert os.listdir(victim / "notes") == []
    assert os.listdir(tmp_path / "home-moved" / "notes") == []
