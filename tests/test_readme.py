"""The README's Python snippets run as written (issue 9 and 18: they did not)."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers.worker_cli import wait_for_event, worker_argv

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_every_python_block_compiles() -> None:
    """A block that imports is a program and must compile as one (no ``async with`` or
    ``await`` outside a function: what made the client snippet unrunnable); a block
    without imports is a fragment of one, and may ``await`` at its top level."""
    blocks = _python_blocks()
    assert any("import" in code for code in blocks)
    for i, code in enumerate(blocks):
        program = re.search(r"^(?:from|import) ", code, flags=re.M) is not None
        flags = 0 if program else ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        compile(code, f"README.md python block {i}", "exec", flags=flags)


def run_snippet(tmp_path: Path, snippet: str, env: dict[str, str], timeout: float) -> Any:
    """`snippet` pasted into a file and run from `tmp_path` (the folder the README's steps
    use: `demo/` beside you) while a worker serves `demo/metnos.db` with the examples."""
    (tmp_path / "snippet.py").write_text(snippet)
    log = tmp_path / "demo" / "worker.jsonl"
    worker = subprocess.Popen(
        worker_argv(
            "sqlite:///demo/metnos.db", ROOT / "examples" / "executors", log, "--home", "demo/home"
        ),
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_for_event(log, "worker.started", worker)
        return subprocess.run(
            [sys.executable, "snippet.py"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)


def test_the_client_snippet_runs_against_a_worker(tmp_path: Path) -> None:
    """The client snippet runs to the end. The worker runs every job in the echo double,
    so this needs no sandbox: what is tested is the snippet's Python, not the arms."""
    [snippet] = [b for b in _python_blocks() if "SyncClient(" in b]
    (tmp_path / "demo" / "home" / "notes").mkdir(parents=True)
    env = {**os.environ, "METNOS_ARM_OVERRIDE": "echo", "HOME": str(tmp_path)}
    out = run_snippet(tmp_path, snippet, env, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("succeeded ") and "Result(" in lines[1], out.stdout


def test_the_undo_snippet_runs_against_a_worker(tmp_path: Path) -> None:
    """Issue 18, item 11: the README's undo snippet was a fragment that did not run as
    written. It runs to the end against a real worker with the real sandbox (a staged
    write, its undo entry, the undo): the note it wrote is gone again."""
    from tests.sandbox.test_bwrap import need_bwrap

    need_bwrap()
    [snippet] = [b for b in _python_blocks() if "client.undo(" in b]
    notes = tmp_path / "demo" / "home" / "notes"
    notes.mkdir(parents=True)
    env = {**os.environ, "HOME": str(tmp_path)}
    env.pop("METNOS_ARM_OVERRIDE", None)
    out = run_snippet(tmp_path, snippet, env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("succeeded ('") and lines[0] != "succeeded ()", out.stdout
    assert lines[1] == "undone: succeeded", out.stdout
    assert not (notes / "b.md").exists()
