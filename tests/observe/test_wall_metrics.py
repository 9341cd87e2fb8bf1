"""Issue 20, the walls' counters end to end: a real worker (bubblewrap, the network wall)
with ``--metrics``, scraped and parsed with prometheus_client's parser after jobs that
reach an allowed host and are refused others (``metnos_egress_total``), write a note and
have it undone (``metnos_undo_total``), and commit over a note changed meanwhile
(``metnos_commit_conflicts_total``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from metnos_exec.client import Client
from metnos_exec.messages import Result
from tests.conftest import need
from tests.helpers.worker_cli import wait_for_event, worker_argv
from tests.observe.test_redis_metrics import _free_port, _scrape, _value
from tests.test_examples import EXAMPLES, ROGUE_FETCH, fetch_variant
from tests.test_examples import server as _server_fixture

prometheus_client = pytest.importorskip("prometheus_client")

pytestmark = pytest.mark.slow

server = _server_fixture

#: Writes a note after a pause, long enough for the test to change it meanwhile (once the
#: job's progress says it runs).
_SLOW_WRITE = """\
import json, os, sys, time
a = json.load(sys.stdin)
# Said to the test: the process runs, so the commit's baseline is taken.
os.write(int(os.environ["METNOS_PROGRESS_FD"]), b'{"progress": 0.1, "message": "up"}\\n')
time.sleep(a["s"])
with open(a["path"], "w") as f:
    f.write("from the job\\n")
print("{}")
"""
_SLOW_MANIFEST = """\
name = "slow_write"
version = "1"
runtime = "python"
entry = "main.py"
[args.path]
type = "string"
format = "path"
required = true
[args.s]
type = "number"
default = 0
[[capabilities]]
name = "fs:write"
hints = ["~/notes/**"]
"""


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    h = tmp_path / "home"
    (h / "notes").mkdir(parents=True)
    (h / "notes" / "today.md").write_text("milk\n")
    (h / "notes" / "race.md").write_text("before\n")
    yield h


def test_egress_undo_and_conflict_counters_equal_the_jobs(
    tmp_path: Path, home: Path, server: str
) -> None:
    need(shutil.which("bwrap") is not None, "bubblewrap is not installed")
    executors = Path(fetch_variant(tmp_path / "x", server, ROGUE_FETCH).path).parent
    shutil.copytree(EXAMPLES / "write_note", executors / "write_note")
    (executors / "slow_write").mkdir()
    (executors / "slow_write" / "manifest.toml").write_text(_SLOW_MANIFEST)
    (executors / "slow_write" / "main.py").write_text(_SLOW_WRITE)
    url = f"sqlite:///{tmp_path / 'q.db'}"
    port, log = _free_port(), tmp_path / "w.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("METNOS_")}
    env["HOME"] = str(home)
    proc = subprocess.Popen(
        worker_argv(url, executors, log, "--metrics", f"127.0.0.1:{port}", "--concurrency", "2"),
        env=env,
        stdin=subprocess.DEVNULL,
    )

    async def drive() -> tuple[Result, Result, Result, Result]:
        async with Client(url) as c:
            fetched = await c.run("fetch_url", {"url": f"{server}/hello"}, wait=120)
            wrote = await c.run(
                "write_note", {"path": "~/notes/today.md", "text": "eggs"}, wait=120
            )
            undone = await c.result(await c.submit_undo(wrote.job_id), wait=120)
            racing = await c.submit("slow_write", {"path": "~/notes/race.md", "s": 3})
            with anyio.fail_after(60):
                while await c.progress(racing) is None:  # noqa: ASYNC110 (another process)
                    await anyio.sleep(0.05)  # polling the store, under a deadline
            (home / "notes" / "race.md").write_text("changed meanwhile\n")
            raced = await c.result(racing, wait=120)
        assert undone is not None and raced is not None
        return fetched, wrote, undone, raced

    try:
        wait_for_event(log, "worker.started", proc, timeout=60)
        fetched, wrote, undone, raced = anyio.run(drive)
        time.sleep(0.2)  # the counters are bumped before the ack: nothing to wait for
        samples = _scrape(port)
    finally:
        proc.terminate()
        proc.wait(30)
    allowed = [r for r in fetched.egress if r.allowed]
    refused = [r for r in fetched.egress if not r.allowed]
    assert allowed and refused, fetched
    total: dict[str, float] = {}
    for (name, labels), value in samples.items():
        if name == "metnos_egress_total":
            verdict = dict(labels)["verdict"]
            total[verdict] = total.get(verdict, 0) + value
    assert total == {"allowed": len(allowed), "refused": len(refused)}
    assert wrote.status == "succeeded" and wrote.undo_ids, wrote
    assert _value(samples, "metnos_undo_total", outcome=undone.status) == 1
    assert raced.error is not None and raced.error.code == "E_COMMIT_CONFLICT", raced
    assert _value(samples, "metnos_commit_conflicts_total") == 1
