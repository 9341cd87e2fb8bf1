"""A real worker's warm sandboxes (issue 22, acceptance 3): a worker SIGKILLed while it
holds warm sandboxes leaves none behind (the keeper kills every bubblewrap carrying its
mark), and a drained worker exits with none left."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import pytest

from metnos_exec.messages import Job
from tests.helpers.worker_cli import wait_for_event, worker_argv
from tests.test_die_with_worker import NAP, _ours
from tests.test_worker_process import wait_until, with_broker
from tests.undo.helpers import bwrap_works

MANIFEST = """\
name = "nap"
version = "1"
runtime = "python"
entry = "main.py"
warm = 3
[args.s]
type = "number"
default = 0.0
[limits]
timeout_s = 60
"""


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_no_warm_sandbox_outlives_its_worker(tmp_path: Path, how: str) -> None:
    bwrap_works()
    executors = tmp_path / "executors"
    (executors / "nap").mkdir(parents=True)
    (executors / "nap" / "manifest.toml").write_text(MANIFEST)
    (executors / "nap" / "main.py").write_text(NAP)
    os.chmod(tmp_path, 0o755)
    url = f"sqlite:///{tmp_path / 'q.db'}"
    marker = str(executors / "nap")

    async def submit(broker: object) -> None:
        await broker.submit(Job(executor="nap", args={}))  # type: ignore[attr-defined]

    with_broker(url, submit)
    log = tmp_path / "w.jsonl"
    proc = subprocess.Popen(
        worker_argv(url, executors, log, "--concurrency", "2", "--grace", "1"),
        env={**os.environ, "HOME": str(tmp_path)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_event(log, "job.finished", proc, timeout=60)
        # The first job taught the pool its template: three sandboxes start and wait
        # (each a bubblewrap monitor, its init and the held guest: 9 processes).
        wait_until(lambda: len(_ours(marker)) >= 9, 30, "three warm sandboxes")
    finally:
        proc.send_signal(signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM)
        proc.wait(60)
    if how == "SIGTERM":
        assert proc.returncode == 0
    try:
        wait_until(lambda: not _ours(marker), 10, "no warm sandbox left")
    finally:
        for pid in _ours(marker):  # leave the machine clean whatever the verdict
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
