"""``metnos-exec undo`` against a real worker process: exit codes scripts rely on."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from metnos_exec.cli import EXIT
from tests.test_worker_process import Workers, has_event, wait_until

from .helpers import bwrap_works, write_executor

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("broker", ["sqlite", "redis"])
def test_undo_command(tmp_path: Path, broker: str, request: pytest.FixtureRequest) -> None:
    bwrap_works()
    home = tmp_path / "home"
    notes = home / "notes"
    notes.mkdir(parents=True)
    workers = Workers(tmp_path, write_executor(tmp_path))
    if broker == "redis":
        server = request.getfixturevalue("redis_server")
        workers.url = f"{server.url}?prefix={tmp_path.name}"
    env = {"METNOS_BROKER": workers.url, "HOME": str(home)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "metnos_exec", *args],
            env={**_environ(), **env},
            capture_output=True,
            text=True,
            timeout=60,
        )

    try:
        log = workers.start("W", "--home", str(home), "--state-dir", str(tmp_path / "state"))
        wait_until(lambda: has_event(log, "worker.started"), 20, "the worker")
        ops = json.dumps({"root": "~/notes", "ops": [["write", "a.txt", "by the job"]]})
        done = cli("submit", "mutate", "--args-json", ops, "--wait", "30", "--json")
        assert done.returncode == 0, done.stderr
        job_id = json.loads(done.stdout)["job_id"]
        (notes / "a.txt").write_text("edited afterwards")

        refused = cli("undo", job_id, "--wait", "30")
        assert refused.returncode == EXIT["rejected"], refused
        assert "E_UNDO_CONFLICT" in refused.stdout and "a.txt" in refused.stdout
        assert (notes / "a.txt").read_text() == "edited afterwards"

        (notes / "a.txt").write_text("by the job")
        undone = cli("undo", job_id, "--wait", "30", "--json")
        assert undone.returncode == 0, undone
        result = json.loads(undone.stdout)
        assert result["status"] == "succeeded" and result["output"]["undone"] == job_id
        assert not (notes / "a.txt").exists()

        again = cli("undo", job_id, "--wait", "30")
        assert again.returncode == EXIT["rejected"] and "already undone" in again.stdout
        queued = cli("undo", result["job_id"], "--no-wait")  # the undo of the undo
        assert queued.returncode == 0 and queued.stdout.strip()
        redo = cli("result", queued.stdout.strip(), "--wait", "30")
        assert redo.returncode == 0, redo
        assert (notes / "a.txt").read_text() == "by the job"
        workers.procs[0].send_signal(signal.SIGTERM)
        assert workers.procs[0].wait(20) == 0
    finally:
        workers.close()


def _environ() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "METNOS_ARM_OVERRIDE"}
