"""No job reaches the worker's own paths through a hint (executors, queue, state, caches).

The red-team's path: executor A declares ``fs:write ~/**`` and the worker keeps its
executors (or its queue, or its state folder) under that home. A job of A rewrote
executor B's ``main.py``, so B's next job ran A's code; another read the queue database
(every job's arguments and results). Such a hint is refused at plan time, in every arm,
naming the path (`plan_invocation`'s ``protected``); each case runs through a worker.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from metnos_exec.brokers.memory import MemoryBroker
from metnos_exec.brokers.sqlite import SQLiteBroker
from metnos_exec.manifest import ExecutorRegistry
from metnos_exec.messages import Job, Result
from metnos_exec.sandbox._types import AXES
from metnos_exec.sandbox.direct import DirectSandbox
from metnos_exec.sandbox.select import ArmChoice, Degradation
from metnos_exec.supervisor import Supervisor, SupervisorConfig
from metnos_exec.undo.staging import Staging

# Writes `text` into `path` (absolute, after ~ expansion), whatever it is.
ROGUE = """\
import json, os, sys
a = json.load(sys.stdin)
path = os.path.expanduser(a["path"])
if a.get("text") is None:
    with open(path, "rb") as f:
        print(json.dumps({"read": len(f.read())}))
else:
    with open(path, "w") as f:
        f.write(a["text"])
    print(json.dumps({"wrote": path}))
"""

MANIFEST = """\
name = "{name}"
version = "1"
runtime = "python"
entry = "main.py"
[args.path]
type = "string"
format = "path"
required = true
[args.text]
type = "string"
[[capabilities]]
name = "{cap}"
hints = ["{hint}"]
[limits]
timeout_s = 20
"""


def _direct(runtime: str, *, require_sandbox: bool) -> ArmChoice:
    # The arm that walls nothing: what stops the job here is the plan alone.
    return ArmChoice(
        DirectSandbox(),
        Degradation(requested="bwrap", used="none", reason="sandbox_off", axes_lost=AXES),
    )


def _executor(root: Path, name: str, cap: str, hint: str) -> None:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "manifest.toml").write_text(MANIFEST.format(name=name, cap=cap, hint=hint))
    (folder / "main.py").write_text(ROGUE)


async def _run(sup: Supervisor, broker: object, job: Job) -> Result:
    await broker.submit(job)  # type: ignore[attr-defined]
    with anyio.fail_after(30):
        await sup.run(burst=True)
    result = await broker.get_result(job.id)  # type: ignore[attr-defined]
    assert result is not None
    return result


@pytest.mark.anyio
async def test_a_hint_over_the_executors_root_cannot_rewrite_another_executor(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    executors = home / "executors"
    _executor(executors, "rogue", "fs:write", "~/**")
    _executor(executors, "victim", "fs:read", "~/notes/**")
    (home / "notes").mkdir()
    victim = executors / "victim" / "main.py"
    before = victim.read_text()
    broker = MemoryBroker()
    staging = Staging(tmp_path / "state", overlay=False)
    try:
        sup = Supervisor(
            broker,
            ExecutorRegistry.load(executors),
            SupervisorConfig(worker_id="w", home=str(home)),
            staging=staging,
            arm_chooser=_direct,
        )
        job = Job(executor="rogue", args={"path": str(victim), "text": "print('pwned')"})
        result = await _run(sup, broker, job)
    finally:
        await staging.aclose()
    assert victim.read_text() == before
    assert result.status == "rejected", result
    assert result.error is not None and result.error.code == "E_CAPABILITY_DENIED"
    assert "'~/**' covers" in result.error.message
    assert str(executors.resolve()) in result.error.message
    assert result.exit is None  # nothing ran


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("cap", "hint", "target"),
    [
        ("fs:write", "~/state/**", "state/blobs/x"),  # lies inside the state folder
        ("fs:write", "~/state/journal/**", "state/journal/x.journal"),
        ("fs:read", "~/**", "q.db"),  # covers the queue database
        ("fs:read", "~/.cache/**", ".cache/metnos-exec/verified/x"),  # covers the caches
    ],
)
async def test_a_hint_over_the_queue_state_or_caches_is_refused(
    tmp_path: Path, cap: str, hint: str, target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("METNOS_CACHE_DIR", str(home / ".cache" / "metnos-exec"))
    executors = tmp_path / "executors"
    _executor(executors, "rogue", cap, hint)
    (home / ".cache").mkdir(parents=True)
    staging = Staging(home / "state", overlay=False)
    broker = SQLiteBroker(home / "q.db")
    try:
        sup = Supervisor(
            broker,
            ExecutorRegistry.load(executors),
            SupervisorConfig(worker_id="w", home=str(home)),
            staging=staging,
            arm_chooser=_direct,
        )
        args = {"path": str(home / target)}
        if cap == "fs:write":
            args["text"] = "planted"
        result = await _run(sup, broker, Job(executor="rogue", args=args))
    finally:
        await broker.close()
        await staging.aclose()
    assert result.status == "rejected", result
    assert result.error is not None and result.error.code == "E_CAPABILITY_DENIED", result.error
    assert "belongs to the worker" in result.error.message
    assert not (home / target).exists() or target == "q.db"
