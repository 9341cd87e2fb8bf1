"""``metnos-exec checkpoint`` against a real worker process (real bwrap, real SQLite or a
private redis-server): create, a session, diff, a refused restore, a restore, its undo."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from metnos_exec.cli import EXIT
from tests.test_worker_process import Workers, has_event, wait_until
from tests.undo.helpers import bwrap_works, seed, write_executor
from tests.undo.test_checkpoints import SESSION, tree_hash
from tests.undo.test_cli_undo import _environ

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("broker", ["sqlite", "redis"])
def test_checkpoint_command(tmp_path: Path, broker: str, request: pytest.FixtureRequest) -> None:
    bwrap_works()
    home = tmp_path / "home"
    notes = home / "notes"
    notes.mkdir(parents=True)
    seed(notes)
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
        before = tree_hash(notes)
        made = cli("checkpoint", "create", "start", "--wait", "30")
        assert made.returncode == 0, made
        assert "checkpoint start made" in made.stdout
        for ops in SESSION[:6]:
            args = json.dumps({"root": "~/notes", "ops": ops})
            done = cli("submit", "mutate", "--args-json", args, "--wait", "30")
            assert done.returncode == 0, done.stderr
        after = tree_hash(notes)
        listed = cli("checkpoint", "list", "--wait", "30", "--json")
        assert [m["name"] for m in json.loads(listed.stdout)["output"]["checkpoints"]] == ["start"]
        diff = cli("checkpoint", "diff", "start", "--wait", "30")
        assert diff.returncode == 0, diff
        assert "created" in diff.stdout and "del.txt" in diff.stdout

        (notes / "mod.txt").write_text("by hand\n")
        refused = cli("checkpoint", "restore", "start", "--wait", "30")
        assert refused.returncode == EXIT["rejected"], refused
        assert "E_UNDO_CONFLICT" in refused.stdout and "mod.txt" in refused.stdout
        (notes / "mod.txt").write_text("old content\nappended\n")
        assert tree_hash(notes) == after

        restored = cli("checkpoint", "restore", "start", "--wait", "30", "--json")
        assert restored.returncode == 0, restored
        assert tree_hash(notes) == before
        job_id = json.loads(restored.stdout)["job_id"]
        undone = cli("undo", job_id, "--wait", "30")
        assert undone.returncode == 0, undone
        assert tree_hash(notes) == after
        unknown = cli("checkpoint", "restore", "nope", "--wait", "30")
        assert unknown.returncode == EXIT["rejected"] and "E_CHECKPOINT_UNKNOWN" in unknown.stdout
        workers.procs[0].send_signal(signal.SIGTERM)
        assert workers.procs[0].wait(20) == 0
    finally:
        workers.close()
