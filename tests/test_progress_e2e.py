"""Progress from executors end to end (issue 19): a real supervisor on a SQLite queue running
executors in the real bwrap arm. The client awaits a job's progress while it runs; a job
that floods its channel is throttled while the worker's other jobs go on, and it still
succeeds."""

from __future__ import annotations

import functools
import textwrap
from pathlib import Path

import anyio
import pytest

from metnos_exec.brokers.sqlite import SQLiteBroker
from metnos_exec.client import Client
from metnos_exec.manifest import ExecutorRegistry
from metnos_exec.messages import Progress
from metnos_exec.sandbox.bwrap import bwrap_probe
from metnos_exec.supervisor import Supervisor, SupervisorConfig
from tests.conftest import need

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

MANIFEST = """\
name = "{name}"
version = "1.0.0"
description = "{name}"
runtime = "python"
entry = "main.py"

[[capabilities]]
name = "fs:read"
hints = ["~/gate/**"]

[limits]
timeout_s = 60
"""

#: Reports half way, then waits (60 s at most) for the test to create ~/gate/go.
STEPPER = """\
import json, os, sys, time
json.load(sys.stdin)
out = os.fdopen(int(os.environ["METNOS_PROGRESS_FD"]), "w", buffering=1)
out.write(json.dumps({"progress": 0.5, "message": "half way"}) + "\\n")
gate = os.path.expanduser("~/gate/go")
end = time.monotonic() + 60
while not os.path.exists(gate) and time.monotonic() < end:
    time.sleep(0.05)
out.write(json.dumps({"progress": 1.0, "message": "done"}) + "\\n")
print(json.dumps({"released": os.path.exists(gate)}))
"""

#: Writes progress lines as fast as it can for 2.5 s, then says how much it wrote.
FLOODER = """\
import json, os, sys, time
json.load(sys.stdin)
out = os.fdopen(int(os.environ["METNOS_PROGRESS_FD"]), "wb", buffering=0)
line = b'{"progress": 0.5, "message": "flooding"}\\n'
end, n = time.monotonic() + 2.5, 0
while time.monotonic() < end:
    out.write(line * 64)
    n += 64
print(json.dumps({"written": n}))
"""

QUICK = "import json, sys\njson.load(sys.stdin)\nprint(json.dumps({'ok': True}))\n"


@pytest.fixture
def setup(tmp_path: Path) -> tuple[ExecutorRegistry, Path, str]:
    probe = bwrap_probe()
    need(probe.working, f"bubblewrap not usable here: {probe.error}")
    root = tmp_path / "executors"
    for name, code in {"stepper": STEPPER, "flooder": FLOODER, "quick": QUICK}.items():
        (root / name).mkdir(parents=True)
        (root / name / "manifest.toml").write_text(MANIFEST.format(name=name))
        (root / name / "main.py").write_text(textwrap.dedent(code))
    home = tmp_path / "home"
    (home / "gate").mkdir(parents=True)
    return ExecutorRegistry.load(root), home, f"sqlite:///{tmp_path / 'q.db'}"


def _supervisor(broker: SQLiteBroker, registry: ExecutorRegistry, home: Path) -> Supervisor:
    config = SupervisorConfig(worker_id="w1", concurrency=2, home=str(home), prefetch=0)
    return Supervisor(broker, registry, config)


async def test_the_client_awaits_progress_while_the_job_runs(
    setup: tuple[ExecutorRegistry, Path, str],
) -> None:
    registry, home, url = setup
    broker = SQLiteBroker.from_url(url)
    seen: list[Progress] = []

    async def on_progress(progress: Progress) -> None:
        seen.append(progress)
        if progress.message == "half way":
            (home / "gate" / "go").write_text("")  # let the executor finish

    async with broker, Client(broker) as client:
        job_id = await client.submit("stepper", {})
        with anyio.fail_after(90):
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    functools.partial(_supervisor(broker, registry, home).run, burst=True)
                )
                result = await client.result(job_id, wait=80, on_progress=on_progress)
        assert result is not None and result.status == "succeeded", result
        assert result.output == {"released": True}
        first = seen[0]
        assert (first.fraction, first.message, first.attempt) == (0.5, "half way", 1)
        assert first.at > 0 and first.lines == 1
        stored = await client.progress(job_id)
        assert stored is not None and stored.attempt == 1


async def test_a_flooding_job_is_throttled_and_the_others_go_on(
    setup: tuple[ExecutorRegistry, Path, str],
) -> None:
    registry, home, url = setup
    broker = SQLiteBroker.from_url(url)
    async with broker, Client(broker) as client:
        flood = await client.submit("flooder", {})
        quick = [await client.submit("quick", {}) for _ in range(4)]
        with anyio.fail_after(120):
            await _supervisor(broker, registry, home).run(burst=True)
        flooded = await client.result(flood)
        assert flooded is not None and flooded.status == "succeeded", flooded
        assert flooded.finished_at is not None and flooded.started_at is not None
        for job_id in quick:
            done = await client.result(job_id)
            assert done is not None and done.status == "succeeded", done
            # Served by the other slot while the flood ran, not after it.
            assert done.finished_at is not None and done.finished_at < flooded.finished_at
        # Throttled: at most the reader's rate (160 KiB/s) plus a pipe's worth got out.
        wall = flooded.finished_at - flooded.started_at
        written = flooded.output["written"]
        assert written * 42 < 160 * 1024 * (wall + 0.5) + 128 * 1024, (written, wall)
        stored = await client.progress(flood)
        assert stored is not None and stored.message == "flooding"
        assert stored.dropped > 0 and stored.lines <= written
