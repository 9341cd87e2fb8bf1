"""An executor's own sibling modules import in every arm, and nothing else joins sys.path.

An executor is a folder: ``main.py`` importing ``helper.py`` next to it is the ordinary
way to split one. The interpreter runs isolated (no environment, no user or venv
site-packages), which with ``-I`` also dropped the script's folder from ``sys.path``: a
sibling import failed with ``ModuleNotFoundError`` in the sandbox although it worked in a
shell. Each arm runs the same executor through the real worker path (`Supervisor`): bwrap
(staged, and unstaged), direct, and wasm-python where python.wasm is installed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from metnos_exec.brokers.memory import MemoryBroker
from metnos_exec.errors import ToolUnavailable
from metnos_exec.manifest import ExecutorRegistry
from metnos_exec.messages import Job, Result
from metnos_exec.sandbox._types import AXES
from metnos_exec.sandbox._wasm_runtime import verified_python_wasm
from metnos_exec.sandbox.direct import DirectSandbox
from metnos_exec.sandbox.select import ArmChoice, Degradation
from metnos_exec.supervisor import Supervisor
from metnos_exec.supervisor.config import split_settings
from metnos_exec.undo.staging import Staging
from tests.conftest import need
from tests.undo.helpers import bwrap_works

MANIFEST = """\
name = "{name}"
version = "1"
runtime = "{runtime}"
entry = "main.py"
[[capabilities]]
name = "fs:write"
hints = ["~/notes/**"]
[limits]
timeout_s = 30
memory_mb = 256
fuel = 20000000000
"""

MAIN = """\
import json, os, sys
import helper
from pkg import inner

here = os.path.dirname(os.path.abspath(__file__))
print(json.dumps({
    "value": helper.VALUE + inner.VALUE,
    "here": here,
    "path": sys.path,
    "cwd_importable": "" in sys.path or "." in sys.path,
}))
"""


def _executors(root: Path) -> Path:
    for name, runtime in (("sib", "python"), ("sibw", "wasm-python")):
        folder = root / "executors" / name
        (folder / "pkg").mkdir(parents=True)
        (folder / "manifest.toml").write_text(MANIFEST.format(name=name, runtime=runtime))
        (folder / "main.py").write_text(MAIN)
        (folder / "helper.py").write_text("VALUE = 40\n")
        (folder / "pkg" / "__init__.py").write_text("")
        (folder / "pkg" / "inner.py").write_text("VALUE = 2\n")
    return root / "executors"


def _direct(runtime: str, *, require_sandbox: bool) -> ArmChoice:
    return ArmChoice(
        DirectSandbox(),
        Degradation(requested="bwrap", used="none", reason="sandbox_off", axes_lost=AXES),
    )


async def _run(tmp_path: Path, executor: str, *, staged: bool, **kw: Any) -> Result:
    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True, exist_ok=True)
    registry = ExecutorRegistry.load(_executors(tmp_path))
    broker = MemoryBroker()
    staging = Staging(tmp_path / "state", overlay=staged)
    try:
        if staged:
            reason = await staging.start()
            need(reason is None, f"overlay staging is unavailable here: {reason}")
        job = Job(executor=executor, args={})
        await broker.submit(job)
        config, collaborators = split_settings({"worker_id": "w", "home": str(home), **kw})
        sup = Supervisor(broker, registry, config, staging=staging, **collaborators)
        with anyio.fail_after(60):
            await sup.run(burst=True)
        result = await broker.get_result(job.id)
    finally:
        await staging.aclose()
    assert result is not None
    return result


def _check(result: Result, folder: Path, *, stdlib_prefix: str) -> None:
    assert result.status == "succeeded", (result.error, result.stderr)
    out = result.output
    assert out["value"] == 42
    assert out["here"] == str(folder.resolve())
    # The executor's own folder first, once; the working directory is not importable.
    assert out["path"][0] == out["here"]
    assert out["path"].count(out["here"]) == 1
    assert not out["cwd_importable"]
    # Nothing else: only the interpreter's standard library (no site-packages, no venv).
    rest = out["path"][1:]
    assert rest, out["path"]
    assert all(p.startswith(stdlib_prefix) for p in rest), out["path"]
    assert not any("site-packages" in p for p in out["path"]), out["path"]


def _base_prefix() -> str:
    return sys.base_prefix


@pytest.mark.anyio
async def test_bwrap_staged_job_imports_its_siblings(tmp_path: Path) -> None:
    bwrap_works()
    result = await _run(tmp_path, "sib", staged=True)
    assert result.containment is not None
    _check(result, tmp_path / "executors" / "sib", stdlib_prefix=_base_prefix())


@pytest.mark.anyio
async def test_bwrap_unstaged_job_imports_its_siblings(tmp_path: Path) -> None:
    bwrap_works()
    result = await _run(tmp_path, "sib", staged=False)
    _check(result, tmp_path / "executors" / "sib", stdlib_prefix=_base_prefix())


@pytest.mark.anyio
async def test_direct_job_imports_its_siblings(tmp_path: Path) -> None:
    result = await _run(tmp_path, "sib", staged=False, arm_chooser=_direct)
    _check(result, tmp_path / "executors" / "sib", stdlib_prefix=_base_prefix())


@pytest.mark.anyio
# The process-wide wasm engine maps python.wasm's memory image and starts its I/O runtime
# on first use (files it keeps for the process's life; tests/sandbox/test_wasm.py warms
# them in a session fixture instead).
@pytest.mark.allow_fd_leak
async def test_wasm_python_job_imports_its_siblings(tmp_path: Path) -> None:
    try:
        verified_python_wasm()
    except ToolUnavailable as exc:
        need(False, f"python.wasm is not installed: {exc}")
    result = await _run(tmp_path, "sibw", staged=False)
    # python.wasm's standard library lives inside the module's own filesystem (/usr/...).
    _check(result, tmp_path / "executors" / "sibw", stdlib_prefix="/")
